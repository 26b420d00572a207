"""The batch's last steps, on the device: the DataLoader's workers ship uint8 crops (dlojz_lib/data/transforms.py), and here

* ``DeviceNormalize(device)`` turns a ``uint8`` batch into normalised floats (optionally channels-last) on the
  device: 4x fewer bytes through the workers' queues and the host-to-device copy than floats;
* ``DevicePrefetcher(loader, device, normalize)`` iterates a DataLoader of ``(uint8 images, labels)`` and yields
  ``(normalised float images, labels)`` already on the device; on CUDA it copies and normalises the next batch on a
  side stream while the current batch is being used.

Typical use::

    loader = torch.utils.data.DataLoader(train_set, batch_size=128, num_workers=8, pin_memory=True)
    for images, labels in DevicePrefetcher(loader, device, DeviceNormalize(device, channels_last=True)):
        ...
"""

import torch

from dlojz_lib.data.transforms import IMAGENET_MEAN, IMAGENET_STD


class DeviceNormalize:
    """Convert a uint8 image batch to normalised floats on ``device``: ``(x / 255 - mean) / std``.

    Accepts ``[N, C, H, W]`` (or a single ``[C, H, W]``) uint8 tensors on any device, in either memory layout; the
    result is on ``device``, in ``dtype``, channels-last when asked (for 4-D input), NCHW-contiguous otherwise. The
    layout change, if any, is done on the uint8 tensor (4x less memory to move), the arithmetic in float32.
    """

    def __init__(
        self,
        device,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        channels_last: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        self.device = torch.device(device)
        self.channels_last = channels_last
        self.dtype = dtype
        mean = torch.tensor(mean, dtype=torch.float32)
        std = torch.tensor(std, dtype=torch.float32)
        # (x / 255 - mean) / std == x * scale - shift: one multiply and one subtract, both in place.
        self.scale = (1.0 / (255.0 * std)).to(self.device)
        self.shift = (mean / std).to(self.device)
        self._rows = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, channels_last={self.channels_last}, dtype={self.dtype})"

    def _row_constants(self, width: int):
        # Per-channel constants repeated along a row of HWC memory, [W * C]: the multiply then broadcasts over
        # rows and vectorises, where a [C, 1, 1] broadcast over channels-last memory is several times slower on CPU.
        if width not in self._rows:
            self._rows[width] = (self.scale.repeat(width), self.shift.repeat(width))
        return self._rows[width]

    def __call__(self, images_uint8: torch.Tensor) -> torch.Tensor:
        if images_uint8.dtype != torch.uint8:
            raise TypeError(
                f"DeviceNormalize expects uint8 images (from TrainTransform/ValTransform), got {images_uint8.dtype}"
            )
        images = images_uint8.to(self.device, non_blocking=True)
        if images.dim() == 4:
            images = images.contiguous(
                memory_format=torch.channels_last if self.channels_last else torch.contiguous_format
            )
        else:
            images = images.contiguous()
        images = images.to(torch.float32)  # keeps the memory layout
        n_channels = images.shape[-3]
        if images.dim() == 4 and not images.is_contiguous():  # channels-last memory: normalise rows of HWC
            n, _, height, width = images.shape
            scale, shift = self._row_constants(width)
            rows = images.permute(0, 2, 3, 1).view(n * height, width * n_channels)
            rows.mul_(scale).sub_(shift)
        else:
            images.mul_(self.scale.view(-1, 1, 1)).sub_(self.shift.view(-1, 1, 1))
        return images if self.dtype == torch.float32 else images.to(self.dtype)


class DevicePrefetcher:
    """Iterate ``loader`` (batches of ``(uint8 images, labels)``), yielding normalised images and labels on ``device``.

    On CUDA, the next batch is copied (``non_blocking``, from pinned memory when the loader pins it) and normalised
    on a side stream while the caller computes on the current batch; the compute stream waits for that side stream
    before a batch is handed out, and the tensors are recorded on the compute stream so that the caching allocator
    does not reuse their memory too early. Elsewhere (CPU) it is a plain loop that normalises each batch.
    """

    def __init__(self, loader, device, normalize: DeviceNormalize, non_blocking: bool = True):
        self.loader = loader
        self.device = torch.device(device)
        self.normalize = normalize
        self.non_blocking = non_blocking

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        if self.device.type == "cuda":
            return self._iter_cuda()
        return self._iter_plain()

    def _iter_plain(self):
        for images, labels in self.loader:
            yield self.normalize(images.to(self.device)), labels.to(self.device)

    def _iter_cuda(self):
        compute_stream = torch.cuda.current_stream(self.device)
        copy_stream = torch.cuda.Stream(device=self.device)
        # Work already queued on the compute stream (e.g. the normalisation constants) comes first.
        copy_stream.wait_stream(compute_stream)
        batches = iter(self.loader)

        def start_copy():
            batch = next(batches, None)
            if batch is None:
                return None
            images, labels = batch
            with torch.cuda.stream(copy_stream):
                images = self.normalize(images.to(self.device, non_blocking=self.non_blocking))
                labels = labels.to(self.device, non_blocking=self.non_blocking)
            return images, labels

        upcoming = start_copy()
        while upcoming is not None:
            compute_stream.wait_stream(copy_stream)
            images, labels = upcoming
            # Allocated on copy_stream, used on compute_stream: keep the memory until compute_stream is done.
            images.record_stream(compute_stream)
            labels.record_stream(compute_stream)
            upcoming = start_copy()  # overlaps with the caller's work on (images, labels)
            yield images, labels
