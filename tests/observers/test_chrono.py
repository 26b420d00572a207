"""Tests of the chronometer (dlojz_lib/observers/chrono.py): Chronometer timings (fake clock), statistics, advice, NVML energy, trace plot, FLOP count.

No training, no GPU: a fake clock and a fake sync stand in for the device; a fake pynvml module for NVML.
Run from the repository root: ``python -m pytest tests/observers/test_chrono.py`` (a few seconds).
"""

import json
import types

import numpy as np
import pytest
import torch
from torch import nn

from dlojz_lib.model.zoo import peak_flops, train_flops_per_image
from dlojz_lib.observers.chrono import Chronometer
from dlojz_lib.observers.chrono_report import loading_advice, main, report_lines


class FakeClock:
    """A clock that only moves when the test says so; logs each read into a shared event list."""

    def __init__(self, events=None):
        self.now = 100.0
        self.reads = 0
        self.events = events if events is not None else []

    def __call__(self):
        self.reads += 1
        self.events.append("clock")
        return self.now

    def advance(self, seconds):
        self.now += seconds


class FakeSync:
    def __init__(self, events=None):
        self.calls = 0
        self.events = events if events is not None else []

    def __call__(self):
        self.calls += 1
        self.events.append("sync")


class FakeNVMLError(Exception):
    pass


class FakeNVML:
    """pynvml stand-in: a GPU drawing `watts` (callable of the clock time), energy counter integrated from it."""

    def __init__(self, clock, watts, energy_supported=True, fail_init=False, limit_w=None):
        self.clock = clock
        self.limit_w = limit_w
        self.watts = watts
        self.energy_supported = energy_supported
        self.fail_init = fail_init
        self.energy_mj = 0.0
        self._last_t = clock.now

    def _integrate(self):
        # constant power between reads is all the tests need: energy = W * dt
        now = self.clock.now
        self.energy_mj += self.watts(self._last_t) * (now - self._last_t) * 1000.0
        self._last_t = now

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("gpu", index)

    def nvmlDeviceGetPowerUsage(self, handle):
        return int(self.watts(self.clock.now) * 1000)  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        if self.limit_w is None:
            raise FakeNVMLError("Not Supported")
        return int(self.limit_w * 1000)  # mW

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.energy_supported:
            raise FakeNVMLError("Not Supported")
        self._integrate()
        return int(round(self.energy_mj))  # mJ


def make(enabled=True, warmup_steps=0, nvml=None, rank=0, synced_steps=None):
    events = []
    clock, sync = FakeClock(events), FakeSync(events)
    chrono = Chronometer(
        enabled, rank=rank, warmup_steps=warmup_steps, clock=clock, sync=sync, nvml=nvml, synced_steps=synced_steps
    )
    return chrono, clock, sync


def run_step(chrono, clock, load, fwd, bwd, untimed=0.0):
    """One training iteration the way dlojz calls the toggles; `untimed` = metrics/logging after the step."""
    chrono.dataload()
    clock.advance(load)
    chrono.dataload()
    chrono.forward()
    clock.advance(fwd)
    chrono.forward()
    chrono.backward()
    clock.advance(bwd)
    chrono.backward()
    clock.advance(untimed)


def read_trace(chrono, tmp_path, ctx=None):
    path = tmp_path / "trace.json"
    chrono.write_trace(path, ctx=ctx)
    return json.loads(path.read_text())


# ------------------------------------------------------------------ timings
def test_toggles_record_exact_intervals(tmp_path):
    chrono, clock, _ = make()
    chrono.start()
    clock.advance(3.0)  # start-up before the first step
    run_step(chrono, clock, load=0.5, fwd=0.25, bwd=0.75, untimed=0.125)
    chrono.first_step_done()
    run_step(chrono, clock, load=0.0625, fwd=0.5, bwd=1.0, untimed=2.0)

    trace = read_trace(chrono, tmp_path)
    assert trace["load_s"] == pytest.approx([0.5, 0.0625], abs=1e-12)
    assert trace["forward_s"] == pytest.approx([0.25, 0.5], abs=1e-12)
    assert trace["backward_s"] == pytest.approx([0.75, 1.0], abs=1e-12)
    assert trace["step_s"] == pytest.approx([1.0, 1.5], abs=1e-12)
    assert chrono.steps == 2
    s = trace["summary"]
    assert s["time_to_first_step_s"] == pytest.approx(3.0 + 0.5 + 0.25 + 0.75 + 0.125)
    assert s["total_time_s"] == pytest.approx(3.0 + 1.625 + 3.5625)


def test_load_open_at_loop_end_is_not_recorded_and_validation_is_not_loading(tmp_path):
    chrono, clock, _ = make()
    chrono.start()
    run_step(chrono, clock, load=0.5, fwd=1.0, bwd=1.0)
    chrono.dataload()  # opens the wait for the next batch...
    clock.advance(0.25)
    chrono.validation()  # ...but a validation pass runs first
    clock.advance(8.0)
    chrono.validation()
    clock.advance(0.5)
    chrono.dataload()  # load = 0.25 + 0.5, the 8 s of validation taken out
    chrono.forward()
    clock.advance(1.0)
    chrono.forward()
    chrono.backward()
    clock.advance(1.0)
    chrono.backward()
    chrono.dataload()  # opened, never closed (StopIteration): dropped
    clock.advance(30.0)
    trace = read_trace(chrono, tmp_path)
    assert trace["load_s"] == pytest.approx([0.5, 0.75])
    assert chrono.val_time == pytest.approx(8.0)
    assert chrono.steps == 2


def test_end_of_epoch_wait_closed_without_a_step_is_not_a_load(tmp_path):
    # dlojz: open, next(batches) raises StopIteration, close, break; the next epoch starts with a fresh load
    chrono, clock, _ = make()
    run_step(chrono, clock, load=0.5, fwd=1.0, bwd=1.0)
    chrono.dataload()
    clock.advance(9.0)
    chrono.dataload()  # end of epoch 1: no step follows
    run_step(chrono, clock, load=0.25, fwd=1.0, bwd=1.0)  # epoch 2
    assert read_trace(chrono, tmp_path)["load_s"] == pytest.approx([0.5, 0.25])


def test_step_without_dataload_has_no_load_figures(tmp_path):
    chrono, clock, _ = make()
    for _ in range(3):
        chrono.forward()
        clock.advance(0.1)
        chrono.forward()
        chrono.backward()
        clock.advance(0.2)
        chrono.backward()
    s = chrono.summary({"images_per_step": 30})
    assert "load_median_s" not in s and "advice" not in s
    assert s["step_median_s"] == pytest.approx(0.3)
    assert s["throughput_img_s"] == pytest.approx(100.0)
    assert read_trace(chrono, tmp_path)["load_s"] == [None, None, None]


# ------------------------------------------------------------------ statistics
def test_statistics_skip_warmup_and_match_numpy():
    rng = np.random.default_rng(0)
    chrono, clock, _ = make(warmup_steps=2)
    loads = [5.0, 4.0] + list(rng.uniform(0.001, 0.002, 9))  # huge warm-up loads and steps
    fwds = [7.0, 6.0] + list(rng.uniform(0.01, 0.02, 9))
    bwds = [9.0, 8.0] + list(rng.uniform(0.02, 0.04, 9))
    for load, fwd, bwd in zip(loads, fwds, bwds):
        run_step(chrono, clock, load, fwd, bwd)

    s = chrono.summary({"images_per_step": 256, "steps_per_epoch": 1000})
    steps = np.add(fwds, bwds)[2:]
    assert s["measured_steps"] == 9 and s["steps"] == 11 and s["warmup_excluded"]
    assert s["step_min_s"] == pytest.approx(steps.min())
    assert s["step_median_s"] == pytest.approx(np.median(steps))
    assert s["step_std_s"] == pytest.approx(np.std(steps))
    assert s["load_min_s"] == pytest.approx(min(loads[2:]))
    assert s["load_median_s"] == pytest.approx(np.median(loads[2:]))
    assert s["load_std_s"] == pytest.approx(np.std(loads[2:]))
    assert s["forward_median_s"] == pytest.approx(np.median(fwds[2:]))
    assert s["backward_median_s"] == pytest.approx(np.median(bwds[2:]))
    assert s["forward_share"] == pytest.approx(np.median(fwds[2:]) / np.median(steps))
    assert s["throughput_img_s"] == pytest.approx(256 / (np.median(steps) + np.median(loads[2:])))
    assert s["compute_throughput_img_s"] == pytest.approx(256 / np.median(steps))
    assert s["epoch_time_estimate_s"] == pytest.approx(1000 * (np.median(steps) + np.median(loads[2:])))


def test_too_few_steps_for_warmup_skips_only_the_first_and_says_so():
    chrono, clock, _ = make(warmup_steps=5)
    run_step(chrono, clock, 0.1, 5.0, 9.0)  # first step: start-up, compilation, autotuning
    run_step(chrono, clock, 0.1, 0.2, 0.3)
    run_step(chrono, clock, 0.1, 0.4, 0.3)
    s = chrono.summary({})
    assert not s["warmup_excluded"] and s["measured_steps"] == 2
    assert s["step_median_s"] == pytest.approx(0.6)


def test_validation_estimate_and_epoch_estimate():
    chrono, clock, _ = make(enabled=False)  # validation is measured even when disabled
    chrono.validation()
    clock.advance(4.0)
    chrono.validation()
    s = chrono.summary({"val_batches_done": 20, "val_batches_total": 196})
    assert s["val_time_s"] == pytest.approx(4.0)
    assert s["val_full_estimate_s"] == pytest.approx(4.0 / 20 * 196)

    chrono, clock, _ = make()
    for _ in range(4):
        run_step(chrono, clock, 0.01, 0.05, 0.15)
    chrono.validation()
    clock.advance(2.0)
    chrono.validation()
    s = chrono.summary({"val_batches_done": 10, "val_batches_total": 50, "steps_per_epoch": 100})
    assert s["epoch_time_estimate_s"] == pytest.approx(100 * 0.21 + 2.0 * 5)


def test_model_flops_and_utilisation():
    chrono, clock, _ = make()
    for _ in range(3):
        run_step(chrono, clock, 0.0, 0.1, 0.3)
    ctx = {
        "images_per_step": 512,
        "world_size": 4,
        "train_flops_per_image": 24.3e9,
        "device_name": "NVIDIA A100-SXM4-80GB",
        "compute_dtype": "bfloat16",
    }
    s = chrono.summary(ctx)
    assert s["achieved_flops"] == pytest.approx(24.3e9 * 512 / 0.4)
    assert s["mfu"] == pytest.approx(s["achieved_flops"] / (4 * peak_flops(ctx["device_name"], "bfloat16")))
    s = chrono.summary(dict(ctx, device_name="cpu"))
    assert "achieved_flops" in s and "mfu" not in s


def test_peak_flops_lookup():
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") < peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")
    assert peak_flops("nvidia a100-sxm4-40gb", "tf32") == peak_flops("NVIDIA A100-SXM4-80GB", "tf32")
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") < peak_flops("NVIDIA A100-SXM4-80GB", "float16")
    assert peak_flops("Tesla V100-SXM2-32GB", "bfloat16") is None  # no bfloat16 units on Volta
    assert peak_flops("Tesla V100-SXM2-32GB", "float16") > 0
    assert peak_flops("NVIDIA H200", "float16") > 0
    assert peak_flops("NVIDIA GeForce RTX 4090", "float16") is None
    assert peak_flops("cpu", "float32") is None


# ------------------------------------------------------------------ advice
@pytest.mark.parametrize("load_share, expected", [(0.0, False), (0.04, False), (0.06, True), (0.5, True)])
def test_advice_appears_exactly_when_loading_dominates(load_share, expected, capsys):
    chrono, clock, _ = make()
    for _ in range(5):
        run_step(chrono, clock, load=0.1 * load_share, fwd=0.03, bwd=0.07)
    ctx = {
        "images_per_step": 64,
        "num_workers": 2,
        "cpus_per_task": 10,
        "device_name": "NVIDIA A100-SXM4-80GB",
        "pin_memory": True,
        "persistent_workers": True,
    }
    s = chrono.summary(ctx)
    assert ("advice" in s) is expected
    assert s["load_share"] == pytest.approx(load_share)
    chrono.display(ctx)
    out = capsys.readouterr().out
    assert ("Advice" in out) is expected
    if expected:
        assert "raise --num-workers from 2 (the task has 10 CPUs)" in out


def test_advice_says_what_to_change_for_the_context():
    gpu = {"device_name": "NVIDIA H100 80GB HBM3"}
    advice = loading_advice(
        0.02, 0.1, dict(gpu, num_workers=4, cpus_per_task=8, pin_memory=False, persistent_workers=False)
    )
    assert "20%" in advice
    assert "raise --num-workers from 4 (the task has 8 CPUs)" in advice
    assert "--pin-memory" in advice and "--persistent-workers" in advice

    advice = loading_advice(
        0.02, 0.1, dict(gpu, num_workers=8, cpus_per_task=8, pin_memory=True, persistent_workers=True)
    )
    assert "CPU-bound" in advice and "--num-workers" not in advice
    assert "--pin-memory" not in advice and "--persistent-workers" not in advice
    # pinned memory only helps host->GPU copies
    advice = loading_advice(
        0.02, 0.1, {"device_name": "cpu", "num_workers": 1, "cpus_per_task": 2, "pin_memory": False}
    )
    assert "--pin-memory" not in advice


def test_slowest_rank_load_drives_the_advice():
    chrono, clock, _ = make()
    for _ in range(5):
        run_step(chrono, clock, load=0.001, fwd=0.03, bwd=0.07)  # rank 0 loads fast: 1 %

    def all_gather_object(obj):
        assert obj["rank"] == 0
        return [obj, dict(obj, rank=1, load_median_s=0.02)]  # rank 1 waits 20 ms per batch

    gathered = chrono.gather(all_gather_object)
    assert len(gathered) == 2
    s = chrono.summary({"images_per_step": 64})
    assert s["slowest_rank"] == 1 and s["slowest_rank_load_median_s"] == pytest.approx(0.02)
    assert s["load_share"] == pytest.approx(0.2)
    assert "advice" in s


# ------------------------------------------------------------------ sync and disabled
def test_default_sync_waits_for_the_compute_stream_only(monkeypatch):
    """Not torch.cuda.synchronize: that would wait for the prefetcher's side stream too (the next batch's copy)."""
    from dlojz_lib.observers.chrono import _default_sync

    waited = []
    stream = types.SimpleNamespace(synchronize=lambda: waited.append("compute stream"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: waited.append(device) or stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append("whole device"))
    _default_sync(torch.device("cuda", 1))()
    assert waited == [torch.device("cuda", 1), "compute stream"]
    _default_sync(torch.device("cpu"))()
    assert len(waited) == 2


def test_enabled_syncs_before_reading_the_clock_at_every_boundary():
    chrono, clock, sync = make()
    run_step(chrono, clock, 0.1, 0.1, 0.1)
    assert sync.calls == 6  # three phases, opened and closed
    # each clock read during the step follows a sync: the phase ends only once the device is done
    assert clock.events == ["sync", "clock"] * 6


def test_disabled_records_nothing_and_never_syncs_in_training_steps(tmp_path):
    chrono, clock, sync = make(enabled=False, nvml=FakeNVML(FakeClock(), lambda t: 300.0))
    chrono.start()
    reads_after_start = clock.reads
    for _ in range(100):
        run_step(chrono, clock, 0.1, 0.1, 0.1)
    assert sync.calls == 0 and clock.reads == reads_after_start
    assert chrono.steps == 0 and not chrono.enabled
    assert (
        chrono.records.loads == []
        and chrono.records.forwards == []
        and chrono.records.backwards == []
        and chrono._energy.power_w == []
    )
    s = chrono.summary({"images_per_step": 64, "steps_per_epoch": 10})
    assert "step_median_s" not in s and "peak_power_w" not in s and "epoch_time_estimate_s" not in s
    assert s["total_time_s"] == pytest.approx(30.0)
    trace = read_trace(chrono, tmp_path)
    assert trace["step_s"] == [] and trace["load_s"] == []


# ------------------------------------------------------------------ NVML
def test_fake_nvml_gives_peak_power_and_energy():
    clock = FakeClock()

    # 250 W during warm-up, 400 W while training, 100 W during the validation pass (t in [200, 210))
    def watts(t):
        return 100.0 if 200.0 <= t < 210.0 else (400.0 if t >= 101.0 else 250.0)

    nvml = FakeNVML(clock, watts)
    chrono = Chronometer(True, warmup_steps=1, clock=clock, sync=lambda: None, nvml=nvml)
    run_step(chrono, clock, 0.2, 0.3, 0.5)  # warm-up step, t 100 -> 101
    for _ in range(4):
        run_step(chrono, clock, 0.5, 0.5, 1.0)  # 4 measured steps of 2 s: t 101 -> 109
    clock.now = 200.0
    chrono.validation()
    clock.advance(10.0)
    chrono.validation()
    clock.now = 300.0  # idle time after the run is not counted

    ctx = {
        "images_per_step": 32,
        "world_size": 1,
        "steps_per_epoch": 100,
        "val_batches_done": 5,
        "val_batches_total": 50,
    }
    s = chrono.summary(ctx)
    assert s["peak_power_w"] == pytest.approx(400.0)
    train_j = 400.0 * 8.0  # 4 steps x 2 s at 400 W
    assert s["train_energy_j"] == pytest.approx(train_j)
    assert s["energy_per_image_j"] == pytest.approx(train_j / (4 * 32))
    val_j = 100.0 * 10.0
    assert s["epoch_energy_estimate_j"] == pytest.approx(train_j / (4 * 32) * 100 * 32 + val_j / 5 * 50)


def test_validation_inside_the_energy_window_is_taken_out():
    clock = FakeClock()

    def watts(t):
        return 50.0 if 102.0 <= t < 105.0 else 300.0

    chrono = Chronometer(True, warmup_steps=0, clock=clock, sync=lambda: None, nvml=FakeNVML(clock, watts))
    run_step(chrono, clock, 0.5, 0.5, 1.0)  # t 100 -> 102
    chrono.validation()
    clock.advance(3.0)
    chrono.validation()
    run_step(chrono, clock, 0.5, 0.5, 1.0)  # t 105 -> 107
    s = chrono.summary({"images_per_step": 10})
    assert s["train_energy_j"] == pytest.approx(300.0 * 4.0)
    assert s["energy_per_image_j"] == pytest.approx(300.0 * 4.0 / 20)


def test_gathered_energy_is_summed_over_ranks():
    clock = FakeClock()
    chrono = Chronometer(True, warmup_steps=0, clock=clock, sync=lambda: None, nvml=FakeNVML(clock, lambda t: 200.0))
    for _ in range(2):
        run_step(chrono, clock, 0.0, 0.5, 0.5)
    chrono.gather(lambda obj: [obj, dict(obj, rank=1, train_energy_j=600.0, peak_power_w=350.0)])
    s = chrono.summary({"images_per_step": 8, "world_size": 2})
    assert s["train_energy_j"] == pytest.approx(400.0 + 600.0)
    assert s["energy_per_image_j"] == pytest.approx(1000.0 / 16)
    assert s["peak_power_w"] == pytest.approx(350.0)


def windowed_run(watts, limit_w, untimed=0.0):
    """Two synchronised steps of 10 images (t 100 -> 104 without `untimed`), then the unsynchronised window: a step,
    a validation of 3 s, two steps, its end."""
    clock = FakeClock()
    nvml = FakeNVML(clock, watts, limit_w=limit_w)
    chrono = Chronometer(True, warmup_steps=0, clock=clock, sync=lambda: None, nvml=nvml, synced_steps=2)
    for _ in range(2):
        run_step(chrono, clock, 0.5, 0.5, 1.0, untimed=untimed)
    window_start = clock.now
    run_step(chrono, clock, 0.5, 0.5, 1.0)
    chrono.validation()
    clock.advance(3.0)
    chrono.validation()
    for _ in range(2):
        run_step(chrono, clock, 0.5, 0.5, 1.0)
    chrono.end_window()
    return chrono, window_start


def test_the_unsynchronised_j_per_image_is_drawn_over_its_throughput_s_own_window(capsys):
    # 200 W over the synchronised steps, 600 W in the unsynchronised window, 100 W in its validation (t 106 -> 109)
    def watts(t):
        return 200.0 if t < 104.0 else (100.0 if 106.0 <= t < 109.0 else 600.0)

    chrono, window_start = windowed_run(watts, limit_w=700.0)
    assert window_start == pytest.approx(104.0)
    ctx = {"images_per_step": 10, "world_size": 1}
    s = chrono.summary(ctx)
    assert s["unsync_throughput_img_s"] == pytest.approx(30 / 6.0)  # 3 steps in 6 s, the validation out
    assert s["unsync_energy_per_image_j"] == pytest.approx(600.0 * 6.0 / 30)
    assert s["unsync_mean_power_w"] == pytest.approx(600.0)
    # the pair multiplies into the power drawn over that window
    assert s["unsync_energy_per_image_j"] * s["unsync_throughput_img_s"] == pytest.approx(600.0)
    assert s["energy_per_image_j"] == pytest.approx(200.0 * 4.0 / 20)  # the synchronised steps' own
    assert s["train_mean_power_w"] == pytest.approx(200.0)
    assert s["power_limit_w"] == pytest.approx(700.0) and "over_power_limit" not in s
    chrono.display(ctx)
    out = capsys.readouterr().out
    assert "Energy, unsynchronised: 120.000 J per image" in out and "mean power 600 W" in out
    assert "limit 700 W" in out and "WARNING" not in out


def test_a_j_per_image_and_images_per_second_over_the_power_limit_are_flagged(capsys):
    # 450 W throughout, under the 500 W limit; but the synchronised steps are 2 s timed + 2 s untimed, so their J per
    # image (the energy window's 6 s: both steps and the untimed time between them) times the chronometer's img/s
    # (the timed phases only, 4 s) is 675 W
    chrono, _ = windowed_run(lambda t: 450.0, limit_w=500.0, untimed=2.0)
    ctx = {"images_per_step": 10, "world_size": 1}
    s = chrono.summary(ctx)
    assert s["energy_per_image_j"] * s["throughput_img_s"] == pytest.approx(450.0 * 6.0 / 4.0)
    assert s["unsync_energy_per_image_j"] * s["unsync_throughput_img_s"] == pytest.approx(450.0)
    assert s["over_power_limit"] == [{"window": "synchronised", "watts": pytest.approx(675.0)}]
    chrono.display(ctx)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "synchronised J per image" in warnings[0] and "500 W limit" in warnings[0]
    # without the limit (a GPU that does not report it) nothing is flagged
    chrono, _ = windowed_run(lambda t: 450.0, limit_w=None, untimed=2.0)
    s = chrono.summary(ctx)
    assert "power_limit_w" not in s and "over_power_limit" not in s


@pytest.mark.parametrize("nvml", ["missing", "init-fails", "default-on-cpu"])
def test_no_nvml_gives_no_power_lines(nvml, capsys):
    clock = FakeClock()
    kwargs = {
        "missing": {"nvml": None},
        "init-fails": {"nvml": FakeNVML(clock, lambda t: 300.0, fail_init=True)},
        "default-on-cpu": {},
    }[nvml]
    chrono = Chronometer(True, warmup_steps=0, clock=clock, sync=lambda: None, **kwargs)
    for _ in range(3):
        run_step(chrono, clock, 0.01, 0.1, 0.2)
    ctx = {"images_per_step": 8, "steps_per_epoch": 10}
    s = chrono.summary(ctx)
    assert not {"peak_power_w", "train_energy_j", "energy_per_image_j", "epoch_energy_estimate_j"} & set(s)
    chrono.display(ctx)
    out = capsys.readouterr().out
    assert "Step time" in out and "power" not in out.lower() and "energy" not in out.lower()


def test_gpu_without_energy_counter_still_reports_power(capsys):
    clock = FakeClock()
    chrono = Chronometer(
        True,
        warmup_steps=0,
        clock=clock,
        sync=lambda: None,
        nvml=FakeNVML(clock, lambda t: 280.0, energy_supported=False),
    )
    for _ in range(3):
        run_step(chrono, clock, 0.01, 0.1, 0.2)
    s = chrono.summary({"images_per_step": 8, "steps_per_epoch": 10})
    assert s["peak_power_w"] == pytest.approx(280.0) and "energy_per_image_j" not in s


# ------------------------------------------------------------------ display
def test_display_order_and_rank(capsys):
    chrono, clock, _ = make(rank=0)
    chrono.start()
    for _ in range(3):
        run_step(chrono, clock, 0.05, 0.1, 0.2)
    chrono.first_step_done()
    chrono.validation()
    clock.advance(1.0)
    chrono.validation()
    ctx = {
        "images_per_step": 64,
        "world_size": 1,
        "steps_per_epoch": 100,
        "val_batches_done": 2,
        "val_batches_total": 20,
        "num_workers": 2,
        "cpus_per_task": 4,
        "train_flops_per_image": 1e9,
        "device_name": "cpu",
        "compute_dtype": "float32",
        "peak_memory_bytes": 3 * 2**30,
        "trace_path": "out/trace.json",
    }
    chrono.display(ctx)
    out = capsys.readouterr().out
    markers = [
        "Training complete",
        "Step time",
        "Load time",
        "Forward median",
        "Throughput",
        "Data loading",
        "Advice",
        "Validation time",
        "Estimated epoch time",
        "Model FLOP/s",
        "Peak memory",
        ">>>JSON",
        "Trace written to out/trace.json",
    ]
    positions = [out.find(m) for m in markers]
    assert -1 not in positions, dict(zip(markers, positions))
    assert positions == sorted(positions)

    other, clock, _ = make(rank=1)
    run_step(other, clock, 0.05, 0.1, 0.2)
    other.display(ctx)
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------ plot
def test_plot_command_writes_a_png(tmp_path, capsys):
    chrono, clock, _ = make(warmup_steps=2)
    for i in range(8):
        run_step(chrono, clock, 0.01 * (i % 3), 0.02, 0.05)
    trace = tmp_path / "trace.json"
    chrono.write_trace(trace, ctx={"images_per_step": 4})
    png = tmp_path / "plots" / "timeline.png"
    assert main(["plot", str(trace), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_command_rejects_a_missing_trace(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope.json"), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dlojz_chrono.py: error: ") and "nope.json: no such file" in err


# ------------------------------------------------------------------ FLOPs
def test_train_flops_per_image_by_hand_and_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 5)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    conv = 2 * (4 * 4) * 8 * (3 * 3 * 3)  # 2 FLOPs per MAC, per output pixel and channel
    linear = 2 * (8 * 4 * 4) * 5
    # backward: weight gradients for both layers, input gradient only for the Linear (the images need none)
    expected = (conv + linear) + (conv + linear) + linear
    assert train_flops_per_image(model, image_size=4) == pytest.approx(expected)
    assert train_flops_per_image(model, image_size=4, channels_last=True) == pytest.approx(expected)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN running stats included
    assert all(p.grad is None for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.training


def test_train_flops_leave_batch_norm_out_and_count_what_its_model_with_it_counts(monkeypatch):
    """FlopCounterMode counts no normalisation: the count runs without BatchNorm (its meta kernel is most of a
    ResNet's count) and finds the FLOPs that counting the model as it is finds, timm's BatchNorm with its activation
    too; the model keeps its BatchNorm layers."""
    from torch.utils.flop_counter import FlopCounterMode

    from dlojz_lib.model.zoo import create_model, meta_copy

    for arch in ("resnet18", "timm:test_resnet"):
        model = create_model(arch, 10)
        counter, meta = FlopCounterMode(display=False), meta_copy(model).eval()
        with counter:
            meta(torch.empty(2, 3, 32, 32, device="meta")).sum().backward()
        with monkeypatch.context() as patched:
            patched.setattr(nn.BatchNorm2d, "forward", lambda *args: pytest.fail("a BatchNorm forward was counted"))
            assert train_flops_per_image(model, image_size=32) == counter.get_total_flops() / 2, arch
        assert any(isinstance(module, nn.BatchNorm2d) for module in model.modules())


def test_train_flops_unwraps_data_parallel_wrappers():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 2 * 2, 4))
    wrapped = nn.DataParallel(model)  # same .module unwrapping as DistributedDataParallel
    assert train_flops_per_image(wrapped, image_size=2) == pytest.approx(2 * (2 * 12 * 4))


# ------------------------------------------------------------------ the unsynchronised window
def test_the_steps_after_the_synced_ones_are_timed_as_a_whole_with_one_wait_at_the_end():
    """3 steps timed phase by phase, then 4 in the window: no wait and no clock read until end_window(), which
    waits once; the window's throughput counts everything in it (the untimed per-step work too)."""
    chrono, clock, sync = make(synced_steps=3)
    for _ in range(3):
        run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3)
    waits, reads = sync.calls, clock.reads
    for _ in range(4):
        run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3, untimed=0.4)  # MixUp, log points: in the window
    assert (sync.calls, clock.reads) == (waits, reads)
    assert chrono.steps == 3 and chrono.window_steps == 4
    chrono.end_window()
    chrono.end_window()  # (gather closes it too: once)
    assert (sync.calls, clock.reads) == (waits + 1, reads + 1)
    s = chrono.summary({"images_per_step": 10})
    assert s["unsync_window_steps"] == 4 and s["unsync_throughput_img_s"] == pytest.approx(40 / 4.0)
    assert s["throughput_img_s"] == pytest.approx(10 / 0.6)  # the chronometer's: the synced steps' medians
    lines = report_lines(s, 0)
    assert any(
        line.startswith("=>>> Throughput, unsynchronised: 10.0 images/s over the last 4 steps") for line in lines
    )


def test_a_validation_pauses_the_window_and_the_steps_after_it_count():
    """A window crossing an epoch's end: the validation's seconds are left out (two waits, at its ends, as always),
    the steps after it counted, the window's one wait at its end: the same span as a run inside one epoch."""
    chrono, clock, sync = make(synced_steps=2)
    for _ in range(2):
        run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3)
    for _ in range(3):
        run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3, untimed=0.4)
    waits = sync.calls
    chrono.validation()
    clock.advance(5.0)  # the validation: not the training's
    chrono.validation()
    assert sync.calls == waits + 2 and chrono.val_time == pytest.approx(5.0)
    for _ in range(2):
        run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3, untimed=0.4)
    chrono.end_window()
    s = chrono.summary({"images_per_step": 10})
    assert s["unsync_window_steps"] == 5 and s["unsync_throughput_img_s"] == pytest.approx(50 / 5.0)
    chrono, clock, _ = make(synced_steps=1)  # ended during a validation (a stop): the seconds before it
    run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3)
    run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3, untimed=0.4)
    chrono.validation()
    clock.advance(5.0)
    chrono.end_window()
    assert chrono.summary({"images_per_step": 10})["unsync_throughput_img_s"] == pytest.approx(10 / 1.0)


def test_without_a_window_there_is_no_unsynchronised_figure():
    chrono, clock, _ = make()
    for _ in range(3):
        run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3)
    chrono.end_window()
    assert "unsync_throughput_img_s" not in chrono.summary({"images_per_step": 10}) and chrono.window_steps == 0
    chrono, clock, _ = make(synced_steps=3)  # a window asked for, but the run ended with the synced steps
    for _ in range(3):
        run_step(chrono, clock, load=0.1, fwd=0.2, bwd=0.3)
    s = chrono.summary({"images_per_step": 10})
    assert "unsync_throughput_img_s" not in s and s["unsync_window_steps"] == 0
    assert any("unsynchronised: not measured" in line for line in report_lines(s, 0))
