"""The planner's roofline against runs: for the layouts dlojz runs on 2 ranks (DDP, FSDP, TP 2 x FSDP 1, PP 2 x
FSDP 1), the images a rank trains a second, measured, beside the roofline's estimate (dlojz_lib/parallelism/plan.py)
for the same machine, both ranked; each pair of layouts whose speed ratio the two put more than 2x apart is said.

The roofline is given this machine's figures, measured first: its compute leg one rank's step of the plain model
alone (the FLOPs of `-b` images over that time: the FLOP/s the model reaches here, not a data sheet's peak), its
links' bandwidth an all-reduce of 64 MB between the ranks, and the share of that all-reduce a step hides when both
run at once (the overlap the roofline gives the data groups' and a pipeline's sends; TP's wait for the compute).
What it leaves out is then what the runs show: the pipeline's schedule beyond its bubble, the many small
collectives' latency, the smaller matrix products of a tensor-parallel rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/plan_vs_runs.py   # ViT-S/16 at 112 px
    torchrun --standalone --nproc-per-node 2 bench/plan_vs_runs.py --arch timm:vit_base_patch16_224 --image-size 224

Each rank takes its local GPU (NCCL) where there is one; else the CPU (gloo, one thread a rank). Float32 (--no-amp).
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS  # noqa: E402

# (the planner's row on 2 ranks, dlojz.py's flags, the images a step takes as a multiple of -b): the planner's -b is
# a GPU's images; a tensor group shares them, a pipeline of p stages takes p times them
LAYOUTS = {
    "DDP": ([], 1),
    "FSDP": (["--fsdp"], 1),
    "TP 2 x FSDP 1": (["--fsdp", "--tp", "2"], 1),
    "PP 2 x FSDP 1": (["--fsdp", "--pp", "2"], 2),
}


def get_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="timm:vit_small_patch16_224", help="a model with a tensor-parallel plan")
    p.add_argument("--image-size", type=PIXELS, default=112)
    p.add_argument("-b", "--batch-size", type=COUNT, default=8, help="images a rank (the planner's -b)")
    p.add_argument("--microbatches", type=COUNT, default=4, help="1F1B's micro-batches a step (default: 4)")
    p.add_argument("--steps", type=COUNT, default=5, help="timed steps a layout, after one warm-up step")
    return p.parse_args(argv)


def laid_out(arch, image_size, flags, batch, world, rank, device):
    """A model of `arch` (3 classes) laid out as dlojz.py lays it out for `flags` (`lay_out`) on this rank of
    `world`, float32, with the optimizer SGD with momentum; returns (model, optimizer, step), `step(images, labels)`
    one training step's forward and backward (the schedule's under --pp), the tensor group's whole weights averaged."""
    import torch

    from dlojz_lib.dist import Distribution, model_parallel_mesh
    from dlojz_lib.model.build import BuiltModel
    from dlojz_lib.model.zoo import create_model
    from dlojz_lib.parallelism.layout import lay_out
    from dlojz_lib.parallelism.pipeline import pipeline_step
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    argv = ["--device", device.type, *flags, "-b", str(batch), "--no-amp"]
    cfg = resolve_config(get_args_parser().parse_args(argv))
    ranks = Distribution(world, rank, rank, device)
    if cfg.fsdp:
        model_parallel_mesh(ranks, cfg.pp, cfg.tp, cfg.fsdp_replicate)
    torch.manual_seed(0)
    built = BuiltModel.of(create_model(arch, 3, False, image_size).to(device), arch)
    model = lay_out(built, cfg, ranks, lambda line: None)
    optimizer = torch.optim.SGD(model.module.parameters(), lr=0.01, momentum=0.9)
    if model.pipeline is not None:
        model.pipeline.give_loss(torch.nn.CrossEntropyLoss())

    def step(images, labels):
        if model.pipeline is not None:
            run = model.pipeline
            pipeline_step(run.runner, run.pipe_rank, run.pp, images, labels)
        else:
            torch.nn.functional.cross_entropy(model.net(images), labels).backward()
        if model.whole_copies is not None:  # --tp: as dlojz.py steps
            model.whole_copies.average_gradients()

    return model, optimizer, step, ranks


def layouts(world):
    """LAYOUTS named as the planner names them on `world` ranks, with HSDP's on 4 (two "nodes" of 2)."""
    found = {name.replace("FSDP 1", f"FSDP {world // 2}"): run for name, run in LAYOUTS.items()}
    if world == 4:
        found["HSDP 2 x FSDP 2"] = (["--fsdp", "--fsdp-replicate", "2"], 1)
    return found


def table(args):
    """The planner's table for the run's model, images and -b (float32, SGD)."""
    from dlojz_lib.parallelism.plan import LayoutTable

    return LayoutTable(args.arch, args.image_size, 3, args.batch_size, pp_microbatches=args.microbatches,
                       optimizer="sgd", amp_bytes=4)  # fmt: skip


def measure(args, rank, world, device):
    """This rank's figures, as `dlojz_lab.py plan --probe` measures them (its model's step, its links' bandwidth
    and latency, the overlap), and the seconds of each layout's step."""
    import torch
    import torch.distributed as dist

    from dlojz_lib.parallelism.probe import measure as probe
    from dlojz_lib.parallelism.probe import timed

    found = {"figures": probe(table(args), device, {"node": (None, world)}, steps=args.steps)}
    torch.manual_seed(rank)
    images = torch.randn(args.batch_size * 2, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, 3, (args.batch_size * 2,), device=device)
    for layout, (flags, share) in layouts(world).items():
        flags = [*flags, "--pp-microbatches", str(args.microbatches)] if "--pp" in flags else flags
        batch = args.batch_size * share
        model, optimizer, step, _ = laid_out(args.arch, args.image_size, flags, batch, world, rank, device)

        def train_step():
            step(images[:batch], labels[:batch])
            optimizer.step()
            optimizer.zero_grad()

        found[layout] = timed(train_step, args.steps, device)
        dist.barrier()
    return found


def disagreements(predicted, measured, factor=2.0) -> list:
    """Each pair of layouts (names of both dicts: images a GPU a second) whose speed ratio the roofline (`predicted`)
    and the runs (`measured`) put more than `factor` apart, in words."""
    names, found = [name for name in predicted if name in measured], []
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            roofline = predicted[first] / predicted[second]
            runs = measured[first] / measured[second]
            if max(roofline / runs, runs / roofline) > factor:
                found.append(
                    f"{first} against {second}: the roofline says {roofline:.2f}x as fast, the runs {runs:.2f}x"
                )
    return found


def report(args, world, device, seconds):
    """The table of both speeds, each layout's error and the pairs they disagree on, from the ranks' `seconds` (the
    slowest rank's step, its compute and links); returns (predicted, measured) images a GPU a second."""
    from dlojz_lib.parallelism.plan import Allocation, plan

    slowest = {key: max(rank[key] for rank in seconds) for key in seconds[0] if key != "figures"}
    figures = {key: (max if "latency" in key else min)(rank["figures"][key] for rank in seconds)
               for key in seconds[0]["figures"]}  # fmt: skip
    figures.update(network_gbs=figures["nvlink_gbs"], network_latency_us=figures["latency_us"])
    nodes = 2 if world == 4 else 1  # (4 ranks: two "nodes" of 2, for HSDP's row)
    allocation = Allocation(nodes, world // nodes, gpu_memory_gib=1e6, **figures)
    rows = {row["layout"]: row for row in plan(table(args), allocation)[0]}
    predicted, measured = {}, {}
    print(f"{args.arch}: {world} ranks ({device.type}), {args.image_size} px, -b {args.batch_size} a rank, float32, "
          f"{args.microbatches} micro-batches a pipeline's step, the median of {args.steps} timed steps a layout; "
          f"the roofline's figures probed here (dlojz_lab.py plan --probe's): {allocation.tflops * 1e3:.1f} GFLOP/s "
          f"a rank (one rank's plain step), {allocation.nvlink_gbs:.2f} GB/s and {allocation.latency_us:.0f} µs a "
          f"collective (all-reduces of 64 MiB and 1 KiB), {allocation.overlap:.0%} of an all-reduce hidden behind a "
          "step (both at once)")  # fmt: skip
    print(f"{'layout':<18}{'roofline img/s':>16}{'measured img/s':>16}{'measured/roofline':>19}")
    for layout in layouts(world):
        tp = rows[layout]["tp"]
        predicted[layout] = rows[layout]["images_per_gpu_s"]
        measured[layout] = args.batch_size / tp / slowest[layout]  # (the world's images a step, over its ranks)
        print(f"{layout:<18}{predicted[layout]:>16.1f}{measured[layout]:>16.1f}"
              f"{measured[layout] / predicted[layout]:>19.2f}")  # fmt: skip
    errors = [abs(measured[name] / predicted[name] - 1) for name in predicted]
    first = max(predicted, key=predicted.get), max(measured, key=measured.get)
    print(f"largest error {max(errors):.0%} ({sum(e <= 0.25 for e in errors)} of {len(errors)} layouts within 25 %); "
          f"the roofline ranks first {first[0]}, the runs {first[1]}")  # fmt: skip
    found = disagreements(predicted, measured)
    print("\n".join(f"disagree: {line}" for line in found) or "the roofline and the runs agree within 2x on every pair")
    return predicted, measured


def main(argv=None) -> int:
    args = get_args(argv)
    import torch.distributed as dist
    from pipeline_bubble import joined_ranks  # (this folder's: the process group a torchrun launch starts)

    rank, world, device = joined_ranks("plan_vs_runs.py", "2 or 4 processes")
    seconds = [None] * world
    dist.all_gather_object(seconds, measure(args, rank, world, device))
    dist.destroy_process_group()
    if rank == 0:
        report(args, world, device, seconds)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # (as pipeline_bubble.py: out without gloo's teardown)
