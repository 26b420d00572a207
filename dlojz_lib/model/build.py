"""The model of a run, built whole before any layout cuts it (torchtitan's order: build, then lay out): created by
name, on the meta device where a layout fills it from the first rank (`--fsdp` on every rank but the first), its
starting weights, what the flags change in its own modules (BlurPool, a linear probe's frozen backbone, DALI's
4-channel stem), float8's linears, SyncBN, its device and memory format and the EMA. Its family
(`model.families`) is resolved here, once: the layouts read `BuiltModel.family`. It reads two facts of the run's
layout (`Config.parallelism`): whether this rank builds on the meta device, and float8's recipe; what each unit
recomputes is the layout's unit pass's (parallelism.layout.parallelize_unit).
"""

import contextlib
import dataclasses
import math

import torch

from dlojz_lib.model import families, float8
from dlojz_lib.model.pretrained import load_starting_weights
from dlojz_lib.model.zoo import (
    BFLOAT16_BATCH_NORM,
    ModelEma,
    adapt_module,
    batch_norm_on_native_kernels,
    create_model,
    ema_decay,
    meta_copy,
)


@dataclasses.dataclass
class BuiltModel:
    module: torch.nn.Module  # the model whole (on the meta device on --fsdp's ranks but the first)
    ema: torch.nn.Module | None  # --model-ema's averaged copy
    num_classes: int
    arch: str
    family: families.Family | None  # its row of the families' table, None for a model of none

    @classmethod
    def of(cls, module, arch="this model", num_classes=None) -> "BuiltModel":
        """A module built elsewhere (a test's, a benchmark's) as the layouts take it: its family looked up."""
        return cls(module, None, num_classes, arch, families.family_of(module))

    @property
    def blocks(self) -> list | None:
        """Its family's blocks, [(path, module)] in forward order, as the model stands now; None for no family."""
        return None if self.family is None else self.family.blocks(self.module)


def build_model(cfg, num_classes, ranks, log) -> BuiltModel:
    """The run's model before its layout (`parallelism.layout.lay_out` wraps, shards or cuts it)."""
    # --fsdp: the model's shapes on every rank but the first, which builds it whole, as one process would; its values
    # fill each rank's own stage and shard once they are cut (fsdp.to_meta, fill_from_first_rank)
    layout = cfg.parallelism
    shapes_only = layout.builds_on_meta(ranks.is_main)
    with torch.device("meta") if shapes_only else contextlib.nullcontext():
        module = create_model(cfg.arch, num_classes, cfg.zero_init_residual, cfg.image_size, cfg.drop_path)
    family = families.family_of(module)
    if not shapes_only:  # (the first rank reads them into the values it gives the others)
        load_starting_weights(cfg.section("training"), cfg.resume, cfg.output_dir, module, num_classes, log)
    # before the copies below (SyncBN, EMA): they keep its changes
    adapt_module(cfg.section("training"), cfg.dali_pad_channels, module, num_classes, log)
    if layout.float8 is not None:
        convert_to_float8(module, family, layout, cfg.arch, cfg.batch_size, cfg.image_size, ranks.device.type, log)
    if cfg.sync_bn and ranks.enabled:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if not layout.fsdp:  # FSDP moves each rank's shards only to the device
        module = module.to(ranks.device)
    if cfg.channels_last:
        module = module.to(memory_format=torch.channels_last)
    model = BuiltModel(module, None, num_classes, cfg.arch, family)
    log(f"model: {cfg.arch}, {sum(p.numel() for p in module.parameters()):,} parameters")
    if cfg.amp and batch_norm_on_native_kernels(module, ranks.device.type, cfg.amp_dtype, cfg.compile):
        log(BFLOAT16_BATCH_NORM)
    if cfg.model_ema:
        decay = ema_decay(cfg.section("memory"), cfg.section("training"), ranks.data_size)
        if cfg.model_ema_adjust:
            log(
                f"EMA decay {decay:.6f} per update: torchvision's rule from --model-ema-decay {cfg.model_ema_decay} "
                f"({ranks.data_size} x {cfg.batch_size * cfg.grad_acc} images x {cfg.model_ema_steps or 1} steps / "
                f"{cfg.epochs} epochs)"
            )
        model.ema = ModelEma(module, decay, cfg.model_ema_steps or 1, cfg.model_ema_warmup)
    return model


def convert_to_float8(module, family, layout, arch, batch_size, image_size, device_type, log):
    """--float8: the family's large block linears converted (model.float8), said in a line, and a second where a
    micro-batch's rows are not a multiple of 16 (torchao pads each product's then)."""
    chosen = float8.float8_linears(module, family, layout.float8)
    uneven = float8.uneven_rows(meta_copy(module), chosen, layout.float8, batch_size, image_size)
    float8.convert(module, chosen, layout.float8, layout.fsdp, pad=uneven is not None)
    log(float8_line(layout.float8, arch, chosen, device_type))
    if uneven is not None:
        path, tokens = uneven
        step = 16 // math.gcd(tokens, 16)
        log(
            f"--float8 {layout.float8}: {path} sees {batch_size} images x {tokens} tokens = {batch_size * tokens} rows "
            f"a micro-batch, not a multiple of 16: torchao pads each float8 product's with zeros (a copy; -b a "
            f"multiple of {step} needs none)"
        )


def float8_line(recipe, arch, converted, device_type="cuda") -> str:
    """What --float8 converted, in one line (none: said, and why; on the CPU: a check, not a speed-up)."""
    if not converted:
        return (
            f"--float8 {recipe}: no linear converted: none of {arch}'s block linears is large enough for float8 to "
            "pay (torchao's sizes, measured on an H100): the run trains as without --float8"
        )
    shown = ", ".join(converted[:3]) + (f" and {len(converted) - 3} more" if len(converted) > 3 else "")
    line = f"--float8 {recipe}: {len(converted)} linears in float8 ({shown}); the others, the stem and the head as they were"
    if device_type == "cpu":
        line += "; on the CPU float8 checks the numerics (torchao's float8 products, on CPU kernels) and is not faster"
    return line
