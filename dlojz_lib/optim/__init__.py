"""How the model learns: the optimizers, the learning-rate schedules and the LR range test, the losses, and the
`Training` record a run builds of them from its flags. The course teaches these by editing the training script;
here each is a function the script calls from its flags.

- `dlojz_lib.optim` (this file, no torch): the optimizer table, one row per `--optimizer` value, read by the
  command line (its choices, which have a fused step) and by the builder. Adding an optimizer is one row here.
- `optimizers`: parameter groups (weight decay by kind, layer decay, the head's groups), `build_optimizer`, the
  frozen backbone of a fine-tune.
- `schedules`: `build_scheduler` (one closed formula per step), `fast_forward`, the LR finder and its analysis.
- `losses`: binary cross-entropy, balanced class weights, the batch accuracy against soft labels.
- `training`: the `Training` record and `build_training`, what dlojz.py's run builds of all this.

Typical use::

    optimizer = build_optimizer(args.optimizer, param_groups(model, args.wd, args.no_wd_norm_bias),
                                args.lr, args.mom, args.wd)
    scheduler = build_scheduler(args.lr_scheduler, optimizer, args.lr, total_steps, warmup_steps)
    for images, labels in loader:
        ...; optimizer.step(); scheduler.step()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class OptimizerRow:
    """One `--optimizer` value: the class (`module.Name`, imported when built: timm's import costs seconds that
    sgd/adamw runs do not pay), whether torch has a fused step for it, and its keyword arguments from `--mom`,
    `--wd` and `--nesterov`; the float32 tensors of state it keeps a parameter (the planner's optimizer bytes:
    momentum, or Adam's two moments) and the bytes of the step count it keeps beside them for each parameter tensor
    (torch's AdamW and RMSprop: a float32 scalar tensor; timm's keep theirs in the group, or none); whether that
    fused step takes sharded (DTensor) parameters (--fsdp: else the foreach step is used); whether the class has
    torch's foreach step, asked for where the fused one is not used (a GPU's default, but not the CPU's, whose step
    one tensor at a time pays DTensor's sharding propagation op by op)."""

    source: str
    fused: bool
    options: Callable[[float, float, bool], dict]
    about: str
    state_per_parameter: int
    fused_on_shards: bool = True
    step_bytes_per_tensor: int = 0
    foreach: bool = False


# The accepted values of --lr-scheduler (their shapes: schedules.py's decay_factor).
SCHEDULERS = ("onecycle", "cosine", "step", "constant", "linear", "poly")


def check_hyperparameters(lr: float, momentum: float, weight_decay: float) -> None:
    """Raise ValueError naming the flag if ``--lr``, ``--mom`` or ``--wd`` is out of range."""
    if not lr > 0:
        raise ValueError(f"--lr must be > 0, got {lr}")
    if not 0 <= momentum < 1:
        raise ValueError(f"--mom must be in [0, 1), got {momentum}")
    if not weight_decay >= 0:
        raise ValueError(f"--wd must be >= 0, got {weight_decay}")


# momentum (--mom) is SGD/LARS/RMSprop momentum or the first beta of AdamW/LAMB/Lion. timm's LAMB and LARS adapt
# the step layer-wise only for groups with weight decay (so the norms and biases of --no-wd-norm-bias keep a plain
# step): with --wd 0 (the course's default) that would silently make them Adam/SGD, so every layer adapts then.
OPTIMIZER_TABLE = {
    "sgd": OptimizerRow(  # torch's fused SGD has no kernel for sharded parameters; fused AdamW has one
        "torch.optim.SGD",
        True,
        lambda mom, wd, nesterov: dict(momentum=mom, nesterov=nesterov),
        "torch's SGD",
        state_per_parameter=1,  # the momentum buffer
        fused_on_shards=False,
        foreach=True,
    ),
    "adamw": OptimizerRow(
        "torch.optim.AdamW",
        True,
        lambda mom, wd, nesterov: dict(betas=(mom, 0.999)),
        "torch's",
        state_per_parameter=2,
        step_bytes_per_tensor=4,
        foreach=True,
    ),
    "rmsprop": OptimizerRow(  # torchvision's MobileNet recipes' (TensorFlow's constants)
        "torch.optim.RMSprop",
        False,
        lambda mom, wd, nesterov: dict(alpha=0.9, eps=0.0316, momentum=mom),
        "torch's, torchvision's constants",
        state_per_parameter=2,  # the square average and the momentum buffer
        step_bytes_per_tensor=4,
        foreach=True,
    ),
    "lamb": OptimizerRow(
        "timm.optim.Lamb",
        False,
        lambda mom, wd, nesterov: dict(betas=(mom, 0.999), always_adapt=wd == 0),
        "timm's",
        state_per_parameter=2,
    ),
    "lars": OptimizerRow(
        "timm.optim.Lars",
        False,
        lambda mom, wd, nesterov: dict(momentum=mom, always_adapt=wd == 0),
        "timm's",
        state_per_parameter=1,
    ),
    "lion": OptimizerRow(
        "timm.optim.Lion", False, lambda mom, wd, nesterov: dict(betas=(mom, 0.99)), "timm's", state_per_parameter=1
    ),
}
