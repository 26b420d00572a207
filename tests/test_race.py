"""Time to accuracy: top-5, flip TTA, --val-every and --target-accuracy, --zero-init-residual, --clip-grad-norm,
the linear (FFCV) and poly (MLPerf) schedules as the training loop uses them."""

import math
import types

import pytest
import torch
from conftest import SMALL, read_json
from test_flag_effects import loop_for

import dlojz
import dlojz_lib.model.zoo


class FixedLogits(torch.nn.Module):
    """Logits that depend on the image's left column only: a mirrored image gets other logits."""

    def __init__(self, num_classes):
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)

    def forward(self, images):
        return self.head(images[:, :, :, 0].mean(dim=2))


def evaluate(net, batches, tta_flip=False):
    loaders = types.SimpleNamespace(val_batches=batches, n_val_batches_every_rank=len(batches))
    training = types.SimpleNamespace(
        autocast=lambda: torch.autocast("cpu", enabled=False), val_criterion=torch.nn.CrossEntropyLoss(reduction="sum")
    )
    ranks = types.SimpleNamespace(enabled=False, device=torch.device("cpu"))
    return dlojz.evaluate(net, loaders, training, ranks, tta_flip=tta_flip)


def batches_of(n_batches=3, size=8, num_classes=10):
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(size, 3, 4, 4, generator=generator), torch.randint(0, num_classes, (size,), generator=generator))
        for _ in range(n_batches)
    ]


def test_top5_counts_a_label_among_the_five_largest_logits():
    torch.manual_seed(0)
    net, batches = FixedLogits(10), batches_of()
    metrics = evaluate(net, batches)
    with torch.no_grad():
        logits = torch.cat([net(images) for images, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    ranks = (logits > logits.gather(1, labels[:, None])).sum(dim=1)  # how many classes beat the label
    assert metrics["val_accuracy"] == pytest.approx((ranks == 0).double().mean().item())
    assert metrics["val_top5_accuracy"] == pytest.approx((ranks < 5).double().mean().item())
    assert 0 < metrics["val_accuracy"] < metrics["val_top5_accuracy"] < 1


def test_flip_tta_averages_the_logits_of_the_image_and_its_mirror():
    torch.manual_seed(0)
    net, batches = FixedLogits(10), batches_of()
    plain, tta = evaluate(net, batches), evaluate(net, batches, tta_flip=True)
    with torch.no_grad():
        expected = (
            sum(
                torch.nn.functional.cross_entropy((net(x) + net(x.flip(3))) / 2, y, reduction="sum").item()
                for x, y in batches
            )
            / 24
        )
    assert tta["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert tta["val_loss"] != pytest.approx(plain["val_loss"], rel=1e-3)


def test_zero_init_residual_starts_each_block_as_the_identity():
    for arch, last in (("resnet18", "bn2"), ("resnet50", "bn3")):
        zero = dlojz_lib.model.zoo.create_model(arch, 10, zero_init_residual=True)
        plain = dlojz_lib.model.zoo.create_model(arch, 10)
        blocks = [m for m in zero.modules() if hasattr(m, last) and hasattr(m, "conv1")]
        assert blocks and all(getattr(b, last).weight.abs().sum() == 0 for b in blocks)
        assert all(
            getattr(b, last).weight.abs().sum() > 0 for b in plain.modules() if hasattr(b, last) and hasattr(b, "conv1")
        )


def test_zero_init_residual_is_on_by_default_where_the_model_takes_it():
    from dlojz_lib.settings.flags import get_args_parser

    def zeroed(model):
        return [m.bn2.weight.abs().sum().item() == 0 for m in model.modules() if hasattr(m, "bn2")]

    for flags, expected in (([], True), (["--zero-init-residual"], True), (["--no-zero-init-residual"], False)):
        setting = get_args_parser().parse_args(flags).zero_init_residual
        blocks = zeroed(dlojz_lib.model.zoo.create_model("resnet18", 10, setting))
        assert blocks and all(z == expected for z in blocks), (flags, setting)
    vit = dlojz_lib.model.zoo.create_model(
        "vit_b_32", 10, None
    )  # the default on a model without the option: built as it is
    assert sum(p.numel() for p in vit.parameters()) > 0


def test_zero_init_residual_on_a_model_without_it_is_one_line(run_inline):
    proc = run_inline(*SMALL, "--arch", "vit_b_32", "--zero-init-residual", "--synthetic", "--test")
    assert proc.returncode == 2 and proc.stderr.startswith("dlojz: error: --zero-init-residual: --arch vit_b_32")


# float16 on a tiny ViT: on the CPU a float16 convolution's backward takes seconds a step; clipping is the same.
@pytest.mark.parametrize("precision", [["--no-amp"], ["--amp", "--amp-dtype", "float16", "--arch", "timm:test_vit"]])
def test_clip_grad_norm_bounds_the_norm_the_optimizer_steps_with(precision, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    norms = {}
    for flags in ([], ["--clip-grad-norm", "0.5"]):
        loop = loop_for(*precision, *flags, n_batches=4)
        if loop["training"].scaler.is_enabled():  # a scale that does not overflow at the first steps: fewer skipped
            loop["training"].scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        optimizer, seen = loop["training"].optimizer, []
        step = optimizer.step

        def recording_step(*args, **kwargs):
            grads = [p.grad for p in loop["model"].module.parameters() if p.grad is not None]
            scale = getattr(optimizer, "grad_scale", None)  # still scaled: the fused step would unscale them
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            seen.append((norm / (scale if scale is not None else 1.0)).item())
            return step(*args, **kwargs)

        monkeypatch.setattr(optimizer, "step", recording_step)
        dlojz.train_one_epoch(**loop)
        norms[bool(flags)] = [norm for norm in seen if math.isfinite(norm)]  # float16 overflows: steps skipped
        assert len(norms[bool(flags)]) >= 2, seen
    assert min(norms[False]) > 0.5 * 1.5  # without the flag the norm is well above the bound...
    assert max(norms[True]) <= 0.5 * (1 + 1e-3)  # ...with it, clipped to it


def test_linear_schedule_peaks_at_lr_peak_epoch(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    loop = loop_for("--lr-scheduler", "linear", "--lr-peak-epoch", "1", "--epochs", "3", "--lr", "0.3", n_batches=4)
    optimizer, scheduler = loop["training"].optimizer, loop["training"].scheduler
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    assert lrs[4] == pytest.approx(0.3) and lrs[0] == 0 and lrs[8] == pytest.approx(0.15)


def test_target_accuracy_stops_at_the_first_validation_that_reaches_it(tiny_data, tmp_path, run_inline):
    metrics = tmp_path / "m.json"
    proc = run_inline(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--no-wandb",
        "--epochs",
        "5",
        "--val-every",
        "2",
        "--target-accuracy",
        "0.01",
        "--output-dir",
        tmp_path / "run",
        "--metrics-json",
        metrics,
    )
    assert proc.returncode == 0, proc.stderr
    m = read_json(metrics)
    assert m["epochs"] == m["epochs_to_target"] == 2  # validated at epoch 2 only, reached there, stopped
    assert proc.stdout.count("Validation Loss") == 1 and "this epoch's training:" in proc.stdout
    assert 0 < m["time_to_target_s"] and m["val_accuracy"] >= 0.01 and m["val_top5_accuracy"] >= m["val_accuracy"]
    assert "Target top-1 0.0100 reached after 2 epochs" in proc.stdout


def test_an_unreached_target_trains_to_the_end_and_says_null(tiny_data, tmp_path, run_inline):
    metrics = tmp_path / "m.json"
    proc = run_inline(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--no-wandb",
        "--epochs",
        "2",
        "--target-accuracy",
        "1.0",
        "--lr",
        "1e-6",
        "--output-dir",
        tmp_path / "run",
        "--metrics-json",
        metrics,
    )
    assert proc.returncode == 0, proc.stderr
    m = read_json(metrics)
    assert m["epochs"] == 2 and m["time_to_target_s"] is None and m["epochs_to_target"] is None
    assert proc.stdout.count("Validation Loss") == 2
