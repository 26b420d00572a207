"""Time to accuracy on this machine: the course's recipe against a race recipe scaled down, same seed, same epochs.

    python bench/bench_time_to_accuracy.py [--epochs 8] [--device cpu] [--arch resnet18]

Both run dlojz.py on the embedded data set (10 classes, made on first use) at small resolution, validating every
epoch. Printed for each: final top-1/top-5, wall time, and the training + validation time at which it first
reached the course recipe's final top-1 (start-up left out of both). The race recipe is recipes/race_rn50_*.toml's
ideas at this scale: triangular schedule peaking at epoch 2, progressive resizing, validation at a larger size
with flip TTA, BlurPool, no weight decay on norms. Figures only: the script does not assert a target.
"""

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(
    0, str(ROOT)
)  # the flags' bounds and one-line errors: dlojz_lib.settings.flags, dlojz_lib.checks (no torch)
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS, POSITIVE, WHOLE  # noqa: E402

VALIDATION = re.compile(r"Epoch \[(\d+)/\d+\], Validation Loss: [\d.]+, Validation Accuracy: ([\d.]+), top-5 ([\d.]+)")
TIMES = re.compile(r"Validation complete in: ([\d.]+) s \(this epoch's training: ([\d.]+) s\)")


def recipes(size, epochs):
    val = ["--val-crop-size", str(size), "--val-resize-size", str(round(size / 0.875))]
    course = ["--image-size", str(size), *val, "--lr-scheduler", "onecycle"]
    low = size * 3 // 4
    peak = 2 if epochs >= 4 else epochs / 4  # FFCV's epoch 2, earlier in a short smoke run
    race = [
        "--lr-scheduler",
        "linear",
        "--lr-peak-epoch",
        str(peak),
        "--min-res",
        str(low),
        "--max-res",
        str(size),
        "--start-ramp",
        str(max(epochs // 2 - 1, 0)),
        "--end-ramp",
        str(max(epochs - 2, 1)),
        "--res-step",
        "8",
        "--image-size",
        str(size),
        "--val-crop-size",
        str(size + size // 4),
        "--val-resize-size",
        str(round((size + size // 4) / 0.875)),
        "--tta-flip",
        "--blurpool",
        "--no-wd-norm-bias",
        "--wd",
        "5e-5",
    ]
    return {"course": course, "race": race}


def run(name, flags, common, out, python):
    metrics = out / f"{name}.json"
    start = time.perf_counter()
    proc = subprocess.run(
        [
            python,
            str(ROOT / "dlojz.py"),
            *common,
            *flags,
            "--metrics-json",
            str(metrics),
            "--output-dir",
            str(out / name),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    accuracies = [(int(e), float(top1), float(top5)) for e, top1, top5 in VALIDATION.findall(proc.stdout)]
    times = [float(v) + float(t) for v, t in TIMES.findall(proc.stdout)]
    cumulative = [sum(times[: i + 1]) for i in range(len(times))]
    return dict(wall=wall, epochs=accuracies, elapsed=cumulative, metrics=json.loads(metrics.read_text()))


def main(argv=None):
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=COUNT, default=8)
    parser.add_argument("--size", type=PIXELS, default=48, help="training resolution of the course recipe (px)")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=COUNT, default=32)
    parser.add_argument("--lr", type=POSITIVE, default=0.05)
    parser.add_argument("--workers", type=WHOLE, default=1)
    parser.add_argument("--python", default=sys.executable, help="the Python that runs dlojz.py (default: this one)")
    args = parser.parse_args(argv)
    common = [
        "--device",
        args.device,
        "--arch",
        args.arch,
        "--epochs",
        str(args.epochs),
        "-b",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--label-smoothing",
        "0.1",
        "--no-wandb",
        "--num-workers",
        str(args.workers),
        "--seed",
        "0",
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in recipes(args.size, args.epochs).items():
            results[name] = run(name, flags, common, Path(tmp), args.python)
            print(f"{name}: done in {results[name]['wall']:.0f} s", flush=True)
    target = results["course"]["epochs"][-1][1]
    print(
        f"\n{args.arch}, {args.epochs} epochs, batch {args.batch_size}, lr {args.lr}, {args.device}; "
        f"target = the course recipe's final top-1, {target:.4f}"
    )
    print(f"{'recipe':<8}{'top-1':>8}{'top-5':>8}{'wall s':>8}{'train+val s':>12}{'to target s':>12}{'epoch':>7}")
    for name, result in results.items():
        _, top1, top5 = result["epochs"][-1]
        reached = next(
            ((e, s) for (e, acc, _), s in zip(result["epochs"], result["elapsed"]) if acc >= target), (None, None)
        )
        print(
            f"{name:<8}{top1:>8.4f}{top5:>8.4f}{result['wall']:>8.0f}{result['elapsed'][-1]:>12.1f}"
            f"{(f'{reached[1]:.1f}' if reached[1] is not None else 'never'):>12}{str(reached[0] or '-'):>7}"
        )
    course_time = results["course"]["elapsed"][-1]
    first = {
        name: next((s for (_, acc, _), s in zip(result["epochs"], result["elapsed"]) if acc >= target), None)
        for name, result in results.items()
    }
    if first["race"] is not None:
        print(
            f"race time to the course's final top-1 / course's whole run: {first['race'] / course_time:.2f} "
            f"(target: <= 0.7); / course's first time at that top-1: {first['race'] / first['course']:.2f}"
        )
    else:
        print("the race recipe did not reach the course's final top-1 in this budget")


if __name__ == "__main__":
    main()
