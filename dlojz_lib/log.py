"""What a dlojz run says: console lines, W&B, the metrics JSON and the final report (the writers; what a run
records with them, section by section: dlojz_lib/run_record.py).

- `Console(is_main)`: rank 0 prints, the other ranks stay silent. In an interactive terminal (not under Slurm) the
  progress lines of an epoch rewrite one live line, ended once with the epoch.
- `Progress(...)`: the training loop's bookkeeping between log points: losses and accuracies summed on the device
  (read only at log points), the steady-state throughput (timed between synchronised log points, warm-up left
  out), the console progress line (10 per epoch, as in the course) and W&B's train curves.
- `start_wandb(cfg, ...)`: W&B on rank 0, offline unless asked, resumed under the same run id; a `NoWandb` stands
  in when it is off, so that callers never test for it.
- `finish(...)`: the report at the end of a run: the chronometer's figures gathered from every rank, then on rank 0
  its report (run_record's `chrono_context` gives it the model's FLOPs and the run's shape), memory and throughput lines and the
  metrics JSON (`write_json`, atomic); W&B closed. `write_lr_finder` writes the LR range test's CSV and plot.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from dlojz_lib.observers.chrono import peak_memory_bytes

LOG_EVERY = 10  # optimizer steps between W&B points and between the ranks' checks for a stop signal or a NaN loss
# The files a run writes in its output folder under fixed names, beside its checkpoints
# (config.check_not_a_run_file keeps --metrics-json and --val-history off them).
ARGS_FILE = "args.toml"
CHRONO_TRACE = "chrono_trace.json"
TIMELINE = "timeline.png"
FINDLR_CSV = "findlr.csv"
FINDLR_PNG = "findlr.png"


class Console:
    def __init__(self, is_main):
        self.is_main = is_main
        self.interactive = sys.stdout.isatty() and "SLURM_JOB_ID" not in os.environ
        self._live_line_open = False

    def __call__(self, *args, **kwargs):
        if self.is_main:
            write(*args, **kwargs)

    def progress(self, line, end_of_epoch):
        if not self.is_main:
            return
        if self.interactive:  # one live line, rewritten in place, ended with the epoch
            write("\r" + line, end="\n" if end_of_epoch else "", flush=True)
            self._live_line_open = not end_of_epoch
        else:
            write(line, flush=True)

    def end_live_line(self):
        """The epoch was left before its last line (--test, stop signal): end the live line."""
        if self._live_line_open:
            write()
            self._live_line_open = False


def write(*args, **kwargs):
    """print(), for a run whose output may outlive its reader (a closed terminal, a killed `| tee`): the run goes on
    without its console, and a stop signal still ends in a checkpoint, instead of dying on the first line."""
    try:
        print(*args, **kwargs)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered, and every later line, goes nowhere
        os.close(devnull)


class NoWandb:
    id = None

    def log(self, values, step):
        pass

    def finish(self):
        pass


class TensorBoardRun:
    """--tensorboard: the scalars W&B gets, as TensorBoard event files in `folder` (torch's SummaryWriter), on rank
    0. A resumed run appends to the same folder from its checkpoint's step (`purge_step`: the points a stopped run
    wrote after its last checkpoint are dropped, as they are trained again)."""

    id = None

    def __init__(self, folder, step):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=step + 1 if step else None)  # (the step's own points stay)

    def log(self, values, step):
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, step)

    def finish(self):
        self.writer.close()


class Loggers:
    """W&B and TensorBoard together, behind W&B's interface (`log(values, step)`, `finish()`, `id`: W&B's)."""

    def __init__(self, *runs):
        self.runs = runs
        self.id = runs[0].id

    def log(self, values, step):
        for run in self.runs:
            run.log(values, step)

    def finish(self):
        for run in self.runs:
            run.finish()


def tensorboard_folder(tensorboard, output_dir):
    """--tensorboard's folder: the one given, or the run's output folder's tensorboard/."""
    return Path(tensorboard) if tensorboard else Path(output_dir) / "tensorboard"


def start_wandb(cfg, config, run_name, wandb_id):
    """W&B run on rank 0 (offline by default: never needs the network), or a NoWandb."""
    if not cfg.wandb or cfg.test or cfg.eval_only or cfg.findlr or cfg.wandb_mode == "disabled":
        return NoWandb()
    import wandb  # imported here: slow to import, and never needed in --test

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=cfg.wandb_project,
        name=run_name,
        dir=cfg.output_dir,
        mode=cfg.wandb_mode,
        config=config,
        group=cfg.wandb_group,
        id=wandb_id,
        resume="allow" if wandb_id else None,
    )


class Progress:
    """Running statistics, throughput and progress lines of the training loop (see the module docstring)."""

    def __init__(self, console, wandb_run, device, epochs, n_batches, grad_acc, images_per_step):
        self.console, self.wandb_run, self.device = console, wandb_run, device
        self.epochs, self.n_batches, self.images_per_step = epochs, n_batches, images_per_step
        # 10 console lines per epoch, as in the course, at optimizer-step boundaries.
        self.line_every = math.ceil(math.ceil(n_batches / 10) / grad_acc) * grad_acc
        self.warmup_micro_steps = LOG_EVERY * grad_acc  # cuDNN autotuning, allocator, workers starting: not counted
        self.micro_steps = 0  # of this run (not counting the steps before a resume)
        self.timed_micro_steps, self.timed_seconds, self.timed_wait_s, self._last_mark = 0, 0.0, 0.0, None
        self.run_start = time.perf_counter()
        self._last_line = (0, self.run_start, 0.0)  # micro-steps, time and data wait at the previous console line
        self.running = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images since last line

    def first_batch(self, images):
        """The run's first batch: its shape and dtype, said once."""
        if self.micro_steps == 0:
            self.console(f"image batch shape: {tuple(images.shape)}, dtype {images.dtype}")

    def micro_step_done(self, stats=None):
        """A micro-batch trained; `stats` (an optimizer step's [loss sum, correct, images], on the device) added to
        the running totals of the next log point."""
        self.micro_steps += 1
        if stats is not None:
            self.running += stats

    def is_console_line(self, batch_index):
        return (batch_index + 1) % self.line_every == 0 or batch_index == self.n_batches - 1

    def mark(self, data_wait_s):
        """At a synchronised point: time the micro-steps since the previous mark, once past the warm-up, and the
        host's wait for batches in them (`data_wait_s`: the run's total so far)."""
        now = time.perf_counter()
        if self._last_mark is not None and self._last_mark[0] >= self.warmup_micro_steps:
            self.timed_micro_steps += self.micro_steps - self._last_mark[0]
            self.timed_seconds += now - self._last_mark[1]
            self.timed_wait_s += data_wait_s - self._last_mark[2]
        self._last_mark = (self.micro_steps, now, data_wait_s)

    def new_epoch(self, data_wait_s):
        """The epoch change (validation, new workers) is not a training step: neither the throughput nor the next
        line's share of time spent waiting for data counts it (`data_wait_s`: the run's total so far)."""
        self._last_mark = None
        self._last_line = (self.micro_steps, time.perf_counter(), data_wait_s)

    def images_per_second(self):
        return self.timed_micro_steps * self.images_per_step / self.timed_seconds if self.timed_seconds else None

    def data_wait_ms(self):
        """Steady state: the host's mean wait for a batch per micro-step, in ms (as images_per_second is timed)."""
        return 1e3 * self.timed_wait_s / self.timed_micro_steps if self.timed_micro_steps else None

    def log_train(self, step, loss, lr):
        loss_sum, correct, count = self.running.tolist()
        values = {"train loss": loss.item(), "train accuracy": correct / max(count, 1), "learning rate": lr}
        if (rate := self.images_per_second()) is not None:  # steady state only: after the warm-up's steps
            values.update({"images per second": rate, "data wait ms per step": self.data_wait_ms()})
        self.wandb_run.log(values, step=step)

    def console_line(self, epoch, batch_index, lr, data_wait_s):
        """The progress line: loss and accuracy since the previous line, the learning rate, the host's wait for
        batches per step since the previous line (and its share of the time), the steady-state throughput."""
        loss_sum, correct, count = self.running.tolist()
        rate = self.images_per_second()
        now = time.perf_counter()
        steps, then, waited = self.micro_steps - self._last_line[0], self._last_line[1], self._last_line[2]
        wait = data_wait_s - waited
        line = (
            f"Epoch {epoch + 1}/{self.epochs}, Step {batch_index + 1}/{self.n_batches}, "
            f"Time: {now - self.run_start:.3f}, Loss: {loss_sum / max(count, 1):.4f}, "
            f"Acc: {correct / max(count, 1):.4f}, LR: {lr:.4g}, "
            f"Data wait: {1e3 * wait / max(steps, 1):.1f} ms/step ({100 * wait / max(now - then, 1e-9):.0f} %)"
            + (f", {rate:.1f} images/s" if rate else ", warming up")
        )  # no rate until past the warm-up
        self._last_line = (self.micro_steps, now, data_wait_s)
        self.console.progress(line, end_of_epoch=batch_index == self.n_batches - 1)
        self.running.zero_()


def write_lr_finder(lr_finder, output_dir) -> dict:
    output_dir.mkdir(parents=True, exist_ok=True)
    lr_finder.write_csv(output_dir / FINDLR_CSV)
    lr_finder.plot(output_dir / FINDLR_PNG)
    suggested, rule = lr_finder.suggestion()
    print(
        f">>> LR finder: {len(lr_finder.lrs)} steps from {lr_finder.lrs[0]:.2e} to {lr_finder.lrs[-1]:.2e}; "
        f"suggested --lr {suggested:.3g} ({rule})"
    )
    print(f">>> LR finder: {output_dir / 'findlr.csv'}, {output_dir / 'findlr.png'}")
    return dict(findlr_suggested_lr=suggested, findlr_csv=str(output_dir / FINDLR_CSV))


def finish(cfg, metrics, chrono, ranks, wandb_run=None, ctx=None, n_batches=None, teardown=False) -> dict:
    """Report on rank 0 (chronometer, memory, metrics JSON), close W&B. Every rank calls it: the chronometer's
    figures are gathered from all of them. `teardown`: also stop W&B's service process now, not at the
    interpreter's exit (a requeue follows, and Slurm ends the job's processes as it requeues it)."""
    chrono.gather(ranks.all_gather if ranks.enabled else None)
    metrics["max_memory_bytes"] = peak_memory_bytes(ranks.device)
    if ranks.is_main:
        print_report(cfg, metrics, chrono, ctx, n_batches)
    if wandb_run is not None:
        summary = {f"chrono/{name}": value for name, value in (metrics.get("chrono") or {}).items()}
        if summary:  # --test: the chronometer's figures, once, at the run's last step
            wandb_run.log(summary, step=metrics.get("steps") or 0)
        wandb_run.finish()
    if teardown and "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    return metrics


def print_report(cfg, metrics, chrono, ctx, n_batches):
    """Rank 0's closing lines: the chronometer (in --test), memory, throughput; then the metrics JSON."""
    if ctx is not None and chrono.enabled:
        output_dir = Path(cfg.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        trace = output_dir / CHRONO_TRACE
        ctx["trace_path"] = str(trace)
        chrono.write_trace(trace, ctx=ctx)
        chrono.display(ctx)
        metrics["chrono"] = chrono.summary(ctx)
        try:
            from dlojz_lib.observers.chrono_report import plot_trace

            plot_trace(trace, output_dir / TIMELINE)
            print(f">>> Timeline plot: {output_dir / TIMELINE}")
        except Exception as err:  # a plot is a bonus: never lose the run for it
            print(f"WARNING: timeline plot not written: {err}")
    if metrics.get("activation_bytes_per_image"):
        kept, plain = metrics["activation_bytes_per_image"], metrics["activation_bytes_per_image_without_checkpointing"]
        batch = cfg.batch_size
        print(
            f">>> --grad-checkpointing: activations kept for the backward {kept * batch / 2**30:.3f} GiB per batch of "
            f"{batch} instead of {plain * batch / 2**30:.3f} GiB (saves {(plain - kept) * batch / 2**30:.3f} GiB; "
            f"float32 estimate from one image)"
        )
    if n_batches is not None:
        print(f">>> Number of batch per epoch: {n_batches}")
    if cfg.torch_device.startswith("cuda"):
        print(f">>> Max Memory Allocated: {metrics['max_memory_bytes']:,} bytes")
    else:
        print(f">>> Peak RSS (CPU): {metrics['max_memory_bytes']:,} bytes")
    if metrics.get("parameter_bytes_per_rank") is not None:
        print(memory_line(metrics))
    if metrics.get("images_per_second"):
        print(f">>> Throughput (steady state, all ranks): {metrics['images_per_second']:.1f} images/s")
    if cfg.metrics_json:
        write_json(cfg.metrics_json, metrics)


def memory_line(metrics):
    """What each rank holds of the model's state (DDP: everything; FSDP: a 1/N shard, HSDP: a 1/N shard of one of R
    copies; TP x FSDP: its blocks' 1/tp, sharded over the data replicas), and each rank's peak."""
    mib = 2**20
    state = (
        metrics["parameter_bytes_per_rank"],
        metrics["gradient_bytes_per_rank"],
        metrics["optimizer_bytes_per_rank"],
    )
    peaks = metrics["peak_memory_bytes_per_rank"]
    ranks = f"{len(peaks)} rank{'s' if len(peaks) > 1 else ''}"
    tp, pp = metrics.get("tensor_parallel_size", 1), metrics.get("pipeline_size", 1)
    replicas = metrics.get("fsdp_replicas", 1)
    data = len(peaks) // (pp * tp)  # the data replicas FSDP shards over, in `replicas` groups
    shards = sharded_said(data, replicas)
    split = f" x TP {tp}" if tp > 1 else ""
    fsdp = f"FSDP {data}" if replicas == 1 else f"HSDP {replicas} x FSDP {data // replicas}"
    how = {
        "pp": f"PP {pp}{split} x {fsdp}: a stage each"
        + (f", its blocks split over groups of {tp}" if tp > 1 else "")
        + f", {shards}",
        "fsdp": f"FSDP, {shards}" if replicas == 1 else f"{fsdp}, {shards}",
        "ddp": f"DDP, a full copy on each of {ranks}",
        "none": "one process",
        "tp": f"TP {tp} x {fsdp}: blocks split over groups of {tp}, {shards}",
    }[metrics["parallel"]]
    return (
        f">>> Model state per rank ({how}): parameters {state[0] / mib:,.1f} MiB, gradients {state[1] / mib:,.1f} "
        f"MiB, optimizer state {state[2] / mib:,.1f} MiB, total {sum(state) / mib:,.1f} MiB; peak memory per rank: "
        + ", ".join(f"{peak / mib:,.0f}" for peak in peaks)
        + " MiB"
    )


def sharded_said(data, replicas):
    """How FSDP holds a model copy's part on `data` data replicas in `replicas` HSDP groups, in words."""
    shards = data // replicas
    if shards == 1:
        return "not sharded (one data replica)" if data == 1 else f"not sharded (HSDP: {replicas} whole copies)"
    said = f"sharded over {shards} ranks"
    return said if replicas == 1 else f"{said} in each of {replicas} replicas (HSDP)"


def warn_unwritten(path, err):
    """A run's side file (metrics JSON, validation history) that could not be written: one warning, never the end
    of the run, whose checkpoints matter more."""
    print(f"WARNING: {path} not written ({err.strerror or err}); the run goes on", file=sys.stderr, flush=True)


def append_json_line(path, obj):
    """One line added to a JSON-lines file: the file is written again whole under a temporary name and renamed, so
    a full disk leaves it as it was (a reader following it by offset sees the same lines, then the new one); a
    failed write is one warning."""
    try:
        before = Path(path).read_text() if Path(path).is_file() else ""
        write_text(path, before + json.dumps(obj, default=float) + "\n")
    except OSError as err:
        warn_unwritten(path, err)


def write_text(path, text):
    """`path` holds `text` whole or keeps what it held: written to a temporary name, then renamed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path, obj):
    """The metrics JSON, whole or as it was; a failed write is one warning."""
    try:
        write_text(path, json.dumps(obj, indent=2, default=float))
    except OSError as err:
        warn_unwritten(path, err)
