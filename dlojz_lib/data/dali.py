"""NVIDIA DALI input pipeline for dlojz.py (`--data-backend dali`): JPEG decoding on the GPU.

One GPU eats more images per second than the CPU cores it gets can decode (an H100 ~7,000 img/s of ResNet-50; a
core decodes 250-290 at 224 px). DALI decodes on the GPU (nvJPEG, and the hardware JPEG decoder of A100/H100:
`device="mixed"`), decoding only the random crop's region, then resizes, flips and crops there. Without a GPU the
same pipeline runs on DALI's CPU backend (what the CPU tests run).

    train: samples -> decoders.image_random_crop (RandomResizedCrop's area 0.08-1 and ratio 3/4-4/3, only the
           region decoded) -> resize to --image-size -> random horizontal flip -> uint8 HWC
    val:   samples -> decoders.image -> resize the shorter side to --val-resize-size -> center crop --val-crop-size

The batches come out HWC and are seen as NCHW tensors in channels-last memory (a free permute): what channels-last
training wants, and one DALI operator less than a CHW transpose. The training resize is not antialiased unless
--dali-antialias, as in NVIDIA's own DALI ResNet-50 pipelines: on DALI's CPU backend the antialiased resize costs
twice the decode (measured here: decode alone 3,200 img/s on 2 threads, + resize 1,000, + resize without
antialiasing 1,450); validation's resize is antialiased (the yardstick stays the pytorch backend's).

Samples come from dlojz's own data sets and samplers through an external source, not from a DALI reader: the
order is the pytorch backend's (the shuffle by seed and epoch, exact mid-epoch resume by the sampler's position,
--train-subset, packed shards read by index), and validation is exact (each image once across ranks, the last
batch partial). Normalisation is dlojz's DeviceNormalize, as for the pytorch backend. What
differs from it: the crops and flips are DALI's draws (seeded by --seed and the rank), not the per-sample seeds, so a
resumed run goes on from the same sample with other crops. A file that is not a whole JPEG or PNG is skipped with
a warning before DALI sees it; one DALI cannot decode stops the run with DALI's error naming no file.

The source runs in the training process: a thread pool reads the next batches' files (chunks of a batch per task,
so the training thread only collects them: ~2.5 ms per batch of 32 here). DALI's parallel external source (worker
processes, `parallel=True`) was measured and not kept: on 2 cores it fed 950-973 img/s against 936-968 for the
thread pool (the workers' processes and shared-memory copies cost what they save), and 1,296 when its workers even
did dlojz's own DCT-scaled decoding; DALI's own file reader (no Python at all) gives at best 1,500-1,570 img/s with
the same operators, but cannot keep dlojz's order, shards or skipped files.

- `check_available()`: the one-line error when DALI is not installed; `check_decodable(dataset)`: one for a data
  set whose files are not all JPEG or PNG.
- `dali_settings(cfg)`: the --dali-* flags, or their defaults from the task's CPUs (`DaliSettings`).
- `train_pipeline`, `val_pipeline`: the two DALI pipelines, fed by `EncodedSamples`.
- `DaliBatches(dataset, sampler, batch_size, make_pipeline, ...)`: an iterable of (normalised images, labels) on the
  device, with `len()` and `batch_size`, in place of the DataLoader + DevicePrefetcher.
"""

import collections
import copy
import dataclasses
import math
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

DALI_PACKAGE = "nvidia-dali-cuda130"
READ_THREADS = 8  # file reads release the GIL: a few threads keep the external source ahead of the decoder
READ_AHEAD = 3  # batches read before DALI asks for them


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


DECODED = (".jpg", ".jpeg", ".png")  # what this pipeline hands to DALI's decoder (see whole_image)


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


def whole_image(data):
    """A whole JPEG (start and end markers) or PNG: what is worth handing to DALI's decoder."""
    return (data[:3] == b"\xff\xd8\xff" and data.rstrip(b"\x00")[-2:] == b"\xff\xd9") or data[
        :8
    ] == b"\x89PNG\r\n\x1a\n"


class EncodedSamples:
    """The external source: each iteration is one epoch of the sampler, in batches of the files' bytes and labels.
    DALI iterates it ahead (the next epoch starts as soon as one ends), so it keeps its own copy of the sampler and
    counts its epochs itself; `next_start` is the (epoch, first sample) its next iteration will give."""

    def __init__(self, dataset, sampler, batch_size, epoch=0, skip=0):
        self.dataset, self.sampler, self.batch_size = dataset, copy.copy(sampler), batch_size
        self.next_start = (epoch, skip)
        self.pool = None

    def __iter__(self):
        epoch, skip = self.next_start
        if hasattr(self.sampler, "set_epoch"):  # training: the next iteration is the next epoch
            self.next_start = (epoch + 1, 0)
            self.sampler.set_epoch(epoch)
            self.sampler.skip = skip
        keys = list(iter(self.sampler))
        return self._batches(keys)

    def _batches(self, keys):
        """DALI calls the source from the training process's thread that runs the pipeline: the files of the next
        READ_AHEAD batches are read meanwhile by the thread pool, so that a call only collects a batch already read."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(READ_THREADS)
        pending = collections.deque()
        # A batch's reads in READ_THREADS chunks, not one task per file: the training thread's share of the work (a
        # future per sample cost ~20 us there) is then small beside the reads.
        chunk = max(1, -(-self.batch_size // READ_THREADS))
        for start in range(0, len(keys), self.batch_size):
            indices = [index for _, index in keys[start : start + self.batch_size]]
            pending.append(
                [self.pool.submit(self._read_many, indices[k : k + chunk]) for k in range(0, len(indices), chunk)]
            )
            if len(pending) > READ_AHEAD:
                yield self._collect(pending.popleft())
        while pending:
            yield self._collect(pending.popleft())

    @staticmethod
    def _collect(futures):
        samples = [sample for future in futures for sample in future.result()]
        return [data for data, _ in samples], [target for _, target in samples]

    def _read_many(self, indices):
        return [self._read(index) for index in indices]

    def _read(self, index):
        """(bytes as a uint8 array, label) of sample `index`, or of the next readable one (as the pytorch backend)."""
        n = len(self.dataset.samples)
        for attempt in range(n):
            i = (index + attempt) % n
            try:
                data = self.dataset.read_bytes(i)
                if not whole_image(data):
                    raise OSError("not a whole JPEG or PNG file")
                return np.frombuffer(data, dtype=np.uint8), np.array([self.dataset.samples[i][1]], dtype=np.int64)
            except OSError as err:
                print(
                    f"WARNING: skipping unreadable image {self.dataset.describe(i)}: {err}", file=sys.stderr, flush=True
                )
        raise OSError(f"no readable image in {self.dataset.root}")

    def __getstate__(self):  # the thread pool stays in the process that made it
        return dict(self.__dict__, pool=None)


@dataclasses.dataclass(frozen=True)
class DaliSettings:
    """How DALI's pipelines run: CPU threads, batches prepared ahead, the hardware decoder's share, the training
    resize's antialiasing."""

    threads: int
    prefetch: int
    hw_decoder_load: float
    antialias: bool


def dali_settings(cfg):
    """The flags' values, or defaults from the CPUs the task has: --num-workers is already the task's CPUs less the
    training process's. With few threads the CPU's share of nvJPEG's decoding is slow, so the hardware decoder
    takes more of the images than DALI's default 0.65."""
    threads = cfg.dali_threads or max(1, cfg.num_workers)
    load = cfg.dali_hw_decoder_load
    if load is None:
        load = 0.9 if threads < 8 else 0.65
    return DaliSettings(threads, cfg.dali_prefetch, load, cfg.dali_antialias)


def decoder_options(device_id, hw_decoder_load):
    """The decoder's device, and the hardware JPEG decoder's share of the images where there is one (A100, H100)."""
    if device_id is None:
        return {"device": "cpu"}
    # nvJPEG's buffers sized once for ImageNet's largest images (the values of NVIDIA's DALI ResNet-50 pipelines):
    # without them it reallocates, synchronously, as larger images come in the first batches.
    return {
        "device": "mixed",
        "hw_decoder_load": hw_decoder_load,
        "device_memory_padding": 211_025_920,
        "host_memory_padding": 140_544_512,
    }


def pipeline_options(batch_size, device_id, settings, seed):
    """What both pipelines run with: the batch, the device, DALI's threads and prefetch depth, the seed."""
    return dict(
        batch_size=batch_size,
        num_threads=settings.threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=settings.prefetch,
    )


def encoded_samples(source):
    """The pipeline's input: EncodedSamples' batches of file bytes and labels (inside a pipeline definition)."""
    from nvidia.dali import fn, types

    return fn.external_source(source=source, num_outputs=2, batch=True, cycle="raise", dtype=[types.UINT8, types.INT64])


def train_pipeline(source, batch_size, image_size, device_id, settings, seed):
    """RandomResizedCrop + flip, uint8 HWC (the batch's NHWC memory is what channels-last training wants)."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(**pipeline_options(batch_size, device_id, settings, seed))
    def pipeline():
        encoded, labels = encoded_samples(source)
        images = fn.decoders.image_random_crop(
            encoded,
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
            num_attempts=10,
            **decoder_options(device_id, settings.hw_decoder_load),
        )
        images = fn.resize(images, resize_x=image_size, resize_y=image_size, antialias=settings.antialias)
        images = fn.flip(images, horizontal=fn.random.coin_flip(probability=0.5))
        return images, labels.gpu() if device_id is not None else labels

    return pipeline()


def val_pipeline(source, batch_size, resize_size, crop_size, device_id, settings, seed):
    """Resize the shorter side (antialiased, whatever the training's setting: validation is the fixed yardstick),
    center crop, uint8 HWC."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(**pipeline_options(batch_size, device_id, settings, seed))
    def pipeline():
        encoded, labels = encoded_samples(source)
        images = fn.decoders.image(
            encoded, output_type=types.RGB, **decoder_options(device_id, settings.hw_decoder_load)
        )
        images = fn.resize(images, resize_shorter=resize_size, antialias=True)
        images = fn.crop(images, crop=(crop_size, crop_size))
        return images, labels.gpu() if device_id is not None else labels

    return pipeline()


class DaliBatches:
    """(normalised images, labels) on the device for one epoch of `sampler` per iteration (uint8 images when
    `normalize` is None: what --loader-only times, as it times the pytorch backend's DataLoader). Each iteration starts
    where the sampler says (its epoch and `skip`, set by the training loop); when that is not what the pipeline has
    already prefetched (the first epoch, a resume, an iteration left before its end), the pipeline is built anew."""

    def __init__(self, dataset, sampler, batch_size, make_pipeline, device, normalize, drop_last=False):
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.make_pipeline, self.device, self.normalize, self.drop_last = make_pipeline, device, normalize, drop_last
        self.pipeline = self.source = None
        self.finished = False  # the previous iteration ran to its end (the pipeline then holds the next epoch)

    def __len__(self):
        n = getattr(self.sampler, "trained", None) or getattr(self.sampler, "num_samples", None) or len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _wanted(self):
        return getattr(self.sampler, "epoch", 0), getattr(self.sampler, "skip", 0)

    def __iter__(self):
        wanted = self._wanted()
        if self.pipeline is not None and self.finished and self.source.next_start == (wanted[0], 0) == wanted:
            self.pipeline.reset()  # already prefetching this epoch
        else:
            self.source = EncodedSamples(self.dataset, self.sampler, self.batch_size, *wanted)
            self.pipeline = self.make_pipeline(self.source)
            self.pipeline.build()
        self.finished = False
        return self._batches()

    def _batches(self):
        from nvidia.dali.plugin.pytorch import feed_ndarray

        left = len(self) - self._wanted()[1] // self.batch_size
        while left > 0:
            try:
                images, labels = self.pipeline.run()
            except StopIteration:
                self.finished = True
                return
            images, labels = images.as_tensor(), labels.as_tensor()
            out_images = torch.empty(images.shape(), dtype=torch.uint8, device=self.device)  # N, H, W, C
            out_labels = torch.empty(labels.shape(), dtype=torch.int64, device=self.device)
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            feed_ndarray(images, out_images, cuda_stream=stream)
            feed_ndarray(labels, out_labels, cuda_stream=stream)
            left -= 1
            out_images = out_images.permute(0, 3, 1, 2)  # NCHW's shape over NHWC memory: channels-last, no copy
            yield (out_images if self.normalize is None else self.normalize(out_images)), out_labels.view(-1)
        # --drop-last: the partial batch left is not trained on; the pipeline's epoch is drained, not wasted work
        while True:
            try:
                self.pipeline.run()
            except StopIteration:
                self.finished = True
                return
