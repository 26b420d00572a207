"""The course's day-4 pipeline lab: the bubble of each pipeline schedule, measured against its formula, and the
images per second, as the micro-batches grow.

Each rank holds one stage of the model (two or more for the interleaved schedules: stages rank, rank + N, ...), cut
by parameters (`dlojz_lib/parallelism/pipeline.py`); a step runs one batch of synthetic images through PyTorch's schedule
(`torch.distributed.pipelining`), SGD after it. Per schedule and micro-batch count, after a warm-up step, each rank's
compute time is timed (its stages' forwards and backwards: CUDA events on a GPU) and the rest of the step is its
idle share, the bubble; the table gives the largest and the mean over the ranks beside the formula, (N - 1) / (V M
+ N - 1) for GPipe, 1F1B and interleaved 1F1B with V stages a rank (zero-bubble's has none: it schedules each
micro-batch's weights' backward apart, into the gaps, so its bubble depends on how long those are), and the images
per second of the step.

    torchrun --standalone --nproc-per-node 4 bench/pipeline_bubble.py --arch timm:vit_base_patch16_224 -b 64 --amp
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/pipeline_bubble.py --arch toy \\
        --microbatches 2,4,8 -b 32                     # on a laptop: layers that pause 1 ms an image, the formula seen

`--arch toy`: 8 layers (`--toy-layers`) whose forward pauses 1 ms an image and backward 2 (`dlojz_lib.parallelism.pipeline.
paused_toy`): compute of a known length on any machine, so the bubble follows the formula, not the CPU's load. A
real model on a few CPU cores mostly shows the schedules' own overhead (micro-batches of a few images).

On GPUs each rank takes its local GPU (NCCL); without one, the CPU (gloo, one thread a rank).
"""

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.parallelism.bubble import expected_bubble  # noqa: E402
from dlojz_lib.parallelism.pipeline import SCHEDULES  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS  # noqa: E402


def get_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="timm:vit_base_patch16_224", help="the model (default: ViT-B/16), or toy")
    p.add_argument("--toy-layers", type=COUNT, default=8, help="--arch toy: its layers (default: 8)")
    p.add_argument("--image-size", type=PIXELS, default=224)
    p.add_argument("--num-classes", type=COUNT, default=1000)
    p.add_argument("-b", "--batch-size", type=COUNT, default=64, help="images a step, split into micro-batches")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of {', '.join(SCHEDULES)}")
    p.add_argument("--microbatches", default="4,8,16", help="micro-batch counts, comma-separated (default: 4,8,16)")
    p.add_argument("--stages-per-rank", type=COUNT, default=2, help="the interleaved schedules' (default: 2)")
    p.add_argument(
        "--split",
        default="params",
        help="the stages balanced by params (default) or by each layer's measured forward time (time), or the\n"
        "layers where stages 2, 3... start (i,j,...)",
    )
    p.add_argument("--steps", type=COUNT, default=5, help="steps timed after one of warm-up (default: 5)")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast on a GPU")
    p.add_argument("--json", help="also write the rows to this file (rank 0)")
    args = p.parse_args(argv)
    args.schedules = args.schedules.split(",")
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"--schedules {','.join(unknown)}: not a schedule; known: {', '.join(SCHEDULES)}")
    try:
        args.microbatches = [int(m) for m in args.microbatches.split(",")]
    except ValueError:
        p.error(f"--microbatches {args.microbatches}: comma-separated whole numbers, e.g. 4,8,16")
    bad = [m for m in args.microbatches if m < 1 or args.batch_size % m]
    if bad:
        p.error(f"--microbatches {bad[0]}: each a divisor of --batch-size {args.batch_size}")
    if args.split not in ("params", "time"):
        try:
            args.split = [int(c) for c in args.split.split(",")]
        except ValueError:
            p.error(f"--split {args.split}: params, time, or layer indices, e.g. 4,8")
    return args


def measure(args, rank, world, device):
    import torch
    import torch.distributed as dist

    from dlojz_lib.model.build import BuiltModel
    from dlojz_lib.model.zoo import create_model
    from dlojz_lib.parallelism.bubble import StageClock, paused_toy
    from dlojz_lib.parallelism.pipeline import PipelineCut, build_pipeline, pipeline_step

    torch.manual_seed(0)
    if args.arch == "toy":
        model, shape, classes = paused_toy(args.toy_layers, 16, 1e-3), (16,), 16
    else:
        model = create_model(args.arch, args.num_classes, False, args.image_size)
        shape, classes = (3, args.image_size, args.image_size), args.num_classes
    images = torch.randn(args.batch_size, *shape, device=device)
    labels = torch.randint(0, classes, (args.batch_size,), device=device)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=args.amp and device.type == "cuda")
    rows = []
    for schedule in args.schedules:
        per_rank = args.stages_per_rank if SCHEDULES[schedule][1] else 1
        for microbatches in args.microbatches:
            if microbatches < world:
                continue  # a micro-batch for every stage at least: the schedules refuse fewer
            sample = images[: args.batch_size // microbatches]
            cut = PipelineCut(world, schedule, microbatches, per_rank, args.split, sample=sample)
            runner, stages, loss = build_pipeline(BuiltModel.of(model, args.arch), cut, rank, device)
            loss.criterion = torch.nn.functional.cross_entropy
            optimizer = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=1e-3)
            clock = StageClock(runner, device)
            walls, idles = [], []
            for step in range(1 + args.steps):
                dist.barrier()
                start = time.perf_counter()
                with amp:
                    pipeline_step(runner, rank, world, images, labels)
                optimizer.step()
                optimizer.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the bench's own clock: the step's kernels done
                dist.barrier()
                wall = time.perf_counter() - start
                busy = clock.busy_seconds()
                if step:  # the first step builds the stages' buffers
                    walls.append(wall)
                    idles.append(1 - busy / wall)
            # freed now, while the process group lives: a schedule's last sends are C++ works that would otherwise
            # be destroyed at the interpreter's exit, after the group (an abort, now and then, on gloo)
            del runner, stages, optimizer, clock
            gc.collect()
            idle = statistics.median(idles)
            every = [None] * world
            dist.all_gather_object(every, idle)
            wall = statistics.median(walls)
            formula = None if schedule == "zero-bubble" else expected_bubble(world, microbatches, per_rank)
            rows.append(
                dict(
                    schedule=schedule,
                    microbatches=microbatches,
                    stages=world * per_rank,
                    ranks=world,
                    bubble_max=max(every),
                    bubble_mean=sum(every) / world,
                    bubble_expected=formula,
                    images_per_s=args.batch_size / wall,
                )
            )
    return rows


def joined_ranks(script, processes):
    """(rank, world, device) of this process of a torchrun (or srun) launch, its process group started: on its local
    GPU (NCCL) where there is one, else on the CPU (gloo, one thread a rank); without a launcher, one line naming
    `script` and the `processes` it wants."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        sys.exit(f"{script}: start it with torchrun (or srun), {processes}: --help shows how")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # a rank a core
        dist.init_process_group("gloo")
    return rank, world, device


def main(argv=None) -> int:
    args = get_args(argv)
    import torch.distributed as dist

    rank, world, device = joined_ranks("pipeline_bubble.py", "one process a stage")
    rows = measure(args, rank, world, device)
    dist.barrier()  # every rank's last sends received before the group goes
    dist.destroy_process_group()
    if rank == 0:
        size = "layers pausing 1 ms an image" if args.arch == "toy" else f"{args.image_size} px"
        print(f"{args.arch}: {world} ranks, {args.batch_size} images a step, {size}, {device.type}; "
              "bubble = a rank's idle share of the step (largest, mean over the ranks), beside the formula's")  # fmt: skip
        print(f"{'schedule':<13}{'stages':>7}{'micro':>7}{'bubble max':>12}{'mean':>7}{'formula':>9}{'img/s':>10}")
        for row in rows:
            formula = "n/a" if row["bubble_expected"] is None else f"{row['bubble_expected']:.3f}"
            print(f"{row['schedule']:<13}{row['stages']:>7}{row['microbatches']:>7}{row['bubble_max']:>12.3f}"
                  f"{row['bubble_mean']:>7.3f}{formula:>9}{row['images_per_s']:>10.1f}")  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    status = main()
    # Out without the interpreter's teardown: gloo's threads and a schedule's last works, destroyed there in no set
    # order after the group, abort a rank now and then ("terminate called without an active exception"), more often
    # on a loaded machine. Everything is written and the group is gone by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
