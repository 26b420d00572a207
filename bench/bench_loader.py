"""Loader benchmark: dlojz's uint8 input pipeline vs the torchvision classification reference, in one run.

Three pipelines read the same ImageFolder with the same DataLoader settings (workers, batch size, sampler) and are
timed over the same number of batches after a warm-up:

* reference: ``ImageFolder`` + ``RandomResizedCrop`` + ``RandomHorizontalFlip`` + ``PILToTensor`` +
  ``ConvertImageDtype(float)`` + ``Normalize`` in the workers (torchvision's classification reference recipe);
* dlojz: what dlojz.py builds, ``SafeImageFolder(loader=lazy_image_loader, transform=TrainTransform)`` (per-sample
  seeding, unreadable files skipped) in the workers, uint8 batches: the CPU work of a GPU node, where the float
  conversion and normalisation run on the GPU;
* dlojz+norm: the same, then ``DeviceNormalize`` on the CPU in the main process (what training on the CPU does);
* dlojz shards: dlojz on the same images packed in webdataset shards, read by index (the generated set is packed
  once, next to it, by dlojz_pack.py; with --data, give --shards PACK);
* DALI-CPU: ``--data-backend dali`` without a GPU, DALI's CPU decoder with ``--workers`` threads, when DALI is
  installed: normalised float32 batches, DALI's ``crop_mirror_normalize`` doing what DeviceNormalize does for
  dlojz+norm; its training resize without antialiasing (dlojz.py's default) and with it (``--dali-antialias``).

The main process runs torch with ``--main-threads`` (default 1) threads: on a machine with as many cores as workers,
a multi-threaded normalisation would spin against the workers (OpenMP threads busy-wait after each operation).

Without ``--data`` it builds, once, an ImageNet-like folder under ``$XDG_CACHE_HOME/dlojz/bench-imagenet`` (default
``~/.cache/dlojz/bench-imagenet``): JPEGs of about 500x375 px and ~100 KB with natural-image statistics (1/f
colour noise plus flat shapes), in a few classes. Run from the repository root::

    python bench/bench_loader.py                      # 2 workers, 224 and 176 px
    python bench/bench_loader.py --data /path/to/imagenet --workers 8 --batch-size 128

It prints, per image size, images/s of each pipeline and its ratio to the reference (medians over ``--repeats``
back-to-back rounds, to resist other load on the machine), and the CPU time per image (main process + workers).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS, WHOLE  # noqa: E402

if TYPE_CHECKING:
    from torchvision.datasets import ImageFolder

# torch, torchvision and dlojz's data modules are imported where they are used, after the flags' checks: a bad flag
# is one line at once, and the set's JPEGs are written by processes forked before torch starts any thread.

BENCH_SET_VERSION = "2"  # bump when the generated images change, so that caches are rebuilt


def default_cache_dir() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "dlojz" / "bench-imagenet"


def natural_like_jpeg(seed: int, width: int, height: int, quality: int = 92) -> bytes:
    """A JPEG whose content compresses like a photograph: 1/f colour noise (the power spectrum of natural images)
    with a few flat-coloured shapes (edges). At 500x375 and quality 92 it weighs about 100 KB, like ImageNet's."""
    rng = np.random.default_rng(seed)
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    frequency = np.hypot(fx, fy)
    frequency[0, 0] = 1.0
    channels = []
    for _ in range(3):
        spectrum = (rng.standard_normal(frequency.shape) + 1j * rng.standard_normal(frequency.shape)) / frequency
        spectrum[0, 0] = 0
        field = np.fft.irfft2(spectrum, s=(height, width))
        channels.append(field / field.std())
    # Correlated channels, as in real colour images.
    mixing = rng.normal(size=(3, 3)) * 0.5 + np.eye(3)
    pixels = np.stack(channels, -1) @ mixing.T
    pixels = 128 + 40 * pixels / pixels.std() + rng.uniform(-40, 40, size=3)
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(3, 8)):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(20, 200)), y0 + int(rng.integers(20, 200))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=colour)
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _write_one(job):
    path, seed = job
    # Three landscape (500x375) for one portrait (375x500), as in ImageNet.
    width, height = (375, 500) if seed % 4 == 3 else (500, 375)
    Path(path).write_bytes(natural_like_jpeg(seed, width, height))
    return os.path.getsize(path)


def build_bench_set(root: Path, num_images: int, num_classes: int, processes: int) -> Path:
    """Create ``root/train/<class>/*.JPEG`` once (atomically: built aside, then renamed); return the train folder."""
    marker = root / f".complete-v{BENCH_SET_VERSION}-{num_images}x{num_classes}"
    if marker.exists():
        return root / "train"
    staging = root.with_name(root.name + f".tmp{os.getpid()}")
    jobs = []
    for index in range(num_images):
        class_dir = staging / "train" / f"n{index % num_classes:08d}"
        class_dir.mkdir(parents=True, exist_ok=True)
        jobs.append((str(class_dir / f"bench_{index:06d}.JPEG"), index))
    print(f"building {num_images} JPEGs in {root} (once) ...", flush=True)
    with multiprocessing.Pool(max(1, processes)) as pool:
        sizes = pool.map(_write_one, jobs, chunksize=16)
    (staging / marker.name).touch()
    if root.exists():  # an older or different set: replace it
        old = root.with_name(root.name + f".old{os.getpid()}")
        root.rename(old)
        staging.rename(root)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(root)
    print(f"built: mean JPEG size {np.mean(sizes) / 1e3:.0f} KB", flush=True)
    return root / "train"


def resolve_train_folder(data: str | None, num_images: int, num_classes: int, processes: int) -> Path:
    if data is None:
        return build_bench_set(default_cache_dir(), num_images, num_classes, processes)
    folder = Path(data)
    if (folder / "train").is_dir():
        folder = folder / "train"
    if not folder.is_dir():
        print(
            f"bench_loader: --data {data}: not a folder (expected an ImageFolder root or a folder with train/)",
            file=sys.stderr,
        )
        sys.exit(2)  # bad input, as in every dlojz script
    from torchvision.datasets import ImageFolder

    try:
        ImageFolder(str(folder))
    except (FileNotFoundError, OSError) as error:  # no class folders, or classes without images
        print(f"bench_loader: --data {data}: not an ImageFolder ({error})", file=sys.stderr)
        sys.exit(2)  # bad input, as in every dlojz script
    return folder


def reference_dataset(folder: Path, image_size: int) -> ImageFolder:
    import torch
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    from dlojz_lib.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    transform = T.Compose(
        [
            T.RandomResizedCrop(image_size),
            T.RandomHorizontalFlip(),
            T.PILToTensor(),
            T.ConvertImageDtype(torch.float),
            T.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
        ]
    )
    return ImageFolder(str(folder), transform=transform)


def dlojz_dataset(folder: Path, image_size: int) -> ImageFolder:
    from dlojz_lib.data.datasets import SafeImageFolder
    from dlojz_lib.data.transforms import TrainTransform, lazy_image_loader

    return SafeImageFolder(str(folder), transform=TrainTransform(image_size), loader=lazy_image_loader)


def _cpu_seconds(processes) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def measure(dataset, finish_batch, workers: int, batch_size: int, batches: int, warmup: int, seed: int):
    """Images/s (wall clock) and CPU milliseconds per image (main process + workers) of iterating ``dataset``
    through a DataLoader, ``finish_batch`` applied to each batch of images in the main process.

    One sampler covers warm-up and timed batches (no worker restart inside the timing); the clocks start once the
    warm-up batches (worker start-up, first reads) have been received. CPU time is insensitive to other jobs
    sharing the machine, wall-clock time is what training sees.
    """
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    generator = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(dataset, num_samples=(warmup + batches) * batch_size, generator=generator)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
        drop_last=True,
    )
    iterator = iter(loader)
    for _ in range(warmup):
        finish_batch(next(iterator)[0])
    main_process = psutil.Process()
    processes = [main_process] + main_process.children(recursive=True)
    cpu_start, start = _cpu_seconds(processes), time.perf_counter()
    count = 0
    for images, _labels in iterator:
        finish_batch(images)
        count += images.shape[0]
        if count == batches * batch_size:
            break  # stop the clocks before the workers are shut down
    elapsed, cpu = time.perf_counter() - start, _cpu_seconds(processes) - cpu_start
    del iterator
    return count / elapsed, 1e3 * cpu / count


def measure_dali(
    folder: Path, image_size: int, threads: int, batch_size: int, batches: int, warmup: int, seed: int, antialias: bool
):
    """measure() for --data-backend dali on DALI's CPU backend (its decoding threads live in this process)."""
    import torch

    from dlojz_lib.data.dali import DaliBatches, DaliSettings, train_pipeline
    from dlojz_lib.data.datasets import SafeImageFolder
    from dlojz_lib.data.samplers import EpochSampler

    dataset = SafeImageFolder(str(folder))
    sampler = EpochSampler(dataset, 1, 0, shuffle=True, seed=seed)
    batches_iter = DaliBatches(
        dataset,
        sampler,
        batch_size,
        lambda source: train_pipeline(
            source, batch_size, image_size, None, DaliSettings(max(1, threads), antialias=antialias), seed
        ),
        torch.device("cpu"),
        drop_last=True,
    )
    process = psutil.Process()
    received, epoch = 0, 0
    start = cpu_start = None
    while received < warmup + batches:
        sampler.set_epoch(epoch)
        for images, _ in batches_iter:
            received += 1
            if received == warmup:
                cpu_start, start = _cpu_seconds([process]), time.perf_counter()
            if received >= warmup + batches:
                break
        epoch += 1
    elapsed, cpu = time.perf_counter() - start, _cpu_seconds([process]) - cpu_start
    return batches * batch_size / elapsed, 1e3 * cpu / (batches * batch_size)


def packed_copy(folder: Path) -> Path:
    """The train folder packed into webdataset shards, once (pack wants train/ and val/: the same images twice)."""
    from dlojz_lib.pack.writer import pack

    src = folder.parent.with_name(folder.parent.name + "-src")
    src.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        if not (src / split).exists():
            (src / split).symlink_to(folder.resolve())
    packed = src.with_name(src.name + "-packed")
    pack(src, packed, shard_size="100MB", log=lambda *a, **k: None)
    return packed


def warm_page_cache(folder: Path):
    # Both pipelines should read from memory, not from disk: read every file once before timing.
    for path in folder.rglob("*"):
        if path.is_file():
            path.read_bytes()


def main(argv=None):
    parser = OneLineArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--data",
        default=None,
        help="ImageFolder root (or a folder holding train/); default: a generated ImageNet-like set",
    )
    parser.add_argument("--workers", type=WHOLE, default=2, help="DataLoader workers (both pipelines)")
    parser.add_argument("--batch-size", type=COUNT, default=32, help="batch size (both pipelines)")
    parser.add_argument("--batches", type=COUNT, default=25, help="timed batches per measurement")
    parser.add_argument("--warmup-batches", type=WHOLE, default=4, help="batches received before the clock starts")
    parser.add_argument("--sizes", type=PIXELS, nargs="+", default=[224, 176], help="training crop sizes")
    parser.add_argument(
        "--repeats",
        type=COUNT,
        default=9,
        help="back-to-back measurement rounds (one run of each pipeline) per size; medians are reported",
    )
    parser.add_argument("--images", type=COUNT, default=1000, help="images in the generated set")
    parser.add_argument("--classes", type=COUNT, default=10, help="classes in the generated set")
    parser.add_argument(
        "--main-threads",
        type=COUNT,
        default=1,
        help="torch threads of the main process (it normalises dlojz's batches)",
    )
    parser.add_argument(
        "--shards",
        default=None,
        help="a dlojz_pack.py pack of the same images, for the shards row "
        "(default: the generated set is packed once; with --data, no shards row)",
    )
    parser.add_argument("--seed", type=WHOLE, default=0)
    args = parser.parse_args(argv)
    for flag in ("workers", "batch_size", "batches", "repeats", "images", "classes", "main_threads"):
        value = getattr(args, flag)
        if value < (0 if flag == "workers" else 1):
            parser.error(f"--{flag.replace('_', '-')} must be {'>= 0' if flag == 'workers' else '>= 1'}, got {value}")

    folder = resolve_train_folder(args.data, args.images, args.classes, max(1, args.workers))
    warm_page_cache(folder)
    import torch

    from dlojz_lib.data.datasets import PackedImages
    from dlojz_lib.data.prefetch import DeviceNormalize
    from dlojz_lib.data.transforms import TrainTransform, decoder_description

    torch.set_num_threads(args.main_threads)
    normalize = DeviceNormalize("cpu")
    decoder = decoder_description()
    print(
        f"data {folder}  workers {args.workers}  batch {args.batch_size}  timed batches {args.batches} "
        f"(+{args.warmup_batches} warm-up)  rounds {args.repeats}  main-process torch threads "
        f"{torch.get_num_threads()}  dlojz JPEG decoder: {decoder}",
        flush=True,
    )

    packed = Path(args.shards) if args.shards else packed_copy(folder) if args.data is None else None
    pipelines = {
        # name: (dataset builder, what the main process does with each batch of images)
        "reference": (reference_dataset, lambda images: images),
        "dlojz": (dlojz_dataset, lambda images: images),  # uint8 batches: on a GPU node they are normalised there
        "dlojz+norm": (dlojz_dataset, normalize),  # CPU training: normalised in the main process
    }
    if packed is not None:
        warm_page_cache(packed)
        pipelines["dlojz shards"] = (
            lambda _, size: PackedImages(packed, "train", TrainTransform(size)),
            lambda images: images,
        )
    from dlojz_lib.data.dali import check_available

    if check_available() is None:
        pipelines["DALI-CPU"] = (None, False)  # dlojz.py's default: the training resize without antialiasing
        pipelines["DALI-CPU antialiased"] = (None, True)  # --dali-antialias
    else:
        print(f"no DALI-CPU row: {check_available()}")
    names = list(pipelines)
    rows = []
    for size in args.sizes:
        rates = {name: [] for name in names}
        cpu_ms = {name: [] for name in names}
        for repeat in range(args.repeats):
            # Back-to-back rounds, rotating which pipeline goes first: the pipelines of a round see the same load
            # from other jobs, and the median over rounds resists the moments when that load changes.
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                make_dataset, finish = pipelines[name]
                if name.startswith("DALI-CPU"):
                    images_per_s, ms_per_image = measure_dali(
                        folder,
                        size,
                        args.workers,
                        args.batch_size,
                        args.batches,
                        args.warmup_batches,
                        args.seed + repeat,
                        antialias=finish,
                    )
                else:
                    images_per_s, ms_per_image = measure(
                        make_dataset(folder, size),
                        finish,
                        args.workers,
                        args.batch_size,
                        args.batches,
                        args.warmup_batches,
                        args.seed + repeat,
                    )
                rates[name].append(images_per_s)
                cpu_ms[name].append(ms_per_image)
        ratios = {
            name: np.median([ours / reference for ours, reference in zip(rates[name], rates["reference"])])
            for name in names
        }
        rows.append(
            dict(
                size=size,
                **{f"{name} img/s": np.median(rates[name]) for name in names},
                **{f"{name} ratio": ratios[name] for name in names},
                **{f"{name} CPU ms/img": np.median(cpu_ms[name]) for name in names},
            )
        )

    print()
    print(
        "| size | workers | batch | reference img/s | "
        + " | ".join(f"{name} img/s | ratio" for name in names[1:])
        + " | CPU ms/img: "
        + " | ".join(names)
        + " |"
    )
    print("|" + "---:|" * (3 + 1 + 2 * (len(names) - 1) + len(names)))
    for row in rows:
        print(
            f"| {row['size']} | {args.workers} | {args.batch_size} | {row['reference img/s']:.0f} | "
            + " | ".join(f"{row[name + ' img/s']:.0f} | {row[name + ' ratio']:.2f}" for name in names[1:])
            + " | "
            + " | ".join(f"{row[name + ' CPU ms/img']:.2f}" for name in names)
            + " |"
        )
    print(
        f"\nMedians over {args.repeats} rounds. img/s: wall clock; ratio: over the reference within each round. "
        "dlojz: uint8 batches as a GPU receives them (it converts and normalises them); dlojz+norm: also "
        "normalised to float32 in the main process, as when training on the CPU; dlojz shards: dlojz reading the "
        "same images from webdataset shards; DALI-CPU: DALI's CPU decoder, normalised float32 (as dlojz+norm). CPU ms/img: main process + "
        "workers (less sensitive to other jobs on the machine)."
    )
    return rows


if __name__ == "__main__":
    main()
