"""The course's ablation on the node it runs on: one optimisation added per row, then how many cores a GPU needs.

    python bench/ablation.py --data-root DIR                    # one GPU: ResNet-50, 224 px, batch 256
    python bench/ablation.py --device cpu --arch resnet18 --image-size 32 -b 8 --steps 3 --rows fp32,bfloat16 \\
        --cores 1 --data-root DIR                               # the table's code on the CPU (tests/test_bench.py)

Table 1, the ablation: each row is the previous one plus one flag of dlojz.py, from fp32 to the fastest step:
fp32 -> TF32 -> AMP float16 -> channels-last -> --compile -> CUDA graphs (--compile-mode reduce-overhead), all on
float16, the dtype that gives a BatchNorm model cuDNN's batch norm; then bfloat16 in its own two rows, eager and
compiled: in eager mode torch gives bfloat16's batch norm its native kernels, not cuDNN's (a ResNet-50 pays about
22 % on an H200), and --compile generates the batch norm itself, which removes the cost. Each row runs twice: with
--synthetic (the GPU alone) and through the real input pipeline (--data-root, all the task's CPUs as DataLoader
workers). Columns: img/s, the run's unsynchronised throughput (its last --steps/2 steps timed as a whole, the
device waited for at their start and end only, every per-step cost in: the figure to set beside MLPerf's);
chrono img/s, the chronometer's (the medians of the first steps, each phase synchronised: the figure that splits the
step into its phases); MFU (the unsynchronised throughput's model FLOP/s over the GPU's dense 16-bit tensor peak,
one peak per GPU so that rows compare); J/image (NVML, over the unsynchronised img/s's own window, with its mean power,
flagged when the pair exceeds the GPU's power limit); peak memory; and the real pipeline's data-loading share.
Table 2, cores per GPU: training img/s on the real pipeline with 2, 4, 8 and all workers for the pytorch backend,
and DALI (--data-backend dali, as many threads) with the same CPU budget: the run is pinned to workers + 1 CPUs
(the training process's own), so each column is what a job asking for that many cores would get.

Each cell is one dlojz.py run (--test: --steps optimizer steps, --test-unsync-steps the last half of them), its
metrics JSON kept under --out, and the JSON table (ablation.json) holds both throughputs of every run. A run that
fails is a cell saying so (its last line), not the end of the table. Rows whose flags this device refuses (CUDA
graphs on the CPU) say so in one line. --steps 60 (default) suffices on a GPU: the step's spread is a few per cent
and the medians resist the outliers; what costs time is each run's start (model, cuDNN autotuning, compilation:
~1 min for --compile, ~1 more for CUDA graphs, the cache warm for the real-pipeline run after the synthetic one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(
    0, str(ROOT)
)  # the flags' bounds and one-line errors: dlojz_lib.settings.flags, dlojz_lib.checks (no torch)
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.observers.chrono_report import unsync_energy_cell  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS  # noqa: E402

# One optimisation more per row: (name, what it adds, dlojz.py's flags for the row as a whole).
FLOAT16_CHANNELS_LAST = ["--amp", "--amp-dtype", "float16", "--tf32", "--channels-last"]
BFLOAT16_CHANNELS_LAST = ["--amp", "--amp-dtype", "bfloat16", "--tf32", "--channels-last"]
ROWS = [
    ("fp32", "float32, no TF32", ["--no-amp", "--no-tf32"]),
    ("tf32", "+ TF32 matmuls and convolutions", ["--no-amp", "--tf32"]),
    ("float16", "+ AMP float16 (GradScaler)", ["--amp", "--amp-dtype", "float16", "--tf32", "--no-channels-last"]),
    ("channels-last", "+ channels-last", FLOAT16_CHANNELS_LAST),
    ("compile", "+ torch.compile", [*FLOAT16_CHANNELS_LAST, "--compile"]),
    ("cuda-graphs", "+ CUDA graphs", [*FLOAT16_CHANNELS_LAST, "--compile-mode", "reduce-overhead"]),
    ("bfloat16", "channels-last, bfloat16 instead (eager)", BFLOAT16_CHANNELS_LAST),
    ("bfloat16-compile", "bfloat16 + torch.compile", [*BFLOAT16_CHANNELS_LAST, "--compile"]),
]
ROW_NAMES = [name for name, _, _ in ROWS]
FASTEST_PER_CORE = FLOAT16_CHANNELS_LAST  # the cores table's step: the fastest eager one


def task_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def get_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="the Python that runs dlojz.py (default: this one)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--image-size", type=PIXELS, default=224)
    p.add_argument("-b", "--batch-size", type=COUNT, default=256)
    p.add_argument(
        "--steps", type=COUNT, default=60, help="optimizer steps per run, the last half unsynchronised (default: 60)"
    )
    p.add_argument("--data-root", help="the real pipeline's data (train/ and val/); without it, synthetic rows only")
    p.add_argument("--rows", default=",".join(ROW_NAMES), help=f"which rows (default: all: {','.join(ROW_NAMES)})")
    p.add_argument(
        "--cores",
        default="2,4,8,all",
        help="DataLoader workers (and DALI threads) of the cores table; 'all': the task's CPUs - 1; '' for none",
    )
    p.add_argument("--no-dali", action="store_true", help="leave DALI out of the cores table")
    p.add_argument("--out", default=None, help="where the runs' metrics go (default: runs/ablation_<time>)")
    args = p.parse_args(argv)
    if args.data_root is not None and not (Path(args.data_root) / "train").is_dir():  # before minutes of rows
        p.error(f"--data-root {args.data_root}: no train/ folder there; give the data set's folder (train/, val/)")
    rows = [name for name in args.rows.split(",") if name]
    unknown = [name for name in rows if name not in ROW_NAMES]
    if unknown:
        p.error(f"--rows: unknown {', '.join(unknown)}; the rows are {', '.join(ROW_NAMES)}")
    args.rows = [row for row in ROWS if row[0] in rows]
    all_workers = max(1, len(task_cpus()) - 1)
    cores = []
    for text in filter(None, args.cores.split(",")):
        if text == "all":
            cores.append(all_workers)
        elif text.isdigit() and int(text) >= 1:
            cores.append(int(text))
        else:
            p.error(f"--cores: {text!r} is not a number of workers >= 1 or 'all'")
    args.cores = [n for n in dict.fromkeys(cores) if n <= all_workers] or ([all_workers] if cores else [])
    args.all_workers = all_workers
    args.out = Path(args.out or ROOT / "runs" / f"ablation_{int(time.time())}")
    return args


def run(args, name: str, flags: list[str], cpus: list[int] | None = None) -> dict:
    """One dlojz.py run; its metrics JSON, or {"error": its last line}."""
    metrics = args.out / f"{name}.json"
    command = [
        args.python,
        str(ROOT / "dlojz.py"),
        "--device",
        args.device,
        "--arch",
        args.arch,
        "--image-size",
        str(args.image_size),
        "-b",
        str(args.batch_size),
        "--test",
        "--test-nsteps",
        str(args.steps),
        "--test-unsync-steps",
        str(args.steps // 2),
        "--no-wandb",
        "--metrics-json",
        str(metrics),
        "--output-dir",
        str(args.out / name),
        *flags,
    ]
    if cpus is not None and shutil.which("taskset"):
        command = ["taskset", "-c", ",".join(map(str, cpus)), *command]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    (args.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not metrics.exists():
        lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit status {proc.returncode}"]
        return {"error": lines[-1][:120]}
    result = json.loads(metrics.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def cells(m: dict, device_name: str = "") -> dict:
    """The table's figures of one run, None where not measured (MFU and energy need a GPU): img_s, the run's
    unsynchronised throughput; chrono_img_s, the chronometer's."""
    if "error" in m:
        return m
    chrono = m.get("chrono") or {}
    peak = chrono.get("peak_memory_bytes") or m.get("max_memory_bytes")
    img_s = chrono.get("unsync_throughput_img_s")
    return {
        "img_s": img_s,
        "chrono_img_s": chrono.get("throughput_img_s"),
        "mfu": mfu_16bit(chrono.get("train_flops_per_image"), img_s, device_name, m.get("world_size") or 1),
        "energy": unsync_energy_cell(chrono),
        "peak_gib": None if peak is None else peak / 2**30,
        "load_share": chrono.get("load_share"),
    }


def mfu_16bit(flops_per_image, img_s, device_name: str, world_size: int):
    """The model FLOP/s at `img_s` over the GPU's dense 16-bit tensor peak (None off the known GPUs): one peak per
    GPU, whatever the row's dtype, so that the rows compare."""
    from dlojz_lib.model.zoo import peak_flops  # (torch: after the flags are checked)

    peak = peak_flops(device_name, "float16")
    if not (peak and flops_per_image and img_s):
        return None
    return flops_per_image * img_s / (peak * world_size)


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def ablation_table(results: dict, rows, with_data: bool, device_name: str = "") -> list[str]:
    head = "| row | adds | synthetic img/s | chrono img/s | MFU | J/image (mean W) | peak GiB |"
    rule = "|---|---|---:|---:|---:|---:|---:|"
    if with_data:
        head += " real img/s | chrono img/s | load share | peak GiB |"
        rule += "---:|---:|---:|---:|"
    lines = [head, rule]
    for name, adds, _ in rows:
        line = f"| {name} | {adds} |"
        runs = [results[f"{name}-synthetic"]] + ([results[f"{name}-data"]] if with_data else [])
        for kind, c in zip(("synthetic", "data"), (cells(run, device_name) for run in runs)):
            if "error" in c:
                line += f" failed: {c['error']} |" + " |" * (4 if kind == "synthetic" else 3)
            elif kind == "synthetic":
                line += (
                    f" {fmt(c['img_s'], ',.0f')} | {fmt(c['chrono_img_s'], ',.0f')} | {fmt(c['mfu'], '.1%')} |"
                    f" {c['energy']} | {fmt(c['peak_gib'], '.1f')} |"
                )
            else:
                line += (
                    f" {fmt(c['img_s'], ',.0f')} | {fmt(c['chrono_img_s'], ',.0f')} | {fmt(c['load_share'], '.1%')} |"
                    f" {fmt(c['peak_gib'], '.1f')} |"
                )
        lines.append(line)
    return lines


def cores_table(results: dict, cores: list[int], backends: list[str]) -> list[str]:
    head = "| CPUs (workers + 1) |" + "".join(f" {b} img/s | {b} load share |" for b in backends)
    lines = [head, "|---:|" + "---:|---:|" * len(backends)]
    for n in cores:
        line = f"| {n + 1} ({n} + 1) |"
        for backend in backends:
            c = cells(results[f"cores{n}-{backend}"])
            if "error" in c:
                line += f" failed: {c['error']} | |"
            else:  # (unsynchronised: what the job gets from its cores)
                line += f" {fmt(c['img_s'], ',.0f')} | {fmt(c['load_share'], '.1%')} |"
        lines.append(line)
    return lines


def main(argv=None) -> int:
    args = get_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with_data = args.data_root is not None
    data = ["--data-root", args.data_root] if with_data else []
    results = {}
    for name, _, flags in args.rows:
        results[f"{name}-synthetic"] = run(args, f"{name}-synthetic", ["--synthetic", *flags])
        if with_data:
            results[f"{name}-data"] = run(args, f"{name}-data", [*data, "--num-workers", str(args.all_workers), *flags])
        print(f"{name}: done", file=sys.stderr, flush=True)
    backends = []
    if with_data and args.cores:
        backends = ["pytorch"]
        if not args.no_dali:
            from dlojz_lib.data.dali import check_available

            if check_available() is None:
                backends.append("dali")
            else:
                print(f"no DALI column: {check_available()}", file=sys.stderr)
        cpus = task_cpus()
        for n in args.cores:
            for backend in backends:
                flags = [*data, "--num-workers", str(n), "--data-backend", backend, *FASTEST_PER_CORE]
                results[f"cores{n}-{backend}"] = run(args, f"cores{n}-{backend}", flags, cpus[: n + 1])
    device_name = gpu_name() if args.device == "cuda" else "cpu"
    lines = [
        f"{args.arch}, {args.image_size} px, batch {args.batch_size}, {args.steps} steps per run (img/s: the last "
        f"{args.steps // 2}, unsynchronised; chrono img/s: the chronometer's medians), device "
        f"{args.device}{' (' + device_name + ')' if args.device == 'cuda' else ''}; runs in {args.out}",
        "",
        *ablation_table(results, args.rows, with_data, device_name),
    ]
    if backends:
        lines += ["", f"Cores per GPU (real pipeline, {' '.join(FASTEST_PER_CORE)}):", ""]
        lines += cores_table(results, args.cores, backends)
    text = "\n".join(lines)
    print(text)
    (args.out / "ablation.md").write_text(text + "\n")
    (args.out / "ablation.json").write_text(
        json.dumps({k: cells(v, device_name) for k, v in results.items()}, indent=1)
    )
    return 1 if any("error" in m for m in results.values()) else 0


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "GPU"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
