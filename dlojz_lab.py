"""The course's lab from the shell: a sweep of dlojz.py runs, here or as one Slurm job array, then one table and
plots comparing them. What the course's idr_pytools does in a notebook (gpu_jobs_submitter, display_slurm_queue,
search_log), for dlojz.

    python dlojz_lab.py sweep --name bs --grid batch-size=128,256 --grid channels-last=on,off [--launch slurm
        --gpus-per-node 1 --time 00:20:00 ...] -- --test --arch resnet50 --amp
    python dlojz_lab.py sweep --name pp --nproc-per-node 2 --grid pp-microbatches=2,4,8 -- --test --fsdp --pp 2
    python dlojz_lab.py status bs                 # the sweep's jobs in the queue, the last line of each run's log
    python dlojz_lab.py compare runs/bs [runs/other ...]   # table, compare.csv and PNG plots (dlojz_lib/lab/report.py)

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
import sys
from pathlib import Path

from dlojz_lib.checks import OneLineArgumentParser, command
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
from dlojz_lib.settings.flags import COUNT, VALIDATION_METRICS, WHOLE


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


# ------------------------------------------------------------------ command line
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
    return run_one(Path(args.sweep_dir), args.index)


if __name__ == "__main__":
    sys.exit(main())
