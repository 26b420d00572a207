"""The data sets and the batches a run trains and validates on, ready on the device: `build_loaders` makes DataLoaders (uint8
JPEG crops decoded by the workers, normalised on the device, a CUDA prefetcher), DALI's pipelines
(`--data-backend dali`) or the synthetic loaders (`--synthetic`), all behind one `Loaders` record, whose `close()`
stops the DataLoaders' workers (dlojz.py's main() hands it to the run's ExitStack). `build_data` finds the data sets first
(--data-root, the variables, else the embedded one). The DataLoader's plumbing (its workers' signals and
end, `--loader-only`'s measure) and the synthetic loader are here too.
"""

import dataclasses
import functools
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dlojz_lib.checks import fail
from dlojz_lib.data import IMAGENET_TRAIN_IMAGES, IMAGENET_VAL_IMAGES
from dlojz_lib.data.augment import train_transform
from dlojz_lib.data.datasets import (
    VAL_SPLIT_FILE,
    build_datasets,
    class_counts,
    class_counts_line,
    read_val_split,
    resolve_data_root,
    select_train_subset,
    write_val_split,
)
from dlojz_lib.data.embedded import embedded_dataset_root
from dlojz_lib.data.prefetch import DeviceNormalize, DevicePrefetcher
from dlojz_lib.data.samplers import BalancedEpochSampler, EpochSampler, RepeatedAugmentationSampler, ShardSampler
from dlojz_lib.data.transforms import IMAGENET_MEAN, IMAGENET_STD, ValTransform, decoder_description
from dlojz_lib.torch_internals import shutdown_loader_workers


# ---------------------------------------------------------------------------------------------------------------
# The DataLoader's plumbing
def _worker_init(_, parent):
    # Slurm's preemption signal reaches every process of the step, and a terminal's Ctrl-C every process of its
    # group: the workers must not die of them, the main process handles them (finishes the step, checkpoints).
    import signal

    for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent(parent)
    torch.set_num_threads(1)


def die_with_parent(parent):
    """A worker ends within a second of the main process `parent` (SIGKILL, the OOM killer): never an orphan holding
    its memory. A thread watching that pid: the worker's own parent may be multiprocessing's fork server, not the
    main process, so neither its parent pid nor Linux's PR_SET_PDEATHSIG tells when the main process dies."""
    import threading

    def watch():
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent, 0)  # signal 0: only asks whether the process exists
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:  # exists, another user's (a reused pid): nothing to watch any more
                return

    threading.Thread(target=watch, name="dlojz-parent-watch", daemon=True).start()


def close_loader(loader):
    """Stop a DataLoader's persistent workers now. They ignore SIGTERM (so that Slurm's SIGTERM lets the main
    process checkpoint), hence they must not be left for the interpreter's exit, which would wait for them forever."""
    shutdown_loader_workers(loader)


def make_loader(dataset, sampler, batch_size, num_workers, pin_memory, persistent_workers, prefetch_factor, drop_last):
    workers_opts = {}
    if num_workers > 0:
        workers_opts = dict(
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            worker_init_fn=functools.partial(_worker_init, parent=os.getpid()),
        )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        **workers_opts,
    )


# ---------------------------------------------------------------------------------------------------------------
# A pipeline's later stages: no image read, the first stage's labels
class Placeholders(torch.utils.data.Dataset):
    """What a pipeline stage that reads no images loads (--pp: only the first stage's input is the images): for each
    sample key its sampler gives, a 1-pixel black image and label 0, nothing read from disk; the real labels come
    from the first stage (FirstStageLabels)."""

    def __init__(self, length):
        self.length, self.image = length, torch.zeros(3, 1, 1, dtype=torch.uint8)

    def __len__(self):
        return self.length

    def __getitem__(self, key):
        return self.image, 0


class FirstStageLabels:
    """`batches` whose labels are the pipeline's first stage's, broadcast over the pipeline's `group` at each batch
    (one small collective, stream-ordered on a GPU): the stages that decode no image (Placeholders) get the labels
    of the images the first stage read, an unreadable image's replacement included."""

    def __init__(self, batches, group):
        self.batches, self.group = batches, group

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for images, labels in self.batches:
            labels = labels.contiguous()
            dist.broadcast(labels, group=self.group, group_src=0)
            yield images, labels


# ---------------------------------------------------------------------------------------------------------------
# Synthetic data: no disk, no decoding
class SyntheticLoader:
    """Serves one random, already normalised batch on the device `num_batches` times (like DLE's synthetic)."""

    def __init__(
        self,
        num_images,
        batch_size,
        image_size,
        num_classes,
        device,
        channels_last,
        num_replicas=1,
        drop_last=False,
        seed=0,
    ):
        gen = torch.Generator().manual_seed(seed)
        images = torch.randn(batch_size, 3, image_size, image_size, generator=gen)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=gen).to(device)
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.images = images.to(device).contiguous(memory_format=memory_format)
        per_rank = num_images // num_replicas
        self.num_batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
        self.skip = 0

    def __iter__(self):
        for _ in range(self.num_batches - self.skip):
            yield self.images, self.labels

    def __len__(self):
        return self.num_batches - self.skip


# ---------------------------------------------------------------------------------------------------------------
# --loader-only
def finished(images):
    """Wait for a batch made on the GPU by stream-ordered work (DALI's): --loader-only's clock reads there, twice
    a measurement, never per batch."""
    if images.is_cuda:
        torch.cuda.synchronize(images.device)


def measure_loader(loader, sampler, nsteps, num_workers, all_gather=None, log=print, jpeg_utilisation=None):
    """Images/s of the DataLoader alone over `nsteps` batches after the workers' start-up, summed over the ranks
    (`all_gather(obj) -> list`, None for one process). `jpeg_utilisation`: a reader of the GPU's JPEG engines' use
    (%), read at each timed batch (DALI on a GPU). Returns the metrics of --loader-only."""
    # Not the steady state: the workers' start-up, and the batches they made meanwhile (num_workers x
    # prefetch_factor wait ready at the start: timed, they would inflate the rate).
    stock = num_workers * (getattr(loader, "prefetch_factor", None) or 0)
    warmup = max(1, min(10, nsteps // 5), stock)
    images, epoch, t0, done, readings = 0, 0, None, 0, []
    while done < warmup + nsteps:
        sampler.set_epoch(epoch)
        for batch_images, _ in loader:
            done += 1
            if done == warmup:
                finished(batch_images)
                t0 = time.perf_counter()
            elif done > warmup:
                images += batch_images.shape[0]
                if jpeg_utilisation is not None:
                    readings.append(jpeg_utilisation())
            if done >= warmup + nsteps:
                break
        epoch += 1
    finished(batch_images)
    rate = images / (time.perf_counter() - t0)
    total = sum(all_gather(rate)) if all_gather else rate
    per_worker = rate / num_workers if num_workers else rate
    log(
        f">>> DataLoader alone: {rate:.1f} images/s per process ({per_worker:.1f} per worker, {num_workers} workers), "
        f"{total:.1f} images/s for all processes, over {nsteps} batches after {warmup} warm-up batches"
    )
    log(
        f">>> A GPU eating 2,500 images/s (ResNet-50, AMP, A100) needs about {math.ceil(2500 / per_worker)} such workers"
    )
    if readings:
        log(
            f">>> the GPU's JPEG engines: {sum(readings) / len(readings):.0f}% busy on average, {max(readings)}% at "
            f"most (NVML, {len(readings)} readings)"
        )
    return dict(
        jpeg_engine_utilisation=sum(readings) / len(readings) if readings else None,
        loader_images_per_second=total,
        loader_images_per_second_per_process=rate,
        loader_images_per_second_per_worker=per_worker,
        loader_batches=nsteps,
        num_workers=num_workers,
    )


SYNTHETIC_CLASSES = 1000  # --synthetic: ImageNet's


@dataclasses.dataclass
class Loaders:
    train: object  # DataLoader or SyntheticLoader
    train_sampler: EpochSampler | None
    train_batches: object  # normalised device batches
    val_batches: object
    n_train_batches: int  # micro-batches per epoch, this rank
    n_val_batches: int  # on rank 0
    n_val_images: int
    n_val_batches_every_rank: int  # that every rank has (the last ranks may have one image fewer than the first)
    n_val_batches_most: int  # that the first rank has
    owned: tuple = ()  # the DataLoaders whose workers close() stops

    def close(self):
        """Stop the DataLoaders' workers now: they ignore SIGTERM (so that Slurm's lets the main process checkpoint),
        and left to the interpreter's exit they would be waited for forever."""
        for loader in self.owned:
            close_loader(loader)

    def start_epoch(self, epoch, first_batch):
        """Shuffle for `epoch` and skip the batches a resumed run has already done."""
        if self.train_sampler is not None:
            self.train_sampler.set_epoch(epoch)
            self.train_sampler.skip = first_batch * self.train.batch_size
        else:
            self.train.skip = first_batch


def build_loaders(cfg, train_set, val_set, num_classes, ranks, log) -> Loaders:
    """Training and validation batches on the device: DataLoaders (uint8 workers, device normalisation), or the
    synthetic loaders."""
    log(
        f"DATALOADER workers={cfg.num_workers} persistent={cfg.persistent_workers} pin_memory={cfg.pin_memory} "
        f"non_blocking={cfg.non_blocking} prefetch_factor={cfg.prefetch_factor} drop_last={cfg.drop_last}"
    )
    if cfg.synthetic:
        return synthetic_loaders(cfg, num_classes, ranks, IMAGENET_TRAIN_IMAGES, IMAGENET_VAL_IMAGES)
    if cfg.min_res is None:  # validating at a larger size than training pays (train-test resolution discrepancy)
        log(
            f"resolution: training {cfg.image_size} px, validation {cfg.val_crop_size} px "
            f"({cfg.val_crop_size / cfg.image_size:.2f}x)"
        )
    # A batch larger than a rank's share is the whole share, padded, with the LR scaled for images that are not there.
    per_rank = (len(train_set) // ranks.data_size) if cfg.drop_last else math.ceil(len(train_set) / ranks.data_size)
    if cfg.batch_size > per_rank and cfg.global_batch is not None:  # (a recipe's, often): the batch is its choice
        fail(
            f"--global-batch {cfg.global_batch} gives each of {ranks.data_size} process(es) {cfg.batch_size} images "
            f"a step, more than its {per_rank} training images ({len(train_set)} in all"
            f"{', --drop-last' if cfg.drop_last else ''}): give --global-batch {per_rank * ranks.data_size} at most "
            "(a recipe's LR was set for its own), or --no-global-batch and a --batch-size"
        )
    if cfg.batch_size > per_rank:
        fail(
            f"--batch-size {cfg.batch_size} is more than the {per_rank} training images of each of the "
            f"{ranks.data_size} process(es) ({len(train_set)} in all{', --drop-last' if cfg.drop_last else ''}): "
            f"give --batch-size {per_rank} at most"
        )
    sampling = dict(seed=cfg.seed, drop_last=cfg.drop_last, batch_size=cfg.batch_size)  # what every sampler takes
    if cfg.ra_reps:
        train_sampler = RepeatedAugmentationSampler(
            train_set, ranks.data_size, ranks.data_rank, cfg.ra_reps, **sampling
        )
        log(
            f"--ra-reps {cfg.ra_reps}: each epoch's images {cfg.ra_reps} times, each copy augmented on its own "
            f"(and on another rank): an epoch sees about 1/{cfg.ra_reps} of the {len(train_set)} images"
        )
    elif cfg.balanced_sampler:
        train_sampler = BalancedEpochSampler(train_set, ranks.data_size, ranks.data_rank, **sampling)
        log(balanced_sampler_line(train_sampler, train_set.classes))
    else:
        train_sampler = EpochSampler(train_set, ranks.data_size, ranks.data_rank, shuffle=True, **sampling)
    if cfg.parallelism.fsdp and len(val_set) < ranks.data_size:
        fail(f"--fsdp: the validation set has {len(val_set)} images for {ranks.data_size} ranks: each rank needs one")
    if cfg.data_backend == "dali":  # before the stages split: every stage and rank counts the same images
        validation_without_cut_short(val_set, ranks)
    reads_images = (
        cfg.parallelism.pp == 1 or ranks.mesh["pipe"].get_local_rank() == 0
    )  # a later stage's input is the previous'
    if cfg.data_backend == "dali" and reads_images:
        return dali_loaders(cfg, train_set, val_set, train_sampler, ranks, log)
    options = dict(
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory,
        persistent_workers=cfg.persistent_workers,
        prefetch_factor=cfg.prefetch_factor,
    )
    val_sampler = ShardSampler(val_set, ranks.data_size, ranks.data_rank)
    if not reads_images:  # (under DALI too: the DataLoader's placeholders, no pipeline built)
        train_set, val_set = Placeholders(len(train_set)), Placeholders(len(val_set))
        options.update(num_workers=0, pin_memory=False)
    train = make_loader(train_set, train_sampler, cfg.batch_size, drop_last=cfg.drop_last, **options)
    val = make_loader(val_set, val_sampler, cfg.val_batch_size, drop_last=False, **options)
    normalize = normalisation(cfg.section("data"), cfg.channels_last, ranks)
    train_batches = DevicePrefetcher(train, ranks.device, normalize, non_blocking=cfg.non_blocking)
    val_batches = DevicePrefetcher(val, ranks.device, normalize, non_blocking=cfg.non_blocking)
    batches = (train_batches, val_batches)
    return finish_loaders(
        train, val, train_sampler, batches, len(val_set), cfg.parallelism.pp, cfg.val_batch_size, ranks, (train, val)
    )


def finish_loaders(train, val, train_sampler, batches, val_images, pp, val_batch_size, ranks, owned=()):
    """The `Loaders` of a run's batches on the device (`batches`: training's and validation's, the DataLoaders' or
    DALI's): under --pp the first stage's labels given to the later stages, which read no image; each rank's share
    of the validation set counted."""
    train_batches, val_batches = batches
    if pp > 1:
        pipe = ranks.mesh["pipe"].get_group()
        train_batches, val_batches = FirstStageLabels(train_batches, pipe), FirstStageLabels(val_batches, pipe)
    per_rank = val_batches_per_rank(val_images, ranks.data_size, val_batch_size)
    return Loaders(
        train, train_sampler, train_batches, val_batches, len(train), len(val), val_images, *per_rank, owned=owned
    )


def validation_without_cut_short(val_set, ranks):
    """DALI's validation set without the images that are not whole files, as the pytorch backend counts them
    (training skips them when they fail): their ends read once, on the first rank, the indices shared with every
    rank (one object gathered), so all the ranks and pipeline stages validate on the same images."""
    from dlojz_lib.data.dali_feed import cut_short, leave_out_cut_short

    found = cut_short(val_set) if ranks.is_main else None
    if ranks.enabled:
        found = ranks.all_gather(found)[0]
    leave_out_cut_short(val_set, found, warn=ranks.is_main)


def balanced_sampler_line(sampler, classes):
    """--balanced-sampler's start-up line: the draws per class, and how often the rarest and the largest class's
    images are seen in an epoch."""
    sizes = [len(images) for images in sampler.by_class]
    per_class = sampler.total_size / len(sizes)
    rare, large = sizes.index(min(sizes)), sizes.index(max(sizes))

    def seen(c):
        return f"{classes[sampler.class_ids[c]]}, {sizes[c]} images: each {per_class / sizes[c]:.2g} times"

    return (
        f"--balanced-sampler: {sampler.total_size} draws an epoch, about {per_class:.0f} of each of {len(sizes)} "
        f"classes (the rarest, {seen(rare)}; the largest, {seen(large)})"
    )


def normalisation(data, channels_last, ranks):
    """uint8 batches to the floats the model takes: --mean and --std, ImageNet's by default."""
    return DeviceNormalize(
        ranks.device, mean=data.mean or IMAGENET_MEAN, std=data.std or IMAGENET_STD, channels_last=channels_last
    )


def dali_loaders(cfg, train_set, val_set, train_sampler, ranks, log) -> Loaders:
    """--data-backend dali: the same samples and samplers, decoded, augmented and normalised by DALI
    (dlojz_lib/data/dali.py); --loader-only times these batches, the model's input."""
    from dlojz_lib.checks import fail
    from dlojz_lib.data.dali import (
        DaliBatches,
        cached_share,
        check_decodable,
        dali_settings,
        largest,
        sampled_sizes,
        start_line,
        train_pipeline,
        val_pipeline,
    )

    for dataset in (train_set, val_set):
        check_decodable(dataset)

    device_id = ranks.device.index if ranks.device.type == "cuda" else None
    data = cfg.section("data")
    if data.dali_cache and device_id is None:
        fail("--dali-cache keeps decoded images in GPU memory: there is no GPU here; drop it")
    if data.dali_cache and not all(isinstance(where, str) for where, _ in train_set.samples):
        fail(
            "--dali-cache keeps decoded images under their files' paths, which packed shards do not give DALI: "
            "drop --dali-cache, or train from the image folder"
        )
    sizes = sampled_sizes(train_set) if device_id is not None else []
    settings = dali_settings(data, cfg.num_workers, cfg.amp, device_id is not None, largest(sizes))
    seed = cfg.seed * 1_000 + ranks.data_rank
    log(start_line(settings, device_id, torch.cuda.get_device_name(ranks.device) if device_id is not None else None))
    if settings.cache_mib:
        share = cached_share(settings.cache_mib, sizes, len(train_sampler))
        log(
            f"DALI cache: {settings.cache_mib / 1024:g} GB of GPU memory holds about "
            + (f"{share:.0%}" if share is not None else "an unknown share")
            + f" of this rank's {len(train_sampler):,} training images (by {len(sizes)} images' sizes): those are "
            "decoded in the first epoch only, the rest every epoch (each epoch's files read by DALI's file reader, "
            "which keys them by path)"
        )
    train = DaliBatches(
        train_set,
        train_sampler,
        cfg.batch_size,
        lambda source: train_pipeline(source, cfg.batch_size, cfg.image_size, device_id, settings, seed),
        ranks.device,
        drop_last=cfg.drop_last,
        name="training",
        log=log,
        by_epoch=bool(settings.cache_mib),  # the cache keys images by path: DALI's file reader, an epoch at a time
    )
    val_sampler = ShardSampler(val_set, ranks.data_size, ranks.data_rank)
    val = DaliBatches(
        val_set,
        val_sampler,
        cfg.val_batch_size,
        lambda source: val_pipeline(
            source, cfg.val_batch_size, cfg.val_resize_size, cfg.val_crop_size, device_id, settings, seed + 1
        ),
        ranks.device,
        name="validation",
        log=log,
    )
    return finish_loaders(
        train, val, train_sampler, (train, val), len(val_set), cfg.parallelism.pp, cfg.val_batch_size, ranks
    )


def synthetic_loaders(cfg, num_classes, ranks, train_images, val_images) -> Loaders:
    """--synthetic: one random batch made once on the device, served for an epoch of `train_images` images."""
    train = SyntheticLoader(
        train_images,
        cfg.batch_size,
        cfg.image_size,
        num_classes,
        ranks.device,
        cfg.channels_last,
        ranks.data_size,
        cfg.drop_last,
        seed=cfg.seed,
    )
    val = SyntheticLoader(
        val_images,
        cfg.val_batch_size,
        cfg.val_crop_size,
        num_classes,
        ranks.device,
        cfg.channels_last,
        ranks.data_size,
        seed=cfg.seed + 1,
    )
    return Loaders(train, None, train, val, len(train), len(val), val_images, len(val), len(val))


def val_batches_per_rank(n_images, world_size, batch_size):
    """Validation batches that every rank has, and that the first rank has (ShardSampler: ranks differ by at
    most one image)."""
    return math.ceil(n_images // world_size / batch_size), math.ceil(math.ceil(n_images / world_size) / batch_size)


def build_data(cfg, ranks, log):
    """(train set, val set, class names): --data-root, the variables, else the embedded data set; none with
    --synthetic."""
    if cfg.synthetic:
        log(f"data: synthetic (random tensors in memory), {SYNTHETIC_CLASSES} classes")
        return None, None, [str(i) for i in range(SYNTHETIC_CLASSES)]
    root, found_by = resolve_data_root(cfg.data_root)
    if root is None:
        if ranks.is_main:  # one rank generates, the others wait for it (the folder is renamed into place atomically)
            embedded_dataset_root()
        if ranks.enabled:
            dist.barrier()
        root = embedded_dataset_root()
        log(
            f"No --data-root, $DLOJZ_DATA, $ALL_CCFRSCRATCH/imagenet or $DSDIR/imagenet: using the embedded "
            f"data set ({root}, 10 classes of shapes and textures)"
        )
    saved_split = None
    if cfg.val_split is not None:  # a run's own split, kept in its folder (or beside the checkpoint it evaluates)
        where = Path(cfg.resume).parent if cfg.resume not in (None, "auto") else Path(cfg.output_dir)
        saved_split = read_val_split(where / VAL_SPLIT_FILE)
    train_set, val_set, classes, layout = build_datasets(
        root,
        train_transform(cfg.section("augmentation"), cfg.section("validation"), cfg.image_size),
        ValTransform(cfg.val_resize_size, cfg.val_crop_size, interpolation=cfg.val_interpolation),
        seed=cfg.seed,
        val_split=cfg.val_split,
        saved_split=saved_split,
    )
    if cfg.val_split is not None and saved_split is None and cfg.writes_checkpoints and ranks.is_main:
        write_val_split(val_set, Path(cfg.output_dir) / VAL_SPLIT_FILE)
    kind = layout if layout.startswith("packed") else f"{layout} layout"
    log(
        f"data: {root} ({kind}, found by {found_by}): {len(train_set)} train / {len(val_set)} val images, "
        f"{len(classes)} classes"
    )
    for line in train_set.notes:  # what the listing left out, and warnings on the classes
        log(line)
    if cfg.train_subset is not None:  # cheap runs, e.g. hyper-parameter search trials
        log(select_train_subset(train_set, cfg.train_subset))
    log(class_counts_line(class_counts(train_set, len(classes)), classes))
    log(f"JPEG decoding: {decoder_description()}")
    return train_set, val_set, classes


def jpeg_reader(train, device):
    """The GPU's JPEG engines' use, read while DALI's batches are timed (dali.jpeg_utilisation_reader), or None."""
    if type(train).__name__ != "DaliBatches":
        return None
    from dlojz_lib.data.dali import jpeg_utilisation_reader

    return jpeg_utilisation_reader(device)


def measure_loader_only(steps, num_workers, metrics_json, loaders, ranks, metrics, log) -> dict:
    """--loader-only: the training DataLoader alone over `steps` batches (--test-nsteps), images/s overall and per
    worker; the figures into `metrics_json` where given."""
    from dlojz_lib.log import write_json

    metrics = dict(
        measure_loader(
            loaders.train,
            loaders.train_sampler,
            steps,
            num_workers,
            ranks.all_gather if ranks.enabled else None,
            log,
            jpeg_reader(loaders.train, ranks.device),
        ),
        world_size=ranks.world_size,
        global_batch_size=metrics["global_batch_size"],
    )
    if type(loaders.train).__name__ == "DaliBatches":  # the threads DALI ran with, not the DataLoader's workers
        metrics["dali_threads"] = loaders.train.pipeline.num_threads
    if ranks.is_main and metrics_json:
        write_json(metrics_json, metrics)
    return metrics
