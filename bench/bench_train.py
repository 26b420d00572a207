"""Training-loop benchmark: ``dlojz.py --synthetic`` against a bare PyTorch loop, in one run (target: >= 0.97 x bare).

Both sides train the same torchvision model on the same device, batch size, image size, precision (autocast dtype,
GradScaler for float16, TF32 rule) and memory format, from one random batch made once on the device, and are timed
the same way: the device is synchronised after the first 10 (warm-up) steps and after the last one, and the
throughput is images / wall time between those two points. That is how dlojz measures ``images_per_second`` in
``--metrics-json`` (steady state between synchronised log points, every 10 steps, the first 10 excluded).

Measured, each in its own fresh subprocess (so that no run inherits another's allocator, caches or threads), started
by ``--python`` (default: this Python; the tests give a fork of a server that imported torch and did nothing else):

* ``dlojz --test``: ``python dlojz.py --synthetic --test --test-nsteps STEPS --no-wandb --metrics-json ...``, as a
  user runs it, its 20 validation batches (not timed) at the training image size. ``--test`` turns the chronometer
  on, which synchronises the device at every phase boundary on a GPU (load, forward, backward), so this figure
  includes the chronometer's cost.
* ``dlojz epoch``: the normal training path, chronometer off. A ``--synthetic`` epoch is ImageNet-sized (1,281,167
  images), so this variant imports ``dlojz`` and runs its ``train_one_epoch`` in-process on ``in_process.synthetic_loop``
  (the parts ``main()`` builds, from the same flags, ``--synthetic --epochs 1``, with an epoch of STEPS batches);
  every line of the training loop is dlojz's own. Note that an epoch of STEPS steps prints a console line every
  ceil(STEPS/10) steps, each a synchronisation point; a real epoch has 10 per epoch.
* ``bare``: this file's ``bare_loop()``: model, fused SGD(lr 0.1, momentum 0.9), CrossEntropyLoss(label_smoothing 0.1),
  autocast + GradScaler, ``zero_grad / forward / backward / step``, nothing else (no scheduler object, no metrics).
  One bare run per dlojz variant: each step's learning rate and momentum are set to the values dlojz's default
  OneCycleLR gives at that step for that variant's schedule length (precomputed before the loop; two dict writes
  per step). Why: a CPU's speed can depend on the values computed (denormal numbers are slow: flushing them
  sped both loops up by ~7 % here), and a constant LR of 0.1 drives the weights elsewhere than OneCycle's warm-up
  from 0.004 does. With the same seed, initial weights, batch and LR/momentum per step, both sides compute the
  same numbers (checked: the bare loop's mean training loss equals dlojz's ``train_loss`` to the last digit).

With ``--repeats N`` the runs are interleaved N times, each dlojz run next to its bare run (order reversed every
other round). The ratio reported is the median over rounds of (dlojz run / the bare run beside it): neighbours
share the machine's load, which drifts over minutes on a shared machine. The table also shows the median img/s of
each side and the ratio of the best runs (noise only ever slows a run down). Run from the repository root::

    python bench/bench_train.py                                   # GPU: resnet50, 224 px, batch 128, AMP float16
    python bench/bench_train.py --arch resnet18 --image-size 64 --batch-size 32 --device cpu --repeats 3

The table lists dlojz img/s, bare img/s, their ratio and the 0.97 target per variant, then the exact commands.
On a CPU dlojz keeps freed host memory for reuse (``dlojz_lib.dist.keep_freed_host_memory``), which the bare loop, as a
user writes it, does not: ``--bare-keeps-freed-memory`` gives the bare loop the same setting, so that the ratio is
dlojz's own code alone. ``--json PATH`` also writes the medians and ratios (``bench/gpu_acceptance.sh`` reads it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.data import IMAGENET_TRAIN_IMAGES  # noqa: E402  (the size of dlojz's synthetic epoch)
from dlojz_lib.settings.flags import COUNT, POSITIVE, flag_like  # noqa: E402

TARGET_RATIO = 0.97
WARMUP_STEPS = 10  # dlojz's LOG_EVERY: its first synchronised log point, where its steady-state timing starts
RESULT_TAG = "BENCH_TRAIN_RESULT "  # prefix of the one stdout line a bare-loop subprocess reports through
VARIANTS = ("test", "epoch")


def parse_args(argv=None):
    parser = OneLineArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # dlojz.py's own flags, from its flag table's rows (their types, bounds and choices): the runs take them as given
    flag_like(parser, "--arch", help="torchvision model name (default: resnet50)")
    flag_like(parser, "--batch-size", help="per process (default: 128 on GPU, 32 on CPU, like dlojz)")
    flag_like(parser, "--image-size", help="px (default: 224 on GPU, 64 on CPU, like dlojz)")
    parser.add_argument(
        "--steps",
        type=COUNT,
        default=60,
        help=f"training steps per run, the first {WARMUP_STEPS} untimed; a multiple of {WARMUP_STEPS} (default: 60)",
    )
    flag_like(parser, "--device", help="(default: auto = cuda if available)")
    flag_like(parser, "--amp", help="autocast (default: on with CUDA, off on CPU)")
    flag_like(parser, "--amp-dtype", help="(default: float16 on CUDA, bfloat16 on CPU)")
    flag_like(parser, "--channels-last", help="NHWC model and input (default: off)")
    parser.add_argument(
        "--repeats", type=COUNT, default=1, help="rounds of interleaved runs; medians reported (default: 1)"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"dlojz runs to time, comma-separated among {','.join(VARIANTS)} (default: both)",
    )
    parser.add_argument(
        "--threads",
        type=COUNT,
        default=None,
        help="CPU threads of every run (OMP_NUM_THREADS); 1 resists a busy machine best (default: torch's)",
    )
    parser.add_argument("--timeout", type=POSITIVE, default=1800, help="seconds allowed per subprocess (default: 1800)")
    parser.add_argument(
        "--python", default=sys.executable, help="the Python that starts every measured run (default: this one)"
    )
    parser.add_argument(
        "--bare-keeps-freed-memory",
        action="store_true",
        help="the bare loop tunes glibc's allocator as dlojz does on a CPU: the ratio is then dlojz's code alone",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the medians and ratios here (bench/gpu_acceptance.sh)"
    )
    flag_like(parser, "--seed", help="dlojz's default seed: same weights and batch on both sides")
    # Internal: the subprocess entry points (hidden from --help).
    parser.add_argument("--run-bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule-steps", type=COUNT, default=None, help=argparse.SUPPRESS)  # dlojz's OneCycle length
    flag_like(parser, "--tf32", help=argparse.SUPPRESS)
    return parser.parse_args(argv), parser


def resolve_settings(args, parser):
    """Fill the defaults exactly as dlojz does, so both sides get the same explicit settings."""
    if args.device in ("auto", "cuda"):  # torch here only to see the GPU: a CPU run's flags are checked without it
        import torch

        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU is visible here; use --device cpu or run on a GPU node")
        if args.tf32 is None and args.device == "cuda":  # dlojz's rule: TF32 on Ampere and newer
            args.tf32 = torch.cuda.get_device_capability()[0] >= 8
    gpu = args.device == "cuda"
    if args.batch_size is None:
        args.batch_size = 128 if gpu else 32
    if args.image_size is None:
        args.image_size = 224 if gpu else 64
    if args.amp is None:
        args.amp = gpu
    if args.amp_dtype is None:
        args.amp_dtype = "float16" if gpu else "bfloat16"
    if args.tf32 is None:
        args.tf32 = False  # no GPU
    if args.steps <= WARMUP_STEPS or args.steps % WARMUP_STEPS:
        parser.error(
            f"--steps must be a multiple of {WARMUP_STEPS} above {WARMUP_STEPS} (dlojz times between its "
            f"log points, every {WARMUP_STEPS} steps); got {args.steps}"
        )
    if args.batch_size < 1 or args.image_size < 1 or args.repeats < 1:
        parser.error("--batch-size, --image-size and --repeats must be at least 1")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"--variants: choose among {','.join(VARIANTS)} (got {unknown or 'nothing'})")


def common_flags(args):
    """Model, batch and precision flags given to every dlojz and bare run (both parsers share these names)."""
    flags = [
        "--arch",
        args.arch,
        "--batch-size",
        str(args.batch_size),
        "--image-size",
        str(args.image_size),
        "--device",
        args.device,
        "--amp" if args.amp else "--no-amp",
        "--amp-dtype",
        args.amp_dtype,
        "--channels-last" if args.channels_last else "--no-channels-last",
        "--seed",
        str(args.seed),
    ]
    if args.device == "cuda":
        flags.append("--tf32" if args.tf32 else "--no-tf32")
    return flags


# ================================ the bare loop (runs in its own subprocess) ================================


def bare_optimizer(model):
    """SGD(lr 0.1, momentum 0.9) with dlojz's fused step: an unfused one under the float16 GradScaler would read the
    overflow flag on the host at every step, and the reference would be slower than the loop it judges."""
    from dlojz_lib.optim.optimizers import build_optimizer

    return build_optimizer("sgd", model.parameters(), 0.1, 0.9, 0.0, fused=True)


def bare_loop(args):
    """Train `args.steps` steps on one random batch; return images/s over the steps after the warm-up."""
    import torch
    import torchvision

    device = torch.device(args.device)
    if args.bare_keeps_freed_memory and device.type == "cpu":
        from dlojz_lib.dist import keep_freed_host_memory

        keep_freed_host_memory()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as dlojz: autotune convolutions for the fixed input size
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    amp_dtype = getattr(torch, args.amp_dtype)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(args.seed)  # dlojz's seed before building the model: the same initial weights
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=1000).to(device)
    model = model.to(memory_format=memory_format)
    model.train()
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = bare_optimizer(model)
    lr_momentum = onecycle_values(0.1, args.schedule_steps or args.steps, args.steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp and amp_dtype == torch.float16)

    # One batch, made once, as dlojz_lib.data.loaders.SyntheticLoader does (same generator and order: the same tensors).
    gen = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
    labels = torch.randint(0, 1000, (args.batch_size,), generator=gen).to(device)
    images = images.to(device).contiguous(memory_format=memory_format)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    start = None
    for step in range(args.steps):
        if step == WARMUP_STEPS:
            sync()
            start = time.perf_counter()
        for group in optimizer.param_groups:  # the LR and momentum dlojz's scheduler gives this step
            group["lr"], group["momentum"] = lr_momentum[step]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            loss = criterion(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    sync()
    seconds = time.perf_counter() - start
    timed_steps = args.steps - WARMUP_STEPS
    return dict(
        images_per_second=timed_steps * args.batch_size / seconds,
        timed_steps=timed_steps,
        seconds=seconds,
        final_loss=loss.item(),
    )


def onecycle_values(max_lr, total_steps, steps):
    """(lr, momentum) of the first `steps` steps of torch's OneCycleLR(max_lr, total_steps), dlojz's default
    schedule, computed on a throw-away optimizer so that the timed loop only copies two numbers per step."""
    import torch

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=max_lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps)
    values = []
    for _ in range(steps):
        values.append((optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["momentum"]))
        optimizer.step()  # keeps the scheduler from warning that it is stepped before the optimizer
        scheduler.step()
    return values


def run_dlojz_short_epoch(steps, dlojz_argv):
    """dlojz's normal (non --test) training loop, its own train_one_epoch, over a synthetic epoch of `steps` batches
    (in_process.synthetic_loop), writing the metrics the driver reads."""
    from in_process import synthetic_run

    import dlojz
    from dlojz_lib.log import write_json

    cfg, loop = synthetic_run(dlojz_argv, n_batches=steps)
    result = dlojz.train_one_epoch(**loop)
    write_json(
        cfg.metrics_json,
        dict(
            steps=loop["state"].global_step,
            train_loss=result.train_loss,
            images_per_second=loop["progress"].images_per_second(),
        ),
    )
    return 0


# ================================ the driver ================================


def run(cmd, timeout, label, threads=None):
    """Run one measurement subprocess from the repository root; on failure, stop with its last lines.
    Returns its stdout and the 1-minute load average around it (mean of before and after)."""
    env = dict(os.environ)
    if threads:  # read by torch at start-up, in dlojz and in the bare loop alike
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    load_before = os.getloadavg()[0]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(
            f"bench_train: the {label} run took more than --timeout {timeout:g} s; lower --steps or raise --timeout"
        )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        sys.exit(f"{tail}\nbench_train: the {label} run failed (exit {proc.returncode}): {shlex.join(cmd)}")
    return proc.stdout, (load_before + os.getloadavg()[0]) / 2


def dlojz_commands(args, tmp):
    """The user-facing command line of each dlojz variant (paths inside `tmp`)."""
    base = [args.python, "dlojz.py", "--synthetic", "--no-wandb"] + common_flags(args)
    cmds = {}
    if "test" in args.variants:
        cmds["test"] = base + [
            "--test",
            "--test-nsteps",
            str(args.steps),
            # Its 20 validation batches at the training size, resized by 256/224 as dlojz's two profiles do (224 px
            # from 256, 64 from 73): the same commands as the defaults', and no 64 px validation for a 32 px run.
            "--val-crop-size",
            str(args.image_size),
            "--val-resize-size",
            str(args.image_size * 256 // 224),
            "--metrics-json",
            str(tmp / "test.json"),
            "--output-dir",
            str(tmp / "test"),
        ]
    if "epoch" in args.variants:
        epoch_args = (
            ["--synthetic", "--no-wandb", "--epochs", "1"]
            + common_flags(args)
            + ["--metrics-json", str(tmp / "epoch.json"), "--output-dir", str(tmp / "epoch")]
        )
        # The hidden entry point runs dlojz's train_one_epoch on a synthetic epoch of --steps batches.
        cmds["epoch"] = [
            args.python,
            str(Path(__file__).resolve()),
            "--run-dlojz-epoch",
            str(args.steps),
            "--",
        ] + epoch_args
    return cmds


def schedule_steps(args, variant):
    """Length of dlojz's OneCycle schedule in `variant`: its synthetic epoch's batches (one epoch, one process)."""
    if variant == "test":  # the ImageNet-sized synthetic epoch
        return math.ceil(IMAGENET_TRAIN_IMAGES / args.batch_size)
    return args.steps  # the short epoch


def measure(args):
    """Interleave the runs `args.repeats` times; return img/s and load average per run name, and the commands."""
    bare_base = (
        [
            args.python,
            str(Path(__file__).resolve()),
            "--run-bare",
            "--steps",
            str(args.steps),
        ]
        + common_flags(args)
        + (["--bare-keeps-freed-memory"] if args.bare_keeps_freed_memory else [])
    )
    bare_cmds = {f"bare-{v}": bare_base + ["--schedule-steps", str(schedule_steps(args, v))] for v in args.variants}
    order = [name for v in args.variants for name in (v, f"bare-{v}")]
    rates = {name: [] for name in order}
    loads = {name: [] for name in order}
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmpdir:
        tmp = Path(tmpdir)
        cmds = dlojz_commands(args, tmp)
        for round_ in range(args.repeats):
            for name in order if round_ % 2 == 0 else order[::-1]:
                if name in bare_cmds:
                    out, load = run(bare_cmds[name], args.timeout, "bare loop", args.threads)
                    result = json.loads(
                        next(line for line in out.splitlines() if line.startswith(RESULT_TAG))[len(RESULT_TAG) :]
                    )
                    rate = result["images_per_second"]
                    if not math.isfinite(result["final_loss"]):  # NaN arithmetic could run at another speed
                        print(
                            f"  WARNING: the bare loop's loss ended {result['final_loss']}: its figure may not compare"
                        )
                else:
                    metrics_path = tmp / f"{name}.json"
                    metrics_path.unlink(missing_ok=True)
                    _, load = run(cmds[name], args.timeout, f"dlojz {name}", args.threads)
                    metrics = json.loads(metrics_path.read_text())
                    if metrics.get("steps") != args.steps or not metrics.get("images_per_second"):
                        sys.exit(
                            f"bench_train: dlojz {name} ran {metrics.get('steps')} steps (expected {args.steps}) "
                            f"or reported no images_per_second: {metrics_path}"
                        )
                    rate = metrics["images_per_second"]
                rates[name].append(rate)
                loads[name].append(load)
                print(
                    f"  round {round_ + 1}/{args.repeats}  {name:<10} {rate:9.1f} img/s   (load avg {load:.2f})",
                    flush=True,
                )
    return rates, loads, cmds, bare_cmds


def threads_per_run(args):
    """--threads, or the CPU threads torch gives each run by default on this machine."""
    if args.threads:
        return args.threads
    import torch

    return torch.get_num_threads()


def report(args, rates, loads, cmds, bare_cmds):
    precision = args.amp_dtype + " autocast" if args.amp else ("tf32" if args.tf32 else "float32")
    print(
        f"\n{args.arch}, {args.device}, batch {args.batch_size}, {args.image_size} px, {precision}, "
        f"{'channels-last' if args.channels_last else 'contiguous'}, {args.steps} steps ({WARMUP_STEPS} warm-up), "
        f"{threads_per_run(args)} threads, {args.repeats} round(s); img/s"
    )
    labels = {"test": "dlojz --test", "epoch": "dlojz short epoch"}
    print(
        f"{'variant':<18}{'dlojz':>9}{'bare':>9}{'ratio':>8}{'target':>8}  {'result':<7}"
        f"{'best dlojz/bare':>17}{'load':>7}  per-round ratios; all runs dlojz | bare"
    )
    summary = {}
    for name in args.variants:
        dlojz, bare = rates[name], rates[f"bare-{name}"]
        paired = [d / b for d, b in zip(dlojz, bare)]
        ratio = statistics.median(paired)
        summary[name] = dict(dlojz=statistics.median(dlojz), bare=statistics.median(bare), ratio=ratio)
        best = f"{max(dlojz):.1f}/{max(bare):.1f}={max(dlojz) / max(bare):.3f}"
        load = statistics.median(loads[name] + loads[f"bare-{name}"])
        print(
            f"{labels[name]:<18}{statistics.median(dlojz):>9.1f}{statistics.median(bare):>9.1f}{ratio:>8.3f}"
            f"{TARGET_RATIO:>8.2f}  {'ok' if ratio >= TARGET_RATIO else 'SLOWER':<7}{best:>17}{load:>7.2f}  "
            + " ".join(f"{r:.3f}" for r in paired)
            + "; "
            + " ".join(f"{r:.1f}" for r in dlojz)
            + " | "
            + " ".join(f"{r:.1f}" for r in bare)
        )
    print(
        "(dlojz, bare: median img/s; ratio: median over rounds of dlojz / the bare run beside it; "
        "load: median 1-min load average during the runs)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    own_load = threads_per_run(args) if args.device == "cpu" else 1
    busiest = max(load for runs in loads.values() for load in runs)
    if busiest > own_load + 0.5:
        print(
            f"WARNING: the load average reached {busiest:.2f} on {os.cpu_count()} CPUs while a run needs {own_load}: "
            f"other processes shared the machine, the figures are noisy; rerun on an idle machine or raise --repeats"
        )
    print("\ncommands (from the repository root; metrics/output paths were temporary):")
    for name in args.variants:
        print(f"  {labels[name]}: {shlex.join(cmds[name])}")
        print(f"  bare loop for it: {shlex.join(bare_cmds[f'bare-{name}'])}")
    if args.threads:
        print(f"  (each with OMP_NUM_THREADS={args.threads} MKL_NUM_THREADS={args.threads})")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-dlojz-epoch"]:  # internal: --run-dlojz-epoch STEPS -- DLOJZ_ARGS...
        return run_dlojz_short_epoch(int(argv[1]), argv[3:])
    args, parser = parse_args(argv)
    resolve_settings(args, parser)
    if args.run_bare:
        print(RESULT_TAG + json.dumps(bare_loop(args)), flush=True)
        return 0
    report(args, *measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
