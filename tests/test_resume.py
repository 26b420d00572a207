"""Preemption without Slurm: a signal mid-run saves a checkpoint and exits 0; `--resume auto` then ends with the
same weights as an uninterrupted run. With several ranks, a signal reaching one rank stops all of them at the same
step, and a rank that dies ends the others in bounded time."""
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, SMALL, clean_env, run_dlojz, show

# 240 train images, batch 16: 15 steps per epoch, long enough for a signal to land mid-run.
RUN = [*SMALL, "--image-size", "48", "-b", "16", "--epochs", "2", "--no-wandb", "--num-workers", "1"]


@pytest.fixture(scope="module")
def resume_data(tmp_path_factory):
    from dlojz_data import make_embedded_dataset
    return make_embedded_dataset(tmp_path_factory.mktemp("data") / "resume", n_classes=3, train_per_class=80,
                                 val_per_class=4, size=(64, 56))


def start(args, env):
    return subprocess.Popen([sys.executable, str(ROOT / "dlojz.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


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


def test_signal_then_resume_gives_the_same_weights(resume_data, tmp_path):
    straight = tmp_path / "straight"
    proc = run_dlojz(*RUN, "--data-root", resume_data, "--output-dir", straight)
    assert proc.returncode == 0, show(proc)

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
    a, b = final_weights(straight), final_weights(interrupted)
    assert a["global_step"] == b["global_step"] == 30 and a["epoch"] == b["epoch"] == 2
    for key, value in a["model"].items():
        assert torch.allclose(value.float(), b["model"][key].float(), rtol=1e-5, atol=1e-6), key
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(args, world_size=2):
    """Two ranks started by hand, as torchrun would (idr_torch reads the torchelastic variables)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = clean_env(TORCHELASTIC_RUN_ID="test", RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world_size,
                        LOCAL_WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=1)
        procs.append(start(args, env))
    return procs


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


def test_a_dead_rank_ends_the_others_in_bounded_time(resume_data, tmp_path):
    args = [*RUN, "--epochs", "50", "--data-root", resume_data, "--output-dir", tmp_path, "--dist-timeout", "60"]
    rank0, rank1 = start_ranks(args)
    wait_for_line(rank0, "Epoch 1/50, Step")
    rank1.kill()  # SIGKILL: no chance to say goodbye
    t0 = time.time()
    try:
        log0 = rank0.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        rank0.kill()
        pytest.fail("rank 0 still running 120 s after rank 1 died")
    assert rank0.returncode not in (0, None)
    assert "dlojz: rank 0 failed" in log0, log0[-2000:]
    print(f"rank 0 ended {time.time() - t0:.1f} s after rank 1 was killed")
