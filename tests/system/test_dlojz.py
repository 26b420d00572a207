"""dlojz.py end to end on the CPU: it learns, validates exactly across ranks, runs every precision path, reports,
and turns every bad input into one clear line."""

import math
import os
import shutil
import subprocess
import sys

import preloaded
import pytest
import torch
from conftest import ROOT, SMALL, TINY, clean_env, read_json, run_dlojz, show

TORCHRUN2 = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def assert_one_line_error(proc, *fragments, status=2):
    assert proc.returncode == status, show(proc)
    assert "Traceback" not in proc.stderr, show(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dlojz: error:"), show(proc)
    for fragment in fragments:
        assert fragment in last, f"{fragment!r} not in {last!r}"


def test_the_first_test_run_s_loss_falls(tmp_path, embedded_cache):
    """`python dlojz.py --test` as the README's first command, shortened: on the CPU profile (ResNet-50, 64 px, lr
    0.025) the training loss falls from its first line and validation ends below chance (ln 10). Without zero-init
    of the residual blocks the loss climbed to 5-10 and validation was far above chance."""
    proc = run_dlojz(
        "--test",
        "--test-nsteps",
        "12",
        "--no-wandb",
        "--output-dir",
        tmp_path,
        env=clean_env(XDG_CACHE_HOME=embedded_cache),
    )
    assert proc.returncode == 0, show(proc)
    losses = [float(line.split("Loss: ")[1].split(",")[0]) for line in proc.stdout.splitlines() if ", Step " in line]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
    val_loss = float(proc.stdout.split("Validation Loss: ")[1].split(",")[0])
    assert val_loss < math.log(10), proc.stdout[-2000:]


def test_learns_on_embedded_data(tmp_path, embedded_cache):
    """No --data-root: the embedded data set is generated, announced, and a model learns it well above chance."""
    out, metrics = tmp_path / "run", tmp_path / "m.json"
    proc = run_dlojz(
        *SMALL,
        "-b",
        "32",
        "--epochs",
        "3",
        "--no-wandb",
        "--output-dir",
        out,
        "--metrics-json",
        metrics,
        env=clean_env(XDG_CACHE_HOME=embedded_cache),
    )
    assert proc.returncode == 0, show(proc)
    assert "embedded data set" in proc.stdout
    m = read_json(metrics)
    assert m["val_images"] == 250 and m["epochs"] == 3 and m["world_size"] == 1
    assert m["val_accuracy"] > 0.35, m  # 10 classes: chance is 0.10
    assert m["images_per_second"] > 0 and m["max_memory_bytes"] > 0
    # one checkpoint per epoch, the last 3 kept, `latest` names the newest
    names = sorted(p.name for p in out.glob("ckpt_*.pt"))
    assert len(names) == 3 and (out / "latest").read_text().strip() == names[-1]
    assert proc.stdout.count("Epoch 1/3, Step") == 10  # 10 console lines per epoch, as in the course


@pytest.fixture(scope="module")
def trained_checkpoint(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    proc = run_dlojz(*SMALL, "--data-root", tiny_data, "-b", "8", "--epochs", "1", "--no-wandb", "--output-dir", out)
    assert proc.returncode == 0, show(proc)
    return out / (out / "latest").read_text().strip()


@pytest.mark.multirank
def test_eval_one_vs_two_processes_identical(trained_checkpoint, tiny_data, tmp_path):
    """15 validation images on 2 ranks (8 + 7): every image counted once, same numbers as 1 process; --predictions
    has one row per image in the data set's order, and the per-class figures are those its rows give."""
    import csv

    results, rows = [], []
    for launcher in (None, TORCHRUN2):  # (torchrun itself: the suite's one training or evaluation run under it)
        metrics = tmp_path / f"eval{len(results)}.json"
        predictions = tmp_path / f"predictions{len(results)}.csv"
        proc = run_dlojz(
            *SMALL,
            "--data-root",
            tiny_data,
            "--val-batch-size",
            "4",
            "--eval-only",
            "--resume",
            trained_checkpoint,
            "--metrics-json",
            metrics,
            "--predictions",
            predictions,
            "--output-dir",
            tmp_path / f"o{len(results)}",
            launcher=launcher,
        )
        assert proc.returncode == 0, show(proc)
        results.append(read_json(metrics))
        with open(predictions) as file:
            rows.append(list(csv.DictReader(file)))
    # The rows: every validation image once, in the data set's order, the same on 1 and 2 ranks.
    images = sorted(str(p) for p in (tiny_data / "val").rglob("*.*"))
    assert [row["image"] for row in rows[0]] == [row["image"] for row in rows[1]] == images
    for a, b in zip(*rows):
        assert [a[f"class_{k}"] for k in (1, 2, 3)] == [b[f"class_{k}"] for k in (1, 2, 3)]
        assert float(a["probability_1"]) == pytest.approx(float(b["probability_1"]), abs=1e-5)
        assert a["true_class"] == b["true_class"] == os.path.basename(os.path.dirname(a["image"]))
        assert a["predicted_class"] == a["class_1"] and float(a["probability_1"]) >= float(a["probability_2"])
    # per_class.csv of each run, from its confusion matrix summed on the device: the recall the rows give.
    for run in (0, 1):
        with open(tmp_path / f"o{run}" / "per_class.csv") as file:
            for row in csv.DictReader(file):
                mine = [r for r in rows[run] if r["true_class"] == row["class"]]
                hits = sum(r["predicted_class"] == row["class"] for r in mine)
                assert int(row["images"]) == len(mine) and float(row["recall"]) == pytest.approx(
                    hits / len(mine), abs=1e-4
                )
    one, two = results
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["val_images"] == two["val_images"] == 15
    assert one["val_accuracy"] == two["val_accuracy"]
    assert one["val_balanced_accuracy"] == two["val_balanced_accuracy"] and one["val_macro_f1"] == two["val_macro_f1"]
    assert one["val_top5_accuracy"] == two["val_top5_accuracy"] >= one["val_accuracy"]
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-5, abs=1e-6)


def test_bf16_autocast_and_channels_last(tiny_data, tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--test",
        "--test-nsteps",
        "4",
        "--amp",
        "--amp-dtype",
        "bfloat16",
        "--channels-last",
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["steps"] == 4 and m["train_loss"] > 0 and m["compute_dtype"] == "bfloat16"


def test_test_unsync_steps_times_the_last_steps_as_a_whole(tmp_path, run_inline):
    """--test-nsteps 6 --test-unsync-steps 2: the chronometer times 4 steps phase by phase, the last 2 as a whole
    (the metrics JSON and the report say both figures); by default, 6 steps are too few for a window."""
    runs = {}
    for name, more in (("window", ["--test-unsync-steps", "2"]), ("default", [])):
        metrics = tmp_path / f"{name}.json"
        proc = run_inline(*TINY, "--synthetic", "--test", "--test-nsteps", "6", *more, "--metrics-json", metrics,
                          "--output-dir", tmp_path / name)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        runs[name] = (read_json(metrics)["chrono"], proc.stdout)
    chrono, stdout = runs["window"]
    assert chrono["steps"] == 4 and chrono["unsync_window_steps"] == 2 and chrono["unsync_throughput_img_s"] > 0
    assert "=>>> Throughput, unsynchronised: " in stdout and " images/s over the last 2 steps" in stdout
    chrono, stdout = runs["default"]
    assert chrono["steps"] == 6 and "unsync_throughput_img_s" not in chrono and "unsynchronised" not in stdout


def test_float16_uses_grad_scaler(tiny_data, tmp_path):
    """float16 autocast turns the GradScaler on (its loss scale is reported); bfloat16 leaves it off."""
    scales = {}
    for dtype in ("float16", "bfloat16"):
        metrics = tmp_path / f"{dtype}.json"
        # A tiny ViT, not a ResNet: on the CPU a float16 convolution's backward takes seconds (4 s a step for
        # resnet18 at 64 px), and at 16 px, where layer3 and layer4 convolve 1x1 maps, torch's reduced-precision
        # convolution (oneDNN, torch 2.14) can return uninitialised gradients: now and then a NaN loss at step 2.
        proc = run_dlojz(
            *SMALL,
            "--arch",
            "timm:test_vit",
            "--data-root",
            tiny_data,
            "-b",
            "8",
            "--test",
            "--test-nsteps",
            "2",
            "--amp",
            "--amp-dtype",
            dtype,
            "--metrics-json",
            metrics,
            "--output-dir",
            tmp_path,
        )
        if dtype == "float16" and "cannot run on cpu" in proc.stderr:
            pytest.skip("this torch build has no float16 autocast on CPU")
        assert proc.returncode == 0, show(proc)
        m = read_json(metrics)
        assert m["compute_dtype"] == dtype and m["steps"] == 2
        scales[dtype] = m["grad_scaler_scale"]
    assert scales["float16"] > 0  # 65536 at start, halved on overflowing steps
    assert scales["bfloat16"] is None


def test_test_mode_prints_chronometer_report(tiny_data, tmp_path):
    proc = run_dlojz(
        *SMALL, "--data-root", tiny_data, "-b", "8", "--test", "--test-nsteps", "8", "--output-dir", tmp_path
    )
    assert proc.returncode == 0, show(proc)
    assert "Number of batch per epoch: 9" in proc.stdout  # 72 train images / 8
    assert "images/s" in proc.stdout and ">>>JSON" in proc.stdout
    assert "nan" not in proc.stdout.lower()  # console lines before the first timed steps say "warming up"
    assert (tmp_path / "chrono_trace.json").is_file()
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("ckpt_*.pt")) and not (tmp_path / "wandb").exists()  # --test writes neither


def test_synthetic_runs_without_touching_disk(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *SMALL,
        "--synthetic",
        "-b",
        "8",
        "--test",
        "--test-nsteps",
        "12",
        "--val-batch-size",
        "8",
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path / "o",
        env=clean_env(XDG_CACHE_HOME=cache, DLOJZ_DATA=tmp_path / "no-such-dir"),
    )
    assert proc.returncode == 0, show(proc)
    assert not (cache / "dlojz").exists()  # no embedded data set generated, no data read
    m = read_json(metrics)
    assert m["val_images"] == 20 * 8 and m["steps"] == 12 and m["images_per_second"] > 0


def test_non_test_run_leaves_wandb_offline_files(tiny_data, tmp_path):
    proc = run_dlojz(*SMALL, "--data-root", tiny_data, "-b", "24", "--output-dir", tmp_path)
    assert proc.returncode == 0, show(proc)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), show(proc)


# ----------------------------------------------------------------------------- bad input: one line, exit 2
def test_missing_data_root(tmp_path, run_inline):
    proc = run_inline(*SMALL, "--data-root", tmp_path / "nope", "--output-dir", tmp_path)
    assert_one_line_error(proc, "--data-root", "no such directory")


def test_empty_data_root(tmp_path, run_inline):
    (tmp_path / "empty").mkdir()
    proc = run_inline(*SMALL, "--data-root", tmp_path / "empty", "--output-dir", tmp_path)
    assert_one_line_error(proc, "missing or empty")


def test_layout_neither_imagenet_nor_imagefolder(tmp_path, run_inline):
    root = tmp_path / "flat"
    (root / "train").mkdir(parents=True)
    (root / "train" / "a.jpg").write_bytes(b"x")
    proc = run_inline(*SMALL, "--data-root", root, "--output-dir", tmp_path)
    assert_one_line_error(proc, "train/<class>/", "ImageFolder")


def test_train_and_val_classes_differ(tiny_data, tmp_path, run_inline):
    root = tmp_path / "mismatch"
    shutil.copytree(tiny_data, root)
    shutil.rmtree(root / "val" / "disc")
    proc = run_inline(*SMALL, "--data-root", root, "--output-dir", tmp_path)
    assert_one_line_error(proc, "different classes", "disc")


def test_unreadable_image_is_skipped_with_its_name(tiny_data, tmp_path):
    root = tmp_path / "corrupt"
    shutil.copytree(tiny_data, root)
    bad = root / "train" / "square" / "square_0003.JPEG"
    bad.write_bytes(b"this is not a jpeg")
    proc = run_dlojz(
        *SMALL,
        "--data-root",
        root,
        "-b",
        "8",
        "--test",
        "--test-nsteps",
        "9",
        "--num-workers",
        "0",
        "--output-dir",
        tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    assert f"skipping unreadable image {bad}" in proc.stderr


def test_batch_larger_than_dataset_with_drop_last(tiny_data, tmp_path, run_inline):
    proc = run_inline(*SMALL, "--data-root", tiny_data, "-b", "100", "--drop-last", "--output-dir", tmp_path)
    assert_one_line_error(proc, "--batch-size 100", "--drop-last")


def test_unknown_arch(tiny_data, tmp_path, run_inline):
    proc = run_inline("--device", "cpu", "--arch", "resnet51", "--data-root", tiny_data, "--output-dir", tmp_path)
    assert_one_line_error(proc, "--arch resnet51", "resnet50")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu(tmp_path, run_inline):
    proc = run_inline("--device", "cuda", "--synthetic", "--output-dir", tmp_path)
    assert_one_line_error(proc, "--device cuda", "no CUDA GPU")


def test_autocast_dtype_that_cannot_run(monkeypatch):
    """Where autocast in the chosen dtype fails on the device, dlojz says so before training, naming the flag."""
    import dlojz_lib.checks
    import dlojz_lib.settings.config

    def broken_autocast(*args, **kwargs):
        raise RuntimeError("Current CPU device does not support float16 autocast\nmore details")

    monkeypatch.setattr(torch, "autocast", broken_autocast)
    with pytest.raises(dlojz_lib.checks.UserError, match=r"^--amp-dtype float16 cannot run on cpu: Current CPU device"):
        dlojz_lib.settings.config.check_autocast(torch.device("cpu"), torch.float16)


def test_unwritable_output_dir(tiny_data, tmp_path, run_inline):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    proc = run_inline(*SMALL, "--data-root", tiny_data, "--output-dir", blocker / "run")
    assert_one_line_error(proc, "--output-dir", "is a file, not a folder")


def test_nan_loss_stops_with_step_and_keeps_checkpoint(tiny_data, tmp_path, trained_checkpoint):
    import dlojz_lib.checkpoint as ckpt

    out = tmp_path / "run"
    out.mkdir()
    # The trained checkpoint resumed with its schedule's learning rates at 1e30: the loss is not finite at once.
    saved = ckpt.load(trained_checkpoint)
    for group in saved["optimizer"]["param_groups"]:
        group.update({key: 1e30 for key in ("lr", "initial_lr", "max_lr", "min_lr") if key in group})
    ckpt.write(saved, out / trained_checkpoint.name)  # (with its checksum)
    (out / "latest").write_text(trained_checkpoint.name + "\n")
    before = (out / trained_checkpoint.name).read_bytes()
    flags = ["-b", "8", "--epochs", "2", "--no-wandb", "--output-dir", out, "--resume", "auto"]
    proc = run_dlojz(*SMALL, "--data-root", tiny_data, *flags)
    assert_one_line_error(proc, "not finite", "at step", trained_checkpoint.name, status=3)
    assert (out / trained_checkpoint.name).read_bytes() == before
    assert (out / "latest").read_text().strip() == trained_checkpoint.name
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == [trained_checkpoint.name]


def test_eval_only_needs_resume(tmp_path, run_inline):
    proc = run_inline(*SMALL, "--synthetic", "--eval-only", "--output-dir", tmp_path)
    assert_one_line_error(proc, "--eval-only", "--resume")


def test_resume_refuses_foreign_file(tiny_data, tmp_path, run_inline):
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    proc = run_inline(*SMALL, "--data-root", tiny_data, "--eval-only", "--resume", foreign, "--output-dir", tmp_path)
    assert_one_line_error(proc, "--resume", "not written by dlojz")


def test_loader_only_reports_images_per_second(tiny_data, tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--loader-only",
        "--test-nsteps",
        "12",
        "--num-workers",
        "2",
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["loader_images_per_second"] > 0 and m["loader_batches"] == 12  # 12 batches > 9 per epoch: wraps
    assert m["loader_images_per_second_per_worker"] == pytest.approx(m["loader_images_per_second"] / 2)
    assert "DataLoader alone" in proc.stdout and "per worker" in proc.stdout


def test_loader_only_with_synthetic_is_refused(tmp_path, run_inline):
    proc = run_inline(*SMALL, "--synthetic", "--loader-only", "--output-dir", tmp_path)
    assert_one_line_error(proc, "--loader-only", "--synthetic")


def test_cpu_profile_scales_the_learning_rate_unless_given(tmp_path, monkeypatch):
    # Without a GPU the profile's batch is 4x smaller than the course's: the lr follows the linear scaling rule.
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    monkeypatch.chdir(tmp_path)  # the default --output-dir is made under ./runs
    common = ["--device", "cpu", "--arch", "resnet18"]
    cfg = resolve_config(get_args_parser().parse_args(common))
    assert (cfg.batch_size, cfg.lr) == (32, 0.025)
    assert "--batch-size 32" in cfg.notes[0] and "--lr 0.025" in cfg.notes[0]
    cfg = resolve_config(get_args_parser().parse_args(common + ["--lr", "0.1", "-b", "16"]))
    assert (cfg.batch_size, cfg.lr) == (16, 0.1)
    assert "--lr" not in cfg.notes[0] and "--batch-size" not in cfg.notes[0]  # given explicitly: not in the profile


def test_interactive_terminal_gets_one_live_line_per_epoch(tiny_data, tmp_path):
    # In a terminal the console lines of an epoch rewrite one line ("\r"), ended once: no blank lines, whether the
    # epoch runs to its end or --test leaves it early.
    import pty

    for extra in (["--epochs", "1", "--no-wandb"], ["--test", "--test-nsteps", "4"]):
        leader, follower = pty.openpty()
        proc = subprocess.Popen(  # a fork of the tests' preloaded server, its stdout the terminal
            [
                *preloaded.launch_prefix(clean_env()),
                sys.executable,
                str(ROOT / "dlojz.py"),
                *SMALL,
                "--data-root",
                str(tiny_data),
                "-b",
                "8",
                "--output-dir",
                str(tmp_path / extra[0]),
                *extra,
            ],
            stdout=follower,
            stderr=subprocess.DEVNULL,
            env=clean_env(),
            cwd=ROOT,
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(leader)
        assert proc.wait(timeout=300) == 0
        text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
        assert "\rEpoch 1/1, Step" in text  # rewritten in place
        assert "\n\n" not in text, text[-2000:]
        assert "\n##EVALUATION STEP##" in text


def test_a_validation_loss_of_nan_ends_the_run_with_status_3_after_saving_the_epoch(
    tiny_data, tmp_path, run_inline, monkeypatch
):
    """A finite training loss but a nan validation (float16 outputs overflowing in evaluation): the epoch's
    checkpoint is written, never made the best, and the run ends with 3 and one line instead of going on (it
    exited 0)."""
    import dlojz

    evaluate = dlojz.evaluate

    def overflowing(*args, **kwargs):
        return dict(evaluate(*args, **kwargs), val_loss=float("nan"))

    monkeypatch.setattr(dlojz, "evaluate", overflowing)
    out = tmp_path / "run"
    proc = run_inline(*TINY, "--data-root", tiny_data, "-e", "2", "--output-dir", out)
    assert_one_line_error(proc, "the validation loss is not finite (nan/inf) after epoch 1: stopping; the epoch's "
                          f"checkpoint is kept ({out / 'ckpt_e0001_s000000009.pt'})", status=3)  # fmt: skip
    assert (out / "latest").read_text().strip() == "ckpt_e0001_s000000009.pt" and not (out / "best").exists()


def test_sigterm_during_eval_only_stops_the_evaluation_between_two_batches(
    tiny_data, tmp_path, run_inline, monkeypatch
):
    """Slurm's SIGTERM reaches an --eval-only run: it ends at the next batch with one line and 128 + 15, writing
    nothing, instead of running to the end of the validation set first."""
    import signal

    import dlojz

    out = tmp_path / "run"
    assert run_inline(*TINY, "--data-root", tiny_data, "-e", "1", "--output-dir", out).returncode == 0
    checkpoint = sorted(out.glob("ckpt_e*.pt"))[-1]
    evaluate = dlojz.evaluate

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as the evaluation starts (the run's StopSignal sets its name)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(dlojz, "evaluate", signalled)
    evaluated = tmp_path / "evaluated"
    proc = run_inline(*TINY, "--data-root", tiny_data, "--eval-only", "--resume", checkpoint, "--output-dir", evaluated,
                      "--val-batch-size", "2", "--metrics-json", tmp_path / "m.json")  # fmt: skip
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "SIGTERM received during --eval-only: the evaluation stops, nothing written" in proc.stdout
    assert "##EVALUATION##" not in proc.stdout  # stopped at its first batch, not after the whole set
    assert not (tmp_path / "m.json").exists() and not (evaluated / "per_class.csv").exists()
