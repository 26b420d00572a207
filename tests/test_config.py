"""resolve_config: the profile's defaults, every check of the flags, all before any process group or data scan.
And the command line itself: `--help` and a mistyped flag answer before torch is imported."""

import subprocess
import sys

import pytest

from conftest import ROOT, SMALL, clean_env
from dlojz_config import UserError, get_args_parser, resolve_config
from test_dlojz import assert_one_line_error


def resolve(*flags):
    return resolve_config(get_args_parser().parse_args(["--device", "cpu", *map(str, flags)]))


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir (./runs/...) is made and checked writable


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["-b", "0"], "--batch-size must be at least 1"),
        (["-e", "0"], "--epochs must be at least 1"),
        (["--image-size", "0"], "--image-size must be at least 1"),
        (["--val-resize-size", "-1"], "--val-resize-size must be at least 1"),
        (["--val-crop-size", "0"], "--val-crop-size must be at least 1"),
        (["--val-batch-size", "0"], "--val-batch-size must be at least 1"),
        (["--test-nsteps", "0"], "--test-nsteps must be at least 1"),
        (["--num-workers", "-1"], "--num-workers must be >= 0"),
        (["--prefetch-factor", "0"], "--prefetch-factor >= 1"),
        (["--grad-acc", "0"], "--grad-acc must be at least 1"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--mom", "1"], "--mom must be in [0, 1)"),
        (["--wd", "-0.1"], "--wd must be >= 0"),
        (["--warmup-epochs", "-1"], "--warmup-epochs must be >= 0"),
        (["--findlr", "--loader-only"], "--findlr trains"),
        (["--model-ema-decay", "1"], "--model-ema-decay must be in (0, 1)"),
        (["--random-erase", "1.5"], "--random-erase is a probability"),
        (["--mixup-alpha", "-1"], "--mixup-alpha and --cutmix-alpha must be >= 0"),
        (["--cutmix-alpha", "-1"], "--mixup-alpha and --cutmix-alpha must be >= 0"),
        (["--prof", "--prof-active", "0"], "--prof-active >= 1"),
        (["--prof", "--prof-wait", "-1"], "--prof-wait and --prof-warmup must be >= 0"),
        (["--sync-bn"], "--sync-bn needs CUDA"),
        (["--lr-peak-epoch", "-1"], "--lr-peak-epoch must be >= 0"),
        (["--lr-poly-power", "0"], "--lr-poly-power must be > 0"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be > 0"),
        (["--val-every", "0"], "--val-every must be at least 1"),
        (["--target-accuracy", "76"], "--target-accuracy is a top-1 fraction in (0, 1]"),
        (["--loader-only", "--synthetic"], "--loader-only times the DataLoader"),
        (["--eval-only"], "--eval-only needs --resume"),
    ],
)
def test_each_bound_is_checked(flags, fragment):
    with pytest.raises(UserError) as err:
        resolve(*flags)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_within_bounds_is_accepted():
    cfg = resolve(
        "-b",
        "1",
        "--lr",
        "1e-4",
        "--mom",
        "0",
        "--wd",
        "0",
        "--model-ema-decay",
        "0.5",
        "--random-erase",
        "1",
        "--grad-acc",
        "3",
    )
    assert (cfg.batch_size, cfg.grad_acc, cfg.random_erase) == (1, 3, 1.0)


def test_cpu_defaults_follow_the_device():
    cfg = resolve()
    assert (cfg.amp, cfg.amp_dtype, cfg.tf32, cfg.torch_device) == (False, "bfloat16", False, "cpu")
    assert cfg.compute_dtype == "float32"
    assert resolve("--amp").compute_dtype == "bfloat16"


def test_config_is_frozen():
    cfg = resolve()
    with pytest.raises(AttributeError):
        cfg.lr = 1.0


def test_more_workers_than_cpus_is_a_warning(monkeypatch):
    import idr_torch

    monkeypatch.setattr(type(idr_torch), "cpus_per_task", property(lambda self: 2))  # idr_torch: class properties
    assert not any("exceeds" in note for note in resolve("--num-workers", "2").notes)
    notes = resolve("--num-workers", "5").notes
    assert any("WARNING: --num-workers 5 exceeds the 2 CPUs of this task" in note for note in notes), notes
    assert resolve().num_workers == 1  # unset: one core left to the training process


@pytest.mark.parametrize("cpus, workers", [(1, 0), (2, 1), (10, 9), (40, 16)])
def test_default_workers_leave_a_core_to_the_training_process(monkeypatch, cpus, workers):
    import idr_torch

    monkeypatch.setattr(type(idr_torch), "cpus_per_task", property(lambda self: cpus))
    assert resolve().num_workers == workers


def test_compile_drops_the_last_batch_unless_told_otherwise():
    assert resolve().drop_last is False
    cfg = resolve("--compile")
    assert cfg.drop_last is True and any("--compile: the last incomplete batch" in note for note in cfg.notes)
    assert resolve("--compile", "--no-drop-last").drop_last is False
    assert resolve("--drop-last").drop_last is True


def test_float16_on_a_recent_gpu_says_bfloat16_needs_no_scaler():
    from dlojz_config import precision_notes

    float16 = resolve("--amp", "--amp-dtype", "float16")
    assert any("--amp-dtype bfloat16 needs no GradScaler" in n for n in precision_notes(float16, (9, 0)))
    assert precision_notes(float16, (7, 5)) == []  # Turing: no bfloat16
    assert precision_notes(resolve("--amp", "--amp-dtype", "bfloat16"), (9, 0)) == []
    lamb = precision_notes(resolve("--amp", "--amp-dtype", "float16", "--optimizer", "lamb"), (9, 0))
    assert any(
        "--optimizer lamb has no fused step" in n and "one GPU synchronisation per optimizer step" in n for n in lamb
    )


def test_unknown_optimizer_is_refused_before_the_data_is_read(tmp_path, run_inline):
    # --data-root does not exist: a check that waited for the data would report it first.
    proc = run_inline(*SMALL, "--data-root", tmp_path / "no-such-dir", "--optimizer", "adamx")
    assert_one_line_error(proc, "--optimizer", "adamx")
    assert "--data-root" not in proc.stderr


def test_help_lists_the_closed_choices(run_inline):
    proc = run_inline("--help")
    assert proc.returncode == 0
    assert "{sgd,adamw,lamb,lars,lion}" in proc.stdout and "{onecycle,cosine,step,constant,linear,poly}" in proc.stdout


HEAVY = {"torch", "torchvision", "timm", "wandb", "numpy", "idr_torch", "nvidia.dali", "optuna", "matplotlib"}


@pytest.mark.parametrize(
    "flags, status, needle",
    [
        (["--help"], 0, "--epochs"),
        (["--epochs", "x"], 2, "argument -e/--epochs: invalid int value: 'x'"),
        (["--test", "--bogus"], 2, "unrecognized arguments: --bogus"),
    ],
)
def test_help_and_a_mistyped_flag_answer_before_torch_is_imported(flags, status, needle):
    """The command as a user types it, under `python -X importtime`: which modules it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "dlojz.py"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=ROOT,
    )
    imports = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    stderr = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert imports, "python -X importtime printed nothing"
    imported = {line.rsplit("|", 1)[1].strip() for line in imports}
    assert not imported & HEAVY, sorted(imported & HEAVY)
    assert proc.returncode == status, proc.stdout + "\n".join(stderr)
    if status:
        assert len(stderr) == 1 and needle in stderr[0], stderr
    else:
        assert needle in proc.stdout and not stderr, stderr
