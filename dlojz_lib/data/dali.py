"""NVIDIA DALI input pipeline for dlojz.py (`--data-backend dali`): JPEG decoding on the GPU, built as NVIDIA's are.

One GPU eats more images per second than the CPU cores it gets can decode (an H200 ~6,500-8,000 img/s of ResNet-50;
a core decodes 250-290 at 224 px). DALI decodes on the GPU (nvJPEG, and the hardware JPEG decoder of A100/H100/H200:
`device="mixed"`, 99% of the images to it as in MLPerf's pipelines), decoding only the random crop's region, then
resizes, and one `crop_mirror_normalize` flips, normalises and writes the model's input: float16 under --amp
(float32 without), HWC, optionally padded to 4 channels (--dali-pad-channels: the stem's weight is padded to match,
see dlojz_lib/model/zoo.py). Without a GPU the same pipeline runs on DALI's CPU backend (what the CPU tests run).

    train: file paths -> io.file.read -> decoders.image_random_crop (RandomResizedCrop's area 0.08-1 and ratio
           3/4-4/3, only the region decoded) -> resize to --image-size -> crop_mirror_normalize (random flip)
    val:   file paths -> io.file.read -> decoders.image -> resize the shorter side to --val-resize-size (antialiased)
           -> crop_mirror_normalize (center crop --val-crop-size)

The HWC batches are seen as NCHW tensors in channels-last memory (a free permute): what channels-last training
wants. The training resize is not antialiased unless --dali-antialias, as in NVIDIA's own DALI ResNet-50 pipelines
(on DALI's CPU backend the antialiased resize costs twice the decode); validation's is (the yardstick stays the
pytorch backend's).

The order is dlojz's own: an external source gives DALI each batch's file paths in the sampler's order (the shuffle
by seed and epoch, exact mid-epoch resume by the sampler's position, --train-subset, shards, exact validation with
the last batch partial), and DALI's threads read the files (`fn.io.file.read`, C++, no GIL): the training thread's
share is a few hundred small arrays per batch. The source runs on from epoch to epoch without an end, so DALI's
queue (--dali-prefetch batches, 3 by default) stays full across an epoch boundary instead of restarting empty.
Packed shards (dlojz_pack.py) are read by index in Python, by a thread pool a few batches ahead. The crops and flips
are DALI's draws (seeded by --seed and the rank), not the per-sample seeds: a resumed run goes on from the same
sample with other crops. A file DALI cannot decode stops DALI's pipeline; the batches it was preparing are then
checked in Python, each file that is not a whole JPEG or PNG skipped with a warning naming it (the next readable
one in its place, as the pytorch backend does), and the pipeline rebuilt where it was.

Measured on DALI's CPU backend (2 threads, 2 cores, 1,000 JPEGs of 500x375, 224 px, batch 32, same operators,
2026-11-27): paths read by `fn.io.file.read` 915 img/s, DALI's own `fn.readers.file` 926 (it cannot take a new
order each epoch without a rebuild), the thread pool of file bytes 805, DALI's parallel sample-mode external source
(worker processes, spawned) 831: the C++ reads are kept, the thread pool serves the shards.

Outputs are stream-ordered and not copied: the pipeline runs with the training's current CUDA stream
(`run(stream)`, DALI's dynamic executor) and its output buffers become torch tensors through DLPack (what DALI's own
PyTorch iterator does with this executor), so there is no host wait, no per-batch allocation and no copy.

- `check_available()`: the one-line error when DALI is not installed; `check_decodable(dataset)`: one for a data
  set whose files are not all JPEG or PNG.
- `dali_settings(data, num_workers, amp, on_gpu, size_hint)`: the --dali-* flags, or their defaults from the node
  (`DaliSettings`: MLPerf's 6 training threads per GPU, validation's 3, the decode, the cache, the preallocation).
- `sampled_sizes(dataset)`, `largest`, `cached_share`: images' sizes from their headers, for the hardware decoder's
  preallocation and the cache's share of an epoch; `jpeg_engines(name)`: whether the GPU has JPEG engines;
  `start_line(settings, device_id, device_name)`: what DALI runs with, said once at start-up.
- `train_pipeline`, `val_pipeline`: the two DALI pipelines, fed by dali_feed's `SampleFeed` (or, under --dali-cache,
  by DALI's file reader from `EpochFiles`: the decoder's cache keys an image by the path the reader sets, and an
  external source sets none); `jpeg_utilisation_reader(device)`: NVML's reading of the JPEG engines' use.
- `DaliBatches(dataset, sampler, batch_size, make_pipeline, ...)`: an iterable of (images, labels) on the device, with
  `len()` and `batch_size`, in place of the DataLoader + DevicePrefetcher; `BatchLifetimes` keeps each batch until
  the step that reads it has run on the device.
"""

import collections
import dataclasses
import io
import math

import torch

from dlojz_lib.data.dali_feed import EpochFiles, SampleFeed
from dlojz_lib.data.transforms import IMAGENET_MEAN, IMAGENET_STD

DALI_PACKAGE = "nvidia-dali-cuda130"
HW_DECODER_LOAD = 0.99  # the hardware JPEG decoder's share (MLPerf's H100/H200 pipelines): nvJPEG's CPU part is slow
GPU_THREADS = 6  # DALI's threads per GPU in NVIDIA's MLPerf ResNet-50 pipelines (DeepLearningExamples: 5)
VAL_THREADS = 3  # validation's pipeline: a tenth of the images, prepared while the training's waits
# nvJPEG's buffers for training sized once for ImageNet's images (NVIDIA's DALI ResNet-50 values): without them they
# are reallocated, synchronously, as larger images come in the first batches. Each decoding thread holds them (host
# memory pinned, twice); validation keeps DALI's defaults.
DEVICE_MEMORY_PADDING, HOST_MEMORY_PADDING = 211_025_920, 140_544_512
SIZE_HINT_SAMPLE = 256  # images whose headers give the hardware decoder's preallocation size (the largest of them)
# GPUs whose JPEG engines nvJPEG's hardware backend uses (NVIDIA's nvJPEG and DALI documentation): elsewhere DALI
# sends --dali-hw-decoder-load's share to nvJPEG's CUDA decoder instead, without a word.
JPEG_ENGINE_GPUS = tuple("A100 A800 A30 H100 H800 H200 H20 GH200 B100 B200 GB200 B300 GB300".split())


def check_available():
    """None if DALI imports, else the reason in one line."""
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except ImportError as err:
        return (
            f"--data-backend dali needs NVIDIA DALI, which does not import here ({err}): pip install "
            f"{DALI_PACKAGE} (CUDA 13; nvidia-dali-cuda120 for CUDA 12), or use --data-backend pytorch"
        )
    return None


DECODED = (".jpg", ".jpeg", ".png")  # what this pipeline hands to DALI's decoder (see dali_feed.whole_image)


def check_decodable(dataset):
    """One line naming the files DALI would not decode (WebP, TIFF, BMP, ...) in a folder data set: each would be
    skipped with a warning and the run stop once none is left, while the pytorch backend reads them."""
    from dlojz_lib.checks import fail

    others = collections.Counter(
        path.rsplit(".", 1)[-1].lower()
        for path, _ in getattr(dataset, "samples", ())
        if isinstance(path, str) and not path.lower().endswith(DECODED)
    )
    if others:
        kinds = ", ".join(f"{count} .{suffix}" for suffix, count in others.most_common())
        fail(
            f"--data-backend dali: {dataset.root} holds images this pipeline does not decode ({kinds}; it takes "
            "JPEG and PNG): use --data-backend pytorch, or convert them"
        )


@dataclasses.dataclass(frozen=True)
class DaliSettings:
    """How DALI's pipelines run: CPU threads (training's, validation's), batches prepared ahead, the hardware
    decoder's share, the training decode (`roi`: the crop's region; `whole`) and decoded-image cache (MiB, 0: none),
    the hardware decoder's preallocation (width, height; 0: DALI's default), the training resize's antialiasing;
    what they write: float16 or float32, normalised by `mean` and `std` (in [0, 1] units), padded to 4 channels or
    not."""

    threads: int
    prefetch: int = 3
    decode: str = "roi"
    cache_mib: int = 0
    size_hint: tuple = (0, 0)
    hw_decoder_load: float = HW_DECODER_LOAD
    antialias: bool = False
    half: bool = False
    pad_channels: bool = False
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD

    @property
    def val_threads(self) -> int:
        return min(self.threads, VAL_THREADS)


def dali_settings(data, num_workers, amp, on_gpu=False, size_hint=(0, 0)):
    """The flags' values, or their defaults: on a GPU MLPerf's 6 training threads, or --num-workers (the task's
    CPUs less the training process's) where fewer; on the CPU --num-workers; validation 3 of them at most; the
    region decode unless --dali-cache (whole images); float16 output under --amp (either AMP dtype: autocast casts
    it to bfloat16 in the first layer, and float16 keeps more of the normalised pixels' precision), ImageNet's mean
    and std unless --mean/--std."""
    load = HW_DECODER_LOAD if data.dali_hw_decoder_load is None else data.dali_hw_decoder_load
    threads = data.dali_threads or (min(GPU_THREADS, max(1, num_workers)) if on_gpu else max(1, num_workers))
    return DaliSettings(
        threads=threads,
        decode=data.dali_decode or ("whole" if data.dali_cache else "roi"),
        cache_mib=round(data.dali_cache * 1024) if data.dali_cache else 0,
        size_hint=tuple(size_hint),
        prefetch=data.dali_prefetch,
        hw_decoder_load=load,
        antialias=data.dali_antialias,
        half=amp,
        pad_channels=data.dali_pad_channels,
        mean=tuple(data.mean or IMAGENET_MEAN),
        std=tuple(data.std or IMAGENET_STD),
    )


def decoder_options(device_id, settings, training=True):
    """The decoder's device; on a GPU the hardware JPEG decoder's share and unpinned threads (`affine=False`, as
    MLPerf: pinned, they pile onto the first cores of a Slurm cpuset); for training, nvJPEG's buffers sized once,
    the hardware decoder's preallocation at the data set's size hint, and the decoded-image cache where asked
    (DALI's threshold cache: every image, until it is full); validation keeps DALI's default buffers."""
    if device_id is None:
        return {"device": "cpu"}
    options = {"device": "mixed", "hw_decoder_load": settings.hw_decoder_load, "affine": False}
    if training:
        options.update(device_memory_padding=DEVICE_MEMORY_PADDING, host_memory_padding=HOST_MEMORY_PADDING)
        if all(settings.size_hint):
            options.update(preallocate_width_hint=settings.size_hint[0], preallocate_height_hint=settings.size_hint[1])
        if settings.cache_mib:
            options.update(cache_size=settings.cache_mib, cache_type="threshold", cache_threshold=0)
    return options


def jpeg_engines(device_name) -> bool:
    """Whether the GPU named `device_name` (torch.cuda.get_device_name) is known to have the JPEG engines nvJPEG's
    hardware backend uses (False: not known to; DALI then decodes on the SMs and the CPU threads)."""
    return any(word in JPEG_ENGINE_GPUS for word in device_name.replace("-", " ").split())


def jpeg_utilisation_reader(device):
    """A reader of the GPU's JPEG engines' utilisation (%, NVML's nvmlDeviceGetJpgUtilization): what --loader-only
    reports beside the start-up line's expectation from the GPU's name (a MIG slice may have no engine, a new GPU
    may be missing from JPEG_ENGINE_GPUS). None on the CPU, or where NVML or the reading is missing."""
    if device.type != "cuda":
        return None
    from dlojz_lib.observers.chrono import nvml_handle_for

    try:
        import pynvml

        pynvml.nvmlInit()
        handle = nvml_handle_for(pynvml, device)  # (by UUID: NVML's indexes ignore CUDA_VISIBLE_DEVICES)
        pynvml.nvmlDeviceGetJpgUtilization(handle)
    except Exception:  # no NVML, no engines, a driver without the reading: nothing to report
        return None
    return lambda: pynvml.nvmlDeviceGetJpgUtilization(handle)[0]


def image_size(data):
    """(width, height) from the header of the image whose first bytes are `data` (PIL reads the header, decodes
    nothing), or None when they hold none it can read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError):
        return None


def sampled_sizes(dataset, sample=SIZE_HINT_SAMPLE, head=1 << 16):
    """(width, height) of `sample` images spread over `dataset`, from their headers (not decoded): the largest is
    the hardware decoder's preallocation, the mean area what a cached image takes."""
    n = len(dataset.samples)
    count = min(n, sample)
    sizes = []
    for i in sorted({k * n // count for k in range(count)}):
        where = dataset.samples[i][0]
        try:
            if isinstance(where, str):
                with open(where, "rb") as file:
                    data = file.read(head)
            else:
                data = dataset.read_bytes(i)[:head]
        except OSError:
            continue
        size = image_size(data)
        if size is not None:
            sizes.append(size)
    return sizes


def largest(sizes):
    """The largest width and height among `sizes`; (0, 0) for none (DALI's default preallocation then)."""
    return (max(w for w, _ in sizes), max(h for _, h in sizes)) if sizes else (0, 0)


def cached_share(cache_mib, sizes, images):
    """The share of `images` decoded training images (RGB, uint8) that a cache of `cache_mib` MiB holds, by the
    mean area of `sizes`: those are decoded once, the rest every epoch. None without sizes."""
    if not sizes or not images:
        return None
    mean_bytes = 3 * sum(w * h for w, h in sizes) / len(sizes)
    return min(1.0, cache_mib * 2**20 / mean_bytes / images)


def pipeline_options(batch_size, device_id, settings, seed, threads):
    """What both pipelines run with: the batch, the device, DALI's threads and prefetch depth, the seed, and DALI's
    dynamic executor (outputs bound to a CUDA stream, and shared with torch without a copy)."""
    return dict(
        batch_size=batch_size,
        num_threads=threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=settings.prefetch,
        exec_dynamic=True,
    )


def encoded_samples(source, by_path):
    """The pipeline's input: the files' bytes (read by DALI from SampleFeed's paths, or given by it; or read by
    DALI's file reader from EpochFiles, each keyed by its path) and labels."""
    from nvidia.dali import fn, types

    if isinstance(source, EpochFiles):
        data, labels = fn.readers.file(files=source.paths, labels=source.labels, random_shuffle=False)
        return data, fn.cast(labels, dtype=types.INT64)
    data, labels = fn.external_source(source=source, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64])
    return (fn.io.file.read(data) if by_path else data), labels


def normalised(images, settings, device_id, **crop_and_flip):
    """crop_mirror_normalize: the model's input, float16 or float32, HWC, (x / 255 - mean) / std, padded to 4
    channels with zeros when asked; with the crop or flip given, in the same pass."""
    from nvidia.dali import fn, types

    if device_id is not None:
        images = images.gpu()
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT16 if settings.half else types.FLOAT,
        output_layout="HWC",
        mean=[255 * m for m in settings.mean],
        std=[255 * s for s in settings.std],
        pad_output=settings.pad_channels,
        **crop_and_flip,
    )


EPOCH_SEED_STRIDE = 1_000_003  # a pipeline an epoch (EpochFiles): each epoch's draws from a seed of its own


def train_pipeline(source, batch_size, image_size, device_id, settings, seed):
    """RandomResizedCrop, then the flip folded into the normalisation."""
    from nvidia.dali import fn, pipeline_def, types

    if isinstance(source, EpochFiles):
        seed += EPOCH_SEED_STRIDE * source.epoch

    @pipeline_def(**pipeline_options(batch_size, device_id, settings, seed, settings.threads))
    def pipeline():
        encoded, labels = encoded_samples(source, getattr(source, "by_path", False))
        crop = dict(random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
        if settings.decode == "roi":  # the crop's region decoded, then resized
            images = fn.decoders.image_random_crop(
                encoded, output_type=types.RGB, **crop, **decoder_options(device_id, settings)
            )
            images = fn.resize(images, resize_x=image_size, resize_y=image_size, antialias=settings.antialias)
        else:  # the whole image decoded (and cached), then cropped and resized in one operator
            images = fn.decoders.image(encoded, output_type=types.RGB, **decoder_options(device_id, settings))
            images = fn.random_resized_crop(images, size=[image_size, image_size], antialias=settings.antialias, **crop)
        images = normalised(images, settings, device_id, mirror=fn.random.coin_flip(probability=0.5))
        return images, labels.gpu() if device_id is not None else labels

    return pipeline()


def val_pipeline(source, batch_size, resize_size, crop_size, device_id, settings, seed):
    """Resize the shorter side (antialiased, whatever the training's setting: validation is the fixed yardstick),
    then the center crop folded into the normalisation."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(**pipeline_options(batch_size, device_id, settings, seed, settings.val_threads))
    def pipeline():
        encoded, labels = encoded_samples(source, getattr(source, "by_path", False))
        images = fn.decoders.image(encoded, output_type=types.RGB, **decoder_options(device_id, settings, False))
        images = fn.resize(images, resize_shorter=resize_size, antialias=True)
        images = normalised(images, settings, device_id, crop=(crop_size, crop_size))
        return images, labels.gpu() if device_id is not None else labels

    return pipeline()


def start_line(settings, device_id, device_name):
    """What DALI runs with, said once: where it decodes and with which decoder (the JPEG engines where the GPU is
    known to have them), its threads, the training decode and buffers, the output."""
    if device_id is None:
        where = "the CPU (no GPU)"
    elif settings.hw_decoder_load == 0:
        where = f"the GPU ({device_name}: nvJPEG's CUDA decoder and the CPU threads, --dali-hw-decoder-load 0)"
    elif jpeg_engines(device_name):
        where = (
            f"the GPU ({device_name}: its JPEG engines expected to take {settings.hw_decoder_load:.0%} (by the GPU's "
            "name; --loader-only reads their use), nvJPEG's CUDA decoder and the CPU threads the rest)"
        )
    else:
        where = (
            f"the GPU ({device_name}: not known to have JPEG engines, so nvJPEG's CUDA decoder and the CPU threads "
            f"take all the images; --dali-hw-decoder-load {settings.hw_decoder_load:g} counts only where DALI finds "
            "engines)"
        )
    decode = "the random crop's region" if settings.decode == "roi" else "whole images, then the crop"
    buffers = ""
    if device_id is not None:
        hint = f"{settings.size_hint[0]}x{settings.size_hint[1]}" if all(settings.size_hint) else "DALI's default"
        buffers = f", nvJPEG's training buffers sized once (hardware decoder preallocated at {hint})"
    return (
        f"DALI: decoding on {where}; training {settings.threads} thread{'s' if settings.threads > 1 else ''} "
        f"decoding {decode}{buffers}, validation {settings.val_threads}; "
        f"{settings.prefetch} batches ahead, training resize {'with' if settings.antialias else 'without'} "
        f"antialiasing, {'float16' if settings.half else 'float32'} channels-last output"
        f"{' padded to 4 channels' if settings.pad_channels else ''}; a resumed run continues at the same sample with "
        "DALI's own crops"
    )


class BatchLifetimes:
    """Each batch's tensors kept until the step that reads them has run on the device. They are DALI's buffers seen
    through DLPack: when the last torch reference goes, DALI's deleter runs at once on the host, while the kernels
    reading the batch may still be queued on torch's stream (torch cannot record a stream on memory it did not
    allocate, and whether DALI frees in that stream's order is not documented). So when the next batch is asked for
    (the step of the last one is queued by then) an event is recorded on the consuming stream for the last one, and
    a batch is let go once its event has passed: `event.query()`, no host wait."""

    def __init__(self, make_event=None):
        self.make_event = make_event or (lambda: torch.cuda.Event())
        self.last = None  # the batch handed out last: its step is being queued
        self.held = collections.deque()  # (event, batch) of earlier batches whose steps may still run

    def next_batch(self, stream):
        """Called before a new batch is made: the last one's step is queued on `stream`."""
        if self.last is not None:
            event = self.make_event()
            event.record(stream)
            self.held.append((event, self.last))
            self.last = None
        while self.held and self.held[0][0].query():
            self.held.popleft()

    def handed_out(self, batch):
        self.last = batch


class DaliBatches:
    """(images, labels) on the device for one epoch of `sampler` per iteration: the model's input, normalised by
    DALI. Each iteration starts where the sampler says (its epoch and `skip`, set by the training loop); when that
    is where the pipeline already is (the previous iteration ran to its end, and DALI has been preparing the next
    one's batches since) it goes on, else (the first epoch, a resume, an iteration left before its end) the
    pipeline is built anew at that place.

    `by_epoch` (--dali-cache): the pipeline reads each epoch's files with DALI's file reader (EpochFiles), which
    keys each image by its path for the decoder's cache; a pipeline an epoch, the next one built before the last is
    let go (DALI keeps a GPU's cache while a decoder holds it), a partial last batch cut from the reader's full one.
    """

    def __init__(
        self, dataset, sampler, batch_size, make_pipeline, device, drop_last=False, name="", log=None, by_epoch=False
    ):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.make_pipeline, self.device, self.drop_last, self.by_epoch = make_pipeline, device, drop_last, by_epoch
        self.name, self.log = name, log  # the first build's memory is said on `log`
        self.pipeline = self.source = None
        self.position = None  # (epoch, samples seen) of the pipeline's next batch; None mid-iteration
        self.rebuilds = 0  # pipelines built: what the tests count
        self.lifetimes = BatchLifetimes() if device.type == "cuda" else None
        self.memory_before = None  # (free GPU bytes, host RSS bytes) before the first build, until read
        self.memory_taken = None  # (GPU bytes, host bytes) the first pipeline took, its prefetch queue filled
        self.handed = 0  # batches handed out

    def __len__(self):
        n = self._samples()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _samples(self):
        """The samples an epoch of the sampler gives this rank."""
        return getattr(self.sampler, "trained", None) or getattr(self.sampler, "num_samples", None) or len(self.sampler)

    def _wanted(self):
        return getattr(self.sampler, "epoch", 0), getattr(self.sampler, "skip", 0)

    def _memory(self):
        """(free GPU bytes or 0, this process's resident host bytes, pinned buffers included)."""
        import resource

        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        try:
            with open("/proc/self/statm") as statm:
                resident = int(statm.read().split()[1]) * resource.getpagesize()
        except OSError:
            resident = 0
        return free, resident

    def _build(self, start, skipped=()):
        if self.rebuilds == 0:
            self.memory_before = self._memory()
        if not self.by_epoch:
            self.pipeline = None  # its threads and buffers go before the new one's come
        self.source = SampleFeed(self.dataset, self.sampler, self.batch_size, start, self.drop_last)
        self.source.skipped |= set(skipped)
        pipeline = self.make_pipeline(self.source.epoch_files(start) if self.by_epoch else self.source)
        pipeline.build()
        self.pipeline = pipeline  # (by_epoch: the last one let go only now, its decoder's cache held by this one's)
        self.rebuilds += 1

    def __iter__(self):
        wanted = self._wanted()
        if self.pipeline is None or self.position != wanted or self.by_epoch:
            self._build(wanted, self.source.skipped if self.source is not None else ())
        self.position = None
        return self._batches(*wanted)

    def _batches(self, epoch, skip):
        first = skip // self.batch_size
        samples = self._samples() if self.by_epoch else None
        for batch in range(first, len(self)):
            if batch == len(self) - 1:  # the next iteration's batches are the ones DALI is preparing
                self.position = (epoch + 1 if hasattr(self.sampler, "set_epoch") else epoch, 0)
            images, labels = self._run(epoch, batch * self.batch_size)
            if samples is not None and (batch + 1) * self.batch_size > samples:  # the reader's batch is full
                kept = samples - batch * self.batch_size
                images, labels = images[:kept], labels[:kept]
            yield images.permute(0, 3, 1, 2), labels.view(-1)  # NCHW's shape over NHWC memory: channels-last

    def _run(self, epoch, seen):
        """The next batch as torch tensors sharing DALI's buffers, ready on the current CUDA stream (no host wait).
        A pipeline that fails is rebuilt at the same place without the files found unreadable among those it was
        preparing; if none is, DALI's error goes on."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if self.lifetimes is not None:
            self.lifetimes.next_batch(stream)
        try:
            outputs = self.pipeline.run(stream)
        except RuntimeError:
            bad = self.source.unreadable((epoch, seen), self.pipeline.prefetch_queue_depth + 2)
            if not bad:
                raise
            self._build((epoch, seen), self.source.skipped | bad)
            outputs = self.pipeline.run(stream)
        batch = tuple(torch.from_dlpack(output.as_tensor()) for output in outputs)
        if self.lifetimes is not None:
            self.lifetimes.handed_out(batch)
        self.handed += 1
        if self.memory_before is not None and self.handed >= min(self.pipeline.prefetch_queue_depth + 1, len(self)):
            # the first pipeline, its prefetch queue filled and a batch past it: what it took, read once (one wait)
            if stream is not None:
                torch.cuda.synchronize(self.device)
            (free, resident), (free_now, resident_now) = self.memory_before, self._memory()
            self.memory_taken, self.memory_before = (free - free_now, resident_now - resident), None
            if self.log is not None:
                self.log(
                    f"DALI {self.name} pipeline: {self.pipeline.num_threads} "
                    f"thread{'s' if self.pipeline.num_threads > 1 else ''}, took "
                    + (f"{self.memory_taken[0] / 2**20:,.0f} MiB of GPU memory and " if stream is not None else "")
                    + f"{self.memory_taken[1] / 2**20:,.0f} MiB of host memory (resident, pinned buffers included)"
                )
        return batch
