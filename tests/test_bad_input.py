"""Bad files, odd data sets and flags that would do nothing: each one line naming the file or the flag (exit 2), or a
line saying what was left out, never a traceback and never data silently wrong. By class: the side files dlojz and
its siblings read, the data listing, the flags."""

import inspect
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, SMALL
from PIL import Image
from test_dlojz import assert_one_line_error

from dlojz_lib.checks import UserError, read_json, read_text


# ---------------------------------------------------------------- side files: one guarded reader per kind
@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"\xff\xfe\x00binary", "not a text file (byte 0xff at offset 0 is not UTF-8)"),
        (b'{"runs": [1, 2', "not valid JSON (the file ends early: truncated?)"),
        (b"[1, 2]", "holds an array, not an object"),
        (b"", "not valid JSON (the file ends early: truncated?)"),
    ],
)
def test_a_side_file_with_bad_bytes_truncated_or_of_another_kind_is_one_line(tmp_path, content, fragment):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(UserError) as err:
        read_json(path, "sweep plan", "start it again")
    assert str(err.value).startswith(f"sweep plan {path}: ") and fragment in str(err.value), err.value
    assert str(err.value).endswith("; start it again") and "\n" not in str(err.value)


def test_a_folder_or_a_pipe_given_for_a_file_is_named_as_such(tmp_path):
    with pytest.raises(UserError, match="a folder, not a file"):
        read_text(tmp_path, "--config", "give a file")
    os.mkfifo(tmp_path / "fifo")  # read_bytes would block on it forever
    with pytest.raises(UserError, match="not a regular file"):
        read_text(tmp_path / "fifo", "--config", "give a file")


def test_a_recipe_that_is_not_utf8_text_is_one_line(tmp_path, run_inline):
    recipe = tmp_path / "r.toml"
    recipe.write_bytes(b"lr = 0.1\n# caf\xe9\n")  # Latin-1
    proc = run_inline("--config", recipe, "--device", "cpu")
    assert_one_line_error(proc, f"--config {recipe}: not a text file (byte 0xe9")


def test_a_recipe_with_one_flag_under_two_spellings_is_refused(tmp_path, run_inline):
    recipe = tmp_path / "r.toml"
    recipe.write_text("batch_size = 16\nbatch-size = 32\n")
    proc = run_inline("--config", recipe, "--device", "cpu")
    assert_one_line_error(proc, "keys 'batch_size' and 'batch-size' are the same flag")


def test_several_recipes_merge_in_order(tmp_path):
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    (tmp_path / "a.toml").write_text("lr = 0.5\nlabel-smoothing = 0.1\n")
    (tmp_path / "b.toml").write_text("lr = 0.2\n")
    argv = ["--device", "cpu", "--config", str(tmp_path / "a.toml"), "--config", str(tmp_path / "b.toml")]
    cfg = resolve_config(get_args_parser().parse_args(argv))
    assert (cfg.lr, cfg.label_smoothing) == (0.2, 0.1)  # b's lr over a's, a's label smoothing kept
    assert cfg.config == [str(tmp_path / "a.toml"), str(tmp_path / "b.toml")]


@pytest.mark.parametrize(
    "content, fragment",
    [
        (bytes(range(256)), "not a text file"),
        (b'{"load_s": [0.1], "forward_s": [0.1], "backward_s"', "truncated"),
        (b'{"load_s": [0.1], "forward_s": [0.1], "backward_s": [0.1]}', "not a chronometer trace"),
        (b'{"load_s": [0.1], "forward_s": [0.1], "backward_s": [0.1], "step_s": ["x"]}', "step_s is not a number"),
    ],
)
def test_chrono_plot_of_a_file_that_is_no_trace_is_one_line(tmp_path, capsys, content, fragment):
    import dlojz_lib.observers.chrono_report

    trace = tmp_path / "trace.json"
    trace.write_bytes(content)
    status = dlojz_lib.observers.chrono_report.main(["plot", str(trace), "-o", str(tmp_path / "t.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and fragment in err[-1], err
    assert f"trace {trace}" in err[-1] and "chrono_trace.json" in err[-1]  # what to give instead


def test_lab_status_of_a_truncated_sweep_plan_is_one_line(tmp_path, capsys):
    import dlojz_lab

    (tmp_path / "sweep.json").write_text('{"name": "s", "runs": [{"name": "r0", "se')
    assert dlojz_lab.main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"sweep plan {tmp_path / 'sweep.json'}: not valid JSON (the file ends early" in err[0]


@pytest.mark.parametrize(
    "name",
    [
        "latest",
        "ckpt_e0001_s000000010.pt",
        "ckpt_e0001_s000000010.pt.sha256",
        "args.toml",
        "findlr.csv",
        ".dlojz.lock",
        "val_split.txt",
    ],
)
def test_a_metrics_file_over_one_of_the_run_s_own_files_is_refused(tmp_path, run_inline, name):
    """--metrics-json DIR/latest would overwrite the checkpoint pointer, and --resume auto then fail."""
    # --test --test-nsteps 1: a run the check let through would end in seconds (and fail here), not train an epoch
    flags = ("--synthetic", "--test", "--test-nsteps", "1", "--output-dir", tmp_path, "--metrics-json", tmp_path / name)
    proc = run_inline(*SMALL, *flags)
    assert_one_line_error(proc, f"--metrics-json {tmp_path / name}: a file the run itself writes in --output-dir")


def test_one_file_for_both_the_metrics_and_the_history_is_refused(tmp_path, run_inline):
    path = tmp_path / "m.json"
    proc = run_inline(*SMALL, "--synthetic", "--metrics-json", path, "--val-history", path, "--output-dir", tmp_path)
    assert_one_line_error(proc, "--metrics-json and --val-history both name")
    checkpoint = tmp_path / "c.pt"
    checkpoint.write_bytes(b"weights")
    proc = run_inline(*SMALL, "--eval-only", "--resume", checkpoint, "--metrics-json", path, "--predictions", path,
                      "--output-dir", tmp_path / "run")  # fmt: skip
    assert_one_line_error(proc, "--metrics-json and --predictions both name")


@pytest.mark.parametrize("flag", ["--metrics-json", "--val-history", "--predictions"])
@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"PK\x03\x04\x00\x00\x08\x08\x00\xff\xfe", id="a checkpoint (a zip)"),
        pytest.param(b"\xff\xd8\xff\xe0\x00\x10JFIF", id="an image"),
        pytest.param(b"my notes, kept for years\n", id="a text of the user's"),
        pytest.param(b'{"model": "resnet18"}', id="another JSON"),
    ],
)
def test_a_side_output_is_never_written_over_a_file_of_another_kind(flag, content, tmp_path, run_inline):
    """The checkpoint that --eval-only --resume reads, an image of the data, a user's own file: refused in one line
    naming the flag, before any work, and left as they were."""
    other = tmp_path / "theirs.bin"
    other.write_bytes(content)
    checkpoint = tmp_path / "c.pt"
    checkpoint.write_bytes(b"weights")
    mode = ["--eval-only", "--resume", checkpoint] if flag == "--predictions" else ["--synthetic", "--test"]
    proc = run_inline(*SMALL, *mode, flag, other, "--output-dir", tmp_path / "run")
    assert_one_line_error(proc, f"{flag} {other}: an existing file that is not a dlojz ", "give a new path")
    assert other.read_bytes() == content


def test_a_side_output_of_its_own_kind_is_written_again(tmp_path):
    """A metrics JSON, a history and a predictions CSV that dlojz wrote are known by their content."""
    from dlojz_lib.checks import PREDICTIONS_HEADER, check_side_outputs

    metrics, history, predictions = tmp_path / "m.json", tmp_path / "h.jsonl", tmp_path / "p.csv"
    metrics.write_text('{"world_size": 1, "steps": 3}')
    history.write_text('{"epoch": 1, "val_accuracy": 0.5}\n{"epoch": 2, "val_accuracy": 0.6}\n')
    predictions.write_text(PREDICTIONS_HEADER + ",class_1,probability_1\nimg.jpg,a,a,a,0.9\n")
    check_side_outputs({"--metrics-json": (metrics, "metrics"), "--val-history": (history, "history"),
                        "--predictions": (predictions, "predictions"), "--other": (tmp_path / "new.json", "metrics")})  # fmt: skip


def test_a_pointer_that_names_no_checkpoint_is_passed_over_for_the_newest_on_disk(tmp_path):
    import torch

    import dlojz_lib.checkpoint as ckpt

    saver = ckpt.CheckpointSaver(tmp_path, keep=3, device=torch.device("cpu"), fixed={}, model=torch.nn.Linear(2, 2))
    saved = saver.save(dict(epoch=0, batch=0, global_step=1))
    (tmp_path / "latest").write_text(json.dumps({"val_accuracy": 0.5}))  # another file written over it
    assert ckpt.latest_name(tmp_path) is None
    state, path = ckpt.load_latest(tmp_path)
    assert path == saved and state["global_step"] == 1


@pytest.mark.parametrize("side", ["latest", "checksum"])
def test_resume_given_a_checkpoint_s_side_file_names_the_checkpoint(tmp_path, side):
    import torch

    import dlojz_lib.checkpoint as ckpt

    saver = ckpt.CheckpointSaver(tmp_path, keep=3, device=torch.device("cpu"), fixed={}, model=torch.nn.Linear(2, 2))
    saved = saver.save(dict(epoch=0, batch=0, global_step=1))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(tmp_path / "latest" if side == "latest" else ckpt.checksum_path(saved))
    assert f"not a checkpoint: give {saved}, or --resume auto --output-dir {tmp_path}" in str(err.value), err.value


def test_a_reason_from_deep_inside_a_library_is_cleaned_for_one_line():
    from dlojz_lib.checkpoint import short_reason

    reason = short_reason(RuntimeError("\x1b[31mPytorchStreamReader failed\x1b[0m reading zip archive: " + "x " * 100))
    assert "\x1b" not in reason and reason.startswith("PytorchStreamReader failed reading zip archive")
    assert len(reason) <= 164 and reason.endswith("x ...")  # cut between words


def test_a_trial_whose_run_gives_no_top1_is_failed_with_its_reason_and_the_search_goes_on(tmp_path, capsys):
    optuna = pytest.importorskip("optuna")
    import dlojz_lib.hpo.search

    study = optuna.create_study(direction="maximize")
    trial = study.ask({"lr": optuna.distributions.FloatDistribution(0.01, 1.0)})
    worker = SimpleNamespace(
        study=study, stop_signal=None, args=SimpleNamespace(direction="maximize", objective="top1")
    )
    worker.objective = lambda metrics: dlojz_lib.hpo.search.Worker.objective(worker, metrics)
    worker.objective_name = lambda: dlojz_lib.hpo.search.Worker.objective_name(worker)
    dlojz_lib.hpo.search.Worker.tell(worker, trial, None, 0, {"val_accuracy": None, "epochs": 1}, tmp_path)
    out = capsys.readouterr().out
    assert "could not record" not in out and f"trial {trial.number}: failed: its run gave no top-1" in out, out
    (recorded,) = study.get_trials()
    assert recorded.state.name == "FAIL" and "gave no top-1" in recorded.user_attrs["error"]
    (tmp_path / "dlojz.log").write_text("dlojz: error: loss is not finite (nan/inf) at step 3 (epoch 1)\n")
    diverged = study.ask({"lr": optuna.distributions.FloatDistribution(0.01, 1.0)})
    dlojz_lib.hpo.search.Worker.tell(worker, diverged, None, 3, {}, tmp_path)
    assert f"trial {diverged.number}: failed (exit 3): dlojz: error: loss is not finite" in capsys.readouterr().out
    assert study.get_trials()[-1].state.name == "FAIL"


# ---------------------------------------------------------------- the data listing decides what an image is
def small_tree(root, classes=("a", "b"), train=4, val=2, size=(24, 20)):
    for split, count in (("train", train), ("val", val)):
        for index, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                Image.new("RGB", size, (40 * index, 100, 7 * k)).save(root / split / name / f"{name}{k}.png")
    return root


def listing(root):
    from dlojz_lib.data.datasets import build_datasets

    train, val, classes, _ = build_datasets(root, None, None)
    return train, val, classes


def test_hidden_and_tool_entries_are_left_out_with_one_line(tmp_path):
    root = small_tree(tmp_path / "d")
    for split in ("train", "val"):
        shutil.copytree(root / split / "a", root / split / ".ipynb_checkpoints")
        (root / split / "__MACOSX").mkdir()
        (root / split / "a" / "._a0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    train, val, classes = listing(root)
    assert classes == ["a", "b"] and len(train) == 8 and len(val) == 4  # no third class, no resource fork
    assert not any("._" in path or "ipynb" in path for path, _ in train.samples + val.samples)
    (line,) = [note for note in train.notes if "hidden or tool entries" in note and "/train" in note]
    assert "3 hidden or tool entries left out (.ipynb_checkpoints, __MACOSX, a/._a0.png)" in line, line


def test_a_link_that_loops_or_leads_into_another_class_is_left_out_with_a_line(tmp_path):
    root = small_tree(tmp_path / "d")
    (root / "train" / "a" / "loop").symlink_to("..")  # train/a/loop/a/loop/... and the other classes under a
    (root / "train" / "a" / "b_too").symlink_to(root / "train" / "b")
    (root / "train" / "self").symlink_to("self")  # a link to itself: ELOOP, not a class
    elsewhere = small_tree(tmp_path / "outside", classes=("extra",))
    (root / "train" / "b" / "more").symlink_to(elsewhere / "train" / "extra")  # out of the data root: followed
    train, _, classes = listing(root)
    assert classes == ["a", "b"]
    counts = [train.targets.count(t) for t in range(2)]
    assert counts == [4, 8], counts  # a: its own 4 only, none of b's labelled a; b: 4 + the 4 linked from outside
    (line,) = [note for note in train.notes if "links not followed" in note]
    assert "3 links not followed" in line and "a/loop (a link to a folder listed already: a loop)" in line, line
    assert "outside its class a/" in line


def test_one_class_and_very_unequal_classes_are_warned(tmp_path):
    train, _, _ = listing(small_tree(tmp_path / "one", classes=("only",)))
    assert any("one class ('only')" in note for note in train.notes), train.notes
    root = small_tree(tmp_path / "unequal", train=2)
    for k in range(2, 20):
        shutil.copy(root / "train" / "a" / "a0.png", root / "train" / "a" / f"a{k}.png")
    train, _, _ = listing(root)
    assert any("unequal classes: 'a' has 20 training images, 'b' 2 (10x)" in note for note in train.notes)
    train, _, _ = listing(small_tree(tmp_path / "even"))
    assert train.notes == []


def test_a_validation_image_gone_mid_run_is_left_out_of_the_count_not_replaced(tiny_data, tmp_path, capsys):
    """Before, the next readable image took its place: the validation line said 15 images while one was counted
    twice."""
    import contextlib

    import torch
    from torch.utils.data import default_collate

    from dlojz import evaluate
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.transforms import ValTransform

    root = shutil.copytree(tiny_data, tmp_path / "d")
    _, val, classes, _ = build_datasets(root, None, ValTransform(36, 32))
    os.remove(val.samples[3][0])  # after the listing: gone mid-run
    batch = default_collate([val[(0, index)] for index in range(len(val))])
    assert batch[1].tolist().count(-100) == 1 and "skipping unreadable image" in capsys.readouterr().err

    class Logits(torch.nn.Module):  # class scores from the mean colour: any model does
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, len(classes))

        def forward(self, images):
            return self.linear(images.float().mean(dim=(2, 3)))

    loaders = SimpleNamespace(val_batches=[batch], n_val_batches_every_rank=1, n_val_batches_most=1)
    training = SimpleNamespace(
        autocast=contextlib.nullcontext, val_criterion=torch.nn.CrossEntropyLoss(reduction="sum")
    )
    ranks = SimpleNamespace(enabled=False, device=torch.device("cpu"))
    net = Logits()
    result = evaluate(net, loaders, training, ranks)
    assert result["val_images"] == len(val) - 1
    readable = batch[1] >= 0
    with torch.no_grad():
        logits = net(batch[0][readable])
    expected = (logits.argmax(1) == batch[1][readable]).double().mean().item()
    assert result["val_accuracy"] == pytest.approx(expected)


def test_sixteen_bit_greys_keep_their_levels():
    from dlojz_lib.data.transforms import as_rgb

    levels = (np.arange(48 * 40).reshape(40, 48) * 30).astype(np.uint16)  # up to 57,570 of 65,535
    rgb = np.asarray(as_rgb(Image.fromarray(levels)))
    assert rgb.shape == (40, 48, 3) and abs(rgb.mean() - levels.mean() / 257) < 1, rgb.mean()  # PIL alone: 254


def test_the_region_decoder_refuses_what_pil_calls_a_decompression_bomb():
    import io

    import dlojz_lib.data.jpeg
    from dlojz_lib.data.transforms import UnreadableImageError, image_from_bytes

    if dlojz_lib.data.jpeg.load() is None:
        pytest.skip(f"the JPEG region decoder is not built here: {dlojz_lib.data.jpeg.unavailable_reason()}")
    buffer = io.BytesIO()
    Image.new("RGB", (48, 40), (10, 20, 30)).save(buffer, format="JPEG")
    data = bytearray(buffer.getvalue())
    sof = data.index(b"\xff\xc0")  # baseline start of frame: length (2), precision (1), height (2), width (2)
    data[sof + 5 : sof + 9] = (20000).to_bytes(2, "big") * 2
    with pytest.raises(UnreadableImageError, match="20000x20000 pixels in its header, more than PIL decodes"):
        image_from_bytes("bomb.jpg", bytes(data))
    with pytest.raises(Image.DecompressionBombError):  # what PIL itself says of the same bytes
        Image.open(io.BytesIO(bytes(data))).load()


# ---------------------------------------------------------------- flags that would do nothing
def test_zero_init_residual_on_a_model_without_it_is_refused(tmp_path, run_inline):
    proc = run_inline(*SMALL, "--arch", "mobilenet_v3_small", "--zero-init-residual", "--synthetic")
    assert_one_line_error(proc, "--zero-init-residual: --arch mobilenet_v3_small does not take it")


def test_a_model_of_one_input_size_at_another_is_refused_before_the_data(tmp_path, run_inline):
    proc = run_inline(*SMALL, "--arch", "vit_b_16", "--data-root", tmp_path / "no-such-data")
    assert_one_line_error(proc, "--arch vit_b_16 cannot take 32 px images (Wrong image height! Expected 224")


def test_a_model_s_input_sizes_are_checked_once_a_process_and_refused_each_time(monkeypatch):
    """The planner's layouts and HPO's trials resolve the same model again: its meta build and forward run once for
    a model and its sizes, its refusal said again each time it is asked; other sizes are checked anew."""
    from dlojz_lib.checks import UserError
    from dlojz_lib.model import zoo

    built, create = [], zoo.create_model
    monkeypatch.setattr(zoo, "create_model", lambda *args: built.append(args[0::3]) or create(*args))
    zoo.input_sizes_refusal.cache_clear()
    for sizes in ([29], [29, 29]):
        with pytest.raises(UserError, match="--arch vit_b_16 cannot take 29 px images"):
            zoo.check_input_sizes("vit_b_16", False, sizes)
    for _ in range(2):
        zoo.check_input_sizes("timm:test_resnet", False, [27, 31])
    assert built == [("vit_b_16", 29), ("timm:test_resnet", 31)]


def test_synthetic_with_a_data_root_is_refused(tmp_path, run_inline):
    proc = run_inline(*SMALL, "--synthetic", "--data-root", tmp_path)
    assert_one_line_error(proc, "--synthetic trains on random tensors and reads no data: drop --data-root")


def test_resume_auto_without_an_output_folder_outside_slurm_is_refused(run_inline):
    proc = run_inline(*SMALL, "--synthetic", "--resume", "auto", "--test", "--test-nsteps", "1")  # short if let by
    assert_one_line_error(proc, "--resume auto without --output-dir", "give --output-dir")


def test_counts_past_what_a_run_can_hold_are_refused(tmp_path, run_inline):
    recipe = tmp_path / "r.toml"
    recipe.write_text("epochs = 10000000000000000000000\n")
    proc = run_inline("--config", recipe, "--device", "cpu")
    assert_one_line_error(proc, "key 'epochs' must be at most 2,147,483,647")
    proc = run_inline(*SMALL, "--synthetic", "--checkpoint-every", "inf")
    assert_one_line_error(proc, "--checkpoint-every", "must be a finite number")


def test_tf32_on_the_cpu_says_it_does_nothing():
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--tf32"]))
    assert cfg.tf32 is False and cfg.compute_dtype == "float32"
    assert any(note.startswith("--tf32: no effect on the CPU") for note in cfg.notes), cfg.notes


def test_a_job_of_several_tasks_started_without_srun_is_refused(run_inline, monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    proc = run_inline(*SMALL, "--synthetic")
    assert_one_line_error(proc, "SLURM_NTASKS=2 but dlojz was not started by srun", "srun python dlojz.py")


def test_wandb_online_without_a_key_is_one_line(tmp_path, run_inline, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    proc = run_inline(*SMALL, "--synthetic", "--wandb", "--wandb-mode", "online", "--output-dir", tmp_path / "o")
    assert_one_line_error(proc, "--wandb-mode online: no W&B API key here", "wandb login")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (tmp_path / "netrc").chmod(0o600)
    from dlojz_lib.settings.config import check_wandb_login

    check_wandb_login()  # `wandb login`'s entry: accepted


SCRIPTS = [
    *sorted(  # every sibling command, found by name (dlojz_chrono.py's command line is chrono_report's)
        path.name if path.name != "dlojz_chrono.py" else "dlojz_lib/observers/chrono_report.py"
        for path in ROOT.glob("dlojz_*.py")
    ),
    *sorted(  # the benches that are commands (in_process.py is the loop they import)
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "bench").glob("*.py")
        if 'if __name__ == "__main__"' in path.read_text()
    ),
]


class Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(script, monkeypatch):
    """The parser a script's main() builds: its parse_args is stopped at its first call."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"walked_{Path(script).stem}", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def capture(self, *args, **kwargs):
        raise Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_intermixed_args", capture)  # (dlojz_predict.py's)
    try:
        module.main([]) if "argv" in inspect.signature(module.main).parameters else module.main()
    except Captured as captured:
        return captured.parser
    raise AssertionError(f"{script}: main() parsed no command line")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_number_option_of_the_siblings_and_benches_has_bounds_and_refuses_in_one_line(
    script, monkeypatch, capsys
):
    """The walk of test_config's over each sibling script and bench: an option taking a number has bounds
    (dlojz_lib.settings.flags.Number: without them `bench_loader.py --sizes 0` reaches torchvision and fails inside it), and
    each value out of them is one line naming the option, exit status 2."""
    import argparse

    from test_config import out_of_bounds

    from dlojz_lib.settings.flags import Number

    parser = parser_of(script, monkeypatch)
    monkeypatch.undo()  # the real parse_args again
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.extend(action.choices.values())
    walked = 0
    for command in parsers:
        for action in command._actions:
            assert action.type not in (int, float), f"{script} {action.dest}: a number without bounds (Number)"
            if not isinstance(action.type, Number) or not action.option_strings:
                continue
            for value in out_of_bounds(action):
                with pytest.raises(SystemExit) as exit:
                    repeat = action.nargs if isinstance(action.nargs, int) else 1  # "+": one value
                    command.parse_args([action.option_strings[-1], *[value] * repeat])
                lines = capsys.readouterr().err.strip().splitlines()
                assert exit.value.code == 2 and len(lines) == 1, (script, action.dest, value, lines)
                assert action.option_strings[-1] in lines[0], (script, lines)
                walked += 1
    no_numbers = ("dlojz_lib/observers/chrono_report.py", "dlojz_fsdp.py", "dlojz_lab.py", "bench/gpu_seams.py",
                  "bench/gpu_checks.py")  # fmt: skip
    assert walked or script in no_numbers, script


def test_dali_on_images_it_does_not_decode_is_one_line_before_the_run(tmp_path):
    """DALI does not decode WebP, which the pytorch backend reads: one line naming the backend that does, not a
    warning per file skipped and then an OSError."""
    from dlojz_lib.data.dali import check_decodable

    files = [(str(tmp_path / f"a/{k}.webp"), 0) for k in range(24)] + [(str(tmp_path / "b/0.JPEG"), 1)]
    with pytest.raises(UserError, match=r"does not decode \(24 \.webp; it takes JPEG and PNG\): use --data-backend"):
        check_decodable(SimpleNamespace(root=str(tmp_path), samples=files))
    check_decodable(SimpleNamespace(root=str(tmp_path), samples=files[-1:]))  # JPEGs only: nothing to say


def test_ctrl_c_while_torch_imports_is_one_line_not_a_traceback(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from conftest import clean_env

    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "dlojz.py"), *SMALL, "--synthetic", "--output-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    maps = Path(f"/proc/{proc.pid}/maps")
    while "libtorch" not in maps.read_text() and time.monotonic() < deadline:  # torch's import has begun
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "dlojz: interrupted while starting, before any training: nothing to resume"


def test_a_cache_folder_that_cannot_be_written_is_named_not_blamed_on_the_compiler(tmp_path, monkeypatch):
    """A cache folder that cannot be written is named as the cause, not a missing gcc or libjpeg-dev."""
    import dlojz_lib.data.jpeg

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))  # under a file: mkdir fails, even for root
    monkeypatch.setattr(dlojz_lib.data.jpeg, "_library", None)
    monkeypatch.setattr(dlojz_lib.data.jpeg, "_load_tried", False)
    monkeypatch.setattr(dlojz_lib.data.jpeg, "_choice", "auto")
    assert dlojz_lib.data.jpeg.load() is None
    status = dlojz_lib.data.jpeg.status()
    assert f"cache folder {blocker / 'cache' / 'dlojz'} cannot be written" in status, status
    assert "XDG_CACHE_HOME" in status and "gcc" not in status, status


def test_consolidate_given_a_run_folder_names_its_sharded_checkpoints(tmp_path, capsys):
    """consolidate takes a .dcp folder: given a run's folder, it names the newest one (not --resume's advice)."""
    import dlojz_fsdp

    (tmp_path / "ckpt_e0001_s000000010.dcp").mkdir()
    (tmp_path / "ckpt_e0002_s000000020.dcp").mkdir()
    assert dlojz_fsdp.main(["consolidate", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a run's folder, not a sharded checkpoint: give one of its .dcp folders" in err, err
    assert err.endswith(f"{tmp_path / 'ckpt_e0002_s000000020.dcp'} (its newest)") and "--resume" not in err


def test_a_data_root_without_read_permission_is_named_not_a_traceback(tiny_data, monkeypatch):
    """The pack check (is there a manifest?) is the first to look into the data root: it must name it too."""
    from dlojz_lib.checks import DataError
    from dlojz_lib.data.datasets import build_datasets

    is_file = Path.is_file

    def as_a_user(path):  # root reads everything: the refusal is simulated
        if path.parent == tiny_data:
            raise PermissionError(13, "Permission denied", str(path))
        return is_file(path)

    monkeypatch.setattr(Path, "is_file", as_a_user)
    with pytest.raises(DataError, match=r"cannot be read \(Permission denied\); check its permissions"):
        build_datasets(tiny_data, None, None)


def test_a_full_disk_leaves_each_side_output_as_it_was(tmp_path, monkeypatch, capsys):
    """The predictions CSV, per_class.csv and the validation history are written whole under a temporary name and
    renamed: a write that fails (ENOSPC) leaves the previous file, and no partial one beside it."""
    import errno
    import os

    import torch

    import dlojz_lib.durable
    from dlojz_lib.log import append_json_line
    from dlojz_lib.metrics import write_per_class, write_predictions

    history, predictions = tmp_path / "h.jsonl", tmp_path / "p.csv"
    append_json_line(history, {"epoch": 1})
    write_predictions(predictions, (torch.arange(2), torch.tensor([0, 1]), torch.tensor([[0], [1]]),
                                    torch.tensor([[0.9], [0.8]])), ["a", "b"], lambda i: f"img{i}.jpg")  # fmt: skip
    write_per_class(torch.tensor([[2, 0], [1, 1]]), ["a", "b"], tmp_path)
    before = {path: path.read_bytes() for path in tmp_path.iterdir()}

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dlojz_lib.durable.os, "fsync", no_space)
    monkeypatch.setattr("dlojz_lib.log.os.replace", no_space)
    with pytest.raises(OSError):
        write_predictions(predictions, (torch.arange(1), torch.tensor([1]), torch.tensor([[0]]),
                                        torch.tensor([[0.5]])), ["a", "b"], str)  # fmt: skip
    with pytest.raises(OSError):
        write_per_class(torch.tensor([[0, 2], [2, 0]]), ["a", "b"], tmp_path)
    append_json_line(history, {"epoch": 2})  # a warning, the run goes on
    assert "not written (No space left on device)" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in tmp_path.iterdir()} == before


@pytest.mark.parametrize(
    "flag", ["--data-root", "--output-dir", "--initial-checkpoint", "--teacher", "--metrics-json", "--val-history",
             "--resume"]
)  # fmt: skip
def test_an_empty_path_is_refused_in_one_line(flag):
    """`--output-dir ""` once wrote the run into the current folder: an empty (or blank) path is one line naming
    the flag, before torch."""
    from dlojz_lib.checks import UserError
    from dlojz_lib.settings.flag_checks import checked_values

    for value in ("", "  "):
        with pytest.raises(UserError) as refused:
            checked_values(["--device", "cpu", flag, value])
        assert str(refused.value) == f"{flag} is empty: give a path (or leave {flag} out for its default)"


def test_a_run_s_settings_record_its_paths_absolute(tmp_path, monkeypatch):
    """args.toml holds --data-root, --output-dir, --metrics-json and --resume PATH absolute (from the folder the run
    started in), so `--config RUN/args.toml --resume auto` reads the same folders from anywhere; `--resume auto`
    stays auto."""
    import types

    from dlojz_lib.run_record import record_settings
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser
    from dlojz_lib.settings.recipe import read_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    for resume, recorded in (("ckpt.pt", str(tmp_path / "ckpt.pt")), ("auto", "auto")):
        argv = ["--device", "cpu", "--data-root", "data", "--output-dir", "run", "--metrics-json", "m.json",
                "--resume", resume]  # fmt: skip
        cfg = resolve_config(get_args_parser().parse_args(argv))
        record_settings(cfg, argv, types.SimpleNamespace(is_main=True), lambda line: None)
        saved = read_recipe(get_args_parser(), tmp_path / "run" / "args.toml")
        assert saved["data_root"] == str(tmp_path / "data") and saved["output_dir"] == str(tmp_path / "run")
        assert saved["metrics_json"] == str(tmp_path / "m.json") and saved["resume"] == recorded
        assert cfg.output_dir == "run"  # (the run's own settings unchanged)
