"""Learning-rate schedules, stepped once per optimizer step (one closed formula per step), and the course's LR range
test (`--findlr`) with its analysis. The accepted --lr-scheduler values are dlojz_lib.optim's `SCHEDULERS`.
"""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import numpy as np
import torch

from dlojz_lib.optim import SCHEDULERS


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


def decay_factor(name: str, progress: float, floor: float, poly_power: float) -> float:
    """The factor of the peak LR after the warm-up, ``progress`` from 0 (the warm-up's end) to 1 (the run's end):
    cosine, linear (FFCV's triangle) or poly (MLPerf's) down to ``floor``, constant at 1."""
    if name == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if name in ("linear", "poly"):
        return floor + (1.0 - floor) * (1.0 - progress) ** (1.0 if name == "linear" else poly_power)
    return 1.0


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
    floor, decay_steps = min_lr / lr, total_steps - warmup_steps
    if name == "step" and step_milestones is None:
        step_milestones = [round(fraction * total_steps) for fraction in (0.3, 0.6, 0.9)]
    milestones = sorted(int(m) for m in step_milestones or ())

    def factor(step: int) -> float:
        if steps_per_epoch:  # the LR of the epoch's first step
            step -= step % steps_per_epoch
        if step < warmup_steps:
            return _warmup_factor(step, warmup_steps, warmup_start, warmup_method)
        if name == "step":
            return gamma ** sum(step >= milestone for milestone in milestones)
        return decay_factor(name, min(step - warmup_steps, decay_steps) / decay_steps, floor, poly_power)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_steps(schedule, steps_per_epoch: int) -> int:
    """The LR's warm-up in optimizer steps: --warmup-epochs, or the linear schedule's --lr-peak-epoch."""
    return round(
        (schedule.lr_peak_epoch if schedule.lr_scheduler == "linear" else schedule.warmup_epochs) * steps_per_epoch
    )


def step_milestones(schedule, epochs, steps_per_epoch: int):
    """--lr-scheduler step's milestones in optimizer steps: every --lr-step-size epochs (torchvision's StepLR), at
    --lr-milestones' epochs (MultiStepLR), else None (30, 60 and 90 % of the run)."""
    if schedule.lr_milestones:
        return [round(epoch * steps_per_epoch) for epoch in schedule.lr_milestones]
    if schedule.lr_step_size:
        return [round(epoch * steps_per_epoch) for epoch in range(schedule.lr_step_size, epochs, schedule.lr_step_size)]
    return None


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
