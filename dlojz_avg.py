"""Average the weights of a run's checkpoints into one checkpoint, as torchvision's MobileNetV3-Large recipe does
for its published 74.042 % (and timm's avg_checkpoints.py): the mean of the parameters and BatchNorm statistics of
the last N checkpoints of a run's folder, the last N that improved its best validation when they were written
(torchvision's MobileNetV3 rule: "the last three checkpoints that improved top-1"), or of the files given.

    python dlojz_avg.py runs/JOB --last 3 -o runs/JOB/averaged.pt
    python dlojz_avg.py runs/JOB --improved 3 -o runs/JOB/averaged.pt
    python dlojz_avg.py runs/JOB/ckpt_e0598_s*.pt runs/JOB/ckpt_e0600_s*.pt -o averaged.pt

The result is an ordinary dlojz checkpoint (the newest's run settings and position, its model averaged, no EMA),
with its .sha256: `python dlojz.py --eval-only --resume averaged.pt` validates it, `--initial-checkpoint
averaged.pt` fine-tunes from it. The averaging is dlojz_lib/checkpoint.py's `average`. A run keeps
--keep-checkpoints of them (3 by default): give it as many as you will average.
"""

import os
import sys
from pathlib import Path

from dlojz_lib.checks import OneLineArgumentParser, command
from dlojz_lib.settings.flags import COUNT


@command("dlojz_avg.py")
def main(argv=None) -> int:
    parser = OneLineArgumentParser(prog="dlojz_avg.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="a run's folder (with --last), or checkpoint files")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--last", type=COUNT, default=None, metavar="N", help="the run folder's newest N checkpoints")
    choice.add_argument(
        "--improved",
        type=COUNT,
        default=None,
        metavar="N",
        help="the run folder's newest N checkpoints that each improved the best validation (--best-metric) when written",
    )
    parser.add_argument("-o", "--output", required=True, help="the checkpoint file to write")
    parser.add_argument("--force", action="store_true", help="replace -o even if dlojz_avg.py did not write it")
    args = parser.parse_args(argv)
    import dlojz_lib.checkpoint as ckpt  # (torch: after the command line is read)
    from dlojz_lib.checks import claim_output

    paths = checkpoints_to_average(args.checkpoints, args.last, args.improved)
    claim_output(
        args.output, "-o", "a checkpoint dlojz_avg.py wrote", lambda path: ckpt.written_by_command(path, "averaged_from"),
        [*paths, *args.checkpoints], args.force, create_folder=False,
    )  # fmt: skip
    ckpt.write_whole(ckpt.average(paths), args.output)  # (a damaged or sharded checkpoint, another model: one line)
    print(
        f"written: {args.output} ({os.path.getsize(args.output) / 2**20:.1f} MiB), the mean of {len(paths)} "
        f"checkpoints: {', '.join(path.name for path in paths)}"
    )
    return 0


def checkpoints_to_average(given, last=None, improved=None):
    """The files to average: the newest `last` of a run's folder, its newest `improved` that each improved the best
    validation when written, or the files given (at least two)."""
    from dlojz_lib.checkpoint import list_checkpoints
    from dlojz_lib.checks import UserError

    if last is None and improved is None:
        paths = [Path(p) for p in given]
        if len(paths) < 2:
            raise UserError("give two checkpoint files or more (or a run folder with --last N or --improved N)")
        for i, path in enumerate(paths):
            if path.is_dir() and not path.name.endswith(".dcp"):
                raise UserError(
                    f"{path}: a folder among checkpoint files; give a run folder alone with --last N or --improved N"
                )
            same = next((p for p in paths[:i] if p.exists() and path.exists() and os.path.samefile(p, path)), None)
            if same is not None:
                raise UserError(f"{path}: given twice ({same}); each checkpoint counts once in the mean")
        return paths
    flag, n = ("--last", last) if last is not None else ("--improved", improved)
    if len(given) != 1 or not Path(given[0]).is_dir():
        raise UserError(f"{flag} N takes one run folder: give its path, or the checkpoint files without {flag}")
    found = [path for path in list_checkpoints(given[0]) if path.suffix == ".pt"]
    if improved is not None:
        found = [path for path in found if improved_when_written(path)]
    if len(found) < max(n, 2):
        what = "checkpoint(s) (.pt)" if last is not None else "checkpoint(s) that improved the best validation"
        raise UserError(
            f"{flag} {n}: {given[0]} holds {len(found)} {what}; give {flag} {len(found)} at most (2 or more), and run "
            "with --keep-checkpoints K to keep more"
        )
    return found[-n:]


def improved_when_written(path) -> bool:
    """Whether the checkpoint at `path` closed an epoch whose validation was the run's best so far (its `best_epoch`
    is its own epoch): the checkpoints that `best` named in turn."""
    from dlojz_lib.checkpoint import load

    saved = load(path)
    return (
        saved.get("batch", 0) == 0
        and saved.get("best_value") is not None
        and saved.get("best_epoch") == saved.get("epoch")
    )


if __name__ == "__main__":
    sys.exit(main())
