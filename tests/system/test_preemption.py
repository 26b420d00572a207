"""A stop signal (Slurm's SIGUSR1 warning, or SIGTERM alone) is acted on at the next optimizer step or validation
batch, by every rank at the same step, and the run resumes exactly; torch.compile's workers survive it.

Signals are simulated by setting the StopSignal's name, as its handler does, at a chosen step: a real signal's
timing could not be chosen. tests/system/test_slurm.py sends real ones through Slurm."""

import inspect
import math
import os
import subprocess
import sys
import textwrap

import preloaded
import pytest
from conftest import ROOT, SMALL, clean_env, read_json, spawn_ranks
from in_process import synthetic_loop, synthetic_run
from test_flag_effects import BASE

import dlojz
from dlojz_lib.data.loaders import SYNTHETIC_CLASSES, synthetic_loaders


def signal_at_step(loop, step, name="SIGTERM"):
    """The stop signal arrives on this rank right after optimizer step `step`."""
    state, stop, hooks = loop["state"], loop["stop"], loop["hooks"]
    step_done = hooks.optimizer_step_done

    def optimizer_step_done(*args):
        if state.global_step == step:
            stop.stop_signal.name = name
        return step_done(*args)

    hooks.optimizer_step_done = optimizer_step_done


def no_log_points(loop, monkeypatch_or_module):
    """Log points also agree on a stop (every LOG_EVERY steps): moved out of reach, only the per-step poll is left."""
    monkeypatch_or_module.setattr(dlojz, "LOG_EVERY", 10**6)
    loop["progress"].line_every = 10**6


def test_one_process_stops_at_the_step_the_signal_arrives(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    loop = synthetic_loop([*BASE, "--no-amp"], n_batches=8)
    no_log_points(loop, monkeypatch)
    signal_at_step(loop, 3)
    result = dlojz.train_one_epoch(**loop)
    assert (result.stop_reason, loop["state"].global_step, loop["state"].batch) == ("SIGTERM", 3, 3)


def as_rank_of_two(rank, port, out_dir):
    """This spawned process's environment as torchrun gives it to `rank` of 2 on one node."""
    os.environ.update(
        TORCHELASTIC_RUN_ID="test",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.chdir(out_dir)


def two_ranks(rank, world, store, results, port, out_dir):
    as_rank_of_two(rank, port, out_dir)
    import torch.distributed as dist

    cfg, loop = synthetic_run([*BASE, "--no-amp"], n_batches=8)
    try:
        no_log_points(loop, pytest.MonkeyPatch())
        if rank == 1:  # only rank 1 receives it: rank 0 must stop at the same step, or DDP would hang
            signal_at_step(loop, 3)
        result = dlojz.train_one_epoch(**loop)
        ranks = loop["ranks"]
        loaders = synthetic_loaders(cfg, SYNTHETIC_CLASSES, ranks, 8, 6 * 2 * cfg.val_batch_size)
        validation = dlojz.evaluate(loop["model"].module, loaders, loop["training"], ranks, stop=loop["stop"])
        results.put((rank, (result.stop_reason, loop["state"].global_step, validation)))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_every_rank_stops_at_the_same_step_and_validation_batch(tmp_path):
    results = dict(spawn_ranks(two_ranks, 2, tmp_path, preloaded.free_port(), str(tmp_path)))
    # Rank 1's signal after step 3 is read by both ranks at step 4 (one call later, without waiting for a GPU).
    assert results[0][:2] == ("signal on another rank", 4) and results[1][:2] == ("SIGTERM", 4), dict(results)
    # The flag stays set: the validation that follows stops at its second batch on both ranks, not at its end.
    assert results[0][2] == {"stopped_by": "signal on another rank"} and results[1][2] == {"stopped_by": "SIGTERM"}


def lr_sweep_of_two_ranks(rank, world, store, results, port, out_dir):
    """--findlr on 2 ranks, where rank 1's loss alone turns infinite at the sweep's third step (as a float16 batch
    can at a high learning rate while the other rank's stays finite)."""
    as_rank_of_two(rank, port, out_dir)
    import torch.distributed as dist

    loop = synthetic_loop([*BASE, "--no-amp", "--findlr", "--lr", "1", "--dist-timeout", "30"], n_batches=8)
    try:
        no_log_points(loop, pytest.MonkeyPatch())
        training, state = loop["training"], loop["state"]
        criterion = training.criterion
        if rank == 1:
            training.criterion = lambda outputs, targets: (
                criterion(outputs, targets) * (float("inf") if state.global_step == 2 else 1.0)
            )
        dlojz.train_one_epoch(**loop)
        results.put((rank, (state.global_step, training.lr_finder.losses, training.lr_finder.done)))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_the_lr_sweep_ends_at_the_same_step_on_every_rank(tmp_path):
    """Each rank's own loss would end the sweep on that rank alone, and leave the other in DDP's next all-reduce
    until --dist-timeout: the ranks read the loss averaged over all of them, and stop together."""
    results = dict(spawn_ranks(lr_sweep_of_two_ranks, 2, tmp_path, preloaded.free_port(), str(tmp_path)))
    (steps0, losses0, done0), (steps1, losses1, done1) = results[0], results[1]
    assert steps0 == steps1 == 3 and done0 and done1, dict(results)
    assert losses0 == losses1 and len(losses0) == 3 and not math.isfinite(losses0[-1])
    assert all(math.isfinite(loss) for loss in losses0[:2])


def test_a_signal_during_validation_checkpoints_and_the_resumed_run_validates_first(
    tiny_data, tmp_path, run_inline, monkeypatch
):
    common = [
        *SMALL,
        "--num-workers",
        "0",
        "--data-root",
        tiny_data,
        "--epochs",
        "2",
        "-b",
        "8",
        "--no-wandb",
        "--lr",
        "0.01",
    ]
    assert (
        run_inline(*common, "--output-dir", tmp_path / "plain", "--metrics-json", tmp_path / "plain.json").returncode
        == 0
    )
    validate = dlojz.validate
    calls = []

    def signal_during_validation(*args):
        arguments = inspect.signature(validate).bind(*args).arguments
        calls.append(arguments["epoch"])
        if len(calls) == 1:
            arguments["run"].stop.stop_signal.name = "SIGTERM"  # arrives as the first validation starts
        return validate(*args)

    monkeypatch.setattr(dlojz, "validate", signal_during_validation)
    stopped = run_inline(*common, "--output-dir", tmp_path / "run", "--metrics-json", tmp_path / "stopped.json")
    assert stopped.returncode == 0, stopped.stderr
    assert "saving a checkpoint after epoch 1's training, before its validation" in stopped.stdout
    assert read_json(tmp_path / "stopped.json")["stopped_by"] == "SIGTERM"
    assert "Validation Accuracy" not in stopped.stdout  # left at its first batch
    resumed = run_inline(
        *common, "--output-dir", tmp_path / "run", "--resume", "auto", "--metrics-json", tmp_path / "resumed.json"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert calls == [0, 0, 1]  # the resumed run validated epoch 1, then trained and validated epoch 2
    assert "Epoch [1/2], Validation Loss" in resumed.stdout
    plain, final = read_json(tmp_path / "plain.json"), read_json(tmp_path / "resumed.json")
    for key in ("val_loss", "val_accuracy", "val_images", "steps", "epochs"):
        assert final[key] == plain[key], key


COMPILE_WORKERS = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, sys.argv[1])
    import torch._inductor.config
    torch._inductor.config.compile_threads = 2  # a worker pool even on a 1-core machine
    import dlojz_lib.dist
    dlojz_lib.dist.start_compile_workers()
    children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    assert children, "no compile worker started"
    for pid in children:
        os.kill(int(pid), signal.SIGUSR1)  # what Slurm's --signal=USR1@T does to every process of the step
    time.sleep(2)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    print("workers", len(children), "alive", len(alive))
""")


def test_compile_workers_survive_the_preemption_warning():
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_WORKERS, str(ROOT)], capture_output=True, text=True, timeout=300, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers, alive = map(int, proc.stdout.split()[1::2])
    assert workers >= 1 and alive == workers, proc.stdout
