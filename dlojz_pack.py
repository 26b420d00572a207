"""Pack an image tree into webdataset tar shards with a random-access index, for a parallel file system.

`python dlojz_pack.py SRC DST [--shard-size 1GB] [--workers N]`: SRC is torchvision's ImageNet layout (meta.bin,
train/<wnid>/, val/<wnid>/) or an ImageFolder (train/<class>/, val/<class>/); DST gets `train-000000.tar`, ...,
`train-index.npy`, `val-...` and the manifest `dlojz_pack.json`, and `python dlojz.py --data-root DST` reads it.
The same SRC gives byte-identical shards whatever --workers; an interrupted pack resumes where it stopped.

A bad input is one line `dlojz_pack.py: error: ...`, exit status 2. The writer, the format and its guarantees are
dlojz_lib/pack/writer.py's; docs/data.md says when packing pays.
"""

import argparse
import sys

from dlojz_lib.checks import command
from dlojz_lib.pack.writer import default_workers, pack
from dlojz_lib.settings.flags import COUNT


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as for every other bad input
        print(f"dlojz_pack.py: error: {message} (see python dlojz_pack.py --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)


@command("dlojz_pack.py")
def main(argv=None) -> int:
    """0 done (or nothing to do), 2 bad input, 1 an I/O error while packing, 130 interrupted."""
    parser = _Parser(
        prog="dlojz_pack.py",
        description="Pack an ImageNet or ImageFolder tree (train/, val/) into "
        "webdataset tar shards with a random-access index (read by dlojz_lib.data.shards.PackedSplit).",
    )
    parser.add_argument("src", metavar="SRC", help="folder holding train/<class>/ and val/<class>/ (and meta.bin)")
    parser.add_argument("dst", metavar="DST", help="folder for the shards: new, empty, or an interrupted pack of SRC")
    parser.add_argument(
        "--shard-size",
        default=None,
        metavar="SIZE",
        help="bytes per shard, e.g. 1GB (default), 500MB, 64KB; 1000-based, KiB/MiB/GiB 1024-based",
    )
    parser.add_argument(
        "--workers",
        type=COUNT,
        default=None,
        metavar="N",
        help=f"processes writing shards (default: the CPUs available, at most 8: {default_workers()})",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else 2
    try:
        pack(args.src, args.dst, shard_size=args.shard_size, workers=args.workers)
    except KeyboardInterrupt:
        print(
            "dlojz_pack: interrupted; rerun the same command to finish (finished shards are kept)",
            file=sys.stderr,
            flush=True,
        )
        return 130
    except OSError as err:  # disk full, quota, a file system going away: the finished shards are kept
        print(
            f"dlojz_pack.py: error: {err}; rerun the same command to finish (finished shards are kept)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
