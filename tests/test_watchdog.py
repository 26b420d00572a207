"""The hang watchdog (dlojz_lib/watchdog.py): its verdicts from the ranks' published states (unit), and two ranks
whose rank 1 is stopped (silent) or kept alive outside the collective rank 0 waits in (stuck)."""

import signal
import socket
import subprocess
import sys
import time

import pytest

import preloaded
from conftest import ROOT, SMALL, clean_env, start_dlojz
from dlojz_lib.watchdog import HUNG_STATUS, Judge

T, PERIOD = 10.0, 1.0


def state(beat, progress, waiting=None, armed=True, step=7, entered=None):
    return dict(beat=beat, progress=progress, armed=armed, step=step, entered=entered or {}, waiting=waiting)


def run_judge(timeline):
    """Feed a Judge the states of two ranks, one poll per second: timeline(t) -> {rank: state}. The first verdict
    and its time."""
    judge = Judge(2, T, PERIOD, 0.0)
    for t in range(1, 60):
        verdict = judge.update(timeline(t), float(t))
        if verdict is not None:
            return verdict, t
    return None, None


def host(rank):
    return f"node{rank}"


def test_a_rank_whose_heartbeat_stops_is_silent_once_the_others_have_waited_the_timeout():
    stopped_at = 5

    def timeline(t):
        rank1 = state(min(t, stopped_at), min(t, stopped_at))  # stopped: neither beats nor moves on
        return {0: state(t, min(t, stopped_at + 1), waiting="the gradient all-reduce"), 1: rank1}

    verdict, t = run_judge(timeline)
    assert verdict.kind == "silent" and verdict.ranks == [1] and verdict.reporter == 0
    assert stopped_at + T < t <= stopped_at + T + 2
    assert verdict.describe(host).startswith("rank 1 (node1) is silent at step 7 (stopped or dead")


def test_a_rank_alive_outside_the_collective_the_others_wait_in_is_stuck():
    def timeline(t):
        return {0: state(t, min(t, 3), waiting="the log point's all-reduce"), 1: state(t, min(t, 3))}

    verdict, t = run_judge(timeline)
    assert verdict.kind == "stuck" and verdict.ranks == [1] and 3 + T < t <= 3 + T + 2
    assert "rank 1 (node1) is stuck at step 7: alive, but not in the log point's all-reduce" in verdict.describe(host)


def test_ranks_in_the_same_collective_are_all_named_and_in_different_ones_each_with_its_own():
    same, _ = run_judge(lambda t: {r: state(t, min(t, 3), waiting="the epoch's totals") for r in (0, 1)})
    assert same.kind == "collective" and same.ranks == [0, 1]
    assert same.describe(host).startswith("every rank is stuck in the epoch's totals at step 7")
    different, _ = run_judge(
        lambda t: {
            0: state(t, 3, waiting="the stop poll's all-reduce", entered={"the stop poll's all-reduce": 9}),
            1: state(t, 3, waiting="the epoch's totals", entered={"the epoch's totals": 1}),
        }
    )
    assert "rank 0 (node0) in the stop poll's all-reduce #9" in different.describe(host)
    assert "rank 1 (node1) in the epoch's totals #1" in different.describe(host)


def test_no_verdict_while_a_rank_moves_on_or_is_outside_a_loop():
    # rank 0 writes a checkpoint (disarmed) for a long time while rank 1 waits: no verdict
    verdict, _ = run_judge(lambda t: {0: state(t, 3, armed=False), 1: state(t, 3, waiting="the epoch's totals")})
    assert verdict is None
    # a slow but moving rank: no verdict
    verdict, _ = run_judge(lambda t: {0: state(t, t // 8, waiting="x"), 1: state(t, t // 8)})
    assert verdict is None


# ---------------------------------------------------------------- two ranks on this machine
RUN = [*SMALL, "--image-size", "32", "-b", "16", "--epochs", "6", "--no-wandb", "--num-workers", "0"]


@pytest.fixture(scope="module")
def watch_data(tmp_path_factory):
    from dlojz_lib.data.embedded import make_embedded_dataset

    return make_embedded_dataset(
        tmp_path_factory.mktemp("data") / "watch", n_classes=3, train_per_class=80, val_per_class=4, size=(40, 36)
    )


def read_until(proc, fragment, timeout=120):
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if fragment in line:
            return "".join(seen)
    raise AssertionError(f"{fragment!r} never printed:\n{''.join(seen)[-3000:]}")


def end_of(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {timeout} s later")


def the_error(log):
    errors = [line for line in log.splitlines() if line.startswith("dlojz: ")]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    return errors[0]


def test_a_stopped_rank_is_named_silent_and_the_job_ends_within_the_hang_timeout(watch_data, tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--data-root", watch_data, "--output-dir", out, "--hang-timeout", T]
    port = preloaded.free_port()
    env = [preloaded.rank_env(clean_env(OMP_NUM_THREADS=1), rank, 2, port) for rank in (0, 1)]
    rank0, rank1 = (start_dlojz(*args, env=env[rank]) for rank in (0, 1))
    try:
        read_until(rank0, "Epoch 1/6, Step")
        rank1.send_signal(signal.SIGSTOP)  # alive in the process table, but not a single instruction more
        stopped = time.time()
        log0 = end_of(rank0, 120)
        elapsed = time.time() - stopped
    finally:
        rank1.kill()
    assert rank0.returncode == HUNG_STATUS, log0[-3000:]
    error = the_error(log0)
    assert error.startswith(f"dlojz: error: rank 1 ({socket.gethostname()}) is silent at step "), error
    assert "(--hang-timeout)" in error and f"--resume auto --output-dir {out}" in error, error
    assert T < elapsed < T + 8, f"rank 0 ended {elapsed:.1f} s after rank 1 stopped"  # not --dist-timeout's 600


def test_a_rank_alive_outside_the_others_collective_is_named_stuck_and_every_rank_ends(watch_data, tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--data-root", watch_data, "--output-dir", out, "--hang-timeout", T]
    port = preloaded.free_port()
    env = [preloaded.rank_env(clean_env(OMP_NUM_THREADS=1), rank, 2, port) for rank in (0, 1)]
    rank0 = start_dlojz(*args, env=env[0])
    rank1 = subprocess.Popen(  # its second log point: a Python loop instead of the all-reduce
        [sys.executable, str(ROOT / "tests" / "stuck_rank.py"), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env[1],
        cwd=ROOT,
    )
    try:
        log0 = end_of(rank0, 180)
        log1 = end_of(rank1, 30)
    finally:
        rank1.kill()
    assert rank0.returncode == HUNG_STATUS and rank1.returncode == HUNG_STATUS, log0[-3000:] + log1[-3000:]
    error = the_error(log0)
    assert error.startswith(f"dlojz: error: rank 1 ({socket.gethostname()}) is stuck at step "), error
    assert "alive, but not in the log point's all-reduce that the others wait in" in error, error
    assert "dlojz: " not in log1, log1[-3000:]  # one line for the job, from rank 0
