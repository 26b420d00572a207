"""Average the weights of a run's checkpoints into one checkpoint, as torchvision's MobileNetV3-Large recipe does
for its published 74.042 % (and timm's avg_checkpoints.py): the mean of the parameters and BatchNorm statistics of
the last N checkpoints of a run's folder, or of the files given.

    python dlojz_avg.py runs/JOB --last 3 -o runs/JOB/averaged.pt
    python dlojz_avg.py runs/JOB/ckpt_e0598_s*.pt runs/JOB/ckpt_e0600_s*.pt -o averaged.pt

The result is an ordinary dlojz checkpoint (the newest's run settings and position, its model averaged, no EMA),
with its .sha256: `python dlojz.py --eval-only --resume averaged.pt` validates it, `--initial-checkpoint
averaged.pt` fine-tunes from it. The averaging is dlojz_lib/checkpoint.py's `average`. A run keeps
--keep-checkpoints of them (3 by default): give it as many as you will average.
"""

import os
import sys
from pathlib import Path

from dlojz_lib.checks import OneLineArgumentParser
from dlojz_lib.flags import COUNT


def main(argv=None) -> int:
    parser = OneLineArgumentParser(prog="dlojz_avg.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="a run's folder (with --last), or checkpoint files")
    parser.add_argument("--last", type=COUNT, default=None, metavar="N", help="the run folder's newest N checkpoints")
    parser.add_argument("-o", "--output", required=True, help="the checkpoint file to write")
    args = parser.parse_args(argv)
    import dlojz_lib.checkpoint as ckpt  # (torch: after the command line is read)
    from dlojz_lib.checks import UserError, check_output_file

    if not Path(args.output).resolve().parent.is_dir():
        print(f"dlojz_avg.py: error: -o {args.output}: its folder does not exist", file=sys.stderr)
        return 2
    try:
        check_output_file(args.output, "-o")
        paths = checkpoints_to_average(args.checkpoints, args.last)
        if Path(args.output).resolve() in {path.resolve() for path in paths}:
            raise UserError(f"-o {args.output}: one of the checkpoints averaged; give a new file")
        ckpt.write(ckpt.average(paths), args.output)
    except (UserError, ckpt.CheckpointError) as err:  # a damaged or sharded checkpoint, another model: one line
        print(f"dlojz_avg.py: error: {err}", file=sys.stderr)
        return 2
    print(
        f"written: {args.output} ({os.path.getsize(args.output) / 2**20:.1f} MiB), the mean of {len(paths)} "
        f"checkpoints: {', '.join(path.name for path in paths)}"
    )
    return 0


def checkpoints_to_average(given, last):
    """The files to average: the newest `last` of a run's folder, or the files given (at least two)."""
    from dlojz_lib.checkpoint import list_checkpoints
    from dlojz_lib.checks import UserError

    if last is not None:
        if len(given) != 1 or not Path(given[0]).is_dir():
            raise UserError("--last N takes one run folder: give its path, or the checkpoint files without --last")
        found = [path for path in list_checkpoints(given[0]) if path.suffix == ".pt"]
        if len(found) < max(last, 2):
            raise UserError(
                f"--last {last}: {given[0]} holds {len(found)} checkpoint(s) (.pt); give --last {len(found)} at "
                "most (2 or more), and run with --keep-checkpoints N to keep N"
            )
        return found[-last:]
    paths = [Path(p) for p in given]
    if len(paths) < 2:
        raise UserError("give two checkpoint files or more (or a run folder with --last N)")
    return paths


if __name__ == "__main__":
    sys.exit(main())
