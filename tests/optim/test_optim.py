"""Tests of dlojz_lib/optim/: optimizers, parameter groups, LR schedules, LR finder and soft-label accuracy.

CPU only, tiny models, a few seconds. Run from the repository root: ``python -m pytest tests/optim/test_optim.py``.
"""

import csv
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from dlojz_lib.optim import SCHEDULERS
from dlojz_lib.optim.losses import soft_target_accuracy
from dlojz_lib.optim.optimizers import build_optimizer, param_groups
from dlojz_lib.optim.schedules import LRFinder, build_scheduler, fast_forward, lr_scaling_line
from dlojz_lib.settings.flags import OPTIMIZERS

# An LR per optimizer that trains the tiny model below in a few steps (LARS scales its step by 1e-3 * |w|/|g|).
GOOD_LR = {"sgd": 0.1, "adamw": 1e-2, "rmsprop": 1e-2, "lamb": 1e-2, "lars": 5.0, "lion": 1e-3}


def tiny_classifier() -> nn.Module:
    """A model with every kind of parameter param_groups has to sort: weights, biases, norm scales/shifts."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, bias=False),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 16),
        nn.LayerNorm(16),
        nn.ReLU(),
        nn.Linear(16, 5),
    )


def fixed_batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, 3, 8, 8, generator=generator), torch.randint(0, 5, (16,), generator=generator)


def lr_of(optimizer) -> float:
    return optimizer.param_groups[0]["lr"]


# ----------------------------------------------------------------------------------------------- param_groups


def test_param_groups_put_norm_and_bias_params_at_zero_weight_decay():
    model = tiny_classifier()
    norm_params = {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm))
        for p in m.parameters()
    }
    bias_params = {id(m.bias) for m in model.modules() if getattr(m, "bias", None) is not None}
    all_params = {id(p) for p in model.parameters()}

    groups = param_groups(model, weight_decay=0.05, no_wd_norm_bias=True)

    by_wd = {group["weight_decay"]: {id(p) for p in group["params"]} for group in groups}
    assert set(by_wd) == {0.05, 0.0}
    assert by_wd[0.0] == norm_params | bias_params
    assert by_wd[0.05] == all_params - norm_params - bias_params
    # Only conv/linear weights keep decay: all of them are matrices or kernels.
    assert all(p.ndim >= 2 for p in groups[0]["params"] if id(p) in by_wd[0.05])


def test_param_groups_without_the_flag_decay_every_trainable_param_once():
    model = tiny_classifier()
    model[0].weight.requires_grad_(False)  # frozen params must not reach the optimizer
    model.append(model[-1])  # a shared layer: its params must appear once

    groups = param_groups(model, weight_decay=0.05, no_wd_norm_bias=False)

    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.05
    ids = [id(p) for p in groups[0]["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters() if p.requires_grad}


# ----------------------------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_lowers_the_loss_on_a_fixed_batch(name):
    torch.manual_seed(0)
    model = tiny_classifier()
    images, labels = fixed_batch()
    criterion = nn.CrossEntropyLoss()
    optimizer = build_optimizer(name, param_groups(model, 1e-4, no_wd_norm_bias=True), GOOD_LR[name], 0.9, 1e-4)
    assert name in type(optimizer).__name__.lower()
    with torch.no_grad():
        initial_loss = criterion(model(images), labels).item()

    for _ in range(15):
        optimizer.zero_grad()
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()

    with torch.no_grad():
        final_loss = criterion(model(images), labels).item()
    assert final_loss < 0.7 * initial_loss, f"{name}: loss {initial_loss:.3f} -> {final_loss:.3f}"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_momentum_flag_sets_momentum_or_first_beta(name):
    optimizer = build_optimizer(name, nn.Linear(2, 2).parameters(), lr=0.01, momentum=0.8, weight_decay=0.0)
    group = optimizer.param_groups[0]
    assert group.get("momentum", group.get("betas", (None,))[0]) == 0.8


def test_an_optimizer_is_one_row_of_the_table(monkeypatch):
    """Adding an optimizer is a row of dlojz_lib.optim's table: the builder reads its class and options from it (a
    row whose class and options the builder ignored would build SGD, or fail), and the flag's choices are the
    table's rows."""
    import dlojz_lib.optim
    import dlojz_lib.optim.optimizers
    from dlojz_lib.settings.flags import FUSED, get_args_parser

    row = dlojz_lib.optim.OptimizerRow(
        "torch.optim.Adagrad", False, lambda mom, wd, nesterov: dict(lr_decay=mom / 100), "torch's", 1
    )
    monkeypatch.setitem(dlojz_lib.optim.OPTIMIZER_TABLE, "adagrad", row)
    optimizer = build_optimizer("adagrad", nn.Linear(2, 2).parameters(), lr=0.01, momentum=0.5, weight_decay=0.0)
    assert isinstance(optimizer, torch.optim.Adagrad) and optimizer.param_groups[0]["lr_decay"] == 0.005
    monkeypatch.undo()
    choices = next(a.choices for a in get_args_parser()._actions if a.dest == "optimizer")
    assert tuple(choices) == tuple(dlojz_lib.optim.OPTIMIZER_TABLE) == OPTIMIZERS
    assert FUSED == ("sgd", "adamw")


def test_lars_with_zero_weight_decay_still_adapts_layer_wise():
    """With --wd 0 LARS must not fall back to plain SGD: its step must not grow with the gradient's scale."""

    def first_step_size(loss_scale):
        torch.manual_seed(0)
        layer = nn.Linear(8, 4)
        before = layer.weight.detach().clone()
        optimizer = build_optimizer("lars", layer.parameters(), lr=1.0, momentum=0.0, weight_decay=0.0)
        (loss_scale * layer(torch.ones(2, 8)).square().sum()).backward()
        optimizer.step()
        return (layer.weight.detach() - before).norm().item()

    assert first_step_size(1000.0) == pytest.approx(first_step_size(1.0), rel=1e-3)


def grad_scaler_steps(optimizer, model, overflow_at, device="cpu"):
    """Float16-style steps through a GradScaler; the gradients of the steps in `overflow_at` hold an inf."""
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    images, labels = (t.to(device) for t in fixed_batch())
    for step in range(4):
        scaler.scale(nn.functional.cross_entropy(model(images), labels)).backward()
        if step in overflow_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_fused_step_skips_overflowed_steps_as_the_unfused_one(name, monkeypatch):
    """The fused step (what GradScaler needs to skip overflowed steps without reading the inf flag on the host)
    ends with the same weights as the unfused one, when the first step overflows (the buffers it would allocate
    uninitialised are filled with NaN here, as memory reused from a GPU's allocator may hold) and a later one."""
    results = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = tiny_classifier()
        optimizer = build_optimizer(name, model.parameters(), GOOD_LR[name], 0.9, 1e-4, fused=fused)
        assert bool(optimizer.defaults.get("fused")) is fused
        empty_like = torch.empty_like
        monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
        results[fused] = grad_scaler_steps(optimizer, model, overflow_at=(0, 2))
        monkeypatch.undo()
        if name == "adamw":  # the two overflowed steps skipped: Adam's step count and bias correction stop there
            assert {int(state["step"]) for state in optimizer.state.values()} == {2}, fused
    for unfused, fused in zip(results[False], results[True]):
        assert torch.isfinite(fused).all()
        if name == "sgd":
            torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-6)
    if name == "adamw":
        # Adam's step is m / (sqrt(v) + eps): where a gradient is near eps (the first convolution's bias, whose
        # gradient BatchNorm makes zero but for rounding), the kernels' rounding (another order of operations,
        # another vector width) can turn it anywhere in [-lr, lr] (bias-corrected, at most 1.0013 lr a coordinate
        # at steps 1 and 2 with betas 0.9, 0.999). So: no coordinate further apart than two steps each way, and
        # the typical coordinate, whose gradient is far from eps, equal to float32's rounding.
        difference = torch.cat([(f - u).abs().flatten() for u, f in zip(results[False], results[True])])
        assert difference.max() <= 2 * 2 * 1.0013 * GOOD_LR[name], difference.max()
        assert difference.median() <= 1e-5, difference.median()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_without_the_fused_step_torchs_rows_ask_for_the_foreach_step(name):
    """Where the fused step is not used (not asked for, as for --fsdp's sharded SGD, or the row has none), torch's
    rows ask for the foreach step: the CPU's default steps one tensor at a time (over DTensors, a sharding
    propagation per op); timm's rows keep their defaults."""
    import dlojz_lib.optim

    optimizer = build_optimizer(name, tiny_classifier().parameters(), GOOD_LR[name], 0.9, 1e-4, fused=False)
    expected = dlojz_lib.optim.OPTIMIZER_TABLE[name].source.startswith("torch.")
    assert bool(optimizer.defaults.get("foreach")) is expected, optimizer.defaults
    assert dlojz_lib.optim.OPTIMIZER_TABLE[name].foreach is expected
    if name in ("sgd", "adamw"):
        fused = build_optimizer(name, tiny_classifier().parameters(), GOOD_LR[name], 0.9, 1e-4, fused=True)
        assert fused.defaults["fused"] and not fused.defaults.get("foreach"), fused.defaults


def test_unknown_optimizer_or_bad_lr_gives_one_line_naming_the_flag():
    with pytest.raises(ValueError) as error:
        build_optimizer("adam", nn.Linear(2, 2).parameters(), 0.1, 0.9, 0.0)
    message = str(error.value)
    assert "--optimizer" in message and "\n" not in message
    assert all(name in message for name in OPTIMIZERS)
    with pytest.raises(ValueError, match="--lr"):
        build_optimizer("sgd", nn.Linear(2, 2).parameters(), 0.0, 0.9, 0.0)
    with pytest.raises(ValueError, match="--mom"):
        build_optimizer("adamw", nn.Linear(2, 2).parameters(), 0.1, 1.0, 0.0)


def test_lr_scaling_line_gives_the_lr_per_256_images():
    assert "0.025 per 256 images" in lr_scaling_line(0.1, 1024)
    assert "0.2 per 256 images" in lr_scaling_line(0.1, 128)
    assert "1024 images" in lr_scaling_line(0.1, 1024)
    with pytest.raises(ValueError, match="--batch-size"):
        lr_scaling_line(0.1, 0)


# ----------------------------------------------------------------------------------------------- schedules


def lr_curve(name, total_steps, warmup_steps=0, lr=0.4, **kwargs):
    """LRs used by each optimizer step, with the optimizer built at another LR (the schedule sets the peak)."""
    optimizer = build_optimizer("sgd", nn.Linear(2, 2).parameters(), lr=1e-3, momentum=0.9, weight_decay=0.0)
    scheduler = build_scheduler(name, optimizer, lr, total_steps, warmup_steps, **kwargs)
    lrs = []
    for _ in range(total_steps):
        lrs.append(lr_of(optimizer))
        optimizer.step()
        scheduler.step()
    return lrs


def test_cosine_schedule_warms_up_linearly_then_follows_the_cosine_to_zero():
    lr, total, warmup = 0.4, 40, 8
    lrs = lr_curve("cosine", total, warmup, lr)
    for step in (0, 1, 4, 7):
        assert lrs[step] == pytest.approx(lr * step / warmup)
    for step in (8, 13, 24, 39):
        expected = lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
        assert lrs[step] == pytest.approx(expected)
    assert max(lrs) == pytest.approx(lr) and lrs[24] == pytest.approx(lr / 2)


def test_linear_schedule_is_ffcvs_triangle():
    lr, total, peak = 0.4, 40, 8
    lrs = lr_curve("linear", total, peak, lr)
    assert lrs[0] == 0 and lrs[4] == pytest.approx(lr / 2) and lrs[peak] == pytest.approx(lr)
    assert lrs[24] == pytest.approx(lr / 2) and lrs[39] == pytest.approx(lr / 32)  # 0 after the last step
    assert max(lrs) == pytest.approx(lr)


def test_poly_schedule_is_mlperfs_polynomial_decay():
    lr, total, warmup = 0.4, 40, 8
    lrs = lr_curve("poly", total, warmup, lr, poly_power=2.0)
    assert lrs[4] == pytest.approx(lr / 2) and lrs[warmup] == pytest.approx(lr)
    assert lrs[24] == pytest.approx(lr / 4)  # half-way through the decay: (1/2)**2
    assert lrs[24] != pytest.approx(lr_curve("linear", total, warmup, lr)[24])


def test_cosine_schedule_without_warmup_starts_at_the_peak():
    lrs = lr_curve("cosine", 10, 0, 0.4)
    assert lrs[0] == pytest.approx(0.4)
    assert all(later < earlier for earlier, later in zip(lrs, lrs[1:]))


def test_step_schedule_divides_by_gamma_at_30_60_90_percent_after_warmup():
    lr, gamma = 0.4, 0.1
    lrs = lr_curve("step", 100, 5, lr, gamma=gamma)
    assert lrs[2] == pytest.approx(lr * 2 / 5)
    assert lrs[5] == lrs[29] == pytest.approx(lr)
    assert lrs[30] == lrs[59] == pytest.approx(lr * gamma)
    assert lrs[60] == lrs[89] == pytest.approx(lr * gamma**2)
    assert lrs[90] == lrs[99] == pytest.approx(lr * gamma**3)


def test_step_schedule_honours_given_milestones_and_gamma():
    lrs = lr_curve("step", 20, 0, 0.4, step_milestones=[15, 5], gamma=0.5)
    assert lrs[4] == pytest.approx(0.4)
    assert lrs[5] == lrs[14] == pytest.approx(0.2)
    assert lrs[15] == lrs[19] == pytest.approx(0.1)


def test_constant_schedule_warms_up_then_holds():
    lrs = lr_curve("constant", 20, 4, 0.4)
    assert lrs[:4] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert lrs[4:] == pytest.approx([0.4] * 16)


def test_onecycle_is_the_course_one_cycle():
    lr, total = 0.4, 100
    lrs = lr_curve("onecycle", total, 0, lr)
    peak = int(np.argmax(lrs))
    assert lrs[0] == pytest.approx(lr / 25)  # OneCycleLR's default div_factor
    assert lrs[peak] == pytest.approx(lr) and peak == round(0.3 * total) - 1  # default pct_start
    assert all(a <= b for a, b in zip(lrs[:peak], lrs[1 : peak + 1]))
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1 :]))
    assert lrs[-1] < lr / 1e4


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("scheduler_name", SCHEDULERS)
def test_every_schedule_drives_every_optimizer(optimizer_name, scheduler_name):
    """OneCycleLR also cycles momentum/betas: every optimizer must expose one of them."""
    layer = nn.Linear(2, 1)
    optimizer = build_optimizer(optimizer_name, layer.parameters(), 0.01, 0.9, 0.0)
    scheduler = build_scheduler(scheduler_name, optimizer, 0.01, total_steps=10, warmup_steps=2)
    for _ in range(3):
        optimizer.zero_grad()
        layer(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        scheduler.step()
    assert 0 < lr_of(optimizer) <= 0.01


@pytest.mark.parametrize("scheduler_name", SCHEDULERS)
def test_schedule_resumes_from_a_checkpoint_on_the_same_curve(scheduler_name):
    """Checkpoint/resume: a rebuilt optimizer and schedule loading the saved states continue the same LR curve."""

    def build():
        optimizer = build_optimizer("sgd", nn.Linear(2, 2).parameters(), 0.4, 0.9, 0.0)
        return optimizer, build_scheduler(scheduler_name, optimizer, 0.4, total_steps=30, warmup_steps=5)

    def take_steps(optimizer, scheduler, count):
        lrs = []
        for _ in range(count):
            lrs.append(lr_of(optimizer))
            optimizer.step()
            scheduler.step()
        return lrs

    uninterrupted = take_steps(*build(), 30)
    optimizer, scheduler = build()
    first_half = take_steps(optimizer, scheduler, 12)
    saved = optimizer.state_dict(), scheduler.state_dict()
    optimizer, scheduler = build()
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert first_half + take_steps(optimizer, scheduler, 18) == pytest.approx(uninterrupted)


def test_bad_schedule_input_gives_one_line_naming_the_flag():
    optimizer = build_optimizer("sgd", nn.Linear(2, 2).parameters(), 0.1, 0.9, 0.0)
    with pytest.raises(ValueError) as error:
        build_scheduler("triangle", optimizer, 0.1, 100)
    assert "--lr-scheduler" in str(error.value) and all(name in str(error.value) for name in SCHEDULERS)
    with pytest.raises(ValueError, match="--warmup-epochs"):
        build_scheduler("cosine", optimizer, 0.1, total_steps=100, warmup_steps=100)


# ----------------------------------------------------------------------------------------------- LR finder


def synthetic_loss(lr, rng, blow_up_to=float("nan")):
    """A textbook range-test curve: flat, falls between 1e-4 and 1e-2 (steepest at 1e-3), bottoms near 5e-2,
    blows up past 0.1 (to ``blow_up_to`` once above 20)."""
    x = math.log10(lr)
    loss = 2.3 - 2.0 / (1 + math.exp(-3 * (x + 3))) + rng.normal(0, 0.02)
    if x > -1.3:
        loss += math.exp(6 * (x + 1.3)) - 1
    return loss if loss < 20 else blow_up_to


def run_sweep(num_steps, loss_of_lr, start_lr=1e-8, end_lr=1.0):
    optimizer = build_optimizer("sgd", nn.Linear(2, 2).parameters(), 0.1, 0.9, 0.0)
    finder = LRFinder(optimizer, start_lr, end_lr, num_steps)
    used = []
    for _ in range(num_steps):
        used.append(lr_of(optimizer))
        optimizer.step()
        finder.step(loss_of_lr(used[-1]), 0.5)
    return finder, used


def test_lr_finder_sweeps_exponentially_from_start_to_end():
    finder, used = run_sweep(50, lambda lr: 1.0, start_lr=1e-8, end_lr=0.1)
    assert used == pytest.approx(finder.lrs)  # the optimizer ran each step at the recorded LR
    assert finder.lrs[0] == pytest.approx(1e-8) and finder.lrs[-1] == pytest.approx(0.1)
    ratios = np.array(finder.lrs[1:]) / np.array(finder.lrs[:-1])
    assert ratios == pytest.approx(np.full(49, (0.1 / 1e-8) ** (1 / 49)))
    assert finder.lr_at(10) == pytest.approx(finder.lrs[10])


def test_lr_finder_writes_csv_and_png(tmp_path):
    rng = np.random.default_rng(0)
    finder, _ = run_sweep(60, lambda lr: synthetic_loss(lr, rng))
    finder.write_csv(tmp_path / "findlr.csv")
    finder.plot(tmp_path / "plots" / "findlr.png")

    with open(tmp_path / "findlr.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == ["lr", "loss", "accuracy"]
    assert len(rows) == 60
    assert [float(row["lr"]) for row in rows] == pytest.approx(finder.lrs)
    assert float(rows[5]["loss"]) == pytest.approx(finder.losses[5])
    png = (tmp_path / "plots" / "findlr.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


@pytest.mark.parametrize("num_steps", [40, 300])
def test_lr_finder_suggests_an_lr_in_the_falling_part_of_the_curve(num_steps):
    rng = np.random.default_rng(1)
    finder, _ = run_sweep(num_steps, lambda lr: synthetic_loss(lr, rng))
    assert any(math.isnan(loss) for loss in finder.losses)  # the curve did diverge

    lr, rule = finder.suggestion()

    assert 1e-8 <= lr <= 1.0
    assert 5e-4 <= lr <= 2e-3, f"{lr:.2e} ({rule})"  # the curve falls fastest at 1e-3; a sweep step is x1.6 at most
    assert rule.startswith("steepest descent") and "diverged" in rule


def test_lr_finder_detects_divergence_without_nan():
    rng = np.random.default_rng(2)
    finder, _ = run_sweep(100, lambda lr: synthetic_loss(lr, rng, blow_up_to=1e6))
    lr, rule = finder.suggestion()
    diverged_lr = float(re.search(r"diverged at lr (\S+);", rule).group(1))
    assert 0.05 <= diverged_lr <= 0.3  # the loss passes 4x its minimum between these
    assert 5e-4 <= lr <= 2e-3


def test_lr_finder_falls_back_to_min_loss_over_10_when_the_loss_never_falls():
    finder, _ = run_sweep(30, lambda lr: 1.0 + lr)  # rises over the whole sweep: best loss at the first lr
    lr, rule = finder.suggestion()
    assert "min-loss/10" in rule
    assert lr == pytest.approx(1e-8)  # the lowest loss is at the start, /10 is clamped into the swept range


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_lr_finder_survives_non_finite_losses(bad, tmp_path):
    finder, _ = run_sweep(20, lambda lr: bad)
    lr, rule = finder.suggestion()
    assert lr == pytest.approx(1e-8) and "no finite loss" in rule
    finder.plot(tmp_path / "findlr.png")  # still draws the (empty) curve
    assert (tmp_path / "findlr.png").exists()


def test_lr_finder_rejects_an_empty_sweep_range():
    optimizer = build_optimizer("sgd", nn.Linear(2, 2).parameters(), 0.1, 0.9, 0.0)
    with pytest.raises(ValueError, match="--lr"):
        LRFinder(optimizer, start_lr=1e-8, end_lr=1e-9, num_steps=10)
    with pytest.raises(RuntimeError, match="no step"):
        LRFinder(optimizer, 1e-8, 0.1, 10).suggestion()


# ----------------------------------------------------------------------------------------------- accuracy


def test_soft_target_accuracy_on_class_indices():
    outputs = torch.tensor([[2.0, 0.1, 0.0], [0.0, 3.0, 0.1], [0.0, 0.1, 1.0], [5.0, 0.0, 0.0]])
    targets = torch.tensor([0, 1, 2, 2])  # the last prediction (class 0) is wrong
    accuracy = soft_target_accuracy(outputs, targets)
    assert accuracy.ndim == 0
    assert accuracy.item() == pytest.approx(3 / 4)


def test_soft_target_accuracy_on_soft_labels_uses_their_argmax():
    torch.manual_seed(0)
    outputs = torch.randn(32, 10)
    hard = torch.randint(0, 10, (32,))
    # MixUp-style labels: 0.7 of the true class, 0.3 of another one, so the argmax is the true class.
    soft = 0.7 * nn.functional.one_hot(hard, 10).float() + 0.3 * nn.functional.one_hot((hard + 3) % 10, 10).float()
    assert soft_target_accuracy(outputs, soft).item() == pytest.approx(soft_target_accuracy(outputs, hard).item())
    perfect = soft * 10  # logits whose argmax is the target class
    assert soft_target_accuracy(perfect, soft).item() == 1.0


def test_soft_target_accuracy_stays_in_0_1_with_torchvision_mixup_and_cutmix():
    from torchvision.transforms import v2

    torch.manual_seed(0)
    images, labels = torch.rand(8, 3, 16, 16), torch.randint(0, 4, (8,))
    mix = v2.RandomChoice([v2.MixUp(alpha=1.0, num_classes=4), v2.CutMix(alpha=1.0, num_classes=4)])
    for _ in range(5):
        _, soft_labels = mix(images, labels)
        assert soft_labels.shape == (8, 4)
        accuracy = soft_target_accuracy(torch.randn(8, 4), soft_labels)
        assert accuracy.ndim == 0 and 0.0 <= accuracy.item() <= 1.0


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("step", [1, 7, 23, 40])
def test_fast_forward_gives_the_lr_and_momentum_of_stepping_one_by_one(name, step):
    """A resumed run with a new length puts its fresh schedule at the saved step: the same lr (and OneCycle's
    momentum) as a schedule stepped that many times."""

    def fresh():
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
        return optimizer, build_scheduler(
            name, optimizer, 0.1, total_steps=40, warmup_steps=0 if name == "onecycle" else 5
        )

    stepped_optimizer, stepped = fresh()
    for _ in range(step):
        stepped_optimizer.step()
        stepped.step()
    optimizer, scheduler = fresh()
    fast_forward(scheduler, step)
    assert scheduler.last_epoch == stepped.last_epoch == step
    assert optimizer.param_groups[0]["lr"] == pytest.approx(stepped_optimizer.param_groups[0]["lr"], rel=1e-12)
    assert optimizer.param_groups[0]["momentum"] == pytest.approx(stepped_optimizer.param_groups[0]["momentum"])
    if step < 40:  # and it goes on as the stepped one does
        optimizer.step(), scheduler.step(), stepped_optimizer.step(), stepped.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(stepped_optimizer.param_groups[0]["lr"], rel=1e-12)


# ------------------------------------------------------------------------ the published recipes' schedule flags


def test_warmup_start_factor_and_method_shape_the_warm_up():
    lrs = lr_curve("cosine", 40, 8, 0.4, warmup_start=0.01)  # torchvision's --lr-warmup-decay 0.01
    assert lrs[0] == pytest.approx(0.004) and lrs[4] == pytest.approx(0.4 * (0.01 + 0.99 * 4 / 8))
    assert lrs[8] == pytest.approx(0.4)
    lrs = lr_curve("step", 40, 8, 0.4, warmup_start=0.1, warmup_method="constant")
    assert lrs[0] == lrs[7] == pytest.approx(0.04) and lrs[8] == pytest.approx(0.4)


def test_min_lr_is_the_floor_of_the_decays():
    for name in ("cosine", "linear", "poly"):
        lrs = lr_curve(name, 40, 8, 0.4, min_lr=0.01)
        plain = lr_curve(name, 40, 8, 0.4)
        assert lrs[8] == pytest.approx(0.4)
        for step in (20, 39):  # min_lr + (lr - min_lr) x the plain curve's factor
            assert lrs[step] == pytest.approx(0.01 + (0.4 - 0.01) * plain[step] / 0.4)
    with pytest.raises(ValueError, match="--min-lr 0.5 must be below the peak --lr 0.4"):
        lr_curve("cosine", 40, 8, 0.4, min_lr=0.5)


def schedule_of(*flags):
    """Each optimizer step's LR under dlojz.py's flags, through build_training as a run builds it (5 steps an
    epoch, 6 epochs)."""
    training = training_of(*flags)
    lrs = []
    for _ in range(training.total_steps):
        lrs.append(training.optimizer.param_groups[0]["lr"])
        training.scheduler.step()
    return lrs


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_the_schedule_flags_reach_the_run_s_schedule():
    """Each flag changes the LRs a run's scheduler gives (5 steps an epoch, 6 epochs)."""
    step = schedule_of("--lr-scheduler", "step", "--lr-step-size", "2", "--lr-gamma", "0.5")
    assert step[9] == pytest.approx(0.4) and step[10] == pytest.approx(0.2) and step[20] == pytest.approx(0.1)
    milestones = schedule_of("--lr-scheduler", "step", "--lr-milestones", "1", "4.5", "--lr-gamma", "0.5")
    assert milestones[4] == pytest.approx(0.4) and milestones[5] == milestones[21] == pytest.approx(0.2)
    assert milestones[22] == pytest.approx(0.1)  # epoch 4.5 of 5 steps: step 22 (rounded)
    cosine = schedule_of("--lr-scheduler", "cosine", "--min-lr", "0.04")
    assert cosine[-1] > 0.04 and cosine[-1] == pytest.approx(0.04, abs=0.002)
    warm = schedule_of("--lr-scheduler", "cosine", "--warmup-epochs", "1", "--warmup-start-factor", "0.25")
    assert warm[0] == pytest.approx(0.1)
    flat = schedule_of(
        "--lr-scheduler",
        "cosine",
        "--warmup-epochs",
        "1",
        "--warmup-start-factor",
        "0.25",
        "--warmup-method",
        "constant",
    )
    assert flat[0] == flat[4] == pytest.approx(0.1) and flat[5] == pytest.approx(0.4)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_lr_per_epoch_gives_torchvision_s_schedule_stepped_once_per_epoch():
    """torchvision's train.py: LinearLR warm-up then CosineAnnealingLR to --lr-min, one scheduler step per epoch."""
    flags = ["--lr-scheduler", "cosine", "--warmup-epochs", "1", "--warmup-start-factor", "0.25", "--min-lr", "0.01"]
    per_step, per_epoch = schedule_of(*flags), schedule_of(*flags, "--lr-per-epoch")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.4)
    torchvision_s = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=1),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=5, eta_min=0.01),
        ],
        milestones=[1],
    )
    for epoch in range(6):  # 5 steps an epoch
        assert per_epoch[5 * epoch : 5 * epoch + 5] == pytest.approx([optimizer.param_groups[0]["lr"]] * 5), epoch
        torchvision_s.step()
    assert per_step[12] < per_epoch[12]  # without the flag, the LR moves within the epoch


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--min-lr", "0.01"], "--min-lr sets --lr-scheduler cosine or linear or poly, not onecycle"),
        (["--lr-per-epoch"], "--lr-per-epoch: onecycle (torch's OneCycleLR) is a per-step schedule"),
        (["--warmup-start-factor", "0.1"], "not onecycle (its own warm-up starts at lr/25)"),
        (["--lr-scheduler", "cosine", "--lr-gamma", "0.5"], "--lr-gamma sets --lr-scheduler step, not cosine"),
        (
            ["--lr-scheduler", "cosine", "--warmup-method", "constant"],
            "shape the warm-up: give its length with --warmup-epochs",
        ),
        (["--lr-scheduler", "step", "--lr-step-size", "2", "--lr-milestones", "3"], "give one of them"),
        (
            ["--lr-scheduler", "step", "--lr-milestones", "3", "2"],
            "--lr-milestones 3 2: give increasing epochs before the end",
        ),
        (["--lr-scheduler", "step", "--lr-milestones", "6"], "before the end (--epochs 6)"),
    ],
)
def test_schedule_flags_the_scheduler_would_not_use_are_refused(flags, message):
    from dlojz_lib.checks import UserError
    from dlojz_lib.settings.flag_checks import checked_values

    with pytest.raises(UserError, match=re.escape(message)):
        checked_values(["--device", "cpu", "-e", "6", *flags])


def training_of(*flags):
    from dlojz_lib.dist import Distribution
    from dlojz_lib.model.build import build_model
    from dlojz_lib.optim.training import build_training
    from dlojz_lib.parallelism.layout import lay_out
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flag_checks import checked_values
    from dlojz_lib.settings.flags import get_args_parser

    argv = ["--device", "cpu", "--arch", "resnet18", "--lr", "0.4", "-e", "6", *flags]
    checked_values(argv)
    cfg = resolve_config(get_args_parser().parse_args(argv))
    cpu = Distribution(1, 0, 0, torch.device("cpu"))
    return build_training(cfg, lay_out(build_model(cfg, 3, cpu, print), cfg, cpu, print), 5, 3, cpu, print)


def test_rmsprop_is_torchvision_s_and_nesterov_reaches_sgd():
    from dlojz_lib.checks import UserError

    optimizer = training_of(
        "--optimizer", "rmsprop", "--mom", "0.9", "--wd", "1e-5", "--lr-scheduler", "cosine"
    ).optimizer
    assert isinstance(optimizer, torch.optim.RMSprop)
    group = optimizer.param_groups[0]
    assert (group["alpha"], group["eps"], group["momentum"], group["weight_decay"]) == (0.9, 0.0316, 0.9, 1e-5)
    assert training_of("--nesterov").optimizer.param_groups[0]["nesterov"] is True
    assert training_of().optimizer.param_groups[0]["nesterov"] is False
    with pytest.raises(UserError, match="--nesterov is SGD's Nesterov momentum: --optimizer adamw has none"):
        training_of("--nesterov", "--optimizer", "adamw")
    with pytest.raises(UserError, match="--nesterov needs a momentum"):
        training_of("--nesterov", "--mom", "0")


def test_bce_loss_is_timm_s_with_smoothing_mixed_targets_and_threshold():
    import torch.nn.functional as F

    from dlojz_lib.checks import UserError

    torch.manual_seed(0)
    logits, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    smoothed = F.one_hot(labels, 3).float() * 0.9 + 0.1 / 3
    criterion = training_of("--bce-loss", "--label-smoothing", "0.1").criterion
    assert criterion(logits, labels) == pytest.approx(F.binary_cross_entropy_with_logits(logits, smoothed).item())
    mixed = 0.7 * F.one_hot(labels, 3).float() + 0.3 * F.one_hot(labels.flip(0), 3).float()  # MixUp's targets
    expected = F.binary_cross_entropy_with_logits(logits, mixed * 0.9 + 0.1 / 3)  # as timm's Mixup smooths them
    assert criterion(logits, mixed) == pytest.approx(expected.item())
    thresholded = training_of("--bce-loss", "--bce-target-thresh", "0.2", "--label-smoothing", "0").criterion
    assert thresholded(logits, mixed) == pytest.approx(
        F.binary_cross_entropy_with_logits(logits, (mixed > 0.2).float()).item()
    )
    assert training_of().criterion(logits, labels) != pytest.approx(criterion(logits, labels).item())
    with pytest.raises(UserError, match="--bce-target-thresh binarises --bce-loss's targets: add --bce-loss"):
        training_of("--bce-target-thresh", "0.2")


def test_model_ema_every_n_steps_with_timm_s_warm_up():
    from dlojz_lib.model.zoo import ModelEma

    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    ema = ModelEma(model, decay=0.9, every=3, warmup=True)
    expected = None
    for step in range(1, 8):
        with torch.no_grad():
            model.weight.add_(1.0)
        if ema.due(step):
            ema.update_parameters(model)
            weight = model.weight.detach().clone()
            decay = min(0.9, (1 + ema.updates - 1) / (10 + ema.updates - 1))  # the update's own
            expected = weight if expected is None else decay * expected + (1 - decay) * weight
    assert ema.updates == 2  # steps 3 and 6
    assert torch.allclose(ema.module.weight, expected)  # decay 2/11 at the second update, not 0.9
    plain = ModelEma(model, decay=0.9)
    assert all(plain.due(step) for step in range(1, 5))


def test_model_ema_steps_reach_the_training_loop(tiny_data, tmp_path, run_inline):
    from conftest import SMALL

    out = tmp_path / "run"
    proc = run_inline(
        *SMALL, "--image-size", "16", "--val-resize-size", "18", "--val-crop-size", "16", "-b", "8", "--no-wandb",
        "--num-workers", "0", "--data-root", tiny_data, "-e", "1", "--model-ema", "--model-ema-steps", "4",
        "--output-dir", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    saved = torch.load(out / (out / "latest").read_text().strip(), weights_only=True)
    assert saved["global_step"] == 9 and int(saved["ema"]["n_averaged"]) == 2  # steps 4 and 8
    proc = run_inline(*SMALL, "--data-root", tiny_data, "--model-ema-warmup")
    assert proc.returncode == 2 and "--model-ema-warmup sets how --model-ema averages: add --model-ema" in proc.stderr


def test_deterministic_turns_on_deterministic_algorithms_and_says_its_cost(tiny_data, tmp_path, run_inline):
    from conftest import SMALL

    assert not torch.are_deterministic_algorithms_enabled()
    try:
        proc = run_inline(
            *SMALL, "--data-root", tiny_data, "-b", "8", "--no-wandb", "--num-workers", "0", "--test",
            "--test-nsteps", "1", "--deterministic", "--output-dir", tmp_path / "run",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)  # (the run was in this process)
    assert "--deterministic: deterministic kernels only (cuDNN autotuning off" in proc.stdout


def test_weight_decay_per_kind_of_parameter():
    """--norm-wd, --bias-wd, --embedding-wd: each kind its value, the others --wd, as torchvision's
    set_weight_decay sorts them (embeddings first, then norms, then biases)."""
    import torchvision

    groups = training_of("--wd", "0.05", "--norm-wd", "0", "--bias-wd", "0.01").optimizer.param_groups
    values = [group["weight_decay"] for group in groups for _ in group["params"]]  # resnet18's 62 parameters
    assert values.count(0.0) == 2 * 20 and values.count(0.01) == 1  # 20 BatchNorms (weight, bias); fc's bias
    assert values.count(0.05) == len(values) - 41
    vit = torchvision.models.vit_b_32(num_classes=3)
    groups = param_groups(vit, 0.3, False, kind_decay=dict(embedding=0.0, norm=0.1))
    decay = {id(p): group["weight_decay"] for group in groups for p in group["params"]}
    by_name = {name: decay[id(p)] for name, p in vit.named_parameters()}
    assert by_name["class_token"] == by_name["encoder.pos_embedding"] == 0.0
    assert by_name["encoder.ln.weight"] == by_name["encoder.layers.encoder_layer_0.ln_1.bias"] == 0.1
    assert by_name["heads.head.bias"] == by_name["conv_proj.weight"] == 0.3


def test_a_weight_decay_for_a_kind_the_model_has_not_is_refused():
    """--embedding-wd on a ResNet (no class token, no position embedding) would do nothing: one line naming it;
    the kinds the model has are taken."""
    from dlojz_lib.checks import UserError

    with pytest.raises(UserError, match=r"^--embedding-wd: --arch resnet18 has no trainable embedding parameters"):
        training_of("--embedding-wd", "0")
    assert training_of("--norm-wd", "0", "--bias-wd", "0").optimizer.param_groups


def test_an_ema_updated_less_often_than_the_run_steps_is_refused_or_said_for_a_recipe(tmp_path, capsys):
    """--model-ema-steps over the run's optimizer steps (6 epochs x 5 here): the EMA would stay the starting
    weights. On the command line: one line; from a recipe file, written for longer runs: said once, and the run
    goes on. As many steps as the run makes is taken."""
    from dlojz_lib.checks import UserError

    with pytest.raises(UserError, match=r"^--model-ema-steps 31: the run makes 30 optimizer steps \(6 epochs x 5\)"):
        training_of("--model-ema", "--model-ema-steps", "31")
    assert training_of("--model-ema", "--model-ema-steps", "30").optimizer
    assert "--model-ema-steps" not in capsys.readouterr().out
    recipe = tmp_path / "long.toml"
    recipe.write_text("model-ema = true\nmodel-ema-steps = 32\n")
    assert training_of("--config", str(recipe)).optimizer
    said = [line for line in capsys.readouterr().out.splitlines() if "--model-ema-steps 32" in line]
    assert len(said) == 1 and said[0].startswith("WARNING: ") and "set by --config" in said[0], said


def test_model_ema_warmup_copy_copies_the_weights_through_the_warm_up(tiny_data, tmp_path, run_inline):
    """torchvision's train.py resets the EMA after each update of the LR's warm-up: it holds the model's weights at
    the warm-up's end, and averages from there."""
    from conftest import TINY

    from dlojz_lib.model.zoo import ModelEma

    model = nn.Linear(2, 1)
    ema = ModelEma(model, decay=0.9)
    ema.copy_updates = 2  # updates 1 to 3 copy (the warm-up's two, and the first after it, as n_averaged 0 does)
    for update in range(1, 5):
        with torch.no_grad():
            model.weight.add_(1.0)
        before = ema.module.weight.detach().clone()
        ema.update_parameters(model)
        expected = model.weight if update <= 3 else 0.9 * before + 0.1 * model.weight
        assert torch.allclose(ema.module.weight, expected), update
    common = [*TINY, "--data-root", tiny_data, "-e", "2", "--warmup-epochs", "1", "--lr-scheduler", "cosine"]
    common += ["--model-ema", "--model-ema-decay", "0.5"]
    for flags, copied in (([], False), (["--model-ema-warmup-copy"], True)):
        out = tmp_path / str(copied)
        assert run_inline(*common, *flags, "--output-dir", out).returncode == 0
        first = torch.load(sorted(out.glob("ckpt_e0001_*.pt"))[0], weights_only=True)  # the warm-up's end
        weights = [name for name, value in first["model"].items() if value.is_floating_point()]
        same = all(torch.equal(first["ema"]["module." + name], first["model"][name]) for name in weights)
        assert same is copied
