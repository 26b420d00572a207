"""Chronometer for dlojz: per-step timings that stay true on a GPU, and a report that says what to change next.

Calling style (the course's toggles: the first call opens a phase, the second call closes it)::

    chrono = Chronometer(enabled=args.test, rank=rank, device=device)
    chrono.start()
    chrono.dataload()                      # open: waiting for the first batch
    for i, (images, labels) in enumerate(train_loader):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        chrono.dataload()                  # close: DataLoader wait + host->device copy
        chrono.forward()                   # forward + loss
        ...
        chrono.forward()
        chrono.backward()                  # backward + optimizer/scaler step
        ...
        chrono.backward()                  # closes the step (step = forward + backward)
        if i == 0:
            chrono.first_step_done()       # time to the first step: start-up, cudnn autotune, compilation
        chrono.validation() ... chrono.validation()   # whole validation pass (measured even when disabled)
        chrono.dataload()                  # open: waiting for the next batch
    chrono.gather(all_gather_object)       # collective, every rank, once at the end
    chrono.write_trace(out_dir / "chrono_trace.json", ctx=ctx)
    chrono.display(ctx)                    # rank 0 prints; chrono.summary(ctx) gives the same figures as a dict

A load phase left open when the loop ends (the StopIteration wait) is simply never recorded. If a validation pass
runs while a load phase is open, its duration is taken out of that load.

Truth on a GPU: CUDA kernels run asynchronously, so every phase boundary first waits for the device (``sync``,
by default the device's current (compute) stream on CUDA, not the prefetcher's copy stream; a no-op on CPU). When the chronometer is disabled
(a normal full training) the training toggles return at once: no synchronisation, no clock read, no list grows.
Only the rare once-per-run / once-per-epoch measurements still run when disabled: ``start()``, ``first_step_done()``
and ``validation()`` (the last two synchronise once, which costs nothing at that frequency and keeps them true).

The unsynchronised window (``synced_steps``): after that many timed steps the chronometer goes quiet (no
synchronisation, no clock read per phase) and times the steps that follow as a whole, wall clock, the device waited
for once at its start and once at its end (``end_window()``, called after the last step; gather() closes it too).
A validation pauses it: its seconds are not the training's, and the window goes on after it, so that a run crossing
epochs times as many steps as one that does not. That throughput, ``unsync_throughput_img_s``, counts every per-step cost (MixUp, the log points, EMA,
the schedule) and none of the chronometer's waits: it is the figure to compare with MLPerf's training throughput.
The per-phase figures come from the synchronised steps before it.

Statistics skip the first ``warmup_steps`` steps (cudnn autotune, allocator growth, compilation); if no step is
left after them, only the first step (start-up, compilation) is left out and the summary says so
(``warmup_excluded: False``).

Power and energy: with NVML (``nvidia-ml-py``, ``import pynvml``) on a CUDA device, the power draw is read at each
step boundary (peak W) and the GPU's energy counter between the end of the warm-up and the last step, validation
passes taken out (J per image, energy per epoch estimate). Without NVML (not installed, no driver, no GPU, any NVML
error) those figures are left out; nothing crashes.

The MFU uses ``dlojz_lib.model.zoo.peak_flops(device_name, dtype)`` (the dense peak of V100/A100/H100/H200 GPUs) and the
context's ``train_flops_per_image`` (``dlojz_lib.model.zoo.train_flops_per_image``). The report's lines, its advice and the
per-step timeline plot are dlojz_lib/observers/chrono_report.py's (``python dlojz_chrono.py plot TRACE.json -o timeline.png``,
the course's command, a thin front to this module and that one).

A step is one micro-batch's forward and backward on every rank; the context's ``images_per_step`` is that many
images (micro-batch x ranks), whatever the gradient accumulation.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from dlojz_lib.model.zoo import peak_flops
from dlojz_lib.observers.chrono_report import (
    energy_figures,
    flops_figures,
    over_power_limit,
    report_lines,
    slowest_rank,
    step_figures,
    unsync_figures,
    validation_figures,
    window_energy_figures,
)

# ``nvml`` default: import pynvml lazily, and only for CUDA devices.
_TRY_PYNVML = object()


class _Toggle:
    """When a toggled phase was opened (None while it is closed)."""

    __slots__ = ("opened_at",)

    def __init__(self):
        self.opened_at = None


class EnergyMeter:
    """The GPU's power and energy through NVML (pynvml): the power at each step's end (peak W), the energy counter
    from the end of the warm-up to the last step with the validation passes taken out, and each validation's energy.
    Without NVML (not installed, no driver, no GPU, any NVML error) the figures are None; nothing fails."""

    def __init__(self, device, nvml=_TRY_PYNVML, enabled=True, clock=time.perf_counter):
        self.nvml = self.handle = None
        self._clock = clock
        self.power_w = []  # W, one sample per step
        self.power_limit_w = None  # the GPU's enforced power limit (NVML), None where it cannot say
        self.start_mj = self.last_mj = None  # the window's first and latest readings
        self.start_s = self.last_s = None  # the clock at those readings: the window's seconds and mean power
        self.excluded_mj = self.excluded_s = 0.0  # validations inside the window
        self.pending_mj = self.pending_s = 0.0  # a validation's, taken out once a later step's reading covers it
        self.steps = 0  # steps in the window
        self.ok = True  # False once the counter failed: energy figures dropped
        self.val_j = None  # the last validation pass's energy
        self._val_open = None  # (mJ, s) at the open validation's start
        # The unsynchronised window's own energy (the throughput's window, validations out): J/image beside its img/s
        self.unsync_start_mj = self.unsync_j = None
        self.unsync_excluded_mj = 0.0
        if enabled:
            self._init(device, nvml)

    def _init(self, device, nvml):
        if nvml is _TRY_PYNVML:
            if device.type != "cuda":
                return
            try:
                import pynvml as nvml
            except ImportError:
                return
        if nvml is None:
            return
        try:
            nvml.nvmlInit()
            self.handle = nvml_handle_for(nvml, device)
            self.nvml = nvml
        except Exception:  # NVMLError (no driver, no GPU, not permitted) or anything odd: no power lines
            self.handle = None
            return
        try:
            self.power_limit_w = nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000.0
        except Exception:  # not reported by this GPU or driver: no limit check
            self.power_limit_w = None

    def read(self):
        """GPU energy counter in mJ, or None (and energy figures dropped) if the GPU cannot report it."""
        if not self.ok:
            return None
        try:
            return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception:
            self.ok = False
            return None

    def start_window(self):
        if self.handle is not None and self.start_mj is None:
            self.start_mj = self.last_mj = self.read()
            self.start_s = self.last_s = self._clock()
            self.steps = 0

    def step_end(self):
        if self.handle is None:
            return
        try:
            self.power_w.append(self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0)
        except Exception:
            pass
        if self.start_mj is not None:
            reading = self.read()
            if reading is not None:
                self.last_mj, self.last_s = reading, self._clock()
                self.steps += 1
                self.excluded_mj += self.pending_mj
                self.excluded_s += self.pending_s
                self.pending_mj = self.pending_s = 0.0

    def window_j(self):
        if self.start_mj is None or not self.ok or self.steps == 0:
            return None
        return (self.last_mj - self.start_mj - self.excluded_mj) / 1000.0

    def window_s(self):
        """The seconds the energy window's joules were drawn over (its validations out), None without a window."""
        if self.window_j() is None:
            return None
        return self.last_s - self.start_s - self.excluded_s

    def unsync_begin(self):
        """The unsynchronised window opens (the device just waited for): its first reading."""
        if self.handle is not None and self.unsync_start_mj is None:
            self.unsync_start_mj = self.read()

    def unsync_end(self):
        """The unsynchronised window closes (the device just waited for): its joules, validations taken out."""
        if self.unsync_start_mj is None or self.unsync_j is not None:
            return
        closed_mj = self.read()
        if closed_mj is not None:
            self.unsync_j = (closed_mj - self.unsync_start_mj - self.unsync_excluded_mj) / 1000.0

    def record(self) -> dict:
        """This rank's energy figures, as the chronometer's record gathers them."""
        return {
            "train_energy_j": self.window_j(),
            "energy_window_s": self.window_s(),
            "unsync_energy_j": self.unsync_j,
            "power_limit_w": self.power_limit_w,
            "energy_steps": self.steps,
            "val_energy_j": self.val_j,
            "peak_power_w": max(self.power_w) if self.power_w else None,
        }

    def validation_start(self):
        reading = self.read() if self.handle is not None else None
        self._val_open = None if reading is None else (reading, self._clock())

    def validation_end(self):
        if self._val_open is None:
            return
        closed_mj = self.read()
        if closed_mj is not None:
            val_mj, val_s = closed_mj - self._val_open[0], self._clock() - self._val_open[1]
            self.val_j = val_mj / 1000.0
            if self.start_mj is not None:
                # taken out of the window only once a later step's reading covers this validation
                self.pending_mj += val_mj
                self.pending_s += val_s
            if self.unsync_start_mj is not None and self.unsync_j is None:
                self.unsync_excluded_mj += val_mj
        self._val_open = None


class StepRecords:
    """The seconds of each synchronised training step's phases: load, teacher, forward, backward (NaN where a step
    had no such phase), each step's total, and those left once the warm-up steps are out."""

    def __init__(self, warmup_steps):
        self.warmup_steps = warmup_steps
        self.loads, self.forwards, self.backwards, self.teachers = [], [], [], []

    def __len__(self):
        return len(self.backwards)

    def add(self, load, forward, backward, teacher):
        for values, value in ((self.loads, load), (self.forwards, forward), (self.teachers, teacher)):
            values.append(math.nan if value is None else value)
        self.backwards.append(backward)

    def measured(self, values):
        """The values after warm-up; if warm-up would leave nothing, all but the first step (which carries start-up,
        cuDNN autotuning and torch.compile, and is reported apart as the time to the first step)."""
        values = np.asarray(values, dtype=float)
        if len(values) > self.warmup_steps:
            return values[self.warmup_steps :]
        return values[1:] if len(values) > 1 else values

    def step_array(self):
        """Per-step seconds: teacher + forward + backward (a step without a forward phase counts its backward only)."""
        return (
            np.nan_to_num(np.asarray(self.teachers, dtype=float))
            + np.nan_to_num(np.asarray(self.forwards, dtype=float))
            + np.asarray(self.backwards, dtype=float)
        )

    def as_trace(self) -> dict:
        """The per-step seconds as a trace file holds them (NaN as null)."""
        return {
            "warmup_steps": self.warmup_steps,
            "load_s": _nan_to_none(self.loads),
            "forward_s": _nan_to_none(self.forwards),
            "backward_s": _nan_to_none(self.backwards),
            "teacher_s": _nan_to_none(self.teachers),
            "step_s": self.step_array().tolist(),
        }


class UnsyncWindow:
    """The steps after the synchronised ones (--test-unsync-steps), timed as a whole: the device waited for at its
    start (the last synchronised step's end) and once at its end, the clock paused across a validation; each step
    counted as its backward toggle closes, not timed."""

    def __init__(self, clock, sync):
        self._clock, self._sync = clock, sync
        self.start = None  # clock at its start, once open
        self.seconds = None  # its seconds, once closed
        self.before_s = 0.0  # its seconds before the last pause (a validation)
        self.paused = False
        self.steps = 0
        self.in_backward = False  # its backward toggle: opened, not closed yet

    @property
    def open(self) -> bool:
        return self.start is not None

    def begin(self):
        self.start = self._clock()  # the device has just been waited for: the window's start

    def toggle_backward(self):
        self.in_backward = not self.in_backward
        if not self.in_backward and self.seconds is None:
            self.steps += 1

    def end(self) -> bool:
        """Closes the window if open: True when this call closed it."""
        if self.start is None or self.seconds is not None:
            return False
        if self.paused:
            self.seconds = self.before_s
            return True
        self._sync()
        self.seconds = self.before_s + self._clock() - self.start
        return True

    def pause(self, now):
        """At a validation's start (the device just waited for): the seconds so far kept, the clock off."""
        if self.start is not None and self.seconds is None and not self.paused:
            self.before_s += now - self.start
            self.paused = True

    def resume(self, now):
        if self.paused:
            self.start, self.paused = now, False


class Chronometer:
    """Times the load / forward / backward phases of each training step, the validation and the run.

    enabled: record per-step figures (dlojz passes ``args.test``). When False the toggles are no-ops.
    rank: only rank 0 prints in display().
    device: the training device; decides the default ``sync`` and whether NVML is tried.
    warmup_steps: first steps left out of the statistics.
    clock: returns seconds (injectable for tests).
    sync: waits for the device's queued work; default: the current CUDA stream of ``device``, else a no-op.
    nvml: a pynvml-compatible module, or None for no power/energy figures. Default: ``import pynvml`` on CUDA.
    synced_steps: steps timed phase by phase; the steps after them form the unsynchronised window (None: none).
    """

    # One object the loop toggles (the course's API): its records and toggles stay together; the figures made from
    # them are dlojz_lib.observers.chrono_report's functions, the energy readings EnergyMeter's.

    def __init__(
        self,
        enabled: bool,
        rank: int = 0,
        device: torch.device | str = "cpu",
        warmup_steps: int = 5,
        clock=time.perf_counter,
        sync=None,
        nvml=_TRY_PYNVML,
        synced_steps=None,
    ):
        if warmup_steps < 0:
            raise ValueError(f"Chronometer: warmup_steps must be >= 0, got {warmup_steps}")
        if synced_steps is not None and synced_steps < 1:
            raise ValueError(f"Chronometer: synced_steps must be >= 1, got {synced_steps}")
        self.synced_steps = synced_steps
        self._enabled = bool(enabled)
        self.rank = rank
        self.device = torch.device(device)
        self.warmup_steps = int(warmup_steps)
        self._clock = clock
        self._sync = sync if sync is not None else _default_sync(self.device)
        self._window = UnsyncWindow(clock, self._sync)

        self._run_start = None
        self._run_end = None  # frozen by gather(): every later report shows the same total
        self._time_to_first_step = None
        self._val_time = None

        self.records = StepRecords(self.warmup_steps)  # added to only when enabled
        self._pending_load = self._pending_forward = self._pending_teacher = None  # closed phases, until the step's end
        self._load, self._forward, self._teacher, self._backward, self._validation = (_Toggle() for _ in range(5))
        self._energy = EnergyMeter(self.device, nvml, enabled=self._enabled, clock=clock)

        self._gathered = None
        self._last_ctx = {}

    # ------------------------------------------------------------------ properties
    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def steps(self) -> int:
        """Number of recorded training steps (0 when disabled)."""
        return len(self.records)

    @property
    def val_time(self):
        """Wall time in seconds of the last validation pass (None before the first one)."""
        return self._val_time

    # ------------------------------------------------------------------ recording
    def start(self):
        """Start of the run (always recorded: one clock read)."""
        self._run_start = self._clock()

    def dataload(self):
        """Toggle: waiting for the DataLoader + host->device copy."""
        if not self._enabled or self._window.open:
            return
        duration = self._toggle(self._load)
        if duration is None:
            self._maybe_start_energy()
        else:
            self._pending_load = duration

    def forward(self):
        """Toggle: forward + loss (the course zeroes the gradients here; dlojz after the optimizer step)."""
        if not self._enabled or self._window.open:
            return
        duration = self._toggle(self._forward)
        if duration is None:
            self._maybe_start_energy()
        else:
            self._pending_forward = duration

    def teacher(self):
        """Toggle: --teacher's forward (its logits for the distillation loss), a phase of the step of its own."""
        if not self._enabled or self._window.open:
            return
        duration = self._toggle(self._teacher)
        if duration is not None:
            self._pending_teacher = duration

    def backward(self):
        """Toggle: backward + optimizer/scaler step. Closing it records the step."""
        if not self._enabled:
            return
        if self._window.open:  # the unsynchronised window: each step counted at its close, not timed
            self._window.toggle_backward()
            return
        duration = self._toggle(self._backward)
        if duration is None:
            return
        self.records.add(self._pending_load, self._pending_forward, duration, self._pending_teacher)
        self._pending_load = self._pending_forward = self._pending_teacher = None
        self._energy.step_end()
        if self.synced_steps is not None and len(self.records) == self.synced_steps:
            self._window.begin()
            self._energy.unsync_begin()

    def end_window(self):
        """After the last training step: the unsynchronised window ends (one wait for the device), if open."""
        if self._window.end():
            self._energy.unsync_end()

    @property
    def window_steps(self) -> int:
        """Steps in the unsynchronised window so far."""
        return self._window.steps

    def validation(self):
        """Toggle: the whole validation pass. Always measured (also when disabled), synchronised at both ends; the
        unsynchronised window paused across it."""
        self._sync()
        now = self._clock()
        if self._validation.opened_at is None:
            self._validation.opened_at = now
            self._window.pause(now)
            self._energy.validation_start()
            return
        duration = now - self._validation.opened_at
        self._validation.opened_at = None
        self._window.resume(now)
        self._val_time = duration
        if self._load.opened_at is not None:
            # A load phase open across the validation: the validation is not data loading.
            self._load.opened_at += duration
        self._energy.validation_end()

    def first_step_done(self):
        """Called once after the first training step: records the time to the first step (always, cheap)."""
        if self._time_to_first_step is not None or self._run_start is None:
            return
        self._sync()
        self._time_to_first_step = self._clock() - self._run_start

    def _toggle(self, phase: _Toggle):
        self._sync()
        now = self._clock()
        if phase.opened_at is None:
            phase.opened_at = now
            return None
        duration = now - phase.opened_at
        phase.opened_at = None
        return duration

    def _maybe_start_energy(self):
        # The energy window opens with the first phase of the first measured (post warm-up) step.
        if len(self.records) >= self.warmup_steps:
            self._energy.start_window()

    # ------------------------------------------------------------------ reporting
    def _local_record(self):
        return {
            "rank": self.rank,
            "load_median_s": _nanmedian(self.records.measured(self.records.loads)),
            "step_median_s": _nanmedian(self.records.measured(self.records.step_array())),
            **self._energy.record(),
            "window_s": self._window.seconds if self._window.steps else None,
            "window_steps": self._window.steps,
        }

    def gather(self, all_gather_object=None):
        """Collective, once at the end on every rank: gathers each rank's medians and energy; fixes the run's end.

        all_gather_object(obj) -> list of every rank's obj (e.g. a wrapper around
        torch.distributed.all_gather_object). None = single process. Returns the gathered list.
        """
        self.end_window()
        if self._run_end is None:
            self._run_end = self._clock()
        record = self._local_record()
        self._gathered = list(all_gather_object(record)) if all_gather_object is not None else [record]
        return self._gathered

    def summary(self, ctx: dict | None = None) -> dict:
        """The report's figures as a dict, in SI units (s, images/s, FLOP/s, W, J, bytes, fractions).

        Keys whose figure cannot be computed (missing ctx entry, disabled chronometer, no NVML) are absent.
        """
        ctx = dict(ctx or {})
        self._last_ctx = ctx
        out = {"enabled": self._enabled}
        if self._run_start is not None:
            end = self._run_end if self._run_end is not None else self._clock()
            out["total_time_s"] = end - self._run_start
        if self._time_to_first_step is not None:
            out["time_to_first_step_s"] = self._time_to_first_step
        if self.steps:
            records = self.records
            phases = (records.loads, records.forwards, records.backwards, records.step_array())
            measured = [records.measured(x) for x in phases]
            out.update(step_figures(*measured, self.steps, self.warmup_steps, slowest_rank(self._gathered), ctx))
            teachers = records.measured(records.teachers)
            if len(teachers) and not np.all(np.isnan(teachers)):
                out["teacher_median_s"] = float(np.nanmedian(teachers))
                out["teacher_share"] = out["teacher_median_s"] / out["step_median_s"]
        out.update(unsync_figures(self._gathered or [self._local_record()], self.synced_steps, ctx))
        out.update(validation_figures(self._val_time, out.get("step_median_s"), out.get("load_median_s"), ctx))
        peak = peak_flops(ctx.get("device_name") or "", ctx.get("compute_dtype") or "")
        out.update(flops_figures(out.get("throughput_img_s"), peak, ctx))
        gathered = bool(self._gathered) and len(self._gathered) > 1  # else rank 0's energy x the world size
        records = self._gathered or [self._local_record()]
        out.update(energy_figures(records, gathered, ctx), **window_energy_figures(records, gathered, ctx))
        if flagged := over_power_limit(out, ctx.get("world_size") or 1):
            out["over_power_limit"] = flagged
        if ctx.get("trace_path"):
            out["trace_path"] = str(ctx["trace_path"])
        return out

    def display(self, ctx: dict | None = None) -> None:
        """Rank 0 prints the report, in the course's order. Lines whose figures are unknown are left out."""
        s = self.summary(ctx)
        if self.rank != 0:
            return
        per_step = (
            (self.records.step_array().tolist(), _nan_to_none(self.records.loads))
            if self._enabled and self.steps
            else None
        )
        print("\n".join(report_lines(s, self.warmup_steps, per_step)), flush=True)

    def write_trace(self, path, ctx: dict | None = None) -> None:
        """JSON trace: per-step load/forward/backward/step seconds, power samples and the summary.

        ctx: as for summary(); default: the last ctx given to summary()/display().
        """
        ctx = self._last_ctx if ctx is None else ctx
        trace = {**self.records.as_trace(), "power_w": list(self._energy.power_w), "summary": self.summary(ctx)}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(trace, indent=1))


# ---------------------------------------------------------------------- helpers
def peak_memory_bytes(device):
    """The most memory this process used: the CUDA allocator's peak, or the CPU's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _default_sync(device: torch.device):
    """Waits for the compute stream only: torch.cuda.synchronize would also wait for the prefetcher's copy of the
    next batch on its side stream, and count it in the step (the untimed run overlaps it)."""
    if device.type == "cuda":
        return lambda: torch.cuda.current_stream(device).synchronize()
    return lambda: None


def nvml_handle_for(nvml, device: torch.device):
    """NVML handle of the torch device: by UUID (NVML indexes ignore CUDA_VISIBLE_DEVICES), else by index."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except Exception:
                pass
        return nvml.nvmlDeviceGetHandleByIndex(index)
    return nvml.nvmlDeviceGetHandleByIndex(device.index or 0)


def _nanmedian(values):
    values = np.asarray(values, dtype=float)
    return None if values.size == 0 or np.all(np.isnan(values)) else float(np.nanmedian(values))


def _nan_to_none(values):
    return [None if math.isnan(v) else v for v in values]
