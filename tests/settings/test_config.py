"""resolve_config: the profile's defaults, every check of the flags, all before any process group or data scan.
And the command line itself: `--help` and a mistyped flag answer before torch is imported."""

import argparse
import subprocess
import sys

import pytest
from conftest import ROOT, SMALL, clean_env
from test_dlojz import assert_one_line_error

from dlojz_lib.checks import UserError
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import Number, get_args_parser


def resolve(*flags):
    return resolve_config(get_args_parser().parse_args(["--device", "cpu", *map(str, flags)]))


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir (./runs/...) is made and checked writable


def refusal(capsys, *flags):
    """The one line refusing these flags: the parser's (a flag out of its bounds) or resolve_config's."""
    try:
        resolve(*flags)
    except UserError as err:
        return str(err)
    except SystemExit as exit:
        assert exit.code == 2
        return capsys.readouterr().err.strip()
    pytest.fail(f"{flags} accepted")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["-b", "0"], "--batch-size: must be >= 1 (got 0)"),
        (["-e", "0"], "--epochs: must be >= 1"),
        (["--image-size", "0"], "--image-size: must be in [8, 4096] (got 0)"),
        (["--image-size", "100000"], "--image-size: must be in [8, 4096] (got 100000)"),
        (["--val-resize-size", "-1"], "--val-resize-size: must be in [8, 4096]"),
        (["--val-crop-size", "1"], "--val-crop-size: must be in [8, 4096]"),
        (["--val-crop-size", "300", "--val-resize-size", "256"], "--val-crop-size 300 must be at most --val-resize"),
        (["--val-crop-size", "100"], "--val-crop-size 100 must be at most --val-resize-size 73"),  # the CPU profile's
        (["--val-batch-size", "0"], "--val-batch-size: must be >= 1"),
        (["--test-nsteps", "0"], "--test-nsteps: must be >= 1"),
        (["--num-workers", "-1"], "--num-workers: must be >= 0"),
        (["--prefetch-factor", "0"], "--prefetch-factor: must be >= 1"),
        (["--grad-acc", "0"], "--grad-acc: must be >= 1"),
        (["--lr", "0"], "--lr: must be > 0"),
        (["--lr", "inf"], "--lr: must be a finite number > 0 (got inf)"),
        (["--lr", "nan"], "--lr: must be a finite number > 0 (got nan)"),
        (["--mom", "1"], "--mom: must be in [0, 1)"),
        (["--wd", "-0.1"], "--wd: must be >= 0"),
        (["--seed", "-1"], "--seed: must be in [0, 2147483647]"),
        (["--seed", "2147483648"], "--seed: must be in [0, 2147483647]"),
        (["--label-smoothing", "1.5"], "--label-smoothing: must be in [0, 1)"),
        (["--label-smoothing", "-0.1"], "--label-smoothing: must be in [0, 1)"),
        (["--randaugment", "-1", "9"], "--randaugment: must be in [0, 30] (got -1)"),
        (["--randaugment", "2", "50"], "--randaugment: must be in [0, 30] (got 50)"),
        (["--randaugment", "2", "9", "--randaugment-mstd", "-1"], "--randaugment-mstd: must be in [0, 30]"),
        (["--randaugment-mstd", "1"], "--randaugment-mstd varies --randaugment's magnitude: add --randaugment N M"),
        (["--randaugment", "2", "9", "--augmix", "3"], "--randaugment and --augmix: one augmentation policy at a"),
        (["--keep-checkpoints", "-1"], "--keep-checkpoints: must be >= 0"),
        (["--dist-timeout", "-5"], "--dist-timeout: must be in [10, 31536000.0]"),
        (["--dist-timeout", "1e-9"], "--dist-timeout: must be in [10, 31536000.0]"),
        (["--warmup-epochs", "-1"], "--warmup-epochs: must be >= 0"),
        (["--findlr", "--loader-only"], "--findlr trains"),
        (["--model-ema-decay", "1"], "--model-ema-decay: must be in (0, 1)"),
        (["--random-erase", "1.5"], "--random-erase: must be in [0, 1]"),
        (["--mixup-alpha", "-1"], "--mixup-alpha: must be >= 0"),
        (["--cutmix-alpha", "-1"], "--cutmix-alpha: must be >= 0"),
        (["--prof", "--prof-active", "0"], "--prof-active: must be >= 1"),
        (["--prof", "--prof-wait", "-1"], "--prof-wait: must be >= 0"),
        (["--sync-bn"], "--sync-bn needs CUDA"),
        (["--lr-peak-epoch", "-1"], "--lr-peak-epoch: must be >= 0"),
        (["--lr-poly-power", "0"], "--lr-poly-power: must be > 0"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm: must be > 0"),
        (["--val-every", "0"], "--val-every: must be >= 1"),
        (["--target-accuracy", "76"], "--target-accuracy: must be in (0, 1]"),
        (["--min-res", "64", "--max-res", "32", "--end-ramp", "2"], "--min-res 64 must be at most --max-res 32"),
        (["--min-res", "32", "--max-res", "64"], "--start-ramp 0 must be before --end-ramp 0"),
        (["--train-subset", "1.5"], "--train-subset is a fraction in (0, 1) or a whole number"),
        (["--loader-only", "--synthetic"], "--loader-only times the DataLoader"),
        (["--loader-only", "--eval-only", "--resume", "c.pt"], "--loader-only times the training DataLoader alone"),
        (["--eval-only"], "--eval-only needs --resume"),
        (["--hang-timeout", "2"], "--hang-timeout 2: at least 5 seconds"),
        (["--hang-timeout", "-1"], "--hang-timeout: must be in [0, 31536000.0]"),
        (["--straggler-factor", "1"], "--straggler-factor 1: above 1"),
        (["--test-unsync-steps", "-1"], "--test-unsync-steps: must be >= 0"),
        (["--test-unsync-steps", "5"], "--test-unsync-steps 5 times the last steps of --test: add --test"),
        (["--test", "--test-nsteps", "4", "--test-unsync-steps", "4"], "--test-unsync-steps 4 leaves no step to"),
    ],
)
def test_each_bound_is_checked(capsys, flags, fragment):
    line = refusal(capsys, *flags)
    assert fragment in line and "\n" not in line, line


# Flags that take any value of their type, and why; a flag added without bounds fails the walk below until it is
# given some (dlojz_lib.settings.flags.Number beside its definition) or is listed here.
FREE = {
    "config": "a file path, read and checked by the recipe reader",
    "arch": "a model name, checked when the model is made",
    "timm_augment": "timm's --aa string, checked by its pattern in flag_checks (tests/settings/test_flag_effects.py)",
    "data_root": "a folder, checked when the data is read",
    "output_dir": "a folder, checked writable before the run",
    "metrics_json": "a file path, its folder checked writable before the run",
    "val_history": "a file path, its folder checked writable before the run",
    "predictions": "a file path, its folder checked writable before the run",
    "teacher": "a checkpoint, or a model name checked with its cached weights before the run (tests/optim/test_distill.py)",
    "tensorboard": "a folder (or none: the output folder's tensorboard/), checked writable before the run",
    "resume": "'auto' or a checkpoint path, checked when the checkpoint is read",
    "pretrained": "a weights name, checked against torchvision's list for --arch before the run",
    "initial_checkpoint": "a weights file, checked there before the run and read when the model is made",
    "wandb_project": "a name W&B shows",
    "wandb_group": "a name W&B shows",
    "pp_split": "params, time or layer indices, checked in flag_checks (tests/parallelism/test_pipeline.py)",
}


def out_of_bounds(action):
    """Values the flag must refuse: outside its bounds, of the wrong type, or not among its choices."""
    if isinstance(action.type, Number):
        bounds = action.type
        values = ["one", "1.5" if bounds.kind is int else "inf", "nan"]
        if bounds.kind is float and bounds.high is None:  # finite, and too large for what it feeds (a timedelta)
            values.append("1e308")
        if bounds.low is not None:
            values.append(str(bounds.low if bounds.low_open else bounds.low - 1))
        if bounds.high is not None:
            values.append(str(bounds.high if bounds.high_open else bounds.high + 1))
        return values
    if action.choices is not None:
        return ["nonexistent-choice"]
    return []


def test_every_flag_of_the_parser_refuses_what_it_cannot_take(capsys):
    """Walks the parser: each flag that takes a value refuses, in one line naming it and with exit status 2, what
    lies outside its bounds, before torch is imported (check_command_line runs first in dlojz.py)."""
    from dlojz_lib.settings.flag_checks import check_command_line

    walked = 0
    for action in get_args_parser()._actions:
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction) or action.dest == "help":
            continue  # a switch: nothing to get wrong
        values = out_of_bounds(action)
        if not values:
            assert action.dest in FREE, (
                f"{action.option_strings[-1]} has no bounds: give it a Number type or a reason in FREE"
            )
            continue
        for value in values:
            with pytest.raises(SystemExit) as exit:
                check_command_line(
                    [action.option_strings[-1], *[value] * (action.nargs if isinstance(action.nargs, int) else 1)]
                )
            lines = capsys.readouterr().err.strip().splitlines()
            assert exit.value.code == 2 and len(lines) == 1, (action.dest, value, lines)
            assert action.option_strings[-1] in lines[0] and "Traceback" not in lines[0], lines
            walked += 1
    assert walked > 100


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


def test_config_is_generated_from_the_parser_s_rows():
    """One flag, one row: Config's fields are the parser's flags in --help's order, then the fields that follow from
    the machine; a new row is a new field of its row's type, and config.py types no flag by hand."""
    import ast
    import dataclasses

    from dlojz_lib.settings.config import DERIVED_FIELDS, Config, flag_fields

    parser = get_args_parser()
    flags = [a.dest for a in parser._actions if a.dest != "help" and a.help != argparse.SUPPRESS]
    assert [field.name for field in dataclasses.fields(Config)] == flags + [name for name, *_ in DERIVED_FIELDS]
    group = parser.add_argument_group("a new group")
    group.add_argument("--new-rate", type=Number(float, 0), default=0.5)
    group.add_argument("--new-switch", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--new-sizes", type=int, nargs="+", default=None)
    assert flag_fields(parser._actions)[-3:] == [
        ("new_rate", float),
        ("new_switch", bool | None),
        ("new_sizes", tuple | None),
    ]
    source = ast.parse((ROOT / "dlojz_lib" / "settings" / "config.py").read_text())
    typed = [node.target.id for node in ast.walk(source) if isinstance(node, ast.AnnAssign)]
    assert not set(typed) & set(flags), typed


def test_a_section_holds_its_help_group_s_settings():
    """cfg.section(name): the values of one --help group's flags, frozen, as the run resolved them; every group with
    flags is a section, and every flag is in one."""
    import dataclasses

    from dlojz_lib.settings.config import SECTIONS

    cfg = resolve("--checkpoint-every", "7", "--prof-wait", "3", "--mixup-alpha", "0.4")
    logging, profiler = cfg.section("logging"), cfg.section("profiler")
    assert (logging.checkpoint_every, logging.output_dir, profiler.prof_wait) == (7.0, cfg.output_dir, 3)
    assert cfg.section("augmentation").mixup_alpha == 0.4 and not hasattr(logging, "lr")
    with pytest.raises(dataclasses.FrozenInstanceError):
        logging.output_dir = "elsewhere"
    assert {*SECTIONS} == {"training", "optimizer", "memory", "augmentation", "validation", "profiler", "modes", "data",
                           "dataloader", "device", "distribution", "logging"}  # fmt: skip
    in_sections = [field.name for section in SECTIONS.values() for field in dataclasses.fields(section)]
    flags = [
        a.dest for a in get_args_parser()._actions if a.dest not in ("help", "config") and a.help != argparse.SUPPRESS
    ]
    assert sorted(in_sections) == sorted(set(flags))


def test_more_workers_than_cpus_is_a_warning(monkeypatch):
    import idr_torch

    monkeypatch.setattr(type(idr_torch), "cpus_per_task", property(lambda self: 2))  # idr_torch: class properties
    assert not any("exceeds" in note for note in resolve("--num-workers", "2").notes)
    notes = resolve("--num-workers", "3").notes
    assert any("WARNING: --num-workers 3 exceeds the 2 CPUs of this task" in note for note in notes), notes
    with pytest.raises(
        UserError, match=r"^--num-workers 5: this task may use 2 CPUs .* give at most 4 \(default: 1\)$"
    ):
        resolve("--num-workers", "5")
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
    from dlojz_lib.settings import config

    def precision_notes(cfg, capability):
        return config.precision_notes(cfg.section("device"), cfg.compile, cfg.optimizer, capability)

    float16 = resolve("--amp", "--amp-dtype", "float16")
    assert any("--amp-dtype bfloat16 needs no GradScaler" in n for n in precision_notes(float16, (9, 0)))
    # the advice says what bfloat16 costs a BatchNorm model in eager mode, and not when compiled
    (eager,) = [n for n in precision_notes(float16, (9, 0)) if "bfloat16" in n]
    assert "without --compile, a BatchNorm model's batch norm then leaves cuDNN" in eager
    (compiled,) = [n for n in precision_notes(resolve("--amp", "--amp-dtype", "float16", "--compile"), (9, 0))]
    assert compiled.endswith("--amp-dtype bfloat16 needs no GradScaler")
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
    assert (
        "{sgd,adamw,rmsprop,lamb,lars,lion}" in proc.stdout
        and "{onecycle,cosine,step,constant,linear,poly}" in proc.stdout
    )


HEAVY = {"torch", "torchvision", "timm", "wandb", "numpy", "idr_torch", "nvidia.dali", "optuna", "matplotlib"}


@pytest.mark.parametrize(
    "flags, status, needle",
    [
        (["--help"], 0, "--epochs"),
        (["--epochs", "x"], 2, "argument -e/--epochs: must be an integer >= 1 (got 'x')"),
        (["--test", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["-b", "0"], 2, "argument -b/--batch-size: must be >= 1 (got 0)"),
        (["--lr", "inf"], 2, "argument --lr: must be a finite number > 0 (got inf)"),
        (["--min-res", "64", "--max-res", "32", "--end-ramp", "2"], 2, "--min-res 64 must be at most --max-res 32"),
        (["--eval-only"], 2, "--eval-only needs --resume"),
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


def test_checkpoint_every_is_off_on_the_cpu_unless_asked():
    from dlojz_lib.settings.config import resolve_config

    assert resolve_config(get_args_parser().parse_args(["--device", "cpu"])).checkpoint_every == 0
    asked = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--checkpoint-every", "12.5"]))
    assert asked.checkpoint_every == 12.5


def test_compile_mode_implies_compile_and_reaches_torch_compile(monkeypatch):
    import torch

    import dlojz_lib.parallelism.layout
    from dlojz_lib.dist import Distribution
    from dlojz_lib.model.build import build_model

    given = []
    monkeypatch.setattr(dlojz_lib.parallelism.layout, "start_compile_workers", lambda: None)
    monkeypatch.setattr(torch, "compile", lambda net, **options: given.append(options) or net)
    cfg = resolve("--arch", "resnet18", "--compile-mode", "max-autotune-no-cudagraphs")
    assert cfg.compile and cfg.drop_last
    cpu = Distribution(1, 0, 0, torch.device("cpu"))
    model = dlojz_lib.parallelism.layout.lay_out(
        build_model(cfg, 3, cpu, lambda line: None), cfg, cpu, lambda line: None
    )
    assert given == [{"mode": "max-autotune-no-cudagraphs"}] and not model.cuda_graphs
    assert not resolve("--arch", "resnet18").compile  # ... and without it, nothing is compiled


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (
            ["--compile-mode", "reduce-overhead"],
            "--compile-mode reduce-overhead records CUDA graphs, which need a GPU: on the CPU use --compile-mode default",
        ),
        (
            ["--compile-mode", "reduce-overhead", "--min-res", "64", "--max-res", "128", "--end-ramp", "4"],
            "replays CUDA graphs of one input shape: progressive resizing (--min-res)",
        ),
        (["--compile-mode", "max-autotune", "--no-drop-last"], "drop --no-drop-last"),
        (
            ["--compile-mode", "reduce-overhead", "--grad-acc", "2"],
            "overwrites the gradients --grad-acc 2 accumulates; use --compile-mode max-autotune-no-cudagraphs",
        ),
        (["--compile-mode", "max-autotune", "--grad-acc", "4"], "--grad-acc 4 accumulates"),
        (["--compile-mode", "fastest"], "--compile-mode: invalid choice: 'fastest'"),
        (
            ["--compile-mode", "reduce-overhead", "--fsdp"],
            "--compile-mode reduce-overhead replays CUDA graphs, whose parameters must stay in place; under --fsdp "
            "they are gathered anew every step: use --compile (compiled block by block)",
        ),
        (["--compile-mode", "max-autotune", "--fsdp", "--tp", "2"], "under --fsdp and --tp 2 they are gathered"),
        (["--compile-mode", "max-autotune", "--fsdp", "--pp", "2"], "under --fsdp and --pp 2 they are gathered"),
    ],
)
def test_cuda_graph_modes_refuse_what_breaks_them_in_one_line(capsys, flags, fragment):
    assert fragment in refusal(capsys, *flags)


def test_gradient_accumulation_compiles_without_cuda_graphs():
    cfg = resolve("--arch", "resnet18", "--compile-mode", "max-autotune-no-cudagraphs", "--grad-acc", "2")
    assert cfg.compile and cfg.grad_acc == 2


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (
            ["--warmup-epochs", "3"],
            "--warmup-epochs 3 shapes --lr-scheduler cosine or step or constant or poly; onecycle",
        ),
        (
            ["--lr-scheduler", "cosine", "--lr-peak-epoch", "3"],
            "--lr-peak-epoch 3 shapes --lr-scheduler linear; cosine",
        ),
        (["--lr-scheduler", "linear", "--lr-poly-power", "3"], "--lr-poly-power 3 shapes --lr-scheduler poly; linear"),
        (
            ["--linear-probe", "--pretrained", "--grad-checkpointing"],
            "with --linear-probe, which trains the head alone",
        ),
        (["--val-split", "2.5"], "--val-split 2.5: a share below 1 (0.1: a tenth), or a whole number"),
        (["--timm-augment", "v0-zzz"], "--timm-augment v0-zzz: section 'zzz' is not one timm's v0 reads"),
        (["--timm-augment", "rand-m9-q3"], "section 'q3' is not one timm's rand reads"),
        (["--timm-augment", "augmix-m5-w"], "section 'w' is not one timm's augmix reads"),  # (no number: skipped)
    ],
)
def test_a_flag_that_cannot_act_on_this_run_is_refused_in_one_line(capsys, flags, fragment):
    """A flag this run would ignore (a schedule's length another scheduler does not read, recomputation where no
    backward runs through the blocks, a count that is not whole) is refused rather than accepted without a word."""
    assert fragment in refusal(capsys, *flags)


def test_the_schedule_s_own_flags_are_taken_with_their_scheduler():
    for flags in (["--lr-scheduler", "cosine", "--warmup-epochs", "1"], ["--lr-scheduler", "linear", "--lr-peak-epoch", "1"],
                  ["--lr-scheduler", "poly", "--lr-poly-power", "3"], ["--val-split", "3"], ["--val-split", "0.2"],
                  ["--timm-augment", "rand-m9-mstd0.5-inc1"], ["--timm-augment", "augmix-m5-w3"]):  # fmt: skip
        resolve(*flags)
