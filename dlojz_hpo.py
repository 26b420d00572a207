"""Hyper-parameter search for dlojz.py with Optuna: one study in a journal file on the shared file system, many
workers (Slurm array tasks) adding trials to it, every trial a normal dlojz.py run pruned at its validations, and a
report that ends in a recipe file for `dlojz.py --config`.

    python dlojz_hpo.py search --study NAME --storage PATH --space FILE.toml --trials N [options] -- DLOJZ FLAGS
    python dlojz_hpo.py report --study NAME --storage PATH --out DIR
    sbatch --array=0-15 slurm/dlojz_hpo.slurm --study NAME --storage PATH --space FILE.toml --trials 4 -- ...

The search space is one TOML table per dlojz.py flag (its long name, `-` or `_`):
    [lr]               low = 0.01, high = 1.0, log = true     # a float flag: a range (log or linear, `step`)
    [label-smoothing]  low = 0.0, high = 0.2
    [batch-size]       low = 64, high = 256, step = 64         # an int flag: a range of integers
    [optimizer]        choices = ["sgd", "adamw"]              # any flag: a list of values (switches: true/false)

How it works, and why:
- A trial is a subprocess, `[--launch ...] python -u dlojz.py SHARED-FLAGS SAMPLED-FLAGS --output-dir
  OUT/STUDY/trial-NNNN --val-history ... --metrics-json ... --resume auto --no-requeue --wandb-group STUDY`, its
  output in OUT/STUDY/trial-NNNN/dlojz.log. A subprocess, not main() in this process: a trial gets its own CUDA
  context and process group, may span GPUs and nodes (`--launch "srun ..."`), and a crash or an out-of-memory ends
  that trial, not the worker.
- Pruning: the worker follows the trial's --val-history file, reports every validation's top-1 to the pruner and,
  when the pruner says so, sends SIGUSR2: dlojz finishes its step, writes a checkpoint and exits.
- Objective: `--direction maximize`, the last validation's `--objective` (top-1, or balanced accuracy or macro-F1
  for an imbalanced data set); `minimize`, the time to --target-accuracy (a trial that never reaches it scores
  +inf). The pruner then sees the top-1 error (1 - top-1).
- Preemption: Slurm's warning (`--signal=B:USR1@T`) or SIGTERM reaches the worker, which passes SIGUSR2 to its
  trial (checkpoint), marks the trial failed, retries it (Optuna's RetryFailedTrialCallback, validations kept) and
  requeues its own Slurm job. The retry runs in the failed trial's folder: it resumes from that checkpoint.
- A worker that dies without a word (killed, node lost): Optuna's journal storage has no heartbeat (its RDB storage
  has), so each worker writes one into its running trial every --heartbeat-interval s; before each new trial, every
  worker fails the running trials whose heartbeat is older than --stale-after s and retries them in the same way.
- `--trials N` counts this worker's finished or pruned trials, under its Slurm array task id: a requeued task goes
  on with what it had left.
The worker and the search are dlojz_lib/hpo/search.py, the space file dlojz_lib/hpo/space.py, the report's files
dlojz_lib/hpo/report.py; this file is the command line.
"""

import argparse
import sys

from dlojz_lib.checks import command, fail
from dlojz_lib.hpo.search import report, search
from dlojz_lib.settings.flags import COUNT, POSITIVE, VALIDATION_METRICS, Number


def get_parser():
    parser = argparse.ArgumentParser(
        prog="dlojz_hpo",
        description="Optuna hyper-parameter search for dlojz.py",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.error = lambda message: parser.exit(2, f"dlojz_hpo.py: error: {message} (--help lists the options)\n")
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("search", help="run trials (one worker; start several on one study)")
    s.add_argument("--study", required=True, help="study name (the trials' folder under --output-dir)")
    s.add_argument("--storage", required=True, help="journal file on the shared file system (or a database URL)")
    s.add_argument("--space", required=True, metavar="FILE.toml", help="search space: one table per dlojz.py flag")
    s.add_argument("--trials", type=COUNT, required=True, help="trials this worker finishes (or prunes)")
    s.add_argument("--timeout", type=POSITIVE, default=None, help="seconds after which this worker starts no new trial")
    s.add_argument(
        "--direction",
        choices=("maximize", "minimize"),
        default="maximize",
        help="maximize the last validation's --objective (default), or minimize the time to --target-accuracy",
    )
    s.add_argument(
        "--objective",
        choices=tuple(VALIDATION_METRICS),
        default="top1",
        help="what --direction maximize maximizes and the pruner judges: top1 (default), or balanced_accuracy\n"
        "or macro_f1 (the mean over classes, for an imbalanced data set)",
    )
    s.add_argument("--sampler", choices=("tpe", "random"), default="tpe", help="(default: tpe)")
    s.add_argument(
        "--sampler-seed", type=Number(int, 0), default=None, help="give each worker its own (e.g. the array task id)"
    )
    s.add_argument(
        "--pruner",
        choices=("median", "hyperband", "threshold", "none"),
        default="median",
        help="judges every validation (default: median)",
    )
    s.add_argument(
        "--pruner-startup-trials", type=Number(int, 0), default=4, help="median: trials never pruned first (default: 4)"
    )
    s.add_argument(
        "--pruner-warmup-epochs", type=Number(int, 0), default=0, help="validations never pruned (default: 0)"
    )
    s.add_argument(
        "--prune-below",
        type=Number(float, 0, 1),  # every --objective is a share: above 1 every trial is pruned at its first validation
        default=None,
        metavar="VALUE",
        help="threshold: prune below this value of --objective",
    )
    s.add_argument(
        "--launch", default="", help='command before python for multi-GPU trials, e.g. "srun --kill-on-bad-exit=1"'
    )
    s.add_argument("--heartbeat-interval", type=POSITIVE, default=30, help="seconds between heartbeats (default: 30)")
    s.add_argument(
        "--stale-after",
        type=POSITIVE,
        default=180,
        help="a running trial without heartbeat for this long is failed and retried (default: 180)",
    )
    s.add_argument("--poll-interval", type=POSITIVE, default=1.0, help=argparse.SUPPRESS)
    r = commands.add_parser("report", help="best trials, plots, trials.csv and best.toml (a recipe for --config)")
    r.add_argument("--study", required=True)
    r.add_argument("--storage", required=True)
    r.add_argument("--out", required=True, help="folder for the plots, the CSV and best.toml")
    r.add_argument(
        "--force", action="store_true", help="replace files of the report's names there that it did not write"
    )
    r.add_argument("--top", type=COUNT, default=5, help="best trials printed (default: 5)")
    for sub in (s, r):
        sub.error = lambda message, sub=sub: sub.exit(2, f"dlojz_hpo.py {sub.prog.split()[-1]}: error: {message}\n")
    return parser


@command("dlojz_hpo.py")
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    shared = []
    if "--" in argv:  # everything after -- goes to every trial's dlojz.py
        cut = argv.index("--")
        argv, shared = argv[:cut], argv[cut + 1 :]
    args = get_parser().parse_args(argv)
    if args.command == "search":
        if args.stale_after <= args.heartbeat_interval:
            fail(
                f"--stale-after {args.stale_after:g} must be longer than --heartbeat-interval {args.heartbeat_interval:g}"
            )
        return search(args, shared)
    if shared:
        fail("report takes no dlojz flags after --")
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
