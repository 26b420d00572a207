"""The loader benchmark runs end to end (on tiny data) and builds ImageNet-like JPEGs: benchmarks must not rot."""

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import preloaded
import pytest
from conftest import ROOT, clean_env, importtime, script_python
from PIL import Image

sys.path.insert(0, str(ROOT / "bench"))
import bench_loader  # noqa: E402


def test_bench_loader_prints_every_pipeline(tiny_data, tmp_path):
    from dlojz_lib.pack.writer import pack

    pack(tiny_data, tmp_path / "packed", log=lambda *a, **k: None)
    command = [
        *script_python(),
        str(ROOT / "bench" / "bench_loader.py"),
        "--data",
        str(tiny_data),
        "--workers",
        "1",
        "--batch-size",
        "4",
        "--batches",
        "2",
        "--warmup-batches",
        "1",
        "--repeats",
        "1",
        "--sizes",
        "32",
        "--shards",
        str(tmp_path / "packed"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dlojz JPEG decoder:" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 32 |")]
    assert len(rows) == 1, result.stdout
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    reference, ours, ratio, ours_normalised, ratio_normalised = (float(cell) for cell in cells[3:8])
    assert min(reference, ours, ours_normalised) > 0
    assert abs(ratio - ours / reference) < 0.5 * ratio and ratio_normalised > 0
    shards, _, dali, _ = (float(cell) for cell in cells[8:12])  # the shards and DALI-CPU rows
    assert shards > 0 and dali > 0, result.stdout
    assert "dlojz shards img/s | ratio | DALI-CPU img/s" in result.stdout


def test_bench_loader_rejects_a_folder_that_is_not_an_image_folder(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "bench_loader.py"), "--data", str(tmp_path / "nowhere")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=clean_env(), cwd=ROOT)
    assert result.returncode == 2 and "--data" in result.stderr and "Traceback" not in result.stderr


def test_generated_jpegs_look_like_imagenet_files():
    data = bench_loader.natural_like_jpeg(seed=1, width=500, height=375)
    img = Image.open(io.BytesIO(data))
    assert img.format == "JPEG" and img.size == (500, 375) and img.mode == "RGB"
    assert 60_000 < len(data) < 160_000  # ImageNet's training JPEGs average ~110 KB


def test_gpu_seams_says_no_cuda_gpu_here(capsys):
    """bench/gpu_seams.py (day 4's seams on one GPU) without a GPU: exit status 1 and the line that says why."""
    import gpu_seams

    assert gpu_seams.main([]) == 1
    assert capsys.readouterr().out == "gpu_seams.py: no CUDA GPU visible\n"


def test_gpu_checks_run_their_cpu_parts(tiny_data, tmp_path, capsys):
    """bench/gpu_checks.py --device cpu: the checks a CPU can run pass (the selective policy recomputes no matrix
    product or convolution and full checkpointing does, the meta-device fill, DALI's loader rows; --fsdp --compile
    against eager is tests/parallelism/test_fsdp.py's compiled run, left out here for the suite's time); the GPU's
    are skipped, each with why; one row each and the JSON. Without a GPU --device cuda is one line, exit 1."""
    import gpu_checks

    out = tmp_path / "checks.json"
    names = ["selective_policy", "meta_fill", "fsdp_offload", "float8", "dali_loader", "dali_memory", "dali_lifetimes"]
    names.append("seams")
    command = [str(ROOT / "bench" / "gpu_checks.py"), "--device", "cpu", "--quick", "--only", ",".join(names)]
    proc = subprocess.run(
        [*script_python(), *command, "--data", str(tiny_data / "train"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    assert {name: row["status"] for name, row in checks.items()} == {
        "selective_policy": "ok", "meta_fill": "ok", "fsdp_offload": "skipped", "float8": "ok", "dali_loader": "ok",
        "dali_memory": "skipped", "dali_lifetimes": "skipped", "seams": "skipped",
    }  # fmt: skip
    policy = checks["selective_policy"]
    for kind in ("vit", "resnet"):
        recomputed = [policy[f"backward_costly_ops {kind} {mode}"] for mode in ("none", "selective", "full")]
        assert recomputed[0] == recomputed[1] < recomputed[2], policy
    assert checks["dali_loader"]["img_s roi threads 1"] > 0 and checks["dali_loader"]["img_s whole threads 1"] > 0
    assert (
        checks["float8"]["converted tensorwise"] == 24
        and checks["float8"]["losses tensorwise"] != checks["float8"]["losses none"]
    )
    assert [line.split()[0] for line in proc.stdout.splitlines() if line[:1].isalpha()][-8:] == list(checks)
    assert set(gpu_checks.CHECKS) == {*names, "fsdp_compile"}
    assert gpu_checks.main(["--device", "cuda"]) == 1 and "no CUDA GPU visible" in capsys.readouterr().out


def test_gpu_acceptance_says_no_cuda_gpu_here():
    """The one-command GPU acceptance run, on a machine without a GPU: non-zero, and its last line says why."""
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_acceptance.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode != 0
    assert proc.stdout.strip().splitlines()[-1].startswith("no CUDA GPU found"), proc.stdout + proc.stderr


def test_gpu_acceptance_imports_from_dlojz_what_dlojz_has():
    """The script's Python (its data set, its driver check) runs only on a GPU node: what it takes from dlojz_lib is
    checked here, on any machine."""
    import importlib
    import re

    text = (ROOT / "bench" / "gpu_acceptance.sh").read_text()
    names = re.findall(r"^from (dlojz_lib[\w.]*) import (\w+)$", text, re.M)
    names += re.findall(r"import (dlojz_lib[\w.]*) as (\w+); .*\b\2\.(\w+)\(", text)
    assert len(names) >= 2, names
    for module, *attributes in names:
        name = attributes[-1] if len(attributes) == 1 else attributes[1]
        assert hasattr(importlib.import_module(module), name), (
            f"bench/gpu_acceptance.sh: {module}.{name} does not exist"
        )


def test_bench_time_to_accuracy_prints_both_recipes(embedded_cache, tmp_path):
    result = subprocess.run(
        [
            *script_python(clean_env(XDG_CACHE_HOME=embedded_cache)),
            str(ROOT / "bench" / "bench_time_to_accuracy.py"),
            "--epochs",
            "1",
            "--size",
            "16",
            "--batch-size",
            "64",
            "--python",  # both runs forks of the tests' preloaded server
            str(preloaded.python_executable(tmp_path, clean_env(XDG_CACHE_HOME=embedded_cache))),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(XDG_CACHE_HOME=embedded_cache),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("recipe "))
    rows = [line.split() for line in lines[header + 1 : header + 3]]  # the table's two rows, under its header
    assert [row[0] for row in rows] == ["course", "race"] and all(0 <= float(row[1]) <= 1 for row in rows)
    assert "race time to the course's final top-1" in lines[-1] or "did not reach" in lines[-1], lines[-1]
    calls = (tmp_path / "python.calls").read_text().splitlines()
    assert len(calls) == 2 and all(call.startswith(str(ROOT / "dlojz.py")) for call in calls), calls


def test_bench_storage_counts_opens_and_times_both_formats(tiny_data, tmp_path):
    import shutil

    data = shutil.copytree(tiny_data, tmp_path / "tree")
    command = [
        *script_python(),
        str(ROOT / "bench" / "bench_storage.py"),
        "--data",
        str(data),
        "--workers",
        "1",
        "--batch-size",
        "8",
        "--size",
        "32",
        "--shard-size",
        "10MB",
        "--no-cold",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:5]
        for line in result.stdout.splitlines()
        if line.startswith("| files") or line.startswith("| shards")
    }
    assert float(rows["files"][0]) >= 1000 and float(rows["shards"][0]) < 100, result.stdout  # one open per file
    assert float(rows["files"][1]) > 0 and float(rows["shards"][1]) > 0 and "not measured" in rows["shards"][2]


def test_bench_plain_loop_compares_dlojz_with_a_plain_loop_on_jpegs(tiny_data, tmp_path):
    """Both sides run on the same JPEGs and the table reports both rates, their ratio and both data waits; both
    started by --python (forks of the tests' preloaded server)."""
    command = [
        *script_python(),
        str(ROOT / "bench" / "bench_plain_loop.py"),
        "--data",
        str(tiny_data),
        "--arch",
        "resnet18",
        "--image-size",
        "32",
        "--batch-size",
        "2",
        "--images",
        "40",
        "--workers",
        "1",
        "--threads",
        "1",
        "--python",
        str(preloaded.python_executable(tmp_path, clean_env())),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    calls = sorted(call.split()[0] for call in (tmp_path / "python.calls").read_text().splitlines())
    assert calls == [str(ROOT / "bench" / "bench_plain_loop.py"), "dlojz.py"], calls
    row = next(line for line in result.stdout.splitlines() if line.startswith("| 1 |"))
    ours, theirs, ratio, our_wait, their_wait = (float(cell) for cell in row.strip("|").split("|")[1:6])
    assert ours > 0 and theirs > 0 and our_wait >= 0 and their_wait >= 0
    assert abs(ratio - ours / theirs) < 0.01 * ratio
    assert "dlojz / plain loop:" in result.stdout and "--num-workers 1" in result.stdout


def test_bench_train_writes_the_ratio_the_gpu_acceptance_run_prints(tmp_path):
    """bench/bench_train.py on a tiny model: both variants timed against the bare loop, medians and ratios written
    to --json as bench/gpu_acceptance.sh reads them; its four runs started by --python (forks of the tests'
    preloaded server)."""
    import json

    out = tmp_path / "bench_train.json"
    command = [
        *script_python(),
        str(ROOT / "bench" / "bench_train.py"),
        "--device",
        "cpu",
        "--arch",
        "resnet18",
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--steps",
        "20",
        "--threads",
        "1",
        "--bare-keeps-freed-memory",
        "--json",
        str(out),
        "--python",
        str(preloaded.python_executable(tmp_path, clean_env())),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert set(rows) == {"test", "epoch"}, rows
    for row in rows.values():
        assert row["dlojz"] > 0 and row["bare"] > 0
        assert abs(row["ratio"] - row["dlojz"] / row["bare"]) < 1e-9  # one round: the ratio of its two runs
    assert "--bare-keeps-freed-memory" in result.stdout  # the bare loop's command says it
    assert "--test-nsteps 20 --val-crop-size 32 --val-resize-size 36 " in result.stdout  # validated at 32 px
    calls = sorted(call.split()[0] for call in (tmp_path / "python.calls").read_text().splitlines())
    assert calls == sorted(["dlojz.py", *[str(ROOT / "bench" / "bench_train.py")] * 3]), calls


def test_bench_checkpoint_times_a_foreground_and_a_background_save(tmp_path):
    import bench_checkpoint

    figures = bench_checkpoint.main(
        ["--model", "resnet18", "--image-size", "32", "--batch-size", "2", "--steps", "4", "--save-at", "1"]
        + ["--dir", str(tmp_path), "--json", str(tmp_path / "figures.json")]
    )
    assert set(figures["ratio"]) == {"foreground", "background"} and figures["checkpoint_bytes"] > 40e6
    assert list(tmp_path.iterdir()) == [tmp_path / "figures.json"]  # its checkpoints removed


def test_ablation_builds_on_float16_and_shows_bfloat16_eager_and_compiled_apart():
    """The compile, CUDA-graph and cores-table steps stand on float16 + channels-last (cuDNN's batch norm); the
    bfloat16 rows, eager and compiled, stand beside them; each row's flags are the previous row's plus its own."""
    import ablation

    rows = {name: flags for name, _, flags in ablation.ROWS}

    def dtype(flags):
        return flags[flags.index("--amp-dtype") + 1] if "--amp" in flags else "float32"

    assert [dtype(rows[name]) for name in ("float16", "channels-last", "compile", "cuda-graphs")] == ["float16"] * 4
    assert "--channels-last" in rows["compile"] and "--no-channels-last" in rows["float16"]
    assert rows["compile"] == [*rows["channels-last"], "--compile"]
    assert rows["cuda-graphs"] == [*rows["channels-last"], "--compile-mode", "reduce-overhead"]
    assert dtype(rows["bfloat16"]) == dtype(rows["bfloat16-compile"]) == "bfloat16"
    assert rows["bfloat16-compile"] == [*rows["bfloat16"], "--compile"]
    assert rows["bfloat16"] == [arg if arg != "float16" else "bfloat16" for arg in rows["channels-last"]]
    assert ablation.FASTEST_PER_CORE == rows["channels-last"]


def test_ablation_s_mfu_uses_one_16_bit_peak_per_gpu():
    import ablation

    h100 = "NVIDIA H100 80GB HBM3"
    assert ablation.mfu_16bit(1e9, 1000.0, h100, 1) == pytest.approx(1e12 / 989.4e12)
    # a float32 row's MFU is over the same peak as a float16 row's: the rows compare
    fp32, fp16 = (ablation.cells({"chrono": {"train_flops_per_image": 1e9, "unsync_throughput_img_s": x}}, h100)
                  for x in (1000.0, 4000.0))  # fmt: skip
    assert fp16["mfu"] == pytest.approx(4 * fp32["mfu"])
    assert ablation.mfu_16bit(1e9, 1000.0, "cpu", 1) is None


def test_ablation_prints_both_tables_from_the_runs_metrics(tiny_data, tmp_path):
    """bench/ablation.py on the CPU (a small model and image): the ablation's rows and columns, each cell the figure
    of its run's metrics JSON, a row this device refuses shown as failed (the table goes on), the cores table."""
    import json

    out = tmp_path / "abl"
    command = [
        *script_python(),
        str(ROOT / "bench" / "ablation.py"),
        *("--device", "cpu", "--arch", "resnet18", "--image-size", "32", "-b", "8", "--steps", "4"),
        *("--rows", "fp32,cuda-graphs", "--cores", "1", "--no-dali", "--data-root", str(tiny_data), "--out", str(out)),
        # its five dlojz.py runs: forks of the tests' preloaded server (each pinned as taskset pins it)
        *("--python", str(preloaded.python_executable(tmp_path, clean_env()))),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=ROOT)
    assert result.returncode == 1, result.stderr[-3000:]  # a cell failed: the CUDA-graph row, on the CPU
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| row |"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        *("row", "adds", "synthetic img/s", "chrono img/s", "MFU", "J/image (mean W)", "peak GiB"),
        *("real img/s", "chrono img/s", "load share", "peak GiB"),
    ]
    fp32 = [c.strip() for c in next(line for line in lines if line.startswith("| fp32 |")).strip("|").split("|")]
    table = json.loads((out / "ablation.json").read_text())
    for (unsync, synced), run in (((fp32[2], fp32[3]), "fp32-synthetic"), ((fp32[7], fp32[8]), "fp32-data")):
        chrono = json.loads((out / f"{run}.json").read_text())["chrono"]
        assert chrono["unsync_window_steps"] == 2 and chrono["steps"] == 2  # --steps 4: the last 2 unsynchronised
        assert unsync == f"{chrono['unsync_throughput_img_s']:,.0f}", (unsync, run)
        assert synced == f"{chrono['throughput_img_s']:,.0f}", (synced, run)
        assert table[run]["img_s"] == chrono["unsync_throughput_img_s"]  # both figures in the JSON
        assert table[run]["chrono_img_s"] == chrono["throughput_img_s"]
    assert fp32[4] == fp32[5] == "n/a"  # MFU and energy: GPU figures
    peak = json.loads((out / "fp32-data.json").read_text())["chrono"]["peak_memory_bytes"]
    assert fp32[10] == f"{peak / 2**30:.1f}" and fp32[9].endswith("%")
    graphs = next(line for line in lines if line.startswith("| cuda-graphs |"))
    assert "failed: dlojz: error: --compile-mode reduce-overhead records CUDA graphs, which need a GPU" in graphs
    cores = next(line for line in lines if line.startswith("| 2 (1 + 1) |"))
    chrono = json.loads((out / "cores1-pytorch.json").read_text())["chrono"]
    assert cores.split("|")[2].strip() == f"{chrono['unsync_throughput_img_s']:,.0f}"
    assert (out / "ablation.md").read_text().strip() == result.stdout.strip()
    calls = (tmp_path / "python.calls").read_text().splitlines()  # --python ran every dlojz.py run
    assert len(calls) == 5 and all(call.startswith(str(ROOT / "dlojz.py")) for call in calls), calls


@pytest.mark.parametrize(
    "script, bad, says",
    [
        ("bench_train.py", ["--device", "cpu", "--steps", "15"], "--steps must be a multiple of 10 above 10"),
        ("bench_checkpoint.py", ["--steps", "4", "--save-at", "3"], "--save-at must leave a step before it and one"),
        ("bench_loader.py", ["--data", "/nonexistent/imagenet"], "--data /nonexistent/imagenet: not a folder"),
    ],
)
def test_a_bench_refuses_a_bad_flag_in_one_line_before_it_imports_torch(script, bad, says):
    """bench_train.py's driver on a CPU only starts subprocesses: its flags are checked, and its runs started,
    without torch; bench_checkpoint.py and bench_loader.py check their flags before they import torch."""
    command = [sys.executable, "-X", "importtime", str(ROOT / "bench" / script), *bad]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=clean_env())
    assert result.returncode == 2 and says in result.stderr.splitlines()[-1], result.stderr[-2000:]
    _, imported = importtime(result.stderr)
    assert "dlojz_lib.settings.flags" in imported and "torch" not in imported, imported


def test_the_bare_loop_steps_with_dlojz_s_fused_sgd():
    """An unfused SGD under the float16 GradScaler reads the device every step: the reference would flatter dlojz."""
    import bench_train
    import torch

    optimizer = bench_train.bare_optimizer(torch.nn.Linear(4, 2))
    assert optimizer.defaults["fused"] and optimizer.defaults["momentum"] == 0.9


@pytest.mark.parametrize(
    "script, flag",
    [
        ("ablation.py", "--data-root"),
        ("bench_plain_loop.py", "--data"),
        ("bench_storage.py", "--data"),
        ("gpu_session.py", "--data"),
    ],
)
def test_a_bench_given_a_missing_data_folder_says_so_before_any_run(script, flag, tmp_path):
    missing = tmp_path / "nonexistent"
    command = [sys.executable, str(ROOT / "bench" / script), flag, str(missing), "--device", "cpu"]
    if script == "bench_storage.py":
        command = command[:-2]  # (no --device: it reads files only)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"{flag} {missing}: no train/ folder there" in result.stderr.splitlines()[-1]
    assert not list(tmp_path.iterdir()) and result.stdout == ""  # nothing run, nothing written


def test_the_activation_memory_bench_orders_the_modes(tmp_path):
    """bench/activation_memory.py on a tiny ViT: a row per mode, the bytes held ordered as the modes say (full the
    least, selective between full and none, every 2nd block between its mode and none), none's ratios 1."""
    import json

    table = tmp_path / "rows.json"
    command = [*script_python(), str(ROOT / "bench" / "activation_memory.py"), "--arch", "timm:test_vit",
               "--image-size", "32", "-b", "4", "--repeats", "1", "--json", str(table)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    held = {(row["mode"], row["every"]): row["held_bytes"] for row in json.loads(table.read_text())}
    assert held["full", 1] < held["selective", 1] < held["none", 1], held
    assert held["full", 1] < held["full", 2] < held["none", 1] and held["selective", 1] < held["selective", 2], held
    assert "none             1" in result.stdout and "x none" in result.stdout


def test_the_train_bench_takes_dlojz_s_flags_from_its_flag_table():
    """bench/bench_train.py's flags that are dlojz.py's (--arch, -b, --image-size, --device, AMP, channels-last, the
    seed, TF32) are the flag table's rows (settings.flags.flag_like): the same type and bounds, choices and switch,
    so a value dlojz.py refuses the bench refuses in the same words, and a row changed in the table changes the
    bench."""
    import argparse

    import bench_train

    from dlojz_lib.settings.flags import flag_like, get_args_parser

    table = {flag: action for action in get_args_parser()._actions for flag in action.option_strings}
    _, parser = bench_train.parse_args(["--device", "cpu"])
    shared = [action for action in parser._actions if action.option_strings[0] in table and action.dest != "help"]
    assert {action.dest for action in shared} >= {"arch", "batch_size", "image_size", "device", "amp", "seed", "tf32"}

    def same_type(a, b):  # (a Number is made anew with each parser: the same kind and bounds)
        return a == b or (type(a) is type(b) and vars(a) == vars(b))

    for action in shared:
        row = table[action.option_strings[0]]
        assert type(action) is type(row) and action.choices == row.choices, action.dest
        assert same_type(action.type, row.type), action.dest
    changed = argparse.ArgumentParser()
    flag_like(changed, "--batch-size", default=7)
    assert changed.parse_args([]).batch_size == 7 and changed.parse_args(["--batch-size", "3"]).batch_size == 3
    with pytest.raises(SystemExit):
        changed.parse_args(["--batch-size", "0"])  # the row's bounds


class FakeClock:
    """The budget's clock, moved by the rows' fake runners only."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def session_of(tmp_path, clock, budget_s):
    import gpu_session

    session = gpu_session.Session("cpu", budget_s, tmp_path, steps=6, clock=clock)
    session._environment = {"date": "2026-12-03", "device_name": "NVIDIA H200", "driver": "580.1", "torch": "2.11.0"}
    session._environment.update(dali="2.4.0", torchao=None)
    return session


def test_the_gpu_session_runs_its_rows_in_priority_order_and_skips_what_the_time_left_cannot_hold(tmp_path):
    """Rows in ROWS' order whatever order --only gives; a row whose estimate exceeds the time left is skipped with a
    line saying both, a later cheaper row still runs, the clock never passes the budget, and the JSON and the
    markdown table (rewritten after each row) hold every row with the DALI / synthetic and MLPerf ratios."""
    import gpu_session

    clock, ran, lines = FakeClock(), [], []
    spent = {"data": 30, "dali": 60, "synthetic": 50, "cpu_pipeline": 55, "dali_memory": 20, "float8": 10}
    costs = {name: 40 for name in gpu_session.ROWS} | {"cpu_pipeline": 200, "ablation": 300}

    def runner(name):
        def run(session):
            ran.append(name)
            clock.now += spent.get(name, 35)
            return {"status": "ok", "unsync_throughput_img_s": {"dali": 7900.0, "synthetic": 8000.0}.get(name)}

        return run

    session = session_of(tmp_path, clock, budget_s=300)
    names = ["float8", "synthetic", "ablation", "dali_memory", "cpu_pipeline", "dali", "data"]
    rows = gpu_session.run_session(session, names, {name: runner(name) for name in names}, costs, lines.append)
    assert ran == ["data", "dali", "synthetic", "dali_memory", "float8"]  # cpu_pipeline (200 s) no longer fitted
    assert list(rows) == ["data", "dali", "synthetic", "cpu_pipeline", "dali_memory", "float8", "ablation"]
    assert rows["cpu_pipeline"]["status"] == "skipped" and "needs ~200 s, 155 s left" in lines[3]
    assert rows["ablation"]["why"] == "needs ~300 s, 125 s left" and clock.now == 170 <= session.budget_s
    report = json.loads((tmp_path / "session.json").read_text())
    assert report["rows"]["dali"]["seconds"] == 60 and report["budget_s"] == 300
    assert "DALI / synthetic, unsynchronised img/s: 0.988" in report["ratios"]
    assert "DALI row / MLPerf's 7,950 img/s per H200: 0.994" in report["ratios"]
    table = (tmp_path / "session.md").read_text()
    assert "| dali | ok | 60 (40) | 7,900 | n/a |  |" in table and "| ablation | skipped | - (300) |" in table


def test_the_gpu_session_stops_a_row_when_its_budget_ends(tmp_path):
    """A row still running when the budget ends is stopped, its process group with it (a child it started too),
    and says so: the session does not run past its budget whatever a row's estimate said."""
    import gpu_session

    session = session_of(tmp_path, time.monotonic, budget_s=gpu_session.TAIL_S + 2)
    session.start = time.monotonic()
    grandchild = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time; child = subprocess.Popen(['sleep', '120']); "
        f"open({str(grandchild)!r}, 'w').write(str(child.pid)); time.sleep(120)"
    )
    begun = time.monotonic()
    result = gpu_session.Session.run(session, "sleeper", [sys.executable, "-c", script])
    assert result == {"status": "stopped", "why": "the budget ended while it ran"}
    assert time.monotonic() - begun < 60  # (2 s of budget; 120 s had it not been stopped)
    pid = int(grandchild.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not process_gone(pid):
        time.sleep(0.1)
    assert process_gone(pid)


def process_gone(pid) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def test_the_gpu_session_refuses_an_unknown_row_in_one_line(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "gpu_session.py"), "--only", "dali,mfu", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=clean_env())
    assert result.returncode == 2 and "--only mfu: not a row; the rows are data,dali," in result.stderr.splitlines()[-1]
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_gpu_session_runs_end_to_end_on_the_cpu(tmp_path):
    """--device cpu within a 75 s budget: the data row writes JPEGs; DALI's CPU backend, --synthetic and the
    DataLoader train on them, each row's unsynchronised img/s read from its run's metrics; the ratios printed; the
    ablation (~60 s) no longer fits and is skipped; the session ends inside its budget, exit 0 unless a row was
    stopped at the budget's end (a machine slower than its estimates)."""
    out = tmp_path / "session"
    env = clean_env() | {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [*script_python(env), str(ROOT / "bench" / "gpu_session.py"), "--device", "cpu", "--out", str(out)]
    command += ["--budget-s", "75", "--only", "ablation,meta_fill,cpu_pipeline,synthetic,dali,data"]
    command += ["--python", str(preloaded.python_executable(tmp_path, env))]  # its rows: forks of the tests' server
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    report = json.loads((out / "session.json").read_text())
    rows = report["rows"]
    # Inside its budget by its own clock (a loaded machine's slower start-up is not the session's to bound).
    assert report["budget_s"] == 75 and sum(row.get("seconds", 0) for row in rows.values()) <= 75, rows
    assert list(rows) == ["data", "dali", "synthetic", "cpu_pipeline", "meta_fill", "ablation"]
    stopped = [name for name, row in rows.items() if row["status"] == "stopped"]
    assert result.returncode == (1 if stopped else 0), result.stdout[-3000:] + result.stderr[-3000:]
    assert rows["data"]["status"] == rows["dali"]["status"] == "ok" and rows["data"]["train_images"] == 10 * 24
    assert rows["ablation"]["status"] == "skipped" and rows["ablation"]["why"].startswith("needs ~60 s, ")
    for name in ("dali", "synthetic", "cpu_pipeline"):
        if rows[name]["status"] == "ok":
            metrics = json.loads((out / f"{name}.json").read_text())
            assert rows[name]["unsync_throughput_img_s"] == metrics["chrono"]["unsync_throughput_img_s"] > 0
        else:
            assert rows[name]["status"] in ("skipped", "stopped"), rows[name]
    assert 'data-backend = "dali"' in (out / "dali" / "args.toml").read_text()
    assert (tmp_path / "cache" / "dlojz" / "gpu-session-96x80-24" / ".complete").exists()  # (XDG_CACHE_HOME's)
    if rows["synthetic"]["status"] == "ok":
        assert "DALI / synthetic, unsynchronised img/s:" in result.stdout
    assert "| dali | ok |" in (out / "session.md").read_text()
    started = [call.split()[:2] for call in (tmp_path / "python.calls").read_text().splitlines()]
    assert ["dlojz.py", "--test"] in started and ["bench/gpu_checks.py", "--device"] in started, started


def test_the_gpu_carry_s_install_refuses_missing_or_cut_pieces_in_one_line(tmp_path):
    """bench/gpu_carry.sh install, on the GPU machine: without the pieces, or with one cut short (the checksums of
    the joined wheels differ), one line saying what to carry, exit 2, nothing installed."""
    script = ["bash", str(ROOT / "bench" / "gpu_carry.sh"), "install"]
    result = subprocess.run(script, capture_output=True, text=True, env=clean_env(DLOJZ_CARRY=tmp_path / "none"))
    assert result.returncode == 2 and "carry each part first" in result.stdout.splitlines()[-1], result.stdout
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(bytes(range(256)) * 400)
    subprocess.run(["tar", "-cf", str(tmp_path / "w.tar"), "-C", str(wheels), "."], check=True)
    data = (tmp_path / "w.tar").read_bytes()
    for n, piece in enumerate((data[: len(data) // 2], data[len(data) // 2 : -30000]), start=1):  # the last cut short
        (tmp_path / "carry" / f"part{n}").mkdir(parents=True)
        (tmp_path / "carry" / f"part{n}" / f"piece.{n - 1:02d}").write_bytes(piece)
    digest = subprocess.run(["sha256sum", "./a-1.0-py3-none-any.whl"], cwd=wheels, capture_output=True, text=True)
    (tmp_path / "carry" / "part2" / "SHA256SUMS").write_text(digest.stdout)
    result = subprocess.run(script, capture_output=True, text=True, env=clean_env(DLOJZ_CARRY=tmp_path / "carry"))
    assert result.returncode == 2 and "checksums differ" in result.stdout.splitlines()[-1], result.stdout
