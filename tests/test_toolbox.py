"""The course's optimisation toolbox as dlojz.py flags, end to end on the CPU."""

import csv
import gzip
import shutil

import pytest
import torch
from conftest import SMALL, clean_env, read_json, run_dlojz, show
from test_dlojz import assert_one_line_error


def test_findlr_writes_csv_png_and_a_suggestion_in_range(tiny_data, tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--findlr",
        "--test",
        "--test-nsteps",
        "16",
        "--lr",
        "10",
        "--output-dir",
        tmp_path,
        "--metrics-json",
        metrics,
    )
    assert proc.returncode == 0, show(proc)
    rows = list(csv.DictReader((tmp_path / "findlr.csv").open()))
    assert 2 <= len(rows) <= 16
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[0] == pytest.approx(1e-8) and all(b > a for a, b in zip(lrs, lrs[1:]))  # exponential sweep up
    assert (tmp_path / "findlr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    suggested = read_json(metrics)["findlr_suggested_lr"]
    assert lrs[0] <= suggested <= lrs[-1]
    assert "suggested --lr" in proc.stdout
    assert "Validation" not in proc.stdout  # the range test does not validate


def test_profiler_trace_has_the_labels(tiny_data, tmp_path):
    proc = run_dlojz(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--test",
        "--test-nsteps",
        "5",
        "--prof",
        "--prof-wait",
        "1",
        "--prof-warmup",
        "1",
        "--prof-active",
        "2",
        "--output-dir",
        tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    traces = list((tmp_path / "profiler").glob("rank0*.json*"))
    assert len(traces) == 1, list((tmp_path / "profiler").iterdir())
    raw = traces[0].read_bytes()
    text = (gzip.decompress(raw) if traces[0].suffix == ".gz" else raw).decode()
    for name in ("data_loading", "forward", "loss", "backward", "optimizer_step"):
        assert f'"name": "{name}"' in text or f'"name":"{name}"' in text, name
    assert "profiler: no collectives in the 2 profiled steps" in proc.stdout  # one process


def test_optimizer_schedule_ema_and_scaling_rule(tiny_data, tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--epochs",
        "2",
        "--optimizer",
        "lamb",
        "--lr-scheduler",
        "cosine",
        "--warmup-epochs",
        "1",
        "--wd",
        "0.05",
        "--no-wd-norm-bias",
        "--model-ema",
        "--model-ema-decay",
        "0.9",
        "--no-wandb",
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path,
    )
    assert proc.returncode == 0, show(proc)
    assert "per 256 images (linear scaling rule)" in proc.stdout
    m = read_json(metrics)
    assert 0 <= m["ema_val_accuracy"] <= 1 and m["ema_val_loss"] > 0
    state = torch.load(tmp_path / (tmp_path / "latest").read_text().strip(), weights_only=True)
    assert state["ema"] is not None and state["scheduler"]["last_epoch"] == 18
    decays = sorted({g["weight_decay"] for g in state["optimizer"]["param_groups"]})
    assert decays == [0.0, 0.05]


def test_compile_runs_a_few_steps(tiny_data, tmp_path):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile needs a C compiler on the CPU: none found")
    metrics = tmp_path / "m.json"
    # A subprocess: inductor's compile workers and threads must not live in pytest's process, which forks later.
    proc = run_dlojz(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--test",
        "--test-nsteps",
        "3",
        "--compile",
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path,
        timeout=900,
        env=clean_env(TORCH_LOGS="dynamo"),
    )
    assert proc.returncode == 0, show(proc)
    # the model that trained was traced by dynamo (its log says so; without --compile nothing is traced)
    assert "torchdynamo done tracing forward" in proc.stderr, show(proc)
    m = read_json(metrics)
    chrono = m["chrono"]
    # compilation is shown apart (time to the first step) and kept out of the step statistics
    assert chrono["time_to_first_step_s"] > chrono["step_median_s"] and chrono["measured_steps"] == 2


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--findlr", "--eval-only", "--resume", "x.pt"], ["--findlr", "--eval-only"]),
        (["--grad-acc", "0"], ["--grad-acc"]),
        (["--optimizer", "adamx"], ["--optimizer"]),
        (["--lr-scheduler", "polynomial"], ["--lr-scheduler"]),
        (["--sync-bn"], ["--sync-bn", "CUDA"]),
        (["--model-ema", "--model-ema-decay", "1.5"], ["--model-ema-decay"]),
    ],
)
def test_incompatible_or_bad_toolbox_flags(tiny_data, tmp_path, flags, fragments, run_inline):
    proc = run_inline(*SMALL, "--data-root", tiny_data, *flags, "--output-dir", tmp_path)
    assert_one_line_error(proc, *fragments)


def test_grad_checkpointing_reports_the_memory_it_saves(tiny_data, tmp_path):
    figures = {}
    for name, extra in (("plain", []), ("ckpt", ["--grad-checkpointing"])):
        metrics = tmp_path / f"{name}.json"
        proc = run_dlojz(
            *SMALL,
            "--arch",
            "resnet18",  # activations large enough beside the weights for the saving to show
            "--data-root",
            tiny_data,
            "-b",
            "8",
            "--test",
            "--test-nsteps",
            "2",
            *extra,
            "--metrics-json",
            metrics,
            "--output-dir",
            tmp_path / name,
        )
        assert proc.returncode == 0, show(proc)
        figures[name] = read_json(metrics)
    kept = figures["ckpt"]["activation_bytes_per_image"]
    plain = figures["ckpt"]["activation_bytes_per_image_without_checkpointing"]
    assert 0 < kept < plain / 2
    assert "--grad-checkpointing: activations kept for the backward" in proc.stdout
    # model FLOPs do not count the recomputation
    assert figures["ckpt"]["chrono"]["train_flops_per_image"] == figures["plain"]["chrono"]["train_flops_per_image"]


def test_the_collectives_line_names_nccl_kernels_and_host_waits():
    """collective_times on a GPU's events (NCCL kernels' device time, by kind) and on the host's (c10d's operators,
    and DTensor's functional waits apart), per step; other events are not counted."""
    from types import SimpleNamespace

    from dlojz_lib.observers.hooks import collective_times

    def event(key, device_us=0.0, cpu_us=0.0, self_cpu_us=0.0):
        return SimpleNamespace(
            key=key, self_device_time_total=device_us, cpu_time_total=cpu_us, self_cpu_time_total=self_cpu_us
        )

    gpu = [
        event("ncclDevKernel_AllGather_RING_LL", device_us=3000),
        event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", device_us=1000),
        event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", device_us=4000),
        event("aten::mm", device_us=9000),
    ]
    assert collective_times(gpu, 2, on_gpu=True) == {"all_gather": 1.5, "reduce_scatter": 0.5, "all_reduce": 2.0}
    host = [
        event("c10d::allreduce_", cpu_us=2000),
        event("_c10d_functional::wait_tensor", self_cpu_us=6000),
        event("aten::addmm", cpu_us=5000),
    ]
    assert collective_times(host, 2, on_gpu=False) == {"all_reduce": 1.0, "waits": 3.0}
