"""Ranks and preemption for dlojz: who this process is, and how all ranks stop together.

- `Distribution(world_size, rank, local_rank, device)`: this rank's place in the job (`enabled` with 2+ ranks,
  `is_main` on rank 0, `all_gather(obj)`); dlojz.setup_distributed makes it.
- `StopSignal().install()`: Slurm's preemption warning (`--signal=USR1@T`) or SIGTERM sets `.name`; the training
  loop finishes its step instead of dying.
- `agree_on_stop(stop, first_nonfinite, ranks)`: one small all-reduce at log points, so that a signal received by
  one rank, or a NaN loss on one rank, stops every rank at the same step.
- `stop_and_requeue(...)`: the checkpoint mid-epoch, then `scontrol requeue` under Slurm (resume with --resume auto).
"""
import dataclasses
import os
import signal
import subprocess

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Distribution:
    world_size: int
    rank: int
    local_rank: int
    device: torch.device

    @property
    def enabled(self):
        return self.world_size > 1

    @property
    def is_main(self):
        return self.rank == 0

    def all_gather(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


class StopSignal:
    """Slurm's preemption warning (--signal=USR1@T) or SIGTERM: finish the current step, checkpoint, requeue."""

    def __init__(self):
        self.name = None  # the signal received, if any

    def install(self):
        signal.signal(signal.SIGUSR1, self._receive)
        signal.signal(signal.SIGTERM, self._receive)
        return self

    def _receive(self, signum, _frame):
        self.name = signal.Signals(signum).name


def agree_on_stop(stop, first_nonfinite, ranks):
    """One small all-reduce: the ranks agree on a stop signal or a NaN loss (a signal may reach them at different
    steps; they stop at the same one). Returns (stop requested, first non-finite step or -1)."""
    control = torch.stack([torch.full((), 1.0 if stop.name else 0.0, dtype=torch.float64, device=ranks.device),
                           first_nonfinite])
    if ranks.enabled:
        dist.all_reduce(control, op=dist.ReduceOp.MAX)
    stop_requested, bad_step = control.tolist()
    return bool(stop_requested), bad_step


def stop_and_requeue(cfg, saver, state, reason, n_train_batches, ranks, log):
    """Checkpoint mid-epoch (rank 0), then requeue the Slurm job or say how to continue."""
    log(f"{reason} received: saving a checkpoint at epoch {state.epoch + 1}, step {state.batch}/{n_train_batches}")
    if ranks.is_main and not cfg.test:
        log(f"checkpoint written: {saver.save(dataclasses.asdict(state))}")
    if ranks.enabled:
        dist.barrier()
    job_id = os.environ.get("SLURM_JOB_ID")
    if ranks.is_main and job_id and not cfg.test:
        print(f"requeue: scontrol requeue {job_id} (resume with --resume auto)", flush=True)
        subprocess.run(["scontrol", "requeue", job_id], check=False)
    elif ranks.is_main:
        print(f"stopped cleanly; continue with --resume auto --output-dir {cfg.output_dir}", flush=True)
