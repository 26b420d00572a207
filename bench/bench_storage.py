"""Storage benchmark: the same images as one file each (ImageFolder) and packed in webdataset shards (dlojz_pack.py),
read by dlojz's pipeline, in one run.

For each format it prints:
* open() calls per 1,000 images read (Python's audit events "open", which both builtins.open and os.open raise; in
  the main process, no workers): the metadata requests a parallel file system serves;
* images/s with a warm page cache (every file read once before) and with a cold one (the kernel's page cache
  dropped before the pass, where the machine lets this process: root and /proc/sys/vm/drop_caches; otherwise it says
  so and leaves the row out), through a DataLoader with --workers workers, RandomResizedCrop at --size.

Without --data it uses bench_loader.py's generated ImageNet-like set (~100 KB JPEGs of about 500x375 px); the tree
is packed once into <tree>-packed next to it (with --data too: mind the disk space). Run from the repository root:

    python bench/bench_storage.py                  # 1,000 images, 2 workers, 224 px
"""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS, WHOLE  # noqa: E402

OPENS = [0]


def count_opens(event, _args):
    if event == "open":
        OPENS[0] += 1


def opens_per_1000(dataset, n):
    OPENS[0] = 0
    for i in range(n):
        dataset[(0, i)]
    return 1000 * OPENS[0] / n


def drop_page_cache():
    """None once the page cache is dropped, else why it could not be."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as file:
            file.write("3\n")
        return None
    except OSError as err:
        return f"cannot drop the page cache ({err.strerror}): run as root on a machine that allows it"


def main(argv=None):
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="an ImageFolder tree with train/ and val/ (default: generated)")
    parser.add_argument("--images", type=COUNT, default=1000, help="images in the generated set")
    parser.add_argument("--workers", type=WHOLE, default=2)
    parser.add_argument("--batch-size", type=COUNT, default=32)
    parser.add_argument("--size", type=PIXELS, default=224)
    parser.add_argument("--shard-size", default="100MB")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache passes (no page cache dropped)")
    args = parser.parse_args(argv)
    if args.data and not (Path(args.data) / "train").is_dir():  # before any pass
        parser.error(f"--data {args.data}: no train/ folder there; give an ImageFolder tree with train/ and val/")
    # torch and the pipelines after the flags: bad input is one line in a tenth of a second, not after torch's import
    import torch
    from bench_loader import default_cache_dir, measure, resolve_train_folder, warm_page_cache

    from dlojz_lib.data.datasets import PackedImages, SafeImageFolder
    from dlojz_lib.data.transforms import TrainTransform, lazy_image_loader
    from dlojz_lib.pack.writer import pack

    if args.data:
        src = Path(args.data)
        folder = src / "train"
    else:
        folder = resolve_train_folder(None, args.images, 10, max(1, args.workers))
        src = default_cache_dir().with_name("bench-imagenet-src")  # pack wants train/ and val/: the same images twice
        src.mkdir(parents=True, exist_ok=True)
        for split in ("train", "val"):
            if not (src / split).exists():
                (src / split).symlink_to(folder.resolve())
    packed = Path(str(src).rstrip("/") + "-packed")
    pack(src, packed, shard_size=args.shard_size, workers=max(1, args.workers))
    torch.set_num_threads(1)
    datasets = {
        "files": SafeImageFolder(str(folder), transform=TrainTransform(args.size), loader=lazy_image_loader),
        "shards": PackedImages(packed, "train", TrainTransform(args.size)),
    }
    n = len(datasets["files"])
    batches = n // args.batch_size
    sys.addaudithook(count_opens)
    rows = {}
    for name, dataset in datasets.items():
        rows[name] = dict(opens=opens_per_1000(dataset, min(n, 1000)))
        warm_page_cache(folder if name == "files" else packed)
        rows[name]["warm"] = measure(dataset, lambda images: images, args.workers, args.batch_size, batches - 2, 2, 0)[
            0
        ]
        why = "--no-cold" if args.no_cold else drop_page_cache()
        if why is None:
            rows[name]["cold"] = measure(dataset, lambda images: images, args.workers, args.batch_size, batches, 0, 1)[
                0
            ]
        else:
            rows[name]["cold"] = None
    print(
        f"\n{n} images ({folder}), {len(datasets['shards'].shards.shards)} shards in {packed}, {args.workers} "
        f"workers, batch {args.batch_size}, {args.size} px"
    )
    print("| format | open() per 1,000 images | img/s, warm cache | img/s, cold cache |")
    print("|---|---:|---:|---:|")
    for name, row in rows.items():
        cold = "not measured" if row["cold"] is None else f"{row['cold']:.0f}"
        print(f"| {name} | {row['opens']:.0f} | {row['warm']:.0f} | {cold} |")
    if rows["files"]["cold"] is None:
        print(f"cold cache: {'not asked (--no-cold)' if args.no_cold else drop_page_cache()}")
    return rows


if __name__ == "__main__":
    main()
