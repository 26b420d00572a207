"""Ranks and preemption for dlojz: who this process is, and how all ranks stop together.

- `Distribution(world_size, rank, local_rank, device)`: this rank's place in the job (`enabled` with 2+ ranks,
  `is_main` on rank 0, `all_gather(obj)`); `setup_distributed(cfg)` makes it, with the process group and seeds.
- `StopSignal().install()`: Slurm's preemption warning (`--signal=USR1@T`), SIGTERM or SIGUSR2 sets `.name`; the
  training loop finishes its step instead of dying. USR1 and TERM end in a requeue; USR2 is a plain stop (a
  checkpoint, no requeue): what a pruned hyper-parameter trial gets, and `scancel --signal=USR2 JOB` for a user.
- `StopPoll(stop_signal, ranks)`: `requested(step)` at every optimizer step and between validation batches, says whether any rank
  has received a stop signal, without waiting for the GPU (a one-number all-reduce on a CPU group, read one call
  later), so that every rank stops at the same step.
- `agree_on_stop(stop, first_nonfinite, ranks, checkpoint_due)`: one small all-reduce at log points (it also
  carries rank 0's "a periodic checkpoint is due"), so that a NaN loss on one
  rank (or a signal) stops every rank at the same step.
- `checkpoint_for_stop(...)` writes the checkpoint mid-epoch; `requeue(...)`, once W&B and the metrics are written,
  asks Slurm to requeue the job (resume with --resume auto).
- `is_lost_peer(err)`, `lost_peer_line(...)`: an error that says another rank is gone (killed, out of memory, its node
  lost), and the one line naming it (the survivors check in through the job's store; the silent ones are lost).
- `first_to_refuse()`: whether this rank is the job's first to refuse its input, the one whose line is said
  (`refusal_claim()`: that question, once the process group has formed); `refused_elsewhere()`: whether a rank has,
  so that the others' broken connections are no lost rank.
- `start_compile_workers()`: torch.compile's worker processes, started deaf to Slurm's signals.
- `keep_freed_host_memory()`: glibc's allocator told to keep freed memory for reuse (training on a CPU);
  `HostMemoryBound`: the free heap given back once the resident memory passes a bound (its fragmentation).
"""

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import dlojz_lib.checkpoint as ckpt
from dlojz_lib.checks import UserError, fail
from dlojz_lib.observers.watchdog import Watchdog, continue_advice
from dlojz_lib.settings.launch import load_idr_torch, model_copy_problem
from dlojz_lib.torch_internals import default_store, flatten_mesh, warm_compile_workers


@dataclasses.dataclass
class Distribution:
    world_size: int
    rank: int
    local_rank: int
    device: torch.device
    hosts: tuple = ()  # every rank's host name, by rank (gathered once at start-up with several ranks)
    # The data dimension: with --tp, the ranks of a tensor-parallel group share one batch, so the samplers, the
    # images a step and the metrics' sums count data replicas, not ranks.
    data_rank: int | None = None  # this rank's replica: rank, or with --tp and --pp rank // (tp x pp)
    data_size: int | None = None  # the replicas: world_size, or with --tp and --pp world_size // (tp x pp)
    data_group: object = None  # the process group of the replicas this rank sums metrics with (None: every rank)
    mesh: object = None  # with --tp or --pp: the DeviceMesh ("data", "pipe", "tensor"), less the dimensions of 1

    def __post_init__(self):
        self.data_rank = self.rank if self.data_rank is None else self.data_rank
        self.data_size = self.world_size if self.data_size is None else self.data_size

    @property
    def enabled(self):
        return self.world_size > 1

    @property
    def is_main(self):
        return self.rank == 0

    def sharding_mesh(self):
        """The mesh FSDP shards over: the data dimension, or with --fsdp-replicate (replicate, shard), HSDP's; None
        without a mesh (FSDP over every rank)."""
        if self.mesh is None:
            return None
        return self.mesh["replicate", "shard"] if "replicate" in self.mesh.mesh_dim_names else self.mesh["data"]

    def all_gather(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP)  # SIGHUP: its terminal closed
AGAIN_AT_ONCE_S = 2.0  # a second SIGTERM or SIGHUP this long after the first: stop now (one sent twice is not)
INTERRUPTED = "SIGINT"  # Ctrl-C: a stop like the others; the run then exits with 130, the shell's convention
NO_REQUEUE = ("SIGUSR2", INTERRUPTED)  # stop and checkpoint, but do not requeue: a person asked for the stop


class StopSignal:
    """Slurm's preemption warning (--signal=USR1@T), SIGTERM or SIGHUP: finish the current step, checkpoint, requeue.
    SIGUSR2 and Ctrl-C (SIGINT): the same without the requeue. A second Ctrl-C stops the process at once (130), and
    so does a second SIGTERM or SIGHUP (128 + its number) sent after the first (srun and slurmstepd may deliver
    one SIGTERM twice at once: that one still checkpoints)."""

    def __init__(self):
        self.name = None  # the signal received, if any
        self._ended_at = None  # when the first SIGTERM or SIGHUP came

    def install(self):
        for signum in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(signum, self._receive)
        return self

    def _receive(self, signum, _frame):
        if signum == signal.SIGINT:
            if self.name == INTERRUPTED:  # the second: now, whatever is under way (the last checkpoint stays)
                os.write(2, b"dlojz: Ctrl-C again: stopped at once\n")
                os._exit(130)  # no clean-up to wait for: the DataLoader workers end with this process
            # os.write, not print: the handler may run in the middle of a print of the main thread
            os.write(2, b"dlojz: Ctrl-C: stopping at the next step with a checkpoint (Ctrl-C again: at once)\n")
        elif signum in (signal.SIGTERM, signal.SIGHUP):
            if self._ended_at is not None and time.monotonic() - self._ended_at >= AGAIN_AT_ONCE_S:
                name = signal.Signals(signum).name
                os.write(2, f"dlojz: {name} again: stopped at once (the last checkpoint stays)\n".encode())
                os._exit(128 + signum)
            self._ended_at = self._ended_at or time.monotonic()
        self.name = signal.Signals(signum).name


class StopPoll:
    """Whether any rank has received a stop signal, asked at every optimizer step and between validation batches.
    With several ranks, each call starts a one-number MAX all-reduce on a CPU (gloo) group and reads the one the
    previous call started: no GPU synchronisation, no wait beyond the step's own gradient all-reduce, and every rank
    gets the same answer at the same call, one call after the signal arrived. Every rank must make the same calls,
    and `settle()` before it leaves a loop."""

    def __init__(self, stop_signal, ranks, timeout=None, watchdog=None):
        self.stop_signal = stop_signal
        self.group = dist.new_group(backend="gloo", timeout=timeout) if ranks.enabled else None
        self.watchdog = watchdog or Watchdog(ranks, 0, None)  # told of each call: the loop moves on
        self._pending = None  # (work, flag) of the all-reduce in flight

    def requested(self, step=None) -> bool:
        """Whether any rank asked to stop, as every rank agrees at this call (see the class); `step`: where the
        loop is, told to the watchdog."""
        self.watchdog.mark(step)
        if self.group is None:
            return self.stop_signal.name is not None
        if self.settle():
            return True  # every rank stops at this call: none starts another
        flag = torch.full((1,), 1.0 if self.stop_signal.name else 0.0)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return False

    # The loop tells the watchdog where it is through these: it reaches one object, the poll it asks anyway.
    def disarm(self, phase=None):
        """Leaving a loop, or before its first mark (compilation, autotuning): not timed; `phase` (a checkpoint
        write, the run's end) is said in a verdict of silence."""
        self.watchdog.disarm(phase)

    def timing(self):
        """Around a micro-batch's forward and loss: this rank's share of a step, for the straggler check."""
        return self.watchdog.timing()

    def collective(self, name, entered=True):
        """The loop waits in collective `name` (when `entered`): a hang there is named by it."""
        return self.watchdog.collective(name, entered)

    def settle(self) -> bool:
        """Wait for the all-reduce in flight, if any: whether it found a signal on some rank."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        with self.watchdog.collective("the stop poll's all-reduce"):
            work.wait()
        return bool(flag.numpy()[0])  # a CPU tensor: nothing to wait for on a GPU


def agree_on_stop(stop, first_nonfinite, ranks, checkpoint_due=False):
    """One small all-reduce: the ranks agree on a stop signal (`stop`, a StopPoll), a NaN loss, or a periodic
    checkpoint that rank 0's clock says is due (a signal may reach them at different steps; they stop, or save, at
    the same one). With stragglers compared, it also carries every rank's forward seconds since the last log point
    (each rank its own slot: the MAX is the gather). Returns (stop requested, first non-finite step or -1,
    checkpoint now, the line naming a straggler or None)."""
    watchdog = stop.watchdog
    control = torch.stack(
        [
            torch.full((), 1.0 if stop.stop_signal.name else 0.0, dtype=torch.float64, device=ranks.device),
            torch.full((), 1.0 if checkpoint_due else 0.0, dtype=torch.float64, device=ranks.device),
            first_nonfinite,
        ]
    )
    if watchdog.compares:
        forward = torch.zeros(ranks.world_size, dtype=torch.float64, device=ranks.device)
        # fill_ takes the seconds as a kernel argument; forward[rank] = secs would copy them from the host and wait
        forward.select(0, ranks.rank).fill_(watchdog.forward_seconds())
        control = torch.cat([control, forward])
    with watchdog.collective("the log point's all-reduce", ranks.enabled):
        if ranks.enabled:
            dist.all_reduce(control, op=dist.ReduceOp.MAX)
        values = control.tolist()  # (a GPU's host waits here)
    stop_requested, checkpoint_now, bad_step = values[:3]
    straggler = watchdog.compare(values[3:]) if watchdog.compares else None
    return bool(stop_requested), bad_step, bool(checkpoint_now), straggler


def checkpoint_for_stop(output_dir, test, saver, state, reason, n_train_batches, ranks, log):
    """Checkpoint where training is (rank 0, or every rank's shards); every rank waits for it."""
    where = (
        f"after epoch {state.epoch + 1}'s training, before its validation"
        if state.batch >= n_train_batches
        else f"at epoch {state.epoch + 1}, step {state.batch}/{n_train_batches}"
    )
    log(f"{reason} received: saving a checkpoint {where}")
    written = True
    if not test:  # rank 0 writes; with --fsdp every rank writes its shards
        path = saver.save(dataclasses.asdict(state))
        saver.wait()  # the job may end right after: the checkpoint is on disk first
        written = not ranks.is_main or (path is not None and path.exists())
        if written and path is not None:
            log(f"checkpoint written: {path}")
    if ranks.enabled:  # every rank waits for rank 0's write, and learns whether it is on disk
        answer = [written]
        dist.broadcast_object_list(answer, src=0)
        written = answer[0]
    if not written:  # no clean stop, and no requeue: the job would only start again from an older checkpoint
        reason_lost = (saver.last_unwritten() or "the write failed") if ranks.is_main else ""
        raise ckpt.CheckpointNotWritten(
            ckpt.not_written_message(output_dir, f"the checkpoint of the stop ({reason})", reason_lost)
        )


# What gloo and NCCL say when a peer process is gone (killed, out of memory, its node lost) or stopped answering.
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused", "timed out")


def is_lost_peer(err) -> bool:
    """Whether `err`, raised with several ranks, says that another rank is gone rather than that this one failed."""
    if isinstance(err, getattr(dist, "DistError", ())):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    message = str(err).lower()
    return isinstance(err, RuntimeError) and "gloo" in message and any(marker in message for marker in _LOST_PEER)


def lost_ranks(ranks, wait_s=3.0):
    """The ranks gone: every survivor writes its rank in the job's key-value store (rank 0's, or the launcher's);
    those that have not within `wait_s` are reported lost. None when the store cannot be reached (its host gone)."""
    try:
        store = default_store()
        store.set(f"dlojz/alive/{ranks.rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(ranks.world_size) if not store.check([f"dlojz/alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:
        return None


def report_crash(err, rank) -> int:
    """A rank that fails must end the job, not leave the others waiting in a collective: its traceback, one line."""
    import traceback

    traceback.print_exc()
    lines = str(err).strip().splitlines()
    if lines:
        said = lines[0]
    else:  # an error without a message (a pipeline stage's, re-raised empty): where it was raised instead
        where = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
        said = f"(no message) at {where[0].filename}:{where[0].lineno}, in {where[0].name}" if where else "(no message)"
    print(f"dlojz: rank {rank} failed: {type(err).__name__}: {said}", file=sys.stderr, flush=True)
    return 1


LOST_PEER_STATUS = 4  # exit status: another rank was lost (killed, out of memory, its node gone)


class PeerLost(Exception):
    """Another rank is gone and the survivors' one line is said: the exit status to end with."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


class LostPeerReport:
    """On the run's ExitStack from the moment the process group forms: an error that says another rank is gone
    becomes the survivors' one line (raised again as PeerLost, with its status); a normal end tells the other ranks'
    watchdogs that this rank's silence from now on is no hang. `state`: the TrainState once training can start,
    for the step the line names."""

    def __init__(self, ranks, output_dir, watchdog):
        self.ranks, self.output_dir, self.watchdog, self.state = ranks, output_dir, watchdog, None

    def __call__(self, exc_type, exc, traceback):
        if exc is None:
            self.watchdog.finish()
        elif self.ranks.world_size > 1 and isinstance(exc, Exception) and is_lost_peer(exc):
            raise PeerLost(report_lost_peer(self.ranks, self.output_dir, self.state, self.watchdog)) from None
        return False


REFUSED_KEY = "dlojz/refused"  # the job's store counts the ranks that refused their input
REFUSED_STATUS = 2  # exit status: bad input (UserError), said in one line


def first_to_refuse() -> bool:
    """Whether this rank is the job's first to refuse its input: the one that says the line (the process group
    has formed; the store's counter is atomic)."""
    return default_store().add(REFUSED_KEY, 1) == 1


def refusal_claim():
    """What tells a refusing rank whether it says the line (checks.say_refusal's `first`): first_to_refuse once the
    process group has formed, None before."""
    return first_to_refuse if dist.is_available() and dist.is_initialized() else None


def refused_elsewhere() -> bool:
    """Whether a rank of the job has refused its input (its line is said); False when the store is unreachable."""
    try:
        return dist.is_initialized() and default_store().check([REFUSED_KEY])
    except Exception:
        return False


def report_lost_peer(ranks, output_dir, state, watchdog=None) -> int:
    """Another rank is gone: one line from the lowest survivor naming it, the step (`state` None: during start-up)
    and the last checkpoint. A rank that ended on a refusal is not lost: its line is said, and the survivors end
    with its status, quietly (a lost rank's status would have Slurm's restart try other nodes). A rank whose
    heartbeat (`watchdog`'s) still moves before its first step is not lost either: it outlasted --dist-timeout
    there (a long compile), and the line says to raise it (exit status 2: a setting, not a node to leave out)."""
    from dlojz_lib.checkpoint import newest_checkpoint

    if refused_elsewhere():
        return REFUSED_STATUS
    step = None if state is None else state.global_step
    line, status = lost_peer_line(ranks, step, output_dir, newest_checkpoint(output_dir), watchdog)
    if line is not None:
        print(f"dlojz: error: {line}", file=sys.stderr, flush=True)
    return status


def lost_peer_line(ranks, step, output_dir, latest, watchdog=None):
    """(the one line a survivor prints, or None on a survivor that leaves it to a lower rank; the exit status)."""
    lost = lost_ranks(ranks)
    if lost is None:  # the store's host is gone: with two ranks, the other one
        lost = [1 - ranks.rank] if ranks.world_size == 2 else []
    if any(r < ranks.rank for r in range(ranks.world_size) if r not in lost):
        return None, LOST_PEER_STATUS
    starting = watchdog.beating_before_first_step(lost) if watchdog is not None else []
    names = ", ".join(f"rank {r} ({ranks.hosts[r]})" if r < len(ranks.hosts) else f"rank {r}" for r in starting or lost)
    if starting:
        return (
            f"{names} is alive but had not reached its first step's collective within --dist-timeout (still starting, "
            "or compiling: torch.compile takes minutes on a large model, the first step on every rank); give a "
            "longer --dist-timeout (1800 with --compile), then "
            + ("start the run again" if latest is None else f"continue with --resume auto --output-dir {output_dir}")
        ), REFUSED_STATUS
    where = "during start-up, before the first step" if step is None else f"at step {step}"
    return (
        f"{names or 'another rank'} stopped answering {where} (killed, out of memory, or its node lost); "
        + continue_advice(latest, output_dir)
    ), LOST_PEER_STATUS


class RequeueFailed(Exception):
    """The run stopped with its checkpoint, but Slurm did not take the job back: one line, exit status 6."""


def requeue(logging, test, ranks, reason=None):
    """Requeue the Slurm job, or say how to continue. Last thing a stopped run does: Slurm ends the job's
    processes as it requeues it, so W&B and the metrics must be written before. --no-requeue, or `reason`
    NO_REQUEUE: only say how to continue."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if ranks.is_main and job_id and not test and logging.requeue and reason not in NO_REQUEUE:
        print(f"requeue: scontrol requeue {job_id} (resume with --resume auto)", flush=True)
        try:
            done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, check=False)
            failure = None
            if done.returncode != 0:
                said = (done.stderr or done.stdout).strip().splitlines()
                failure = said[-1] if said else f"exit {done.returncode}"
        except OSError as err:  # no scontrol here
            failure = err.strerror or str(err)
        if failure is not None:
            raise RequeueFailed(
                f"scontrol requeue {job_id} failed ({failure}): the job is not requeued; its checkpoint is kept: "
                f"submit it again with --resume auto --output-dir {logging.output_dir}"
            )
    elif ranks.is_main and test:
        print(f"stopped by {reason} (--test writes no checkpoint)", flush=True)
    elif ranks.is_main:
        print(f"stopped cleanly; continue with --resume auto --output-dir {logging.output_dir}", flush=True)


def start_compile_workers():
    """Start torch.compile's compile worker processes with the stop signals (SIGUSR1, SIGTERM, SIGUSR2) blocked. Slurm signals every process
    of the job step, and a worker killed by the preemption warning fails the next compilation; a signal blocked
    when a process starts stays blocked in it (and its children) across exec. This process keeps its handlers:
    a signal that arrives meanwhile is delivered when the `with` ends."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        warm_compile_workers()  # nothing to start in a torch without inductor
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep the memory a training step frees, so that the next step reuses it. By default it
    maps each allocation of a few MiB or more (an activation) afresh and unmaps it when freed: every step touched
    ~1 GB of new pages (250,000-375,000 page faults per ResNet-50 step at 128 px, batch 32), about 20 % of the step
    on a CPU. After this call, none once the heap has grown to the step's peak. The memory is then kept by the
    process (its peak, reached at every step anyway). Returns False where the C library is not glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):  # not glibc (musl, macOS): its own policy stays
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))  # C int: 2 GiB


def resident_bytes():
    """This process's resident memory (Linux's /proc/self/statm: one read, no wait for anything), or None."""
    try:
        with open("/proc/self/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def give_back_free_heap():
    """glibc's malloc_trim(0): the heap's free pages returned to the system (False where the C library is not
    glibc)."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (AttributeError, OSError):
        return False


class HostMemoryBound:
    """With freed host memory kept for reuse (keep_freed_host_memory), the heap still grows while its free pieces
    do not fit the next step's allocations: FSDP on gloo grew ViT-B's rank 1 from 2.2 GiB after its first step to
    3.6 GiB by its 19th, its live tensors the same 0.5 GiB throughout. After each step, once the resident memory
    passes `factor` x what it was after the reference step (the first, then the one after each trim: a working
    set that grows for good, compiled graphs or a validation's, moves the reference instead of being trimmed at
    every step), the free heap is given back and the next steps fault in only what they use. `read` and `trim`:
    resident_bytes and give_back_free_heap."""

    def __init__(self, factor=1.25, read=resident_bytes, trim=give_back_free_heap):
        self.factor, self.read, self.trim = factor, read, trim
        self.first = None  # the resident bytes after the reference step
        self.trims = 0

    @classmethod
    def on(cls, device):
        """A bound for a CPU device's run, None on a GPU (its activations are not in host memory)."""
        return cls() if device.type == "cpu" else None

    def step_done(self):
        resident = self.read()
        if resident is None:
            return
        if self.first is None:
            self.first = resident
        elif resident > self.factor * self.first:
            self.trims += self.trim()
            self.first = None  # the next step, its memory faulted in again, is the reference


def setup_distributed(cfg):
    """This rank's device, the process group (NCCL on GPUs, gloo on CPUs) through idr_torch, the seeds, and one
    output folder for all ranks (rank 0's). Returns (Distribution, cfg)."""
    device = torch.device(cfg.torch_device)
    if cfg.deterministic:
        # cuBLAS reduces deterministically only with this workspace, set before its first call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        cfg = dataclasses.replace(
            cfg,
            notes=(
                *cfg.notes,
                "--deterministic: deterministic kernels only (cuDNN autotuning off, cuBLAS's fixed workspace): the "
                "same run gives the same weights on the same machine and software, at the cost of slower kernels "
                "(often 10-30 % on GPUs); an operation without a deterministic kernel stops the run naming itself",
            ),
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = not cfg.deterministic  # autotune convolutions for the fixed input size
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    elif keep_freed_host_memory():  # on a CPU, page faults for each step's activations cost ~20 % of the step
        cfg = dataclasses.replace(cfg, notes=(*cfg.notes, "host memory: freed memory kept for reuse (glibc mallopt)"))
    idr_torch = load_idr_torch()
    ranks = Distribution(idr_torch.world_size, idr_torch.rank, idr_torch.local_rank, device)
    if ranks.enabled:
        # device_id: NCCL connects now (a broken fabric fails at start-up) and knows each rank's GPU.
        idr_torch.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=cfg.dist_timeout),
            device_id=device if device.type == "cuda" else None,
        )
        holder = [cfg.output_dir]
        dist.broadcast_object_list(holder, src=0)
        cfg = dataclasses.replace(cfg, output_dir=holder[0])
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # Slurm's name of the node, else its own
        ranks.hosts = tuple(ranks.all_gather(host))  # to name a lost rank's node
    elif (
        cfg.parallelism.fsdp
    ):  # sharding over one process: a group of one (the same code path, and the GPU tests, on one GPU)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )
    layout = cfg.parallelism
    if layout.tp > 1 or layout.pp > 1 or layout.replicate > 1:
        try:
            model_parallel_mesh(ranks, layout.pp, layout.tp, layout.replicate)
        except UserError as refused:  # (a run's args.toml read back on fewer ranks: the line names the file)
            from dlojz_lib.settings.config import set_in_recipe

            raise UserError(set_in_recipe(str(refused), cfg.config)) from None
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    return ranks, cfg


def model_parallel_mesh(ranks, pp, tp, replicate=1):
    """--pp, --tp and --fsdp-replicate: the ranks as a DeviceMesh (data, pipe, tensor) without the dimensions of size
    1, the tensor dimension innermost (a tensor-parallel group: `tp` consecutive ranks, on a node over its fast links
    when tp divides the GPUs per node), then the pipeline's stages, the data replicas outermost. With `replicate` R
    (HSDP) the data dimension is two, (replicate, shard): R copies of the model, each sharded over consecutive data
    ranks (one node's when R is the number of nodes), flattened into one for the samplers and the metrics."""
    from torch.distributed.device_mesh import init_device_mesh

    if (problem := model_copy_problem(ranks.world_size, pp, tp, replicate)) is not None:
        fail(problem)
    copy = pp * tp  # the ranks that hold one copy of the model
    data = ranks.world_size // copy
    dims = [("replicate", replicate), ("shard", data // replicate)] if replicate > 1 else [("data", data)]
    dims += [(name, size) for name, size in (("pipe", pp), ("tensor", tp)) if size > 1]
    ranks.mesh = init_device_mesh(
        ranks.device.type, tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims)
    )
    data_mesh = flatten_mesh(ranks.mesh, ("replicate", "shard"), "data") if replicate > 1 else ranks.mesh["data"]
    ranks.data_rank, ranks.data_size = data_mesh.get_local_rank(), data
    ranks.data_group = data_mesh.get_group()
