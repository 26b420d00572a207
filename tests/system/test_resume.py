"""Preemption without Slurm: a signal mid-run saves a checkpoint and exits 0; `--resume auto` then ends with the
same weights as an uninterrupted run. With several ranks, a signal reaching one rank stops all of them at the same
step, and a rank that dies ends the others in bounded time."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import preloaded
import pytest
import torch
from conftest import ROOT, SMALL, TINY, clean_env, run_dlojz, show, start_dlojz

import dlojz_lib.checkpoint

# 240 train images, batch 16: 15 steps per epoch, long enough for a signal to land mid-run.
RUN = [*SMALL, "-b", "16", "--epochs", "2", "--no-wandb", "--num-workers", "1"]


@pytest.fixture(scope="module")
def resume_data(tmp_path_factory):
    from dlojz_lib.data.embedded import make_embedded_dataset

    return make_embedded_dataset(
        tmp_path_factory.mktemp("data") / "resume", n_classes=3, train_per_class=80, val_per_class=4, size=(64, 56)
    )


@pytest.fixture(scope="module")
def straight_run(resume_data, tmp_path_factory):
    """The final checkpoint of RUN trained without a stop: what every stopped and resumed run must end with (the
    samples' seeds do not depend on the number of workers)."""
    out = tmp_path_factory.mktemp("straight")
    proc = run_dlojz(*RUN, "--data-root", resume_data, "--output-dir", out)
    assert proc.returncode == 0, show(proc)
    return final_weights(out)


def start(args, env):
    return start_dlojz(*args, env=env)


def wait_for_line(proc, fragment, timeout=300):
    """Read proc's output until a line contains `fragment`; return everything read so far."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if fragment in line:
            return "".join(seen)
    raise AssertionError(f"{fragment!r} never printed:\n{''.join(seen)[-3000:]}")


def final_weights(out):
    state = torch.load(out / (out / "latest").read_text().strip(), weights_only=True)
    return state


def test_signal_then_resume_gives_the_same_weights(resume_data, straight_run, tmp_path):
    interrupted = tmp_path / "interrupted"
    proc = start([*RUN, "--data-root", resume_data, "--output-dir", interrupted], clean_env())
    early = wait_for_line(proc, "Epoch 1/2, Step")
    proc.send_signal(signal.SIGUSR1)
    rest, _ = proc.communicate(timeout=300)
    log = early + rest
    assert proc.returncode == 0, log
    assert "SIGUSR1 received: saving a checkpoint" in log and "continue with --resume auto" in log
    stopped = final_weights(interrupted)
    assert stopped["global_step"] < 30, "the signal should have stopped the run before its end"

    proc = run_dlojz(*RUN, "--data-root", resume_data, "--output-dir", interrupted, "--resume", "auto")
    assert proc.returncode == 0, show(proc)
    assert f"resumed from {interrupted}" in proc.stdout
    a, b = straight_run, final_weights(interrupted)
    assert a["global_step"] == b["global_step"] == 30 and a["epoch"] == b["epoch"] == 2
    for key, value in a["model"].items():
        assert torch.allclose(value.float(), b["model"][key].float(), rtol=1e-5, atol=1e-6), key
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


def test_a_run_whose_output_reader_is_gone_still_checkpoints_and_ends_on_sigterm(resume_data, tmp_path):
    """Piped into a process that died (a closed terminal, a killed `| tee`), then sent SIGTERM: the run goes on
    without its console, checkpoints and ends with its DataLoader workers (which ignore SIGTERM), never waits for
    them for ever."""
    out = tmp_path / "run"
    proc = start([*RUN, "--data-root", resume_data, "--output-dir", out], clean_env())
    wait_for_line(proc, "Epoch 1/2, Step")
    proc.stdout.close()  # the reader is gone: the run's next line meets a broken pipe
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()  # (its workers follow it within a second)
        pytest.fail("the run still runs 120 s after SIGTERM with its output pipe gone")
    assert status == 0
    assert 0 < final_weights(out)["global_step"] < 30


def start_ranks(args, world_size=2):
    """Two ranks started by hand, as torchrun would (idr_torch reads the torchelastic variables)."""
    port = preloaded.free_port()
    return [
        start(args, preloaded.rank_env(clean_env(OMP_NUM_THREADS=1), rank, world_size, port))
        for rank in range(world_size)
    ]


@pytest.mark.multirank
def test_signal_on_one_rank_stops_all_ranks_at_the_same_step(resume_data, tmp_path):
    out = tmp_path / "run"
    rank0, rank1 = start_ranks([*RUN, "--data-root", resume_data, "--output-dir", out])
    early = wait_for_line(rank0, "Epoch 1/2, Step")  # 240 images on 2 ranks: 8 steps per epoch
    rank1.send_signal(signal.SIGUSR1)  # only rank 1 is told
    log0 = early + rank0.communicate(timeout=300)[0]
    log1 = rank1.communicate(timeout=300)[0]
    assert rank0.returncode == 0 and rank1.returncode == 0, log0 + log1
    assert "signal on another rank received: saving a checkpoint" in log0, log0
    state = final_weights(out)
    assert 0 < state["global_step"] < 16


@pytest.mark.multirank
def test_a_killed_rank_ends_the_other_with_one_line_and_the_run_resumes_from_its_last_checkpoint(resume_data, tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--data-root", resume_data, "--output-dir", out, "--dist-timeout", "60"]
    rank0, rank1 = start_ranks([*args, "--checkpoint-every", "1e-9"])  # a checkpoint at every log point
    wait_for_line(rank0, "(--checkpoint-every 1e-09 min: epoch 1, step 3/8)")
    rank1.kill()  # SIGKILL: no chance to say goodbye
    t0 = time.time()
    try:
        log0 = rank0.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        rank0.kill()
        pytest.fail("rank 0 still running 120 s after rank 1 died")
    elapsed = time.time() - t0
    assert rank0.returncode == 4, log0[-3000:]
    errors = [line for line in log0.splitlines() if line.startswith("dlojz: ")]
    assert len(errors) == 1 and "Traceback" not in log0, log0[-3000:]
    host = socket.gethostname()
    assert errors[0].startswith(f"dlojz: error: rank 1 ({host}) stopped answering at step "), errors[0]
    assert f"last checkpoint: {out}/ckpt_e0000_s" in errors[0] and "--resume auto" in errors[0]
    assert elapsed < 30, f"rank 0 ended {elapsed:.1f} s after rank 1 was killed"
    saved, path = dlojz_lib.checkpoint.load_latest(out)
    assert 3 <= saved["global_step"] < 16 and (saved["batch"] > 0 or saved["epoch"] > 0), path
    # The job is relaunched (here on one rank): it goes on from that checkpoint to the end.
    proc = run_dlojz(*args, "--resume", "auto")
    assert proc.returncode == 0, show(proc)
    # 2 ranks' steps are 2 of this rank's: the position is said in this run's steps, at the same image
    assert f"resumed from {path} (epoch {saved['epoch'] + 1}, step {2 * saved['batch']}/15" in proc.stdout, proc.stdout
    assert final_weights(out)["epoch"] == 2


# ----------------------------------------------------------------------------- resume, in-process (no interpreter start)
ARCH = SMALL[SMALL.index("--arch") + 1]


def latest_state(out):
    return torch.load(out / (out / "latest").read_text().strip(), weights_only=True)


def lr_after(name, steps, total_steps, lr=0.025):
    """The learning rate a fresh schedule of `total_steps` gives after `steps` steps, stepped one by one."""
    import dlojz_lib.optim.schedules

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr, momentum=0.9)
    scheduler = dlojz_lib.optim.schedules.build_scheduler(name, optimizer, lr, total_steps)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("schedule", ["onecycle", "cosine", "step", "constant"])
def test_resume_with_more_epochs_continues_a_rebuilt_schedule(schedule, tiny_data, tmp_path, run_inline):
    out = tmp_path / "run"
    common = [*TINY, "--data-root", tiny_data, "--output-dir", out, "--lr-scheduler", schedule]
    first = run_inline(*common, "-e", "1")
    assert first.returncode == 0, first.stderr
    checkpoint = out / (out / "latest").read_text().strip()
    longer = run_inline(*common, "-e", "2", "--resume", checkpoint)
    assert longer.returncode == 0, longer.stderr
    assert "learning-rate schedule (" in longer.stdout
    assert "is rebuilt for 18 optimizer steps and continues from step 9" in longer.stdout
    state = latest_state(out)
    assert state["global_step"] == 18 and state["epoch"] == 2 and state["total_steps"] == 18
    # the run ended where the 2-epoch schedule ends (fast_forward's steps are checked in test_optim)
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(lr_after(schedule, 18, 18))
    assert state["scheduler"]["last_epoch"] == 18


@pytest.fixture(scope="module")
def two_epochs_tiny(tiny_data, tmp_path_factory):
    """The checkpoint at the end of the first of 2 epochs of TINY (9 optimizer steps an epoch, sgd, onecycle)."""
    out = tmp_path_factory.mktemp("two_epochs")
    proc = run_dlojz(*TINY, "--data-root", tiny_data, "--output-dir", out, "-e", "2")
    assert proc.returncode == 0, show(proc)
    return out / "ckpt_e0001_s000000009.pt"


@pytest.mark.parametrize(
    "changed, steps_per_epoch, said",
    [
        (["-b", "4"], 18, "is rebuilt for 36 optimizer steps and continues from step 18"),
        (["--grad-acc", "2"], 5, "is rebuilt for 10 optimizer steps and continues from step 5"),
        (  # the same global batch, hence the same steps: the schedule is not even rebuilt
            ["-b", "4", "--keep-global-batch"],
            9,
            "--keep-global-batch: 1 rank x 4 images x --grad-acc 2 keep the checkpoint's global batch of 8 images "
            "(1 rank x 8 x 1): the same steps per epoch and learning rates",
        ),
        (["-b", "3", "--keep-global-batch"], 24, "1 rank x 3 images do not divide the checkpoint's global batch of 8"),
        (["--optimizer", "adamw"], 9, "--optimizer adamw: the checkpoint's sgd state is dropped; it starts afresh"),
        (  # other parameter groups: each parameter's momentum carried into its new group
            ["--layer-decay", "0.8"],
            9,
            "layer decay 0.8: ",  # (and the state's line, below)
        ),
        (["--no-wd-norm-bias"], 9, "goes on in this run's 2 groups, each parameter's momenta kept"),
        (
            ["--lr-scheduler", "cosine"],
            9,
            "schedule (cosine) is rebuilt for 18 optimizer steps and continues from step 9",
        ),
    ],
)
def test_resume_with_changed_settings_goes_on_from_the_same_image_on_a_rebuilt_schedule(
    changed, steps_per_epoch, said, two_epochs_tiny, tiny_data, tmp_path, run_inline
):
    out = tmp_path / "again"
    proc = run_inline(
        *TINY, "--data-root", tiny_data, "--output-dir", out, "-e", "2", "--resume", two_epochs_tiny, *changed
    )
    assert proc.returncode == 0, proc.stderr
    assert said in proc.stdout
    if "--layer-decay" in changed:
        assert "the checkpoint's optimizer state (1 parameter groups) goes on in this run's " in proc.stdout
    state = latest_state(out)  # the second epoch, whole, on this setting's schedule, which ends with it
    assert state["global_step"] == state["total_steps"] == state["scheduler"]["last_epoch"] == 2 * steps_per_epoch
    assert state["epoch"] == 2


def test_same_length_resume_loads_the_schedule_as_saved(tiny_data, tmp_path, run_inline):
    out = tmp_path / "run"
    proc = run_inline(*TINY, "--data-root", tiny_data, "--output-dir", out, "-e", "2", "--test-nsteps", "1")
    assert proc.returncode == 0, proc.stderr
    first = sorted(out.glob("ckpt_*.pt"))[0]
    again = run_inline(
        *TINY, "--data-root", tiny_data, "--output-dir", tmp_path / "again", "-e", "2", "--resume", first
    )
    assert again.returncode == 0, again.stderr
    assert "rebuilt" not in again.stdout


def test_float16_resumes_a_checkpoint_written_with_the_scaler_off(tiny_data, tmp_path, run_inline):
    out = tmp_path / "run"
    # A tiny ViT, not a ResNet: on the CPU a float16 convolution's backward takes seconds a step (2 s for resnet18
    # at 16 px, 0.03 s for the ViT); the scaler's state is the same whatever the model.
    common = [*TINY, "--arch", "timm:test_vit", "--data-root", tiny_data, "--output-dir", out]
    assert run_inline(*common, "-e", "1", "--no-amp").returncode == 0
    assert latest_state(out)["scaler"] == {}  # GradScaler off (float32, or bfloat16): nothing saved
    proc = run_inline(*common, "-e", "2", "--amp", "--amp-dtype", "float16", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    state = latest_state(out)
    assert state["global_step"] == 18 and state["scaler"]["scale"] > 0  # float16's scaler started afresh


def test_resume_auto_with_nothing_to_resume(tiny_data, tmp_path, run_inline):
    out = tmp_path / "empty"
    proc = run_inline(*TINY, "--data-root", tiny_data, "--output-dir", out, "--resume", "auto", "-e", "1")
    assert proc.returncode == 0, proc.stderr
    assert f"--resume auto: no checkpoint in {out}, starting from scratch" in proc.stdout
    assert latest_state(out)["global_step"] == 9
    # its only checkpoint damaged (a byte appended): refused in one line naming it, never written over by a fresh run
    (saved,) = out.glob("ckpt_*.pt")
    saved.write_bytes(damaged := saved.read_bytes() + b"\0")
    proc = run_inline(*TINY, "--data-root", tiny_data, "--output-dir", out, "--resume", "auto", "-e", "2")
    assert proc.returncode == 2, proc.stderr
    refusal = proc.stderr.strip().splitlines()[-1]
    assert f"error: --resume auto: every checkpoint in {out} fails its check ({saved.name};" in refusal, proc.stderr
    assert "move them aside" in refusal and saved.read_bytes() == damaged and list(out.glob("ckpt_*.pt")) == [saved]
    proc = run_inline(
        *TINY, "--data-root", tiny_data, "--output-dir", tmp_path / "none", "--resume", "auto", "--eval-only"
    )
    assert proc.returncode == 2 and "--resume auto: no usable checkpoint" in proc.stderr


def test_keep_checkpoints_prunes_the_oldest(tiny_data, tmp_path, run_inline):
    out = tmp_path / "run"
    proc = run_inline(
        *TINY, "--data-root", tiny_data, "--output-dir", out, "-e", "4", "--keep-checkpoints", "2",
        "--best-metric", "none",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("checkpoint being written:") == 4
    names = sorted(p.name for p in out.glob("ckpt_*.pt"))
    assert names == ["ckpt_e0003_s000000027.pt", "ckpt_e0004_s000000036.pt"]
    assert (out / "latest").read_text().strip() == names[-1]
    assert not (out / "best").exists()  # --best-metric none: no best kept


def test_pruning_never_deletes_the_best_checkpoint_and_best_loads(tmp_path):
    ckpt = dlojz_lib.checkpoint
    for epoch in range(1, 5):
        ckpt.save({"epoch": epoch}, tmp_path, ckpt.checkpoint_name(epoch, epoch * 10), keep=1, best=epoch == 2)
    names = sorted(p.name for p in tmp_path.glob("ckpt_*.pt"))
    assert names == ["ckpt_e0002_s000000020.pt", "ckpt_e0004_s000000040.pt"]
    assert (tmp_path / "best").read_text().strip() == names[0]
    assert ckpt.load(tmp_path / "best")["epoch"] == 2  # --resume DIR/best
    ckpt.save({"epoch": 5}, tmp_path, ckpt.checkpoint_name(5, 50), keep=1, best=True)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_e0005_s000000050.pt"]


@pytest.mark.parametrize("metric", ["top1", "macro_f1"])
def test_best_metric_names_the_checkpoint_of_the_best_validation_through_a_resume(
    tiny_data, tmp_path, run_inline, metric
):
    import json

    out, history = tmp_path / "run", tmp_path / "history.jsonl"
    common = [*TINY, "--data-root", tiny_data, "--output-dir", out, "--keep-checkpoints", "1", "--best-metric", metric]
    common += ["--val-history", history, "--metrics-json", tmp_path / "metrics.json", "--lr", "1.0"]
    assert run_inline(*common, "-e", "2").returncode == 0
    proc = run_inline(
        *common, "-e", "3", "--resume", "auto"
    )  # (here the first top-1 stays the best: kept through the resume and the pruning)
    assert proc.returncode == 0, proc.stderr
    key = {"top1": "val_accuracy", "macro_f1": "val_macro_f1"}[metric]
    values = [json.loads(line)[key] for line in history.read_text().splitlines()]
    best_epoch = values.index(max(values)) + 1  # the first of equals
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["best_metric"], metrics["best_value"], metrics["best_epoch"]) == (metric, max(values), best_epoch)
    best = (out / "best").read_text().strip()
    assert best.startswith(f"ckpt_e{best_epoch:04d}_") and (out / best).is_file()
    assert dlojz_lib.checkpoint.load(out / "best")["best_value"] == max(values)
    if metric == "top1":  # resumed with another metric: said, not silent (its earlier checkpoints are not compared)
        again = [*TINY, "--data-root", tiny_data, "--output-dir", out, "--keep-checkpoints", "1", "--lr", "1.0"]
        proc = run_inline(*again, "-e", "4", "--resume", "auto", "--best-metric", "macro_f1")
        assert proc.returncode == 0, proc.stderr
        assert "--best-metric macro_f1: the checkpoint's best was by top1 (epoch " in proc.stdout
        assert "earlier checkpoints not compared" in proc.stdout


def test_a_checkpoint_written_before_the_restructuring_still_resumes(tiny_data, tmp_path, run_inline):
    """tests/fixtures/ckpt_before_restructuring.pt: written by the dlojz.py of one train() function (squeezenet1_1,
    1 epoch of the tiny data, SGD without momentum, constant schedule): its keys must still be read."""
    fixture = ROOT / "tests" / "fixtures" / "ckpt_before_restructuring.pt"
    saved = torch.load(fixture, weights_only=True)
    assert "total_steps" not in saved  # older than the key: its length comes from its args
    common = [
        *SMALL,
        "--arch",
        "squeezenet1_1",
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--mom",
        "0",
        "--lr-scheduler",
        "constant",
        "--no-wandb",
        "--num-workers",
        "0",
        "--resume",
        fixture,
    ]
    proc = run_inline(*common, "--eval-only", "--metrics-json", tmp_path / "eval.json", "--output-dir", tmp_path / "e")
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {fixture} (epoch 2, step 0/9, global step 9)" in proc.stdout
    out = tmp_path / "run"
    proc = run_inline(*common, "-e", "2", "--output-dir", out)
    assert proc.returncode == 0, proc.stderr
    state = latest_state(out)
    assert state["global_step"] == 18 and state["epoch"] == 2
    assert not torch.equal(state["model"]["classifier.1.weight"], saved["model"]["classifier.1.weight"])


def test_sigterm_takes_the_same_path_as_usr1(resume_data, tmp_path):
    out = tmp_path / "run"
    proc = start([*RUN, "--data-root", resume_data, "--output-dir", out], clean_env())
    early = wait_for_line(proc, "Epoch 1/2, Step")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, early + rest
    assert "SIGTERM received: saving a checkpoint" in rest and "continue with --resume auto" in rest
    assert 0 < final_weights(out)["global_step"] < 30


def test_ema_and_wandb_run_are_continued_on_resume(tiny_data, tmp_path):
    out = tmp_path / "run"
    common = [
        *TINY,
        "--data-root",
        tiny_data,
        "--output-dir",
        out,
        "--model-ema",
        "--model-ema-decay",
        "0.9",
        "--wandb",
        "--wandb-mode",
        "offline",
    ]
    proc = run_dlojz(*common, "-e", "1", env=clean_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, show(proc)
    first = latest_state(out)
    assert first["wandb_id"] and int(first["ema"]["n_averaged"]) == 9
    proc = run_dlojz(*common, "-e", "2", "--resume", "auto", env=clean_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, show(proc)
    second = latest_state(out)
    assert second["wandb_id"] == first["wandb_id"]  # the same W&B run goes on
    assert int(second["ema"]["n_averaged"]) == 18  # the average went on from the saved one, not from scratch
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(first["wandb_id"]) for name in runs), runs


# ----------------------------------------------------------------------------- Ctrl-C
def descendants(pid):
    """The processes started by `pid`, and theirs (its DataLoader workers): /proc's parent links."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def ignores_sigint(pid):
    """Whether the process ignores SIGINT (/proc's SigIgn mask: bit 1 is signal 2)."""
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def ctrl_c(proc):
    """What a terminal's Ctrl-C does: SIGINT to every process of the foreground group, the workers too."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("workers_flag", ["1", "0"])
def test_ctrl_c_checkpoints_says_how_to_continue_and_resumes_exactly(resume_data, straight_run, tmp_path, workers_flag):
    run = [*RUN, "--num-workers", workers_flag, "--data-root", resume_data]
    out = tmp_path / "run"
    proc = start([*run, "--output-dir", out], clean_env())
    early = wait_for_line(proc, "Epoch 1/2, Step")
    workers = descendants(proc.pid)
    assert (len(workers) > 0) == (workers_flag == "1") and all(ignores_sigint(pid) for pid in workers), workers
    ctrl_c(proc)
    rest, _ = proc.communicate(timeout=300)
    log = early + rest
    assert proc.returncode == 130, log
    assert "Traceback" not in log and "exited unexpectedly" not in log, log
    assert log.count("dlojz: Ctrl-C: stopping at the next step") == 1, log  # the workers ignore it
    assert "SIGINT received: saving a checkpoint" in log and f"continue with --resume auto --output-dir {out}" in log
    assert 0 < final_weights(out)["global_step"] < 30
    assert not [pid for pid in descendants(proc.pid)]  # no worker left behind
    proc = run_dlojz(*run, "--output-dir", out, "--resume", "auto")
    assert proc.returncode == 0, show(proc)
    a, b = straight_run, final_weights(out)
    assert a["global_step"] == b["global_step"] == 30
    for key, value in a["model"].items():
        assert torch.allclose(value.float(), b["model"][key].float(), rtol=1e-5, atol=1e-6), key


@pytest.mark.multirank
def test_ctrl_c_on_two_ranks_stops_both_with_one_checkpoint(resume_data, tmp_path):
    out = tmp_path / "run"
    rank0, rank1 = start_ranks([*RUN, "--data-root", resume_data, "--output-dir", out])
    early = wait_for_line(rank0, "Epoch 1/2, Step")
    for proc in (rank0, rank1):  # srun and torchrun pass the terminal's Ctrl-C to every rank
        ctrl_c(proc)
    log0 = early + rank0.communicate(timeout=300)[0]
    log1 = rank1.communicate(timeout=300)[0]
    assert rank0.returncode == 130 and rank1.returncode == 130, log0 + log1
    assert "Traceback" not in log0 + log1 and "continue with --resume auto" in log0, log0 + log1
    assert 0 < final_weights(out)["global_step"] < 16


def test_a_second_ctrl_c_stops_at_once():
    """The handler alone, in a process of its own: the first SIGINT asks for a stop, the second ends the process."""
    code = (
        "import os, signal, time, dlojz_lib.dist; stop = dlojz_lib.dist.StopSignal().install(); "
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2); print('first:', stop.name, flush=True); "
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(5); print('still running')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 130 and proc.stdout == "first: SIGINT\n", proc.stdout + proc.stderr
    assert "Ctrl-C again: stopped at once" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_sighup_stops_like_sigterm_and_a_later_sigterm_stops_at_once():
    """SIGHUP (a closed terminal) asks for a stop, as SIGTERM; SIGTERM delivered twice at once (srun and slurmstepd
    both pass scancel's on) still asks for one; a SIGTERM sent again later ends the process (143)."""
    code = (
        "import os, signal, time, dlojz_lib.dist; dlojz_lib.dist.AGAIN_AT_ONCE_S = 0.5; "
        "stop = dlojz_lib.dist.StopSignal().install(); os.kill(os.getpid(), signal.SIGHUP); time.sleep(0.05); "
        "print('first:', stop.name, flush=True); os.kill(os.getpid(), signal.SIGTERM); "
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1); print('twice at once:', stop.name, flush=True); "
        "time.sleep(0.5); os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('still running')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    assert proc.stdout == "first: SIGHUP\ntwice at once: SIGTERM\n", proc.stdout + proc.stderr
    assert "SIGTERM again: stopped at once" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_no_worker_outlives_a_killed_main_process(resume_data, tmp_path):
    proc = start([*RUN, "--num-workers", "2", "--data-root", resume_data, "--output-dir", tmp_path], clean_env())
    wait_for_line(proc, "Epoch 1/2, Step")
    workers = descendants(proc.pid)
    assert workers
    proc.kill()  # SIGKILL, as the OOM killer: no handler runs, no DataLoader shutdown
    proc.wait(timeout=60)
    deadline = time.time() + 3  # torch's own watchdog would take up to 5 s more, if the worker is waiting at all
    while time.time() < deadline and any(Path(f"/proc/{pid}").exists() and not zombie(pid) for pid in workers):
        time.sleep(0.1)
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists() and not zombie(pid)]
    assert not alive, alive


def zombie(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_checkpoint_of_another_model_or_number_of_classes_is_refused_in_one_line(tiny_data, tmp_path, run_inline):
    """Refused in one line, the checkpoint's settings read before the model is built."""
    out = tmp_path / "run"
    assert run_inline(*TINY, "--data-root", tiny_data, "--output-dir", out, "-e", "1").returncode == 0
    checkpoint = out / (out / "latest").read_text().strip()
    other_arch = [*TINY, "--arch", "resnet34", "--data-root", tiny_data, "--output-dir", tmp_path / "a"]
    proc = run_inline(*other_arch, "--resume", checkpoint, "-e", "2")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert (
        f"--resume {checkpoint}: a checkpoint of --arch {ARCH} with 3 classes; this run is --arch resnet34 with "
        "3 classes" in proc.stderr
    )
    assert "model: resnet34" not in proc.stdout  # refused before the build (a minute for a large model)
    more_classes = make_classes(tmp_path / "four", 4)
    proc = run_inline(*TINY, "--data-root", more_classes, "--output-dir", tmp_path / "b", "--resume", checkpoint)
    assert proc.returncode == 2 and f"this run is --arch {ARCH} with 4 classes" in proc.stderr, proc.stderr


def make_classes(root, n_classes):
    from dlojz_lib.data.embedded import make_embedded_dataset

    return make_embedded_dataset(root, n_classes=n_classes, train_per_class=4, val_per_class=2, size=(24, 20))


def test_checkpoint_every_writes_mid_epoch_checkpoints_and_one_resumes_exactly(tiny_data, tmp_path, run_inline):
    common = [*TINY, "--data-root", tiny_data, "-e", "2", "--keep-checkpoints", "0"]
    plain = run_inline(*common, "--output-dir", tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    out = tmp_path / "periodic"
    proc = run_inline(*common, "--output-dir", out, "--checkpoint-every", "1e-9")
    assert proc.returncode == 0, proc.stderr
    assert "(--checkpoint-every 1e-09 min: epoch 2, step 4/9)" in proc.stdout, proc.stdout
    names = sorted(p.name for p in out.glob("ckpt_*.pt"))
    mid_epoch = [n for n in names if torch.load(out / n, weights_only=True)["batch"] != 0]
    assert len(mid_epoch) >= 8, names  # besides the two epochs' ends (batch 0 of the next epoch)
    straight = latest_state(out)
    for key, value in latest_state(tmp_path / "plain")["model"].items():  # the saves do not change training
        assert torch.equal(value, straight["model"][key]), key
    # Resumed from a mid-epoch checkpoint of epoch 2, the run ends with the uninterrupted run's weights.
    middle = out / "ckpt_e0001_s000000013.pt"
    assert torch.load(middle, weights_only=True)["batch"] == 4
    resumed_out = tmp_path / "resumed"
    proc = run_inline(*common, "--output-dir", resumed_out, "--resume", middle)
    assert proc.returncode == 0, proc.stderr
    assert "(epoch 2, step 4/9, global step 13)" in proc.stdout
    resumed = latest_state(resumed_out)
    assert resumed["global_step"] == straight["global_step"] == 18
    for key, value in straight["model"].items():
        assert torch.allclose(value.float(), resumed["model"][key].float(), rtol=1e-5, atol=1e-6), key
    off = run_inline(*common, "--output-dir", tmp_path / "off", "--checkpoint-every", "0")
    assert off.returncode == 0 and len(list((tmp_path / "off").glob("ckpt_*.pt"))) == 2  # the epochs' ends only


def test_a_full_disk_during_a_run_warns_keeps_the_previous_checkpoint_and_trains_on(
    tiny_data, tmp_path, run_inline, monkeypatch
):
    import errno

    real_save, calls = torch.save, []

    def second_save_fails(obj, f):  # the disk fills during the second epoch's checkpoint
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f)

    monkeypatch.setattr(torch, "save", second_save_fails)
    out = tmp_path / "run"
    metrics = tmp_path / "metrics.json"
    proc = run_inline(*TINY, "--data-root", tiny_data, "--output-dir", out, "-e", "3", "--metrics-json", metrics)
    assert proc.returncode == 0, proc.stderr
    lost = out / "ckpt_e0002_s000000018.pt"
    assert (
        f"WARNING: checkpoint {lost} not written (No space left on device); ckpt_e0001_s000000009.pt stays the "
        "latest; training goes on" in proc.stderr
    )
    assert not lost.exists() and not list(out.glob(".*.tmp"))
    assert (out / "latest").read_text().strip() == "ckpt_e0003_s000000027.pt"  # the next one, written
    assert '"epochs": 3' in metrics.read_text()


@pytest.mark.parametrize("before, after", [((2, 4), (1, 4)), ((1, 4), (2, 4)), ((2, 8), (4, 2)), ((3, 4), (2, 6))])
def test_a_resume_on_other_ranks_and_batches_goes_on_at_the_first_unseen_image(before, after):
    """The samplers of a run stopped after 4 batches, then those of its resume on another number of ranks and batch
    size, skipping as restore() says (`state.batch` of the new setting): every image of the epoch is trained once,
    none skipped, none twice (the 4 batches fill whole batches of the new setting)."""
    from dlojz_lib.data.samplers import EpochSampler

    images = list(range(96))
    (ranks, batch), (new_ranks, new_batch) = before, after
    seen = []
    for rank in range(ranks):
        sampler = EpochSampler(images, ranks, rank, seed=7, batch_size=batch)
        sampler.set_epoch(2)
        seen += [i for _, i in sampler][: 4 * batch]
    first_batch = 4 * batch * ranks // (new_batch * new_ranks)  # restore()'s position in the new setting's batches
    rest = []
    for rank in range(new_ranks):
        sampler = EpochSampler(images, new_ranks, rank, seed=7, batch_size=new_batch)
        sampler.set_epoch(2)
        sampler.skip = first_batch * new_batch  # as Loaders.start_epoch sets it
        rest += [i for _, i in sampler]
    assert sorted(seen + rest) == images


def test_keep_global_batch_under_cuda_graphs_compiles_without_them(tmp_path, monkeypatch):
    """A restart on half the ranks with --compile-mode reduce-overhead (or max-autotune): --keep-global-batch's
    --grad-acc 2 would accumulate into gradients that the graphs' next replay overwrites, so the run compiles the
    same mode without graphs, says so, and its final settings pass the rule that refuses graphs with --grad-acc."""
    import dataclasses

    import dlojz_lib.global_batch
    from dlojz_lib.checks import UserError
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flag_checks import check_flags
    from dlojz_lib.settings.flags import get_args_parser

    saved = tmp_path / "ckpt.pt"
    saved.write_bytes(b"")  # read through the stand-in below: the checkpoint of a run on 2 ranks x 8 images
    monkeypatch.setattr(dlojz_lib.global_batch.ckpt, "load", lambda path: {"args": {"batch_size": 8}, "world_size": 2})
    argv = ["--device", "cpu", "-b", "8", "--resume", str(saved), "--keep-global-batch", "--output-dir", tmp_path]
    args = get_args_parser().parse_args(list(map(str, argv)))
    for mode, graph_free in (("reduce-overhead", "default"), ("max-autotune", "max-autotune-no-cudagraphs")):
        cfg = dataclasses.replace(resolve_config(args), compile=True, compile_mode=mode)  # (a GPU's settings)
        lines = []
        final = dlojz_lib.global_batch.keep_global_batch(cfg, 1, lines.append)
        assert (final.grad_acc, final.compile_mode) == (2, graph_free)
        assert lines[-1] == (
            f"--keep-global-batch: --compile-mode {mode} replays CUDA graphs, which cannot accumulate gradients over "
            f"--grad-acc 2: this run compiles with --compile-mode {graph_free} instead"
        )
        check_flags(dict(vars(args), grad_acc=final.grad_acc, compile_mode=final.compile_mode))
        with pytest.raises(UserError, match="overwrites the gradients --grad-acc 2 accumulates"):
            check_flags(dict(vars(args), grad_acc=final.grad_acc, compile_mode=mode))  # what it was before
    same = dlojz_lib.global_batch.keep_global_batch(dataclasses.replace(cfg, compile_mode=mode), 2, lines.append)
    assert (same.grad_acc, same.compile_mode) == (1, mode)  # the same ranks: the graphs stay


def test_momenta_follow_their_parameters_into_other_groups(tmp_path):
    """The checkpoint of a run with one group, resumed with --no-wd-norm-bias (two groups, norms and biases apart):
    every parameter has the momentum it had, whatever its new index."""
    from types import SimpleNamespace

    import torchvision

    from dlojz_lib.optim.optimizers import build_optimizer, param_groups
    from dlojz_lib.resume import restore_optimizer_state

    torch.manual_seed(0)
    module = torchvision.models.resnet18(num_classes=3)
    before = build_optimizer("sgd", param_groups(module, 5e-5, False), lr=0.1, momentum=0.9, weight_decay=5e-5)
    for param in module.parameters():
        param.grad = torch.randn_like(param)
    before.step()
    momentum = {name: before.state[param]["momentum_buffer"].clone() for name, param in module.named_parameters()}
    saved = {"optimizer": before.state_dict(), "args": {"wd": 5e-5, "no_wd_norm_bias": False, "arch": "resnet18"}}
    after = build_optimizer("sgd", param_groups(module, 5e-5, True), lr=0.1, momentum=0.9, weight_decay=5e-5)
    lines = []
    restore_optimizer_state(after, SimpleNamespace(module=module, num_classes=3), saved, lines.append)
    assert len(after.param_groups) == 2 and "each parameter's momenta kept" in lines[0]
    for name, param in module.named_parameters():
        assert torch.equal(after.state[param]["momentum_buffer"], momentum[name]), name
    assert {group["weight_decay"] for group in after.param_groups} == {0.0, 5e-5}  # this run's groups


def test_a_peer_lost_during_start_up_is_one_line_too(tmp_path, monkeypatch, capsys):
    """A rank lost before training starts (in the data scan, the model's build): the survivor's line says so, as it
    names the step of a rank lost in training (cli reports it from the process group's start, not a traceback)."""
    from types import SimpleNamespace

    import dlojz_lib.checkpoint
    import dlojz_lib.dist
    from dlojz_lib.dist import Distribution, report_lost_peer

    monkeypatch.setattr(dlojz_lib.dist, "lost_ranks", lambda ranks: [1])
    ranks = Distribution(2, 0, 0, torch.device("cpu"), ("node0", "node1"))
    assert report_lost_peer(ranks, tmp_path, None) == 4
    err = capsys.readouterr().err
    assert err.startswith(
        "dlojz: error: rank 1 (node1) stopped answering during start-up, before the first step (killed, out of memory"
    )
    assert "no checkpoint yet: if that rank's log ends with an error, mend what it names; then start the run again" in (
        err
    )  # not "continue with --resume auto": nothing to continue, and a refused setting repeats at every start
    (tmp_path / "ckpt_e0000_s000000007.pt").write_bytes(b"x")
    monkeypatch.setattr(dlojz_lib.checkpoint, "newest_checkpoint", lambda folder: tmp_path / "ckpt_e0000_s000000007.pt")
    report_lost_peer(ranks, tmp_path, SimpleNamespace(global_step=7))
    err = capsys.readouterr().err
    assert "rank 1 (node1) stopped answering at step 7 (killed" in err
    assert (
        f"last checkpoint: {tmp_path}/ckpt_e0000_s000000007.pt; continue with --resume auto --output-dir {tmp_path}"
        in err
    )


def test_a_rank_s_error_without_a_message_says_where_it_was_raised(capsys):
    """A failure whose exception has no message (a pipeline stage's RuntimeError re-raised empty) still gets a line
    that says something: the file, line and function it was raised in."""
    from dlojz_lib.dist import report_crash

    def stage_forward():
        raise RuntimeError()

    try:
        stage_forward()
    except RuntimeError as err:
        assert report_crash(err, 1) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dlojz: rank 1 failed: RuntimeError: (no message) at ") and "in stage_forward" in last, last


def test_a_rank_alive_in_its_first_step_past_the_dist_timeout_is_not_called_lost(tmp_path, monkeypatch, capsys):
    """A rank whose heartbeat still moves but has not marked its first step (compiling it, under --compile, past
    --dist-timeout) is named alive, the line says to raise --dist-timeout, and the status is 2 (a setting: dlojz_srun
    restarts on status 4, leaving a node out); a rank whose heartbeat stopped is lost, as before. The watchdog reads
    a heartbeat twice from the job's store; --compile below --dist-timeout's default says so at start-up."""
    from types import SimpleNamespace

    import dlojz_lib.dist
    from dlojz_lib.dist import Distribution, report_lost_peer
    from dlojz_lib.observers.watchdog import Watchdog

    monkeypatch.setattr(dlojz_lib.dist, "lost_ranks", lambda ranks: [1])
    ranks = Distribution(2, 0, 0, torch.device("cpu"), ("node0", "node1"))
    beats = iter([{1: dict(beat=3, progress=0)}, {1: dict(beat=4, progress=0)}])
    watchdog = Watchdog(ranks, 8.0, tmp_path)
    watchdog._store, watchdog._read = object(), lambda: next(beats)
    assert watchdog.beating_before_first_step([1], wait_s=0) == [1]
    starting = SimpleNamespace(beating_before_first_step=lambda lost: lost)
    assert report_lost_peer(ranks, tmp_path, None, starting) == 2
    err = capsys.readouterr().err
    assert "rank 1 (node1) is alive but had not reached its first step's collective within --dist-timeout" in err
    assert "give a longer --dist-timeout (1800 with --compile), then start the run again" in err
    gone = SimpleNamespace(beating_before_first_step=lambda lost: [])
    assert report_lost_peer(ranks, tmp_path, None, gone) == 4
    assert "rank 1 (node1) stopped answering during start-up" in capsys.readouterr().err
    stopped = iter([{1: dict(beat=3, progress=0)}, {1: dict(beat=3, progress=0)}])
    watchdog._read = lambda: next(stopped)
    assert watchdog.beating_before_first_step([1], wait_s=0) == []


@pytest.mark.parametrize("dist_timeout, said", [(120, True), (600, False)])
def test_compile_on_several_ranks_below_the_default_dist_timeout_says_so_at_start_up(dist_timeout, said):
    """--compile with several ranks and a --dist-timeout below its default: a line before the layout says the
    first step compiles on each rank while the others wait at most that long."""
    from dlojz_lib.dist import Distribution
    from dlojz_lib.model.build import BuiltModel
    from dlojz_lib.model.zoo import create_model
    from dlojz_lib.parallelism.layout import lay_out
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    class Said(Exception):
        pass

    def log(line):
        raise Said(line)

    argv = ["--device", "cpu", "--compile", "--dist-timeout", str(dist_timeout), "--arch", "resnet18"]
    cfg = resolve_config(get_args_parser().parse_args(argv))
    built = BuiltModel.of(create_model("resnet18", 3, False, 32), "resnet18")
    with pytest.raises(Exception) as raised:  # (no process group here: DDP's wrapper fails after the line)
        lay_out(built, cfg, Distribution(2, 0, 0, torch.device("cpu")), log)
    assert (f"--dist-timeout {dist_timeout} s" in str(raised.value)) == said, raised.value
