"""Optional observers of dlojz's training loop: the chronometer, torch.profiler and the LR range test.

The loop calls the same few methods whatever is plugged in, so that it reads the same with or without them:

    for images, labels in hooks.loading(batches):     # "data_loading" phase around each next()
        with hooks.phase("forward"): ...               # also "loss", "backward", "optimizer_step", "pipeline"
        hooks.step_done()                             # after each micro-batch
        if hooks.optimizer_step_done(loss, stats): break   # the LR finder has swept its range

- The chronometer (`dlojz_lib.observers.chrono.Chronometer`) times data loading, forward (with the loss) and backward (with the
  optimizer step, as the course counts it); disabled, its toggles cost nothing.
- The profiler (`make_profiler`) labels each phase with `record_function` and is stepped after each micro-batch;
  once its steps are recorded it says how long each kind of collective took per step (`collective_times`): the part
  of a step the chronometer's phases cannot tell apart from compute (FSDP's gathers, tensor parallelism's
  all-reduces inside the forward and the backward).
- The LR finder (`dlojz_lib.optim.schedules.LRFinder`) reads every optimizer step's loss (one host synchronisation per step: the
  range test needs it) and sets the next step's learning rate. Across ranks it reads the loss averaged over all of
  them (one all-reduce per step), so that every rank records the same curve and ends the sweep at the same step.
"""

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

# The chronometer's toggles each phase opens and closes. "backward" closes in step_done (with the optimizer step).
# --pp's "pipeline" (the schedule's step: every micro-batch's forward and backward) is timed as the forward, and the
# optimizer step that follows as the backward.
_CHRONO_OPENS = {
    "data_loading": ("dataload",),
    "forward": ("forward",),
    "backward": ("backward",),
    "pipeline": ("forward",),
    "teacher": ("teacher",),
}
_CHRONO_CLOSES = {
    "data_loading": ("dataload",),
    "forward": ("forward",),
    "pipeline": ("forward", "backward"),
    "teacher": ("teacher",),
}


class LoopHooks:
    def __init__(self, chrono, profiler=None, lr_finder=None, distributed=False, host_memory=None):
        self.chrono, self.profiler, self.lr_finder = chrono, profiler, lr_finder
        self.host_memory = host_memory  # on a CPU device: the heap's growth bounded (dist.HostMemoryBound)
        self.distributed = distributed  # several ranks: the LR finder reads the loss averaged over all of them
        self.data_wait_s = 0.0  # host seconds spent waiting for the next batch, this run (a clock read: no sync)

    def loading(self, batches):
        """Iterate `batches`, each wait being a "data_loading" phase; closing this generator closes theirs."""
        iterator = iter(batches)
        try:
            while True:
                with self.phase("data_loading"):
                    asked = time.perf_counter()
                    try:
                        batch = next(iterator)
                    except StopIteration:
                        return
                    self.data_wait_s += time.perf_counter() - asked
                yield batch
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:  # leaving mid-epoch (test, stop signal): release this epoch's iterator now
                close()

    @contextlib.contextmanager
    def phase(self, name):
        for toggle in _CHRONO_OPENS.get(name, ()):
            getattr(self.chrono, toggle)()
        with torch.profiler.record_function(name) if self.profiler is not None else contextlib.nullcontext():
            yield
        for toggle in _CHRONO_CLOSES.get(name, ()):
            getattr(self.chrono, toggle)()

    def step_done(self):
        self.chrono.backward()  # closes the step: backward + optimizer step
        if self.profiler is not None:
            self.profiler.step()
        self.chrono.first_step_done()  # once: start-up, cuDNN autotuning and torch.compile
        if self.host_memory is not None:
            self.host_memory.step_done()

    def optimizer_step_done(self, loss, correct, count):
        """Return True when the run should stop here (the LR finder has swept its range or diverged)."""
        if self.lr_finder is None:
            return False
        step = torch.stack([loss.detach().double(), correct.detach().double() / count])
        if self.distributed:  # each rank's own loss can turn non-finite alone: the end of the sweep is agreed on
            dist.all_reduce(step)
            step /= dist.get_world_size()
        loss_value, accuracy = step.tolist()
        self.lr_finder.step(loss_value, accuracy)
        return self.lr_finder.done

    def close(self):
        if self.profiler is not None:
            self.profiler.stop()


# Collectives as the profiler names them: NCCL's kernels on a GPU, c10d's operators on the host.
COLLECTIVE_KINDS = {
    "all_reduce": ("allreduce", "all_reduce"),
    "all_gather": ("allgather", "all_gather"),
    "reduce_scatter": ("reducescatter", "reduce_scatter"),
    "broadcast": ("broadcast",),
    "all_to_all": ("alltoall", "all_to_all"),
    "send/recv": ("sendrecv", "send", "recv"),
}
FUNCTIONAL_WAIT = "_c10d_functional::wait_tensor"


def collective_times(events, steps, on_gpu):
    """Milliseconds per step spent in each kind of collective, from the profiler's `events` (key_averages) over
    `steps` steps: on a GPU the NCCL kernels' time; on the host (gloo) c10d's operators' time, and apart ("waits")
    the time spent waiting for the functional collectives that DTensor issues (tensor parallelism's all-reduces run
    on gloo's own thread: the training thread's wait is what they cost it, late peers included)."""
    times = {}
    for event in events:
        name = event.key.lower()
        if on_gpu and name.startswith("nccl"):
            spent = event.self_device_time_total
        elif not on_gpu and name.startswith("c10d::"):
            spent = event.cpu_time_total
        elif not on_gpu and event.key == FUNCTIONAL_WAIT:
            times["waits"] = times.get("waits", 0.0) + event.self_cpu_time_total / 1e3 / steps
            continue
        else:
            continue
        kind = next((k for k, names in COLLECTIVE_KINDS.items() if any(n in name for n in names)), "other")
        times[kind] = times.get(kind, 0.0) + spent / 1e3 / steps
    return times


def collectives_line(profiler, steps, on_gpu):
    """One line: each kind of collective's milliseconds per profiled step, beside the step's."""
    events = profiler.key_averages()
    step_ms = sum(e.cpu_time_total for e in events if e.key.startswith("ProfilerStep")) / 1e3 / steps
    times = collective_times(events, steps, on_gpu)
    if not times:
        return f"profiler: no collectives in the {steps} profiled steps ({step_ms:.1f} ms a step)"
    where = "NCCL kernels' GPU time" if on_gpu else "host time"
    figures = ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in sorted(times.items(), key=lambda item: -item[1]))
    return f"profiler: collectives per step on rank 0 ({where}): {figures}; a step {step_ms:.1f} ms (host)"


def make_profiler(profiler_settings, output_dir, rank, device, log=None):
    """torch.profiler over --prof-wait/--prof-warmup/--prof-active steps, traces for TensorBoard and Perfetto in
    <output-dir>/profiler; `log` gets the collectives' line once the steps are recorded. None without --prof."""
    if not profiler_settings.prof:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace_dir = Path(output_dir) / "profiler"
    write_trace = torch.profiler.tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{rank}")

    def trace_ready(profiler):
        write_trace(profiler)
        if log is not None:
            log(collectives_line(profiler, profiler_settings.prof_active, device.type == "cuda"))

    profiler = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(
            wait=profiler_settings.prof_wait,
            warmup=profiler_settings.prof_warmup,
            active=profiler_settings.prof_active,
            repeat=1,
        ),
        on_trace_ready=trace_ready,
    )
    profiler.start()
    return profiler
