"""Optimizers, learning-rate schedules and the LR range test for dlojz.

The course teaches these by editing the training script; here each is a function the script calls from its flags.

Public API
----------
``OPTIMIZERS``, ``SCHEDULERS``
    The accepted values of ``--optimizer`` and ``--lr-scheduler``.
``param_groups(model, weight_decay, no_wd_norm_bias, layer_decay=None, head=None) -> list[dict]``
    Parameter groups for an optimizer; with ``no_wd_norm_bias`` (``--no-wd-norm-bias``) the parameters of
    normalisation layers and all biases get ``weight_decay=0``; with ``layer_decay`` (``--layer-decay``) each group
    has an ``lr_scale`` that the schedules and the LR finder apply; the head's parameters are groups of their own.
``freeze_backbone(optimizer, scheduler, frozen_steps)``
    ``--freeze-backbone-epochs``: only the head's groups step for the first ``frozen_steps`` optimizer steps.
``build_optimizer(name, params, lr, momentum, weight_decay, fused=False) -> torch.optim.Optimizer``
    ``sgd`` (torch SGD with momentum), ``adamw`` (torch AdamW, ``betas=(momentum, 0.999)``), both with torch's
    fused step when ``fused`` and this torch has one for the parameters' device (``optimizer.defaults["fused"]``
    says which): one kernel per step, and GradScaler hands it the scale and the inf flag as tensors instead of
    reading the inf flag on the host every step. And timm's
    large-batch optimizers ``lamb`` (``betas=(momentum, 0.999)``), ``lars`` (``momentum``) and ``lion``
    (``betas=(momentum, 0.99)``).
``build_scheduler(name, optimizer, lr, total_steps, warmup_steps=0, step_milestones=None, gamma=0.1)``
    A torch LR scheduler to be stepped once per optimizer step. ``lr`` is the peak LR of every group (times its
    ``lr_scale``).
``check_hyperparameters(lr, momentum, weight_decay)``
    Raises ``ValueError`` naming ``--lr``, ``--mom`` or ``--wd`` when one is out of range.
``fast_forward(scheduler, step)``
    Puts a fresh scheduler at optimizer step ``step`` (a run resumed with a different length).
``lr_scaling_line(lr, global_batch_size) -> str``
    The LR expressed per 256 images (linear scaling rule, Goyal et al. 2017), for the start-up log.
``LRFinder(optimizer, start_lr, end_lr, num_steps)``
    The course's LR range test: the LR grows exponentially from ``start_lr`` to ``end_lr`` over ``num_steps``
    optimizer steps; ``step(loss, accuracy)`` after each optimizer step records the point and sets the next LR.
    ``write_csv(path)``, ``plot(png_path)``, ``suggestion() -> (lr, rule)``.
``soft_target_accuracy(outputs, targets) -> torch.Tensor``
    Batch accuracy (0-dim tensor in [0, 1]) against class indices or soft labels (MixUp/CutMix).
``build_training(cfg, model, n_train_batches, num_classes, ranks, log, class_counts=None) -> Training``
    What dlojz.py's run builds of all this from its flags: the losses, optimizer, schedule or LR finder,
    GradScaler, autocast and MixUp/CutMix, in one record.

Typical use in the training loop::

    optimizer = build_optimizer(args.optimizer, param_groups(model, args.wd, args.no_wd_norm_bias),
                                args.lr, args.mom, args.wd)
    scheduler = build_scheduler(args.lr_scheduler, optimizer, args.lr, total_steps, warmup_steps)
    for images, labels in loader:
        ...; optimizer.step(); scheduler.step()
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

# The flags' values and their check live with the command line (torch-free, so that --help answers at once).
from dlojz_lib.checks import fail
from dlojz_lib.flags import OPTIMIZERS, SCHEDULERS, check_hyperparameters
from dlojz_lib.data.transforms import batch_mixing
from dlojz_lib.fsdp import UNFUSED_UNDER_FSDP
from dlojz_lib.model import classifier_name

# Layers whose affine parameters are normalisation scales/shifts: decaying them towards 0 only fights the
# normalisation (see "Bag of Tricks", He et al. 2019), hence --no-wd-norm-bias.
NORM_LAYERS = tuple(
    getattr(nn, name)
    for name in (
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "SyncBatchNorm",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "GroupNorm",
        "LayerNorm",
        "LocalResponseNorm",
        "RMSNorm",
    )
    if hasattr(nn, name)
)


# Parameters that --embedding-wd sets: ViTs' class token and position embeddings, Swin's relative position bias
# (torchvision's --transformer-embedding-decay keys), and those a timm model names in its no_weight_decay().
EMBEDDING_NAMES = ("class_token", "cls_token", "dist_token", "pos_embed", "pos_embedding", "position_embedding")
EMBEDDING_NAMES += ("relative_position_bias_table",)


def parameter_kind(module: nn.Module, full_name: str, name: str, timm_names=()) -> str:
    """ "embedding", "norm", "bias" or "other", in torchvision's order of precedence (set_weight_decay).
    `timm_names`: the model's no_weight_decay() set, where it is a timm model."""
    if name in EMBEDDING_NAMES or full_name in timm_names or name in timm_names:
        return "embedding"
    if isinstance(module, NORM_LAYERS):
        return "norm"
    return "bias" if name == "bias" else "other"


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_wd_norm_bias: bool,
    layer_decay: float | None = None,
    head: str | None = None,
    kind_decay: dict | None = None,
) -> list[dict]:
    """Return optimizer parameter groups for the trainable parameters of ``model``.

    Without ``no_wd_norm_bias``: the parameters take ``weight_decay``. With it: norm-layer parameters and biases
    take ``weight_decay=0``. ``kind_decay`` (``--norm-wd``, ``--bias-wd``, ``--embedding-wd``): the weight decay of
    each kind of parameter it names (``parameter_kind``), over the two above. With ``layer_decay`` (``--layer-decay``), each group's ``lr_scale`` is
    ``layer_decay ** (depth of the head - depth of its layer)``, the depths from ``layer_depths``. With ``head``
    (the classifier's module name), its parameters are groups of their own (``"head": True``), for
    ``--freeze-backbone-epochs``. Groups go from the head (the largest ``lr_scale``) down, so that the first
    group's LR is the schedule's. Frozen parameters (``requires_grad=False``) are left out; shared parameters
    appear once.
    """
    depth = layer_depths(model, head) if layer_decay is not None else {}
    timm_names = model.no_weight_decay() if kind_decay and hasattr(model, "no_weight_decay") else ()
    deepest = max(depth.values(), default=0)
    groups, seen = {}, set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, NORM_LAYERS)
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{name}" if module_name else name
            in_head = head is not None and full_name.startswith(head + ".")
            scale = layer_decay ** (deepest - depth[full_name]) if layer_decay is not None else 1.0
            decays = not (no_wd_norm_bias and (is_norm or name == "bias"))
            decay = weight_decay if decays else 0.0
            kind = parameter_kind(module, full_name, name, timm_names) if kind_decay else ""
            if kind in (kind_decay or {}):
                decay = kind_decay[kind]
            key = (not in_head, -scale, not decays, kind)  # (without kind_decay: the groups of earlier checkpoints)
            group = groups.setdefault(key, {"params": [], "weight_decay": decay, "lr_scale": scale, "head": in_head})
            group["params"].append(param)
    return [groups[key] for key in sorted(groups)]


def layer_depths(model: nn.Module, head: str | None) -> dict[str, int]:
    """Each parameter's depth for ``--layer-decay``, 0 at the input and the head deepest. A timm model's own
    grouping where it has one (``group_matcher``: its stem, each block, its head, as timm's layer decay uses);
    otherwise one layer per block of the model's stages (each child of a plain ``nn.Sequential``/``ModuleList``
    that is not one itself: a ResNet's ``layer1.0``, a ConvNeXt's ``features.1.0``, a ViT's encoder layers) and
    per other module, in the order the model defines them."""
    if hasattr(model, "group_matcher"):
        from timm.models import group_parameters

        return group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    containers = (nn.Sequential, nn.ModuleList)
    keys = {}
    for name, _ in model.named_parameters():
        parts, module, key = name.split("."), model, None
        for index, part in enumerate(parts[:-1]):
            child = module.get_submodule(part)
            if type(module) in containers and type(child) not in containers:  # a block (not a subclass: a ConvBN)
                key = ".".join(parts[: index + 1])
                break
            module = child
        if key is None:
            key = ".".join(parts[:-1]) or name  # the module owning it, or the model's own (a class token)
        if head is not None and name.startswith(head + "."):
            key = head
        keys[name] = key
    order = {}
    for key in keys.values():
        if key != head:
            order.setdefault(key, len(order))
    if head is not None:
        order[head] = len(order)
    return {name: order[key] for name, key in keys.items()}


def build_optimizer(
    name: str, params, lr: float, momentum: float, weight_decay: float, fused: bool = False, nesterov: bool = False
) -> torch.optim.Optimizer:
    """Build the optimizer ``name`` (one of ``OPTIMIZERS``) over ``params`` (parameters or param groups).

    ``momentum`` (``--mom``) is SGD/LARS momentum or the first beta of AdamW/LAMB/Lion. ``weight_decay`` is the
    default for groups that do not set their own. LAMB keeps timm's defaults (global gradient-norm clipping at
    1.0), as does LARS (trust coefficient 1e-3: its LR is much larger than SGD's). Both adapt the step layer-wise
    only for groups with weight decay, unless ``weight_decay`` is 0, when every layer is adapted. RMSprop is
    torchvision's (TensorFlow's constants: smoothing 0.9, eps 0.0316, its MobileNet recipes'), ``momentum`` its
    momentum. ``nesterov``: SGD's Nesterov momentum.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer {name!r} is unknown: choose one of {', '.join(OPTIMIZERS)}")
    check_hyperparameters(lr, momentum, weight_decay)
    if nesterov and name != "sgd":
        raise ValueError(f"--nesterov is SGD's: --optimizer {name} has no Nesterov momentum")
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=0.9, eps=0.0316, momentum=momentum, weight_decay=weight_decay)

    if name in ("sgd", "adamw"):
        params = list(params)  # read twice when the fused step is refused
        cls, options = (
            (torch.optim.SGD, dict(momentum=momentum, nesterov=nesterov))
            if name == "sgd"
            else (torch.optim.AdamW, dict(betas=(momentum, 0.999)))
        )
        if fused:
            try:
                optimizer = cls(params, lr=lr, weight_decay=weight_decay, fused=True, **options)
            except (RuntimeError, ValueError):  # no fused kernel for this device or dtype in this torch
                pass
            else:
                if name == "sgd":
                    zero_momentum_buffers(optimizer)
                return optimizer
        return cls(params, lr=lr, weight_decay=weight_decay, **options)

    import timm.optim  # imported here so that sgd/adamw runs do not pay timm's import time

    # timm's LAMB/LARS adapt the step layer-wise only for groups with weight decay (so norm layers and biases
    # excluded by --no-wd-norm-bias keep a plain step). With --wd 0 (the course default) that would silently turn
    # them into Adam/SGD: adapt every layer then.
    always_adapt = weight_decay == 0
    if name == "lamb":
        return timm.optim.Lamb(
            params, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay, always_adapt=always_adapt
        )
    if name == "lars":
        return timm.optim.Lars(params, lr=lr, momentum=momentum, weight_decay=weight_decay, always_adapt=always_adapt)
    return timm.optim.Lion(params, lr=lr, betas=(momentum, 0.99), weight_decay=weight_decay)


def zero_momentum_buffers(optimizer):
    """Momentum buffers of zeros before the first step of torch's fused SGD. On its first step that SGD allocates
    them uninitialised (`empty_like`) and leaves them so when the float16 GradScaler skips the step for an
    overflow, frequent at the first steps: the next step then moves the weights by whatever that memory held.
    From zeros, the first step sets each buffer to its gradient, as the unfused SGD does."""
    for group in optimizer.param_groups:
        if group["momentum"] != 0:
            for param in group["params"]:
                optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))


def fast_forward(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Put a freshly built scheduler at optimizer step ``step``, as if it had been stepped ``step`` times.

    Every schedule here is a closed formula of the step (``LambdaLR``, ``OneCycleLR``), so setting the step and
    stepping once gives the same LR (and OneCycle momentum) as replaying them all.
    """
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()


def _warmup_factor(step: int, warmup_steps: int, start: float = 0.0, method: str = "linear") -> float:
    """The warm-up's factor of the peak LR at ``step`` < ``warmup_steps``: ``linear`` from ``start`` (step 0)
    towards 1 (reached at step ``warmup_steps``), ``constant`` at ``start`` throughout (torchvision's
    --lr-warmup-method and --lr-warmup-decay)."""
    if method == "constant":
        return start
    return start + (1.0 - start) * step / warmup_steps


def build_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    step_milestones=None,
    gamma: float = 0.1,
    poly_power: float = 2.0,
    warmup_start: float = 0.0,
    warmup_method: str = "linear",
    min_lr: float = 0.0,
    steps_per_epoch: int | None = None,
) -> torch.optim.lr_scheduler.LRScheduler:
    """Build the LR schedule ``name`` (one of ``SCHEDULERS``), stepped once per optimizer step.

    ``lr`` becomes the peak LR of every param group. With ``s`` the optimizer step (0-based, ``T=total_steps``,
    ``W=warmup_steps``), the LR used by step ``s`` is:

    - ``onecycle``: torch ``OneCycleLR(max_lr=lr, total_steps=T)`` with its defaults, as in the course (its own
      30 % warmup from lr/25, cosine annealing, momentum cycled 0.95 -> 0.85 -> 0.95); ``warmup_steps`` is ignored.
    - ``cosine``: ``lr*s/W`` for ``s < W``, then ``lr*(1+cos(pi*(s-W)/(T-W)))/2`` (reaches 0 at ``s = T``).
    - ``step``: ``lr*s/W`` for ``s < W``, then ``lr*gamma**k`` with ``k`` the number of milestones <= ``s``;
      milestones (optimizer steps) default to 30, 60 and 90 % of ``T``.
    - ``constant``: ``lr*s/W`` for ``s < W``, then ``lr``.
    - ``linear``: FFCV's triangle: ``lr*s/W`` for ``s < W`` (``W`` from ``--lr-peak-epoch``), then linear down to 0
      at ``s = T``.
    - ``poly``: MLPerf's polynomial decay: ``lr*s/W`` for ``s < W``, then ``lr*(1-(s-W)/(T-W))**poly_power``.

    The warm-up (``lr*s/W`` above) starts from ``warmup_start*lr`` instead of 0 when given, and with
    ``warmup_method="constant"`` stays there until ``W``. ``min_lr`` (absolute, scaled like each group's LR) is the
    floor cosine, linear and poly decay to: ``min_lr + (lr - min_lr) * factor``. With ``steps_per_epoch`` (all but
    onecycle), every step of an epoch takes the LR of the epoch's first step: the schedule in epochs, as torchvision's
    and timm's schedulers stepped once per epoch give it (warm-up and milestones at epoch boundaries).

    The warmup schedules are one ``LambdaLR`` each: an exact closed formula per step, and unlike ``SequentialLR``
    + ``LinearLR`` it can start the warmup from 0 and has no milestone hand-over to get wrong.
    """
    if name not in SCHEDULERS:
        raise ValueError(f"--lr-scheduler {name!r} is unknown: choose one of {', '.join(SCHEDULERS)}")
    if total_steps < 2:
        raise ValueError(
            f"the schedule needs at least 2 optimizer steps, got {total_steps}: raise --epochs, or lower --batch-size or --grad-acc"
        )
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"warmup lasts {warmup_steps} steps out of {total_steps}: lower --warmup-epochs below --epochs (0: no "
            "warm-up, a recipe's warm-up shape then left out too)"
        )

    if name == "onecycle":
        max_lrs = [lr * group.get("lr_scale", 1.0) for group in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lrs, total_steps=total_steps)

    for group in optimizer.param_groups:  # LambdaLR multiplies each group's own LR: make it the peak
        group["lr"] = lr * group.get("lr_scale", 1.0)
        group.pop("initial_lr", None)

    if not 0 <= min_lr < lr:
        raise ValueError(f"--min-lr {min_lr:g} must be below the peak --lr {lr:g}")
    floor = min_lr / lr

    def warmup(step: int) -> float:
        return _warmup_factor(step, warmup_steps, warmup_start, warmup_method)

    if name == "cosine":
        decay_steps = total_steps - warmup_steps

        def factor(step: int) -> float:
            if step < warmup_steps:
                return warmup(step)
            progress = min(step - warmup_steps, decay_steps) / decay_steps
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    elif name == "step":
        if step_milestones is None:
            step_milestones = [round(fraction * total_steps) for fraction in (0.3, 0.6, 0.9)]
        milestones = sorted(int(m) for m in step_milestones)

        def factor(step: int) -> float:
            if step < warmup_steps:
                return warmup(step)
            return gamma ** sum(step >= milestone for milestone in milestones)

    elif name in ("linear", "poly"):
        decay_steps = total_steps - warmup_steps
        power = 1.0 if name == "linear" else poly_power

        def factor(step: int) -> float:
            if step < warmup_steps:
                return warmup(step)
            return floor + (1.0 - floor) * (1.0 - min(step - warmup_steps, decay_steps) / decay_steps) ** power

    else:  # constant

        def factor(step: int) -> float:
            return warmup(step) if step < warmup_steps else 1.0

    if steps_per_epoch:
        per_step = factor

        def factor(step: int) -> float:
            return per_step(step - step % steps_per_epoch)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def lr_scaling_line(lr: float, global_batch_size: int) -> str:
    """Describe ``lr`` per 256 images, the reference batch of the linear scaling rule (Goyal et al. 2017)."""
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be >= 1, got {global_batch_size}: check --batch-size")
    per_256 = lr * 256 / global_batch_size
    return f"lr {lr:g} for {global_batch_size} images = {per_256:.4g} per 256 images (linear scaling rule)"


DIVERGENCE_FACTOR = 4.0  # an LR sweep has diverged once the smoothed loss exceeds 4x its minimum so far


class LRFinder:
    """The LR range test (Smith 2017; the course's ``--findlr``): an exponential LR sweep recording the loss.

    The constructor sets every param group to ``start_lr``; after each optimizer step call
    ``step(loss, accuracy)``, which records ``(lr, loss, accuracy)`` and sets the LR of the next step.
    Step ``i`` uses ``start_lr * (end_lr/start_lr) ** (i/(num_steps-1))``: the first step runs at ``start_lr``,
    step ``num_steps-1`` at ``end_lr`` (later steps stay at ``end_lr``). Do not step an LR scheduler as well.
    """

    divergence_factor = DIVERGENCE_FACTOR

    def __init__(
        self, optimizer: torch.optim.Optimizer, start_lr: float = 1e-8, end_lr: float = 1.0, num_steps: int = 100
    ):
        if not 0 < start_lr < end_lr:
            raise ValueError(f"the LR sweep needs 0 < start lr ({start_lr:g}) < end lr ({end_lr:g}): check --lr")
        if num_steps < 2:
            raise ValueError(f"the LR sweep needs at least 2 steps, got {num_steps}: run more steps")
        self.optimizer = optimizer
        self.start_lr, self.end_lr, self.num_steps = start_lr, end_lr, num_steps
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.accuracies: list[float] = []
        self._set_lr(self.lr_at(0))

    def lr_at(self, step: int) -> float:
        """LR of optimizer step ``step`` (0-based), clamped to the swept range."""
        fraction = min(max(step, 0), self.num_steps - 1) / (self.num_steps - 1)
        return self.start_lr * (self.end_lr / self.start_lr) ** fraction

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def step(self, loss: float, accuracy: float) -> None:
        """Record the loss and accuracy of the step just taken, then set the LR of the next step."""
        self.lrs.append(self.lr_at(len(self.lrs)))
        self.losses.append(float(loss))
        self.accuracies.append(float(accuracy))
        self._set_lr(self.lr_at(len(self.lrs)))

    @property
    def done(self) -> bool:
        """The sweep is over: all its steps taken, or the last loss is not finite."""
        return bool(self.losses) and (not math.isfinite(self.losses[-1]) or len(self.losses) >= self.num_steps)

    def write_csv(self, path) -> None:
        """Write the recorded points as CSV with a ``lr,loss,accuracy`` header."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["lr", "loss", "accuracy"])
            writer.writerows(zip(self.lrs, self.losses, self.accuracies))

    def suggestion(self) -> tuple[float, str]:
        """Return the suggested LR (inside the swept range) and a sentence stating the rule used.

        Rule: the LR where the smoothed loss falls fastest (most negative slope against log10(lr)), looking only
        before the divergence (first NaN/inf loss, or smoothed loss above 4x its running minimum). If the loss
        never falls, the min-loss/10 rule: the LR of the lowest smoothed loss divided by 10.
        """
        analysis = analyse_sweep(self.lrs, self.losses, self.start_lr, self.divergence_factor)
        return analysis["lr"], analysis["rule"]

    def plot(self, png_path) -> None:
        """Plot the loss (raw and smoothed) against the LR on a log axis, with the suggested LR marked, to PNG."""
        from matplotlib.figure import Figure  # object API with the Agg canvas: no display, no global backend state

        analysis = analyse_sweep(self.lrs, self.losses, self.start_lr, self.divergence_factor)
        lrs, losses = np.asarray(self.lrs), np.asarray(self.losses, dtype=float)
        figure = Figure(figsize=(7, 4.5))
        axes = figure.add_subplot()
        axes.plot(lrs, losses, color="0.7", linewidth=0.8, label="loss")
        usable, smoothed = analysis["usable"], analysis["smoothed"]
        if usable:
            axes.plot(lrs[:usable], smoothed, color="tab:blue", label="smoothed loss (before divergence)")
            # Keep the diverged tail from squashing the interesting part of the curve.
            low, high = float(np.min(smoothed)), float(np.max(smoothed))
            margin = 0.1 * (high - low) or 0.1 * abs(high) or 1.0
            axes.set_ylim(low - margin, high + margin)
        axes.axvline(analysis["lr"], color="tab:red", linestyle="--", label=f"suggested lr {analysis['lr']:.2e}")
        axes.set_xlim(self.start_lr, self.end_lr)  # the whole swept range, even if the sweep stopped early
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("training loss")
        axes.set_title("LR range test")
        axes.legend()
        figure.tight_layout()
        path = Path(png_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png", dpi=100)


def analyse_sweep(lrs, losses, start_lr, divergence_factor=DIVERGENCE_FACTOR) -> dict:
    """An LR sweep's points: the loss smoothed, where the sweep diverged, the suggested LR and its rule (see
    LRFinder.suggestion)."""
    if not len(losses):
        raise RuntimeError("the LR finder has recorded no step: call LRFinder.step() after each optimizer step")
    lrs, losses = np.asarray(lrs), np.asarray(losses, dtype=float)
    # Divergence, part 1: everything from the first NaN/inf loss on is unusable.
    finite = np.isfinite(losses)
    usable = len(losses) if finite.all() else int(np.argmin(finite))
    if usable == 0:
        return {
            "smoothed": np.array([]),
            "usable": 0,
            "lr": float(lrs[0]),
            "rule": "no finite loss recorded: the first LR of the sweep is returned; check the data and model",
        }
    # A centred moving average (about 5 % of the sweep) rather than an EMA: an EMA lags, which would move the
    # steepest point towards larger, riskier LRs.
    window = max(3, usable // 20) | 1
    padded = np.pad(losses[:usable], window // 2, mode="edge")
    smoothed = np.convolve(padded, np.ones(window) / window, mode="valid")
    # Divergence, part 2: the smoothed loss blows up past divergence_factor x its running minimum.
    blown_up = smoothed > divergence_factor * np.minimum.accumulate(smoothed)
    if blown_up.any():
        usable = max(1, int(np.argmax(blown_up)))
        smoothed = smoothed[:usable]
    diverged_at = f"diverged at lr {lrs[usable]:.2e}" if usable < len(losses) else "did not diverge"

    best = int(np.argmin(smoothed))
    min_over_10 = max(float(lrs[best]) / 10, start_lr)
    if usable >= 3:
        slope = np.gradient(smoothed, np.log10(lrs[:usable]))
        steepest = int(np.argmin(slope))
        if slope[steepest] < 0:
            rule = (
                f"steepest descent of the smoothed loss (moving average over {window} steps) before "
                f"divergence; sweep {diverged_at}; the min-loss/10 rule gives {min_over_10:.2e}"
            )
            return {"smoothed": smoothed, "usable": usable, "lr": float(lrs[steepest]), "rule": rule}
    rule = (
        f"min-loss/10: LR of the lowest smoothed loss ({lrs[best]:.2e}) divided by 10, as the smoothed "
        f"loss never decreased; sweep {diverged_at}"
    )
    return {"smoothed": smoothed, "usable": usable, "lr": min_over_10, "rule": rule}


def soft_target_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of the batch whose predicted class (argmax of ``outputs``) matches the target class.

    ``targets`` holds class indices (shape ``[N]``) or soft labels (shape ``[N, C]``, from MixUp/CutMix or label
    smoothing), whose target class is their argmax. Returns a 0-dim float tensor on the outputs' device, so no
    GPU synchronisation happens until the caller reads it.
    """
    predicted = outputs.detach().argmax(dim=1)
    labels = targets.argmax(dim=1) if targets.ndim == outputs.ndim else targets
    return (predicted == labels).float().mean()


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


def fine_tuning_head(module, num_classes, args) -> str | None:
    """The classifier's name when the run's flags (a dict: a Config's, or a checkpoint's args) give its groups a
    part of their own (--freeze-backbone-epochs, --layer-decay), else None."""
    if not (args.get("freeze_backbone_epochs") or args.get("layer_decay") is not None):
        return None
    head = classifier_name(module, num_classes)
    if head is None:
        fail(
            f"--freeze-backbone-epochs/--layer-decay: --arch {args['arch']} has no Linear layer with {num_classes} "
            "outputs, the head they start from"
        )
    return head


def freeze_backbone(optimizer, scheduler, frozen_steps: int):
    """``--freeze-backbone-epochs``: for optimizer steps 0 to ``frozen_steps - 1`` (the schedule's count, so a
    resumed run goes on where it was) only the head's groups learn. The other parameters' gradients are dropped
    before each of those steps, so the optimizer neither moves them nor builds their momentum or weight decay. The
    backward still computes them: DDP and FSDP keep one set of buckets for the whole run, and the change to every
    layer is a step like any other, with no new wrapper or optimizer. Returns the function that drops them: the
    loop calls it before clipping and unscaling (the head is clipped by its own norm, and an overflow in a frozen
    gradient skips no step); the optimizer's step pre-hook calls it too, for any other caller of step()."""
    backbone = [param for group in optimizer.param_groups if not group["head"] for param in group["params"]]

    def drop_backbone_gradients():
        if scheduler.last_epoch < frozen_steps:  # a Python int: no device synchronisation
            for param in backbone:
                param.grad = None

    optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: drop_backbone_gradients())
    return drop_backbone_gradients


def kind_decay(args: dict) -> dict:
    """--norm-wd, --bias-wd, --embedding-wd as param_groups' kind_decay (the kinds given only)."""
    given = dict(norm=args.get("norm_wd"), bias=args.get("bias_wd"), embedding=args.get("embedding_wd"))
    return {kind: value for kind, value in given.items() if value is not None}


def step_milestones(cfg, steps_per_epoch: int):
    """--lr-scheduler step's milestones in optimizer steps: every --lr-step-size epochs (torchvision's StepLR), at
    --lr-milestones' epochs (MultiStepLR), else None (30, 60 and 90 % of the run)."""
    if cfg.lr_milestones:
        return [round(epoch * steps_per_epoch) for epoch in cfg.lr_milestones]
    if cfg.lr_step_size:
        return [round(epoch * steps_per_epoch) for epoch in range(cfg.lr_step_size, cfg.epochs, cfg.lr_step_size)]
    return None


class BinaryCrossEntropy(nn.Module):
    """--bce-loss: timm's BinaryCrossEntropy (one sigmoid per class, as "ResNet strikes back" trains), whose
    smoothing applies to class indices; MixUp/CutMix's soft labels are smoothed here as timm's Mixup smooths its
    targets (mixing smoothed one-hots is smoothing the mix: target x (1 - s) + s / classes)."""

    def __init__(self, smoothing: float, target_threshold: float | None, weight: torch.Tensor | None):
        super().__init__()
        from timm.loss import BinaryCrossEntropy as TimmBinaryCrossEntropy

        self.smoothing = smoothing
        self.loss = TimmBinaryCrossEntropy(smoothing=smoothing, target_threshold=target_threshold, weight=weight)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.shape == logits.shape and self.smoothing:
            targets = targets * (1.0 - self.smoothing) + self.smoothing / logits.shape[-1]
        return self.loss(logits, targets)


def balanced_class_weights(class_counts) -> torch.Tensor:
    """--class-weights balanced: images / (classes x images of the class), as scikit-learn's "balanced" (a class
    with no training image gets 0: it has nothing to weigh)."""
    counts = torch.tensor(class_counts, dtype=torch.float64)
    weights = counts.sum() / (len(class_counts) * counts.clamp(min=1))
    return torch.where(counts > 0, weights, torch.zeros_like(weights)).float()


def build_training(cfg, model, n_train_batches, num_classes, ranks, log, class_counts=None) -> Training:
    """Loss, optimizer, per-step schedule (or the LR finder), GradScaler, autocast and MixUp/CutMix.
    `class_counts`: the training images of each class, for --class-weights."""
    step_images = cfg.batch_size * ranks.world_size * cfg.grad_acc
    log(
        f"global batch size: {step_images} - mini batch size: {cfg.batch_size}"
        + (f" - {cfg.grad_acc} accumulated micro-batches per optimizer step" if cfg.grad_acc > 1 else "")
    )
    weight = None
    if cfg.class_weights == "balanced":
        weight = balanced_class_weights(class_counts)
        log(
            f"--class-weights balanced: the training loss weighs each class by {weight.min():.3g} (the largest) to "
            f"{weight.max():.3g} (the smallest)"
        )
        weight = weight.to(ranks.device)
    if cfg.bce_loss:
        criterion = BinaryCrossEntropy(cfg.label_smoothing, cfg.bce_target_thresh, weight)
        log(
            f"loss: binary cross-entropy per class (label smoothing {cfg.label_smoothing}"
            + (f", targets above {cfg.bce_target_thresh} as 1" if cfg.bce_target_thresh is not None else "")
            + "); validation's loss: cross-entropy"
        )
    else:  # (it also takes MixUp's soft labels, the weight applied to each class's share)
        criterion = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=cfg.label_smoothing)
    val_criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing, reduction="sum")
    # Fused steps (sgd, adamw): no host synchronisation with the float16 GradScaler (see dlojz_lib.optim); FSDP's
    # sharded parameters have no fused SGD (its foreach step is used, and bfloat16 needs no scaler).
    fused = not (cfg.fsdp and cfg.optimizer in UNFUSED_UNDER_FSDP)
    head = fine_tuning_head(model.module, num_classes, vars(cfg))
    groups = param_groups(model.module, cfg.wd, cfg.no_wd_norm_bias, cfg.layer_decay, head, kind_decay(vars(cfg)))
    optimizer = build_optimizer(
        cfg.optimizer,
        groups,
        lr=cfg.lr,
        momentum=cfg.mom,
        weight_decay=cfg.wd,
        fused=fused,
        nesterov=cfg.nesterov,
    )
    fused = optimizer.defaults.get("fused")
    log(
        f"optimizer: {cfg.optimizer}{' (fused step)' if fused else ''} (lr {cfg.lr}, "
        f"{'Nesterov ' if cfg.nesterov else ''}momentum {cfg.mom}, weight decay {cfg.wd}"
        f"{', none on norms and biases' if cfg.no_wd_norm_bias else ''}"
        + "".join(f", {value:g} on {kind} parameters" for kind, value in kind_decay(vars(cfg)).items())
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
    scheduler, lr_finder = None, None
    try:  # these checks need the data set's size
        if cfg.findlr:  # the course's range test: the finder sets the lr of every step, no scheduler
            lr_finder = LRFinder(
                optimizer, 1e-8, cfg.lr, min(total_steps, cfg.test_nsteps) if cfg.test else total_steps
            )
        else:
            warmup_epochs = cfg.lr_peak_epoch if cfg.lr_scheduler == "linear" else cfg.warmup_epochs
            if cfg.lr_scheduler == "linear" and cfg.lr_peak_epoch >= cfg.epochs:
                fail(f"--lr-peak-epoch {cfg.lr_peak_epoch} must come before the end (--epochs {cfg.epochs})")
            scheduler = build_scheduler(
                cfg.lr_scheduler,
                optimizer,
                cfg.lr,
                total_steps,
                warmup_steps=round(warmup_epochs * steps_per_epoch),
                poly_power=cfg.lr_poly_power,
                step_milestones=step_milestones(cfg, steps_per_epoch),
                gamma=0.1 if cfg.lr_gamma is None else cfg.lr_gamma,
                warmup_start=cfg.warmup_start_factor or 0.0,
                warmup_method=cfg.warmup_method or "linear",
                min_lr=cfg.min_lr or 0.0,
                steps_per_epoch=steps_per_epoch if cfg.lr_per_epoch else None,
            )
    except ValueError as err:
        fail(str(err))
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
        batch_mixing(cfg, num_classes),
        total_steps,
        drop_frozen_gradients,
    )
