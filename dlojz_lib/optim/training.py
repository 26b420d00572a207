"""What a run builds from its flags to learn with: the loss, the optimizer and its schedule (or the LR finder), the
float16 loss scaler, autocast and MixUp/CutMix, in one `Training` record that train_one_epoch and evaluate take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from dlojz_lib.checks import fail
from dlojz_lib.data.augment import batch_mixing
from dlojz_lib.optim import OPTIMIZER_TABLE
from dlojz_lib.optim.losses import BinaryCrossEntropy, balanced_class_weights
from dlojz_lib.optim.optimizers import (
    build_optimizer,
    check_kinds_present,
    fine_tuning_head,
    freeze_backbone,
    kind_decay,
    param_groups,
)
from dlojz_lib.optim.schedules import LRFinder, build_scheduler, lr_scaling_line, step_milestones, warmup_steps


# ---------------------------------------------------------------------- what a run builds of all this
@dataclasses.dataclass
class Training:
    """How the model learns, beside the model and its batches: the loss, the optimizer and its schedule (or the LR
    finder), the float16 loss scaler, autocast and MixUp/CutMix. train_one_epoch and evaluate take it whole."""

    criterion: torch.nn.Module
    val_criterion: torch.nn.Module  # summed over the images: exact totals across ranks
    optimizer: torch.Optimizer
    scheduler: object | None  # None for the LR finder, which sets the lr itself
    lr_finder: "LRFinder | None"
    scaler: torch.amp.GradScaler  # on with float16 only
    autocast: object  # () -> context manager
    mix: object | None  # MixUp/CutMix on the device batch
    total_steps: int  # optimizer steps the schedule spans
    # --freeze-backbone-epochs: () -> None, drops the frozen layers' gradients while they are frozen; called before
    # the clip and the float16 scaler, so that neither the norm nor the overflow check counts them
    drop_frozen_gradients: object = None
    teacher: object = None  # --teacher: images -> its logits, which the criterion (a DistillationLoss) then takes
    clip_grad_norm: float | None = None  # the global norm the loop clips the gradients to (--clip-grad-norm)
    grad_acc: int = 1  # the micro-batches an optimizer step accumulates (--grad-acc)


def build_losses(training, class_counts, device, log):
    """The training loss (cross-entropy, or --bce-loss's, weighted per class by --class-weights) and validation's
    (cross-entropy summed over the images: exact totals across ranks)."""
    weight = None
    if training.class_weights == "balanced":
        weight = balanced_class_weights(class_counts)
        log(
            f"--class-weights balanced: the training loss weighs each class by {weight.min():.3g} (the largest) to "
            f"{weight.max():.3g} (the smallest)"
        )
        weight = weight.to(device)
    if training.bce_loss:
        criterion = BinaryCrossEntropy(training.label_smoothing, training.bce_target_thresh, weight)
        log(
            f"loss: binary cross-entropy per class (label smoothing {training.label_smoothing}"
            + (f", targets above {training.bce_target_thresh} as 1" if training.bce_target_thresh is not None else "")
            + "); validation's loss: cross-entropy"
        )
    else:  # (it also takes MixUp's soft labels, the weight applied to each class's share)
        criterion = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=training.label_smoothing)
    val_criterion = torch.nn.CrossEntropyLoss(label_smoothing=training.label_smoothing, reduction="sum")
    return criterion, val_criterion


def build_schedule(cfg, optimizer, steps_per_epoch, total_steps):
    """(the per-step schedule, None) or, with --findlr, (None, the LR finder, which sets every step's LR)."""
    scheduler, lr_finder = None, None
    try:  # these checks need the data set's size
        if cfg.findlr:  # the course's range test: the finder sets the lr of every step, no scheduler
            lr_finder = LRFinder(
                optimizer, 1e-8, cfg.lr, min(total_steps, cfg.test_nsteps) if cfg.test else total_steps
            )
        else:
            if total_steps < 2 and cfg.global_batch is not None:  # (a recipe's, often): its advice is the global batch
                fail(
                    f"--global-batch {cfg.global_batch} makes {total_steps} optimizer step of {cfg.epochs} epoch(s) "
                    f"on this data set; the schedule needs 2 at least: give a smaller --global-batch (a recipe's LR "
                    "was set for its own), more --epochs, or --no-global-batch and a --batch-size"
                )
            if cfg.lr_scheduler == "linear" and cfg.lr_peak_epoch >= cfg.epochs:
                fail(f"--lr-peak-epoch {cfg.lr_peak_epoch} must come before the end (--epochs {cfg.epochs})")
            scheduler = build_scheduler(
                cfg.lr_scheduler,
                optimizer,
                cfg.lr,
                total_steps,
                warmup_steps=warmup_steps(cfg.section("optimizer"), steps_per_epoch),
                poly_power=cfg.lr_poly_power,
                step_milestones=step_milestones(cfg.section("optimizer"), cfg.epochs, steps_per_epoch),
                gamma=0.1 if cfg.lr_gamma is None else cfg.lr_gamma,
                warmup_start=cfg.warmup_start_factor or 0.0,
                warmup_method=cfg.warmup_method or "linear",
                min_lr=cfg.min_lr or 0.0,
                steps_per_epoch=steps_per_epoch if cfg.lr_per_epoch else None,
            )
    except ValueError as err:
        fail(str(err))
    return scheduler, lr_finder


def check_ema_every(model_ema_steps, epochs, steps_per_epoch, set_by_recipe, log):
    """An EMA updated every more optimizer steps than the run makes is never updated: it stays the starting
    weights, which --ema-judges and the EMA's validation would then report. Refused in one line; said once where
    a recipe file sets it (written for longer runs: a short trial of a recipe is meant)."""
    if not model_ema_steps or model_ema_steps <= epochs * steps_per_epoch:
        return
    problem = (
        f"--model-ema-steps {model_ema_steps}: the run makes {epochs * steps_per_epoch} optimizer steps "
        f"({epochs} epochs x {steps_per_epoch}), so its EMA would never be updated"
    )
    if "model_ema_steps" in set_by_recipe:
        log(f"WARNING: {problem} (set by --config: give --model-ema-steps to change it)")
    else:
        fail(f"{problem}: give at most {epochs * steps_per_epoch}, or more epochs")


def build_training(cfg, model, n_train_batches, num_classes, ranks, log, class_counts=None) -> Training:
    """Loss, optimizer, per-step schedule (or the LR finder), GradScaler, autocast and MixUp/CutMix.
    `class_counts`: the training images of each class, for --class-weights."""
    step_images = cfg.batch_size * ranks.data_size * cfg.grad_acc
    log(
        f"global batch size: {step_images} - mini batch size: {cfg.batch_size}"
        + (f" - {cfg.grad_acc} accumulated micro-batches per optimizer step" if cfg.grad_acc > 1 else "")
    )
    criterion, val_criterion = build_losses(cfg.section("training"), class_counts, ranks.device, log)
    teacher = None
    if cfg.teacher is not None:
        from dlojz_lib.optim.distill import DistillationLoss, load_teacher

        teacher = load_teacher(cfg, num_classes, ranks.device, log)
        criterion = DistillationLoss(criterion, cfg.distill_alpha, cfg.distill_temperature)
    if getattr(model, "pipeline", None) is not None:  # --pp: the schedule computes the loss on the last stage
        model.pipeline.give_loss(criterion)
    # Fused steps (sgd, adamw): no host synchronisation with the float16 GradScaler (see build_optimizer); FSDP's
    # sharded parameters have no fused SGD (its foreach step is used, and bfloat16 needs no scaler); the log says
    # which step.
    fused = not cfg.parallelism.fsdp or OPTIMIZER_TABLE[cfg.optimizer].fused_on_shards
    decays = kind_decay(vars(cfg))  # --norm-wd, --bias-wd, --embedding-wd given
    check_kinds_present(model.unsharded, decays, cfg.arch)
    head = fine_tuning_head(model.module, num_classes, vars(cfg))
    groups = param_groups(model.module, cfg.wd, cfg.no_wd_norm_bias, cfg.layer_decay, head, decays)
    optimizer = build_optimizer(
        cfg.optimizer,
        groups,
        lr=cfg.lr,
        momentum=cfg.mom,
        weight_decay=cfg.wd,
        fused=fused,
        nesterov=cfg.nesterov,
    )
    step = "fused" if optimizer.defaults.get("fused") else "foreach" if optimizer.defaults.get("foreach") else ""
    log(
        f"optimizer: {cfg.optimizer}{f' ({step} step)' if step else ''} (lr {cfg.lr}, "
        f"{'Nesterov ' if cfg.nesterov else ''}momentum {cfg.mom}, weight decay {cfg.wd}"
        f"{', none on norms and biases' if cfg.no_wd_norm_bias else ''}"
        + "".join(f", {value:g} on {kind} parameters" for kind, value in decays.items())
        + f"); {lr_scaling_line(cfg.lr, step_images)}"
    )
    if cfg.layer_decay is not None:
        scales = sorted({group["lr_scale"] for group in optimizer.param_groups})
        log(
            f"layer decay {cfg.layer_decay}: {len(scales)} layers, learning rates from lr x {scales[0]:.3g} (the "
            f"first layer) to lr x 1 ({head})"
        )
    steps_per_epoch = math.ceil(n_train_batches / cfg.grad_acc)  # optimizer steps: what schedules and logs count
    total_steps = cfg.epochs * steps_per_epoch
    check_ema_every(cfg.model_ema_steps if cfg.model_ema else None, cfg.epochs, steps_per_epoch, cfg.set_by_recipe, log)
    scheduler, lr_finder = build_schedule(cfg, optimizer, steps_per_epoch, total_steps)
    if model.ema is not None and cfg.model_ema_warmup_copy:  # torchvision's: the EMA follows the warm-up's weights
        model.ema.copy_updates = warmup_steps(cfg.section("optimizer"), steps_per_epoch) // model.ema.every
    clip = split_model_clip(optimizer, model, cfg.clip_grad_norm, log)
    drop_frozen_gradients = None
    if cfg.freeze_backbone_epochs:
        drop_frozen_gradients = freeze_backbone(optimizer, scheduler, cfg.freeze_backbone_epochs * steps_per_epoch)
        log(f"the head ({head}) learns alone for {cfg.freeze_backbone_epochs} epochs, then every layer")
    float16 = cfg.amp and cfg.amp_dtype == "float16"
    autocast = (
        (lambda: torch.autocast(ranks.device.type, dtype=cfg.autocast_dtype)) if cfg.amp else contextlib.nullcontext
    )
    return Training(
        criterion,
        val_criterion,
        optimizer,
        scheduler,
        lr_finder,
        torch.amp.GradScaler(ranks.device.type, enabled=float16),
        autocast,
        batch_mixing(cfg.section("augmentation"), num_classes),
        total_steps,
        drop_frozen_gradients,
        teacher,
        clip,
        cfg.grad_acc,
    )


def split_model_clip(optimizer, model, clip_grad_norm, log):
    """The global norm the loop clips to: --clip-grad-norm, and under --pp or --tp also an optimizer's own global
    clip (LAMB's max_grad_norm), which would see this rank's stage or shard alone: taken out of the optimizer, into
    the model's clip across the stages and shards (clipping to c, then to m, is clipping to min(c, m))."""
    own = optimizer.defaults.get("max_grad_norm")
    if own is None or (getattr(model, "pipeline", None) is None and not getattr(model, "tensor_parallel", False)):
        return clip_grad_norm
    optimizer.defaults["max_grad_norm"] = None
    clip = own if clip_grad_norm is None else min(clip_grad_norm, own)
    log(
        f"the optimizer's own clip of the global gradient norm ({own:g}) is the model's across its stages and "
        f"shards: the gradients clipped to {clip:g}"
    )
    return clip
