"""The course's lab from the shell: a sweep of dlojz.py runs, here or as one Slurm job array, then one table and
plots comparing them. What the course's idr_pytools does in a notebook (gpu_jobs_submitter, display_slurm_queue,
search_log), for dlojz.

    python dlojz_lab.py sweep --name bs --grid batch-size=128,256 --grid channels-last=on,off [--launch slurm
        --gpus-per-node 1 --time 00:20:00 ...] -- --test --arch resnet50 --amp
    python dlojz_lab.py sweep --name pp --nproc-per-node 2 --grid pp-microbatches=2,4,8 -- --test --fsdp --pp 2
    python dlojz_lab.py status bs                 # the sweep's jobs in the queue, the last line of each run's log
    python dlojz_lab.py compare runs/bs [runs/other ...]   # table, compare.csv and PNG plots (dlojz_lib/lab/report.py)
    python dlojz_lab.py plan --arch timm:coatnet_7_224 --nodes 2 [--gpu h100 --gpu-memory 80 -b 16]  # which layout

A sweep is the cross product of its grids: `--grid FLAG=V1,V2,...` with FLAG one of dlojz.py's long flags (without
its dashes), `on`/`off` for a switch. Each run is a dlojz.py command line (the flags after `--`, then the run's
settings) with its own folder `runs/NAME/RUN` (RUN names its settings, e.g. `batch-size=128_channels-last=on`):
its log, its metrics JSON, its --val-history, and with --test its chronometer's report and trace. Every run's
command line is checked by dlojz.py's own parser and checks before anything runs or is submitted: a bad grid is one
line, exit 2. `runs/NAME/sweep.json` records the sweep (its runs and their command lines, the launch, the job id);
each run's `status.json` says running, done or failed (with the exit status): a failed run is marked and the others
go on. `--launch slurm` writes `runs/NAME/sweep.slurm`, one array task per run, the resources asked as #SBATCH
lines and the environment from slurm/dlojz_env.sh, submits it and prints the job id.
"""

import argparse
import os
import sys
from pathlib import Path

from dlojz_lib.checks import OneLineArgumentParser, command, fail
from dlojz_lib.lab.sweep import (
    SLURM_RESOURCES,
    last_line,
    load,
    read_plan,
    run_one,
    run_states,
    states,
    sweep,
    sweep_dir_of,
)
from dlojz_lib.optim import OPTIMIZER_TABLE
from dlojz_lib.settings.flags import COUNT, PIXELS, POSITIVE, VALIDATION_METRICS, WHOLE, Number


def sweep_command(args) -> int:
    resources = {key: getattr(args, key) for key, _, _ in SLURM_RESOURCES if getattr(args, key) is not None}
    sweep_dir = sweep(
        args.name, args.grid, args.dlojz_args, args.launch, args.sbatch, args.python, args.nproc_per_node, **resources
    )
    if args.launch == "local":
        done = [state for _, state in states(sweep_dir)]
        return 0 if all(state == "done" for state in done) else 1
    return 0


def status_command(args) -> int:
    sweep_dir = sweep_dir_of(args.sweep)
    sweep = read_plan(sweep_dir)
    where = f"job array {sweep['job_id']}" if sweep.get("job_id") else "run here"
    print(f"sweep {sweep['name']} ({where}), {len(sweep['runs'])} runs:")
    width = max(len(run["name"]) for run in sweep["runs"])
    for run, state in run_states(sweep_dir, sweep):
        print(f"  {run['name']:<{width}}  {state:<12}  {last_line(sweep_dir / run['name'])[:100]}")
    return 0


def compare_command(args) -> int:
    from dlojz_lib.lab.report import compare

    sweeps = load(*args.sweeps)
    return compare(sweeps, Path(args.out) if args.out else sweeps[0][0], args.metric, args.force)


def plan_command(args) -> int:
    from dlojz_lib.model.zoo import check_arch, check_input_sizes
    from dlojz_lib.parallelism.plan import GPUS, Allocation, LayoutTable, named_layout_line, pick_line, plan

    check_arch(args.arch)  # (dlojz.py's checks, in its words)
    check_input_sizes(args.arch, False, [args.image_size])
    microbatches = args.pp_microbatches or (None if args.batch_per_copy else 8)  # (None: 2 p, dlojz.py's)
    settings = LayoutTable(
        args.arch, args.image_size, args.num_classes, args.batch_size, pp_microbatches=microbatches,
        optimizer=args.optimizer, batch_per_copy=args.batch_per_copy,
    )  # fmt: skip
    preset = dict(GPUS[args.gpu])
    if args.float8_tflops is not None and preset.get("float8_tflops") is None:  # (dlojz.py's --float8 refuses it)
        fail(
            f"--float8-tflops: an {args.gpu.upper()} has no float8 (dlojz.py's --float8 needs an H100 or newer); drop it"
        )
    if args.probe is not None:  # what the job's ranks measure, over the data sheet's
        from dlojz_lib.parallelism.probe import measure_job, probed

        world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        preset.update(probed(args.probe, settings, world, lambda: measure_job(settings)[0], rank=rank))
        if rank != 0:
            return 0  # (rank 0 says the plan)
    keys = ("gpus_per_node", "gpu_memory_gib", "tflops", "nvlink_gbs", "network_gbs", "float8_tflops", "overlap")
    keys += ("latency_us", "network_latency_us")
    figures = {
        key: getattr(args, key, None) if getattr(args, key, None) is not None else preset.get(key) for key in keys
    }
    allocation = Allocation(args.nodes, **{key: value for key, value in figures.items() if value is not None})
    rows, total, planned = plan(settings, allocation)
    if args.layout is not None and args.layout not in (names := [row["layout"] for row in rows]):
        fail(f"--layout {args.layout}: not a layout of this allocation's table; give one of: {', '.join(names)}")
    gib, gb = 2**30, 1e9
    print(
        f"{args.arch}: {total / 1e6:,.1f} M parameters, {args.image_size} px, "
        f"-b {args.batch_size} {'a model copy (as dlojz.py)' if args.batch_per_copy else 'a GPU'}, "
        f"{args.optimizer}; {args.nodes} node(s) of {allocation.gpus_per_node} {args.gpu.upper()}-class GPUs "
        f"({allocation.gpu_memory_gib:g} GiB, {allocation.tflops:.4g} TFLOP/s, NVLink {allocation.nvlink_gbs:.4g} GB/s, "
        f"network {allocation.network_gbs:.4g} GB/s a GPU; a collective {allocation.latency_us:.3g} µs inside a node, "
        f"{allocation.network_latency_us:.3g} µs across{'; probed' if args.probe else ''})"
    )
    print(f"{'layout':<32}{'state':>8}{'activ.':>8}{'fits':>6}{'in node':>9}{'across':>9}{'bubble':>8}"
          f"{'step ms':>10}{'img/s/GPU':>14}")  # fmt: skip
    for row in rows:
        activations = "n/a" if row["activation_bytes"] is None else f"{row['activation_bytes'] / gib:.2f}"
        state = row["used_bytes"] - (row["activation_bytes"] or 0)
        print(
            f"{row['layout']:<32}{state / gib:>8.2f}{activations:>8}{'yes' if row['fits'] else 'no':>6}"
            f"{row['intra_bytes'] / gb:>9.2f}{row['inter_bytes'] / gb:>9.2f}{row.get('bubble', 0.0):>8.0%}"
            f"{row['step_s'] * 1e3:>10.2f}{row['images_per_gpu_s']:>14,.0f}"
        )
    print(
        "GiB a GPU (float32 state; activations: Megatron-LM's count for transformer blocks, fused attention; the rest as saved), GB sent a GPU a step "
        "inside a node and across nodes; step: the compute at peak FLOP/s (--probe: the model's own) plus the sends "
        "at the links' bandwidths and each collective's latency, less what the compute hides, / (1 - bubble); + AC: with --activation-checkpointing, where the layout does not fit "
        "without (full: a third more FLOPs); + float8: --float8 tensorwise's linears at the float8 peak, gathered "
        "in 1 byte under FSDP (dlojz.py --layout auto leaves --float8, which needs torchao, to the run's flags)"
    )
    if not planned:
        print(f"{args.arch}: no tensor-parallel plan (its TP rows are left out, its activations counted unsplit)")
    print(pick_line(rows, allocation))
    if args.layout is not None:
        print(named_layout_line(args.layout, rows, allocation))
    return 0 if rows[0]["fits"] else 1


# ------------------------------------------------------------------ command line
def add_plan_parser(sub):
    """`plan`'s flags: the model, the allocation and the roofline's figures (each a data sheet's unless given or
    probed)."""
    pl = sub.add_parser("plan", help="which parallel layout for a model on an allocation: bytes, sends, a pick")
    pl.add_argument("--arch", required=True, help="the model, as dlojz.py's --arch (built on the meta device)")
    pl.add_argument("--nodes", type=COUNT, default=1)
    pl.add_argument("--gpu", choices=("h100", "a100"), default="h100", help="the figures below' defaults: Jean Zay's")
    pl.add_argument("--gpus-per-node", type=COUNT, default=None, help="(default: 4 H100s, 8 A100s)")
    pl.add_argument("--gpu-memory", dest="gpu_memory_gib", type=POSITIVE, default=None, metavar="GIB")
    pl.add_argument("--tflops", type=POSITIVE, default=None, help="dense bfloat16 TFLOP/s a GPU")
    pl.add_argument(
        "--float8-tflops",
        type=POSITIVE,
        default=None,
        help="dense float8 TFLOP/s a GPU (default: H100's; none on an A100)",
    )
    pl.add_argument("--nvlink-gbs", type=POSITIVE, default=None, help="GB/s a GPU sends inside its node")
    pl.add_argument("--network-gbs", type=POSITIVE, default=None, help="GB/s a GPU sends across nodes")
    pl.add_argument("--latency-us", type=Number(float, 0), default=None, help="a collective's latency inside a node")
    pl.add_argument("--network-latency-us", type=Number(float, 0), default=None, help="and across nodes")
    pl.add_argument(
        "--probe", default=None, metavar="FILE",
        help="measure the figures where this runs (the model's step: its FLOP/s; under torchrun or srun the links' "
        "bandwidth, latency and overlap too), saved in FILE and reused while the model, -b and ranks match",
    )  # fmt: skip
    pl.add_argument("-b", "--batch-size", type=COUNT, default=16, help="images a GPU (a tensor group shares them)")
    pl.add_argument("--image-size", type=PIXELS, default=224)
    pl.add_argument("--num-classes", type=COUNT, default=1000)
    pl.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_TABLE))
    pl.add_argument(
        "--pp-microbatches", type=COUNT, default=None,
        help="1F1B's micro-batches a step (default: 8; with --batch-per-copy, 2 p as dlojz.py's)",
    )  # fmt: skip
    pl.add_argument(
        "--batch-per-copy", action="store_true",
        help="-b counts a model copy's images, as dlojz.py's -b and --layout auto: a pipeline of p stages takes -b "
        "(not -b x p), a tensor group shares it",
    )  # fmt: skip
    pl.add_argument(
        "--layout", default=None, help="a layout of the table, as it names it: whether it fits, and by how much not"
    )


def get_parser():
    p = OneLineArgumentParser(prog="dlojz_lab.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="run the cross product of the grids, here or as a Slurm job array")
    s.add_argument("--name", required=True, help="the sweep's folder under runs/")
    s.add_argument("--grid", action="append", default=[], metavar="FLAG=V1,V2", help="a dlojz.py flag and its values")
    s.add_argument("--launch", choices=("local", "slurm"), default="local")
    for key, directive, count in SLURM_RESOURCES:
        s.add_argument(
            f"--{key.replace('_', '-')}",
            type=COUNT if count else None,
            default=None,
            help=f"Slurm: #SBATCH {directive}",
        )
    s.add_argument("--sbatch", action="append", default=[], metavar="OPTION", help="any other #SBATCH option")
    s.add_argument(
        "--python",
        default=None,
        help="the Python that runs each dlojz.py (default: the one running this, or the job's after dlojz_env.sh)",
    )
    s.add_argument(
        "--nproc-per-node",
        type=COUNT,
        default=1,
        metavar="N",
        help="--launch local: each run as N processes (torchrun's --standalone), e.g. for --pp or --tp; on Slurm\n"
        "the job's tasks are the ranks (--ntasks-per-node)",
    )
    s.add_argument("dlojz_args", nargs=argparse.REMAINDER, help="-- then dlojz.py's flags, common to every run")
    c = sub.add_parser("compare", help="one table, compare.csv and plots of one or more sweeps")
    c.add_argument("sweeps", nargs="+", help="sweep folders (runs/NAME) or names")
    c.add_argument("--out", default=None, help="where compare.csv and the plots go (default: the first sweep's folder)")
    c.add_argument(
        "--force", action="store_true", help="replace files of compare's names there that compare did not write"
    )
    c.add_argument(
        "--metric",
        choices=tuple(VALIDATION_METRICS),
        default="top1",
        help="the validation figure that names the best run and that accuracy.png draws (default: top1)",
    )
    add_plan_parser(sub)
    st = sub.add_parser("status", help="the sweep's jobs in the queue and the last line of each run's log")
    st.add_argument("sweep")
    t = sub.add_parser("run-task", help=argparse.SUPPRESS)  # what an array task runs
    t.add_argument("sweep_dir")
    t.add_argument("index", type=WHOLE)
    return p


@command("dlojz_lab.py")
def main(argv=None) -> int:
    args = get_parser().parse_args(argv)
    if getattr(args, "dlojz_args", None) and args.dlojz_args[0] == "--":
        args.dlojz_args = args.dlojz_args[1:]
    if args.command == "sweep":
        return sweep_command(args)
    if args.command == "status":
        return status_command(args)
    if args.command == "compare":
        return compare_command(args)
    if args.command == "plan":
        return plan_command(args)
    return run_one(Path(args.sweep_dir), args.index)


if __name__ == "__main__":
    sys.exit(main())
