"""Real-data benchmark: ``dlojz.py`` against a plain loop in the style of torchvision's classification reference.

Both sides train the same torchvision model, from the same random weights, on the same JPEGs (ImageNet-sized,
500x375 px), with the same batch, DataLoader workers, CPU threads, precision and memory format, SGD with momentum
0.9 at a constant learning rate, for one epoch; both are timed the same way: images / wall time from the end of
step 10 (workers started, allocator warm) to the end of the epoch's last step (the device synchronised at both
points). dlojz's figure is its own ``images_per_second`` (``--metrics-json``), measured that way.

* ``plain``: this file's ``plain_loop()``, as torchvision's ``references/classification/train.py`` does it:
  ``ImageFolder`` (PIL decoding), ``RandomResizedCrop`` + ``RandomHorizontalFlip`` + ``PILToTensor`` +
  ``ToDtype(float32, scale=True)`` + ``Normalize`` in the workers, ``DataLoader(shuffle, pin_memory on a GPU)``,
  ``zero_grad / forward / backward / step``. It also reports the time the loop waited for its next batch.
* ``dlojz``: ``python dlojz.py --data-root DATA --epochs 1 --lr-scheduler constant ...``, as a user runs it
  (validation on 2 images per class, not timed).

The data set (``--images`` training JPEGs in 10 classes, written once by dlojz's own generator) is cached under
$XDG_CACHE_HOME/dlojz (default ~/.cache/dlojz). With ``--repeats N`` the two runs are interleaved N times (order
reversed every other round); the ratio reported is the median of (dlojz / the plain run beside it). Run from the
repository root::

    python bench/bench_plain_loop.py --arch resnet50 --image-size 128 --repeats 3
    python bench/bench_plain_loop.py --arch resnet18 --image-size 64 --repeats 3

The table lists, per round, both img/s, their ratio, and what each side waited for data per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(
    0, str(REPO)
)  # the flags' bounds and one-line errors: dlojz_lib.settings.flags, dlojz_lib.checks (no torch)
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS, POSITIVE, WHOLE  # noqa: E402

WARMUP_STEPS = 10  # dlojz's first synchronised log point: its steady-state timing starts there
RESULT_TAG = "BENCH_PLAIN_RESULT "
TARGET_RATIO = 1.0


def parse_args(argv=None):
    parser = OneLineArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="resnet50", help="torchvision model name (default: resnet50)")
    parser.add_argument("--image-size", type=PIXELS, default=128, help="training crop, px (default: 128)")
    parser.add_argument("--batch-size", type=COUNT, default=32, help="(default: 32)")
    parser.add_argument("--workers", type=WHOLE, default=2, help="DataLoader workers of both sides (default: 2)")
    parser.add_argument(
        "--threads", type=COUNT, default=None, help="torch threads of both training processes (default: the CPUs)"
    )
    parser.add_argument("--lr", type=POSITIVE, default=0.0125, help="constant learning rate (default: 0.0125)")
    parser.add_argument("--images", type=COUNT, default=1280, help="training images: one epoch (default: 1280)")
    parser.add_argument("--repeats", type=COUNT, default=1, help="rounds of interleaved runs (default: 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default: cpu)")
    parser.add_argument("--data", type=Path, default=None, help="an ImageFolder with train/ (default: generated)")
    parser.add_argument("--seed", type=WHOLE, default=123, help="dlojz's default seed")
    parser.add_argument("--timeout", type=POSITIVE, default=1800, help="seconds allowed per run (default: 1800)")
    parser.add_argument("--python", default=sys.executable, help="the Python that starts both runs (default: this one)")
    parser.add_argument(
        "--dlojz-flags", default="", help="more flags for the dlojz side, e.g. '--prefetch-factor 2' (quoted)"
    )
    parser.add_argument("--run-plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.data is not None and not (args.data / "train").is_dir():  # before any run
        parser.error(f"--data {args.data}: no train/ folder there; give an ImageFolder with train/<class>/")
    if args.threads is None:
        args.threads = len(os.sched_getaffinity(0))
    if args.images < (WARMUP_STEPS + 10) * args.batch_size:
        parser.error(f"--images: at least {(WARMUP_STEPS + 10) * args.batch_size} (20 steps of the batch)")
    return args


def make_data(args) -> Path:
    if args.data is not None:
        if not (args.data / "train").is_dir():
            print(
                f"bench_plain_loop.py: --data {args.data}: no train/ folder inside (an ImageFolder layout)",
                file=sys.stderr,
            )
            sys.exit(2)  # bad input, as in every dlojz script
        return args.data
    sys.path.insert(0, str(REPO))
    from dlojz_lib.data.embedded import make_embedded_dataset

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlojz"
    root = cache / f"bench-plain-500x375-{args.images}-v1"
    if not (root / ".complete").exists():
        print(f"writing {args.images} JPEGs of 500x375 px into {root} (once)", flush=True)
    per_class = -(-args.images // 10)
    return make_embedded_dataset(root, n_classes=10, train_per_class=per_class, val_per_class=2, size=(500, 375))


# ================================ the plain loop (runs in its own subprocess) ================================


def plain_loop(args, data):
    import torch
    import torchvision
    from torchvision.transforms import v2

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    transform = v2.Compose(
        [
            v2.RandomResizedCrop(args.image_size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )
    dataset = torchvision.datasets.ImageFolder(str(data / "train"), transform)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        drop_last=True,
        multiprocessing_context="forkserver" if args.workers else None,
    )
    torch.manual_seed(args.seed)
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=len(dataset.classes)).to(device)
    model.train()
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    wait = 0.0
    steps = 0
    start = time.perf_counter()
    iterator = iter(loader)
    while True:
        before = time.perf_counter()
        try:
            images, labels = next(iterator)
        except StopIteration:
            break
        if steps >= WARMUP_STEPS:
            wait += time.perf_counter() - before
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps += 1
        if steps == WARMUP_STEPS:
            sync()
            start = time.perf_counter()
    sync()
    seconds = time.perf_counter() - start
    timed = steps - WARMUP_STEPS
    return dict(
        images_per_second=timed * args.batch_size / seconds,
        data_wait_ms=1e3 * wait / timed,
        step_ms=1e3 * seconds / timed,
        steps=steps,
    )


# ================================ the driver ================================


def run(command, args, env):
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"bench_plain_loop.py: failed ({proc.returncode}): {shlex.join(command)}\n{proc.stderr[-3000:]}")
    return proc, time.perf_counter() - started


def run_plain(args, data, env):
    command = [args.python, __file__, *passed_args(args), "--data", str(data), "--run-plain"]
    proc, wall = run(command, args, env)
    line = next(x for x in proc.stdout.splitlines() if x.startswith(RESULT_TAG))
    return dict(json.loads(line[len(RESULT_TAG) :]), wall_s=wall), command


def run_dlojz(args, data, env, scratch):
    metrics = scratch / "dlojz.json"
    command = [
        args.python,
        "dlojz.py",
        "--data-root",
        str(data),
        "--arch",
        args.arch,
        "--image-size",
        str(args.image_size),
        "--batch-size",
        str(args.batch_size),
        "--num-workers",
        str(args.workers),
        "--device",
        args.device,
        "--epochs",
        "1",
        "--lr",
        str(args.lr),
        "--lr-scheduler",
        "constant",
        "--label-smoothing",
        "0",
        "--wd",
        "0",
        "--no-amp",
        "--no-channels-last",
        "--drop-last",
        "--seed",
        str(args.seed),
        "--val-resize-size",
        str(args.image_size),
        "--val-crop-size",
        str(args.image_size),
        "--no-wandb",
        "--output-dir",
        str(scratch / "run"),
        "--metrics-json",
        str(metrics),
        *shlex.split(args.dlojz_flags),
    ]
    proc, wall = run(command, args, env)
    m = json.loads(metrics.read_text())
    return dict(images_per_second=m["images_per_second"], data_wait_ms=m.get("data_wait_ms"), wall_s=wall), command


def passed_args(args):
    return [
        "--arch",
        args.arch,
        "--image-size",
        str(args.image_size),
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(args.workers),
        "--threads",
        str(args.threads),
        "--lr",
        str(args.lr),
        "--images",
        str(args.images),
        "--device",
        args.device,
        "--seed",
        str(args.seed),
    ]


def main(argv=None):
    args = parse_args(argv)
    data = make_data(args)
    if args.run_plain:
        print(RESULT_TAG + json.dumps(plain_loop(args, data)), flush=True)
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    print(
        f"{args.arch}, {args.image_size} px, batch {args.batch_size}, {args.workers} workers, {args.threads} threads, "
        f"{args.device}, fp32 NCHW, one epoch of {args.images // args.batch_size} steps (the first {WARMUP_STEPS} "
        f"untimed), {data}",
        flush=True,
    )
    print("| round | dlojz img/s | plain img/s | dlojz / plain | dlojz data wait ms/step | plain data wait ms/step |")
    print("|---|---|---|---|---|---|")
    ratios, ours, theirs, commands = [], [], [], {}
    with tempfile.TemporaryDirectory(prefix="bench_plain_") as tmp:
        for round_index in range(args.repeats):
            order = ("dlojz", "plain") if round_index % 2 == 0 else ("plain", "dlojz")
            results = {}
            for side in order:
                if side == "dlojz":
                    results[side], commands[side] = run_dlojz(args, data, env, Path(tmp) / f"r{round_index}")
                else:
                    results[side], commands[side] = run_plain(args, data, env)
            a, b = results["dlojz"], results["plain"]
            ratios.append(a["images_per_second"] / b["images_per_second"])
            ours.append(a["images_per_second"])
            theirs.append(b["images_per_second"])
            wait = "n/a" if a["data_wait_ms"] is None else f"{a['data_wait_ms']:.1f}"
            print(
                f"| {round_index + 1} | {a['images_per_second']:.1f} | {b['images_per_second']:.1f} | "
                f"{ratios[-1]:.3f} | {wait} | {b['data_wait_ms']:.1f} |",
                flush=True,
            )
    ratio = statistics.median(ratios)
    print(
        f"| median | {statistics.median(ours):.1f} | {statistics.median(theirs):.1f} | {ratio:.3f} | | |\n"
        f"dlojz / plain loop: {ratio:.3f} (median of {args.repeats} interleaved pairs; target >= {TARGET_RATIO})"
    )
    for side, command in commands.items():
        print(f"{side}: {shlex.join(command)}")


if __name__ == "__main__":
    main()
