"""The model of a run, built whole before any layout cuts it (torchtitan's order: build, then lay out): created by
name, on the meta device where a layout fills it from the first rank (`--fsdp` on every rank but the first), its
starting weights, what the flags change in its own modules (BlurPool, a linear probe's frozen backbone, DALI's
4-channel stem), SyncBN, its device and memory format, activation checkpointing and the EMA. Its family
(`model.families`) is resolved here, once: the layouts read `BuiltModel.family`.
"""

import contextlib
import dataclasses

import torch

from dlojz_lib.checks import fail
from dlojz_lib.model import families
from dlojz_lib.model.zoo import (
    BFLOAT16_BATCH_NORM,
    ModelEma,
    apply_blurpool,
    batch_norm_on_native_kernels,
    checkpoint_blocks,
    classifier_name,
    create_model,
    enable_grad_checkpointing,
    linear_probe,
    pad_stem_channels,
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
    shapes_only = cfg.fsdp and not ranks.is_main
    with torch.device("meta") if shapes_only else contextlib.nullcontext():
        module = create_model(cfg.arch, num_classes, cfg.zero_init_residual, cfg.image_size, cfg.drop_path)
    family = families.family_of(module)
    if not shapes_only:  # (the first rank reads them into the values it gives the others)
        load_starting_weights(cfg.section("training"), cfg.resume, cfg.output_dir, module, num_classes, log)
    # before the copies below (SyncBN, EMA): they keep its changes
    adapt_module(cfg.section("training"), cfg.dali_pad_channels, module, num_classes, log)
    if cfg.sync_bn and ranks.enabled:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if not cfg.fsdp:  # FSDP moves each rank's shards only to the device
        module = module.to(ranks.device)
    if cfg.channels_last:
        module = module.to(memory_format=torch.channels_last)
    model = BuiltModel(module, None, num_classes, cfg.arch, family)
    if cfg.activation_checkpointing != "none" and cfg.pp == 1:  # (--pp: each stage recomputes its own layers)
        if cfg.activation_checkpointing == "full" and cfg.ac_every == 1:
            enable_grad_checkpointing(module, cfg.arch, [block for _, block in model.blocks or ()])
        else:
            checkpoint_blocks(checkpointed_blocks(module, family, cfg.arch), cfg.activation_checkpointing, cfg.ac_every)
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


def ema_decay(memory, training, world_size) -> float:
    """The EMA's decay per update: --model-ema-decay, or with --model-ema-adjust torchvision's rule (train.py):
    1 - min(1, (1 - decay) x images a step x --model-ema-steps / --epochs), so that a recipe's EMA averages over the
    same share of its training whatever the number of GPUs (images a step: world size x batch x --grad-acc).
    `memory`, `training`: the settings of those groups."""
    if not memory.model_ema_adjust:
        return memory.model_ema_decay
    adjust = world_size * training.batch_size * memory.grad_acc * (memory.model_ema_steps or 1) / training.epochs
    return 1.0 - min(1.0, (1.0 - memory.model_ema_decay) * adjust)


def adapt_module(training, pad_channels, module, num_classes, log):
    """What the flags change in the model's own modules, in place (classes and flags only: the state dict keeps its
    keys): --blurpool's blurred downsampling, --linear-probe's frozen backbone, --dali-pad-channels' 4-channel stem."""
    if training.blurpool:
        changed = apply_blurpool(module, maxpool=training.blurpool_maxpool)
        layers = "strided convolutions and max-pools" if training.blurpool_maxpool else "strided convolutions (FFCV's)"
        if changed == 0:
            fail(f"--blurpool: --arch {training.arch} has no {layers} to blur")
        log(f"BlurPool: {changed} {layers} blur their input first")
    if training.linear_probe:
        head = classifier_name(module, num_classes)
        if head is None:
            fail(
                f"--linear-probe: --arch {training.arch} has no Linear layer with {num_classes} outputs to train alone"
            )
        trained, total = linear_probe(module, head)
        log(
            f"--linear-probe: only the head ({head}, {trained:,} of {total:,} parameters) trains, on the backbone's "
            "features: the backbone frozen, in eval mode (its BatchNorm statistics kept), no backward through it"
        )
    if pad_channels:
        stem = pad_stem_channels(module)
        if stem is None:
            fail(f"--dali-pad-channels: --arch {training.arch} has no 3-channel convolution to pad: drop the flag")
        log(f"--dali-pad-channels: DALI writes 4 channels, {stem}'s weight is padded with zeros to take them")


def load_starting_weights(training, resume, output_dir, module, num_classes, log):
    """--pretrained's or --initial-checkpoint's weights into `module`, before any wrapper or copy; not read when the
    run resumes from a checkpoint (`resume`, `output_dir`), whose weights replace them."""
    if training.initial_checkpoint is None and training.pretrained is None:
        return
    from dlojz_lib.checkpoint import resumes_a_checkpoint
    from dlojz_lib.model.pretrained import load_initial_weights, weights_source

    if resumes_a_checkpoint(resume, output_dir):  # the file may be gone since: not read
        log("initial weights: not read, the run resumes from its checkpoint, whose weights replace them")
        return
    weights, what, fix = weights_source(training)  # the file, the flag as given, what to do with a damaged cache file
    log(load_initial_weights(module, weights, num_classes, what, fix))


def checkpointed_blocks(module, family, arch) -> list:
    """The blocks --activation-checkpointing selective (or --ac-every) recomputes: its family's (model.families),
    in forward order; a model of no family is one line."""
    if family is None:
        fail(
            f"--activation-checkpointing selective and --ac-every recompute a model family's blocks: --arch {arch} is "
            f"none of {families.names()}; use --activation-checkpointing full (or --grad-checkpointing)"
        )
    return [block for _, block in family.blocks(module)]
