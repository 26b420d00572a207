"""One session on a lent GPU, its figures in priority order inside a time budget: the headline first.

    BUDGET_S=720 python bench/gpu_session.py [--device cuda|cpu] [--budget-s S] [--out DIR] [--data FOLDER]
        [--only ROW,...] [--steps N]

A GPU is lent for 15 minutes in all, its start and the transfers included, and the prepared benches ask more than
that (bench/gpu_checks.py 6-9 min, bench/gpu_acceptance.sh ~10, bench/ablation.py ~5, each compiled run 35-40 s of
compilation). This runs their rows in the order of what matters, each with an estimated cost (COST_S, measured on
an H200 where a figure exists, else reckoned from its compiles and steps): a row whose cost the time left cannot
hold is skipped with a line, and a running row is stopped when the budget ends (its process group killed), so the
session never runs past --budget-s (default: $BUDGET_S, else 720 s).

1. data: ImageNet-sized JPEGs (500x375 px, ~110 KB: dlojz_lib.data.embedded's generator, grain 0.6), 10 classes x
   (1,280 train + 50 val), written by all the machine's cores into $XDG_CACHE_HOME/dlojz (default ~/.cache/dlojz)
   once; --data FOLDER (train/, val/) instead.
2. dali: ResNet-50 at 224 px, batch 256, bfloat16 autocast + --compile, channels-last, through those JPEGs decoded
   by DALI on the GPU (--data-backend dali): the unsynchronised img/s over --steps/2 steps, J/image and mean power
   over the same window;
3. synthetic: the same run --synthetic (the GPU alone); the table gives DALI / synthetic and the MLPerf comparison;
4. cpu_pipeline: the same run through the DataLoader's workers (all CPUs but one): DALI / CPU pipeline;
5. bench/gpu_checks.py's GPU rows, one row each: dali_lifetimes (with its negative control), dali_memory (DALI's
   bytes and the JPEG engine's utilisation), dali_loader, fsdp_offload, meta_fill and fsdp_compile (on NCCL),
   selective_policy;
6. float8: ViT-L/16 bfloat16 + compile against float8 + compile (gpu_checks.py's float8), when torchao imports;
7. ablation: the rest of bench/ablation.py's rows (fp32 to CUDA graphs, bfloat16 eager), synthetic and real.

On the CPU (--device cpu) the same rows run at the CPU's sizes (ResNet-18 at 32 px, batch 8, eager; DALI's CPU
backend): the order, the budget, the skipping and the files are what tests/test_bench.py checks. Output, under
--out (default: $OUT, else runs/gpu_session_<time>): session.json (the device, torch, DALI, the date, each row's
status, seconds and figures) and session.md (the table for docs/benchmarks.md), rewritten after every row, and
each run's own metrics JSON and log. Exit 1 when a row failed or was stopped; skipped rows are not failures.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MLPERF_IMG_S = {"H200": 7950, "H100": 7160}  # MLPerf Training's last ResNet-50 round, per GPU, real data
TAIL_S = 5  # kept back from the budget for the files and the table after the last row

# Each row's estimated seconds on this device, its process's start included. GPU: a compiled ResNet-50 run is
# ~40 s of compilation, ~15 s of start and --steps x 256 images at ~7,000 img/s; the checks as gpu_checks.py's
# docstring reckons them. CPU: this 2-core machine's, at the CPU's sizes.
COST_S = {
    "cuda": {
        "data": 40,  # 13,300 JPEGs at ~14 ms each on a core, over 16 cores, and the pool's start
        "dali": 80,
        "synthetic": 70,
        "cpu_pipeline": 80,
        "dali_lifetimes": 40,
        "dali_memory": 40,
        "dali_loader": 60,
        "fsdp_offload": 60,
        "meta_fill": 30,
        "fsdp_compile": 60,
        "selective_policy": 30,
        "float8": 150,
        "ablation": 300,
    },
    "cpu": {  # measured on this 2-core machine (2026-12-03: 90 s for all the rows), doubled for slower ones
        "data": 5,
        "dali": 10,
        "synthetic": 10,
        "cpu_pipeline": 10,
        "dali_lifetimes": 7,
        "dali_memory": 7,
        "dali_loader": 10,
        "fsdp_offload": 7,
        "meta_fill": 8,
        "fsdp_compile": 26,
        "selective_policy": 9,
        "float8": 20,
        "ablation": 60,
    },
}
GPU_CHECKS = ("dali_lifetimes", "dali_memory", "dali_loader", "fsdp_offload", "meta_fill", "fsdp_compile")
GPU_CHECKS += ("selective_policy",)
ROWS = ("data", "dali", "synthetic", "cpu_pipeline", *GPU_CHECKS, "float8", "ablation")


class Session:
    """What the rows share: the device, the budget's clock, the output folder, the rows' results so far."""

    def __init__(self, device, budget_s, out, steps, data=None, clock=time.monotonic, python=sys.executable):
        self.device, self.budget_s, self.out, self.steps, self.data = device, budget_s, Path(out), steps, data
        self.clock, self.python = clock, python
        self.start = 0.0
        self.rows = {}  # name: result, in the order they ran or were skipped
        self._environment = None  # environment()'s, read once

    def left_s(self) -> float:
        return self.budget_s - (self.clock() - self.start) - TAIL_S

    def run(self, name, command, env=None) -> dict:
        """`command` in its own process group, stopped at the budget's end; its output in OUT/NAME.log."""
        log = self.out / f"{name}.log"
        with open(log, "w") as sink:
            child = subprocess.Popen(
                command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )  # fmt: skip
            try:
                rc = child.wait(timeout=max(self.left_s(), 1))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return {"status": "stopped", "why": "the budget ended while it ran"}
        if rc != 0:
            last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
            return {"status": "FAILED", "why": f"exit {rc}: {last[0][:200] if last else 'no output'}"}
        return {"status": "ok"}


def training_flags(session) -> list[str]:
    """The rows' dlojz.py run: ResNet-50 224 px batch 256 bfloat16 + compile channels-last on a GPU, small on a CPU."""
    if session.device == "cuda":
        model = ["--arch", "resnet50", "--image-size", "224", "-b", "256", "--amp", "--amp-dtype", "bfloat16"]
        model += ["--compile", "--channels-last", "--tf32", "--val-resize-size", "256", "--val-crop-size", "224"]
    else:
        model = ["--device", "cpu", "--arch", "resnet18", "--image-size", "32", "-b", "8", "--no-amp"]
        model += ["--val-resize-size", "36", "--val-crop-size", "32"]
    steps = ["--test-nsteps", str(session.steps), "--test-unsync-steps", str(session.steps // 2)]
    return [session.python, "dlojz.py", "--test", "--no-wandb", *model, *steps]


def workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


def data_row(session) -> dict:
    if session.data is not None:
        return {"status": "ok", "folder": str(session.data), "given": True}
    per_class = (1280, 50) if session.device == "cuda" else (24, 4)
    size = "500x375" if session.device == "cuda" else "96x80"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlojz"
    folder = cache / f"gpu-session-{size}-{per_class[0]}"  # kept for the next session on this machine
    script = (
        "from bench.gpu_session import write_jpegs; "
        f"write_jpegs({str(folder)!r}, {per_class[0]}, {per_class[1]}, {size.split('x')!r})"
    )
    result = session.run("data", [session.python, "-c", script], env={"PYTHONPATH": str(ROOT)})
    if result["status"] == "ok":
        session.data = folder
        result.update(folder=str(folder), train_images=sum(1 for _ in folder.glob("train/*/*.JPEG")))
    return result


def write_jpegs(folder, train_per_class, val_per_class, size):
    """The data row's JPEGs: one slice of every class per core (its own seed), merged into `folder` once."""
    import multiprocessing
    import shutil

    folder = Path(folder)
    if (folder / ".complete").exists():
        return
    parts = max(1, min(len(os.sched_getaffinity(0)), 32))
    staging = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    folder.parent.mkdir(parents=True, exist_ok=True)

    def share(count, i):  # this part's images of each class: the counts asked for, exactly, whatever the cores
        return count // parts + (i < count % parts)

    shape = tuple(map(int, size))
    jobs = [(staging / f"p{i}", share(train_per_class, i), share(val_per_class, i), shape, i) for i in range(parts)]
    with multiprocessing.get_context("spawn").Pool(parts) as pool:
        done = pool.starmap(_jpeg_part, jobs)
    for i, part in enumerate(map(Path, done)):
        for image in sorted(part.glob("*/*/*.JPEG")):
            target = staging / "data" / image.parent.relative_to(part) / f"p{i:02d}_{image.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            image.rename(target)
    (staging / "data" / ".complete").write_text("bench/gpu_session.py data set\n")
    os.replace(staging / "data", folder)
    shutil.rmtree(staging, ignore_errors=True)


def _jpeg_part(path, train_per_class, val_per_class, size, seed):
    from dlojz_lib.data.embedded import make_embedded_dataset

    grain = 0.6 if size[0] >= 400 else 0.0  # a photograph's weight at ImageNet's size
    return str(
        make_embedded_dataset(path, 10, train_per_class, val_per_class, size=size, seed=1000 + seed, grain=grain)
    )


def training_row(name, extra):
    """A row that is one dlojz.py run: its unsynchronised img/s, J/image and mean power from its metrics JSON."""

    def row(session) -> dict:
        if extra is None and session.data is None:
            return {"status": "skipped", "why": "no data (the data row did not run)"}
        if name == "dali" and importlib.util.find_spec("nvidia.dali") is None:
            return {"status": "skipped", "why": "DALI does not import here: carry it (docs/benchmarks.md)"}
        metrics = session.out / f"{name}.json"
        flags = extra if extra is not None else ["--data-root", str(session.data), *ROW_DATA_FLAGS[name]()]
        command = [*training_flags(session), *flags, "--output-dir", str(session.out / name)]
        result = session.run(name, [*command, "--metrics-json", str(metrics)])
        if result["status"] == "ok":
            result.update(figures_of(json.loads(metrics.read_text())))
        return result

    return row


ROW_DATA_FLAGS = {
    "dali": lambda: ["--data-backend", "dali"],
    "cpu_pipeline": lambda: ["--data-backend", "pytorch", "--num-workers", str(workers())],
}


def figures_of(metrics) -> dict:
    from dlojz_lib.observers.chrono_report import unsync_energy_cell  # (no torch)

    chrono = metrics.get("chrono", {})
    keys = ("unsync_throughput_img_s", "throughput_img_s", "unsync_energy_per_image_j", "unsync_mean_power_w")
    figures = {key: chrono.get(key) for key in keys}
    figures["energy"] = unsync_energy_cell(chrono)  # the table's cell, as bench/ablation.py's
    return figures


def gpu_check_row(check):
    def row(session) -> dict:
        if check == "float8" and importlib.util.find_spec("torchao") is None:
            return {"status": "skipped", "why": "torchao does not import here: carry it (docs/benchmarks.md)"}
        report = session.out / f"{check}.json"
        command = [session.python, "bench/gpu_checks.py", "--device", session.device, "--only", check]
        command += ["--json", str(report), *(["--quick"] if session.device == "cpu" else [])]
        if check.startswith("dali") and session.data is not None:
            command += ["--data", str(session.data)]
        result = session.run(check, command)
        if report.exists():
            found = json.loads(report.read_text())["checks"][check]
            status = found.pop("status")
            result = {**result, **found, "status": "FAILED" if status == "FAILED" else status}
        return result

    return row


def ablation_row(session) -> dict:
    """bench/ablation.py's rows but bfloat16 + compile (the training rows above), without its cores table."""
    rows = "fp32,tf32,float16,channels-last,compile,cuda-graphs,bfloat16"
    command = [session.python, "bench/ablation.py", "--device", session.device, "--cores", ""]
    if session.device == "cpu":  # the table's code at the CPU's sizes
        command += ["--arch", "resnet18", "--image-size", "32", "-b", "8", "--steps", "3"]
        rows = "fp32,bfloat16"
    command += ["--rows", rows, "--out", str(session.out / "ablation")]
    if session.data is not None:
        command += ["--data-root", str(session.data)]
    return session.run("ablation", command)


RUNNERS = {
    "data": data_row,
    "dali": training_row("dali", None),
    "synthetic": training_row("synthetic", ["--synthetic"]),
    "cpu_pipeline": training_row("cpu_pipeline", None),
    **{check: gpu_check_row(check) for check in (*GPU_CHECKS, "float8")},
    "ablation": ablation_row,
}


def run_session(session, names, runners=RUNNERS, costs=None, say=print) -> dict:
    """The rows `names` in ROWS' order, each skipped when its cost exceeds the time left; the files after each."""
    costs = costs or COST_S[session.device]
    session.start = session.clock()
    for name in (row for row in ROWS if row in names):
        left = session.left_s()
        if costs[name] > left:
            result = {"status": "skipped", "why": f"needs ~{costs[name]:.0f} s, {max(left, 0):.0f} s left"}
        else:
            begun = session.clock()
            result = runners[name](session)
            result["seconds"] = round(session.clock() - begun, 1)
        result["estimate_s"] = costs[name]
        session.rows[name] = result
        say(row_line(name, result))
        write_files(session)
    return session.rows


def row_line(name, result) -> str:
    figures = {k: v for k, v in result.items() if k not in ("status", "why", "seconds", "estimate_s")}
    seconds = f"{result['seconds']:>6.1f} s" if "seconds" in result else f"  (~{result['estimate_s']} s)"
    return f"{name:<17} {result['status']:<8} {seconds}  {result.get('why', '')} {json.dumps(figures)}".rstrip()


def ratio_lines(rows, device_name) -> list[str]:
    def img_s(name):
        return (rows.get(name) or {}).get("unsync_throughput_img_s")

    lines = []
    for top, bottom, label in (("dali", "synthetic", "DALI / synthetic"), ("dali", "cpu_pipeline", "DALI / CPU")):
        if img_s(top) and img_s(bottom):
            lines.append(f"{label}, unsynchronised img/s: {img_s(top) / img_s(bottom):.3f}")
    for gpu, figure in MLPERF_IMG_S.items():
        if gpu in device_name and img_s("dali"):
            lines.append(f"DALI row / MLPerf's {figure:,} img/s per {gpu}: {img_s('dali') / figure:.3f}")
    return lines


def write_files(session):
    report = {**environment(session), "budget_s": session.budget_s, "rows": session.rows}
    report["ratios"] = ratio_lines(session.rows, report["device_name"])
    (session.out / "session.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"{report['date']}, {report['device_name']}, driver {report['driver']}, torch {report['torch']}, "
        f"DALI {report['dali']}, torchao {report['torchao']}: `BUDGET_S={session.budget_s:.0f} python "
        f"bench/gpu_session.py`",
        "",
        "| row | status | s (estimate) | unsync img/s | J/image (mean W) | note |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in session.rows.items():
        img_s, energy = r.get("unsync_throughput_img_s"), r.get("energy", "n/a")
        seconds = f"{r['seconds']:.0f} ({r['estimate_s']})" if "seconds" in r else f"- ({r['estimate_s']})"
        cell = f"{img_s:,.0f}" if img_s else ""
        lines.append(f"| {name} | {r['status']} | {seconds} | {cell} | {energy} | {r.get('why', '')} |")
    lines += ["", *report["ratios"]]
    (session.out / "session.md").write_text("\n".join(lines) + "\n")


def environment(session) -> dict:
    """The date, the device, its driver and the versions that make the figures, read in a child (no torch here)."""
    if session._environment is not None:
        return session._environment
    probe = (
        "import json, torch, importlib.metadata as m\n"
        "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
        f"gpu = torch.cuda.is_available() and {session.device == 'cuda'}\n"
        "driver = None\n"
        "try:\n    import pynvml; pynvml.nvmlInit(); driver = pynvml.nvmlSystemGetDriverVersion()\n"
        "except Exception: pass\n"
        "print(json.dumps({'device_name': torch.cuda.get_device_name() if gpu else 'cpu', 'driver': driver,"
        " 'torch': torch.__version__, 'cuda': torch.version.cuda, 'dali': v('nvidia-dali-cuda130'),"
        " 'torchao': v('torchao')}))"
    )
    found = subprocess.run([session.python, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    env = json.loads(found.stdout) if found.returncode == 0 else {"device_name": "unknown", "driver": None}
    env.setdefault("torch", None), env.setdefault("dali", None), env.setdefault("torchao", None)
    session._environment = {"date": datetime.date.today().isoformat(), **env}
    return session._environment


def main(argv=None):
    sys.path.insert(0, str(ROOT))  # the flags' bounds and one-line refusals (no torch)
    from dlojz_lib.checks import OneLineArgumentParser
    from dlojz_lib.settings.flags import TIMEOUT_LIMIT_S, Number

    parser = OneLineArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    budget = Number(float, TAIL_S, TIMEOUT_LIMIT_S, low_open=True)  # (TAIL_S: the files after the rows)
    parser.add_argument("--budget-s", type=budget, default=os.environ.get("BUDGET_S", "720"), help="default: $BUDGET_S")
    parser.add_argument("--out", type=Path, default=None, help="default: $OUT, else runs/gpu_session_<time>")
    parser.add_argument(
        "--data", type=Path, default=None, help="an image folder (train/, val/) instead of the data row"
    )
    parser.add_argument("--only", default=None, help=f"the rows to run, separated by commas ({','.join(ROWS)})")
    parser.add_argument("--python", default=sys.executable, help="the Python that starts each row (default: this one)")
    steps = Number(int, 2)  # (its last half unsynchronised: one step at least)
    parser.add_argument("--steps", type=steps, default=None, help="a training row's steps (default: 200 GPU, 6 CPU)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(ROWS)
    if unknown := [name for name in names if name not in ROWS]:
        parser.error(f"--only {','.join(unknown)}: not a row; the rows are {','.join(ROWS)}")
    if args.data is not None and not (args.data / "train").is_dir():
        parser.error(f"--data {args.data}: no train/ folder there; give the data set's folder (train/, val/)")
    out = args.out or (
        Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "runs" / f"gpu_session_{time.time():.0f}"
    )
    out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (200 if args.device == "cuda" else 6)
    session = Session(args.device, args.budget_s, out.resolve(), steps, data=args.data, python=args.python)
    print(f"gpu_session.py: {', '.join(names)} within {args.budget_s:.0f} s; output in {session.out}", flush=True)
    rows = run_session(session, names, say=lambda line: print(line, flush=True))
    for line in ratio_lines(rows, environment(session)["device_name"]):
        print(line)
    return 1 if any(r["status"] in ("FAILED", "stopped") for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
