"""Fast input pipeline for dlojz: decode only what the crop needs, ship uint8, normalise on the device.

The torchvision reference pipeline (``ImageFolder`` + ``RandomResizedCrop`` + ``RandomHorizontalFlip`` +
``ToTensor`` + ``Normalize``) decodes every JPEG at full size and does the float conversion and normalisation in the
DataLoader workers, so that each sample travels to the main process as 4-byte floats. This module keeps the same
augmentation statistics while doing less work per image:

* ``lazy_pil_loader(path)`` opens a file without decoding it, so that the transform can still choose how to decode.
* ``TrainTransform(image_size)`` draws the crop box on the original image size with torchvision's own
  ``RandomResizedCrop.get_params`` (same random numbers, same distribution), then, when the crop will be shrunk by
  2x or more, has libjpeg-turbo decode directly at 1/2, 1/4 or 1/8 scale in the DCT domain (PIL's draft mode), maps
  the box into the reduced image, crops, resizes (bilinear with antialiasing, as torchvision does on PIL images)
  and flips. It returns a ``uint8`` tensor ``[3, image_size, image_size]`` (RGB).
* ``ValTransform(resize_size, crop_size)`` is the reference ``Resize(resize_size) + CenterCrop(crop_size)`` done as
  one resize of the matching box of the original (same pixels up to rare 1-level rounding), with draft decoding
  for large images.
* JPEG decoding: when the optional ``simplejpeg`` package is installed, YCbCr and grayscale JPEGs are decoded by it
  (the same libjpeg-turbo, bit-identical pixels and DCT scaling, about 20% less time per training sample because it
  decodes straight into a packed RGB array); PIL decodes everything else and everything when it is absent.
* ``DeviceNormalize(device)`` turns a ``uint8`` batch into normalised floats (optionally channels-last) on the device.
* ``DevicePrefetcher(loader, device, normalize)`` iterates a DataLoader of ``(uint8 images, labels)`` and yields
  ``(normalised float images, labels)`` already on the device; on CUDA it copies and normalises the next batch on a
  side stream while the current batch is being used.

Typical use (the DataLoader's default collate stacks the uint8 samples)::

    train_set = torchvision.datasets.ImageFolder(root, transform=TrainTransform(224), loader=lazy_pil_loader)
    loader = torch.utils.data.DataLoader(train_set, batch_size=128, num_workers=8, pin_memory=True)
    for images, labels in DevicePrefetcher(loader, device, DeviceNormalize(device, channels_last=True)):
        ...

Unreadable files raise ``UnreadableImageError`` (an ``OSError``) whose message starts with the file name.
Everything here is picklable, as DataLoader workers started with ``spawn`` or ``forkserver`` require.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import RandomResizedCrop

try:  # optional, faster JPEG decoder (same libjpeg-turbo pixels as PIL); PIL is used when it is absent
    import simplejpeg
except ImportError:
    simplejpeg = None

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "UnreadableImageError",
    "lazy_pil_loader",
    "TrainTransform",
    "ValTransform",
    "DeviceNormalize",
    "DevicePrefetcher",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Errors PIL raises on files that are not images, truncated or corrupt, or too large to be safe.
_PIL_READ_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class UnreadableImageError(OSError):
    """A file that cannot be opened or decoded as an image; the message starts with its path."""


def _image_name(img: Image.Image) -> str:
    return getattr(img, "filename", "") or "<in-memory image>"


def lazy_pil_loader(path: str) -> Image.Image:
    """Open ``path`` as a PIL image without decoding its pixels.

    Decoding is left to the transform, which can then ask for a reduced-size decode (JPEG draft mode). The file is
    closed by PIL once the pixels are loaded. Raises ``UnreadableImageError`` naming the file if it is missing or
    is not an image that PIL recognises.
    """
    try:
        return Image.open(path)
    except _PIL_READ_ERRORS as error:
        raise UnreadableImageError(f"{path}: cannot be read as an image ({error})") from error


def _reduction_for_crop(box: tuple, out_width: int, out_height: int) -> int:
    """1, 2, 4 or 8: the DCT-domain reduction that keeps the crop ``box`` at least as large as the output."""
    shrink = min((box[2] - box[0]) / out_width, (box[3] - box[1]) / out_height)
    return 8 if shrink >= 8 else 4 if shrink >= 4 else 2 if shrink >= 2 else 1


def _scale_box(box: tuple, fx: float, fy: float) -> tuple:
    return (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)


def _jpeg_bytes_for_simplejpeg(img: Image.Image) -> bytes | None:
    """The raw bytes of ``img`` when simplejpeg can decode it in PIL's place, else None.

    Only for JPEGs opened by path and not decoded yet (so the file is ours to read and close), in YCbCr or
    grayscale (CMYK and other rare colour spaces stay with PIL, which converts them correctly).
    """
    if (simplejpeg is None or img.format != "JPEG" or not getattr(img, "filename", None)
            or getattr(img, "fp", None) is None or not img.tile):
        return None
    img.fp.seek(0)
    data = img.fp.read()
    try:
        colorspace = simplejpeg.decode_jpeg_header(data)[2]
    except ValueError:
        colorspace = None  # let PIL decode it and report the error
    if colorspace not in ("YCbCr", "Gray"):
        img.fp.seek(0)
        return None
    return data


def _decode(img: Image.Image, box: tuple, out_width: int, out_height: int, draft: bool):
    """Decode ``img`` to RGB, at reduced scale when ``draft`` and the crop ``box`` allow it.

    Returns ``(pixels, box)``: pixels as an HWC uint8 RGB ndarray (simplejpeg) or an RGB PIL image, and ``box``
    (left, top, right, bottom) mapped into them. libjpeg-turbo does the reduction in the DCT domain (1/2, 1/4, 1/8),
    skipping most of the inverse DCT and colour conversion work. simplejpeg and PIL decode to identical pixels (same
    libjpeg-turbo, same settings); simplejpeg is faster because it decodes straight into a packed RGB array.
    """
    reduction = _reduction_for_crop(box, out_width, out_height) if draft else 1
    width, height = img.size
    data = _jpeg_bytes_for_simplejpeg(img)
    if data is not None:
        try:
            # Asking for at least ceil(size / reduction) selects libjpeg-turbo's 1/reduction scaling factor.
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-height // reduction),
                                            min_width=-(-width // reduction))
        except ValueError:
            # simplejpeg also stops at libjpeg's warnings (e.g. extraneous bytes), which PIL tolerates: let PIL
            # decide, so that exactly the files the reference pipeline reads are read (and the others reported).
            pixels = None
        if pixels is not None:
            img.close()
            decoded_height, decoded_width = pixels.shape[:2]
            if (decoded_height, decoded_width) == (-(-height // reduction), -(-width // reduction)):
                # libjpeg maps original coordinate x to x / reduction (the decoded size is rounded up).
                box = _scale_box(box, 1 / reduction, 1 / reduction)
            else:  # another scaling factor was chosen (not expected): map by the decoded size
                box = _scale_box(box, decoded_width / width, decoded_height / height)
            return pixels, box
    if reduction > 1:
        # PIL picks the largest reduction that keeps the decoded image at least the requested size.
        drafted = img.draft("RGB", (width // reduction, height // reduction))
        if drafted is not None:  # None: not a JPEG, already decoded, or a layout libjpeg cannot scale
            # drafted[1] is the region of the reduced image that covers the whole original: map the box through it.
            _, (_, _, covered_width, covered_height) = drafted
            box = _scale_box(box, covered_width / width, covered_height / height)
    try:
        img.load()
    except _PIL_READ_ERRORS as error:
        img.close()  # PIL closes the file only after a successful load
        raise UnreadableImageError(f"{_image_name(img)}: cannot be decoded ({error})") from error
    return (img if img.mode == "RGB" else img.convert("RGB")), box


def _pil_to_uint8_chw(img: Image.Image) -> torch.Tensor:
    # np.array copies into a writable buffer (torch warns on PIL's read-only one); permute is a free view.
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)


def _resize_box_pil(pixels, box: tuple, out_width: int, out_height: int) -> torch.Tensor:
    """PIL's bilinear (antialiased) resize of ``box`` (fractional coordinates allowed) to a uint8 CHW tensor."""
    if isinstance(pixels, np.ndarray):
        pixels = Image.fromarray(pixels)
    return _pil_to_uint8_chw(pixels.resize((out_width, out_height), Image.BILINEAR, box=box))


class TrainTransform:
    """RandomResizedCrop(image_size, scale, ratio) + RandomHorizontalFlip(flip_p), producing uint8 CHW RGB tensors.

    The crop box is drawn on the original size with ``torchvision.transforms.RandomResizedCrop.get_params`` (same
    torch random numbers, same distribution); the flip uses ``torch.rand(1) < flip_p`` like torchvision. Only the
    decoding differs: with ``draft=True``, a JPEG whose crop shrinks by 2x or more is decoded at reduced scale.
    """

    def __init__(self, image_size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip_p: float = 0.5,
                 draft: bool = True):
        if image_size < 1:
            raise ValueError(f"TrainTransform: image_size must be a positive number of pixels, got {image_size}")
        self.image_size = int(image_size)
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        self.flip_p = flip_p
        self.draft = draft

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(image_size={self.image_size}, scale={self.scale}, ratio={self.ratio}, "
                f"flip_p={self.flip_p}, draft={self.draft})")

    def __call__(self, img: Image.Image) -> torch.Tensor:
        size = self.image_size
        top, left, height, width = RandomResizedCrop.get_params(img, self.scale, self.ratio)
        pixels, box = _decode(img, (left, top, left + width, top + height), size, size, self.draft)
        if all(float(c).is_integer() for c in box):
            # Full-scale decode: slice the crop exactly and resize it with torch's vectorised uint8 antialiased
            # bilinear kernel (same filter as PIL's to within rounding, and faster).
            left, top, right, bottom = (int(c) for c in box)
            if isinstance(pixels, np.ndarray):
                crop = torch.from_numpy(pixels)[top:bottom, left:right]
            else:
                crop = torch.from_numpy(np.array(pixels.crop((left, top, right, bottom)), dtype=np.uint8))
            crop = crop.permute(2, 0, 1).unsqueeze(0)  # HWC memory seen as NCHW: the kernel's fast layout
            out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
        else:
            # Reduced decode: the box has fractional coordinates, which PIL's resize takes exactly.
            out = _resize_box_pil(pixels, box, size, size)
        if torch.rand(1).item() < self.flip_p:
            out = out.flip(-1)
        return out


class ValTransform:
    """Resize the shorter side to ``resize_size`` then center-crop ``crop_size``, as uint8 CHW RGB tensors.

    Same pixels as torchvision's ``Resize(resize_size) + CenterCrop(crop_size)`` on PIL images (up to rare 1-level
    rounding): the center crop of the resized image is computed as one PIL resize of the corresponding box of the
    original image, without resizing the margins that the crop throws away. With
    ``draft=True``, JPEGs whose shorter side is at least twice ``resize_size`` are decoded at reduced scale, which
    stays within JPEG-decoding tolerance of the reference (checked by the tests).
    """

    def __init__(self, resize_size: int = 256, crop_size: int = 224, draft: bool = True):
        if not 0 < crop_size <= resize_size:
            raise ValueError(f"ValTransform: need 0 < crop_size <= resize_size, got crop_size={crop_size}, "
                             f"resize_size={resize_size} (check --val-crop-size and --val-resize-size)")
        self.resize_size = int(resize_size)
        self.crop_size = int(crop_size)
        self.draft = draft

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(resize_size={self.resize_size}, crop_size={self.crop_size}, "
                f"draft={self.draft})")

    def __call__(self, img: Image.Image) -> torch.Tensor:
        width, height = img.size
        # torchvision's rule for Resize(int): the shorter side becomes resize_size, the longer is truncated.
        if width <= height:
            resized_width, resized_height = self.resize_size, int(self.resize_size * height / width)
        else:
            resized_width, resized_height = int(self.resize_size * width / height), self.resize_size
        crop = self.crop_size
        # torchvision's CenterCrop offsets, then the same box expressed in original pixels.
        crop_top = int(round((resized_height - crop) / 2.0))
        crop_left = int(round((resized_width - crop) / 2.0))
        sx, sy = width / resized_width, height / resized_height
        box = (crop_left * sx, crop_top * sy, (crop_left + crop) * sx, (crop_top + crop) * sy)
        pixels, box = _decode(img, box, crop, crop, self.draft)
        # Always PIL's resize here (the reference's filter), so that full-scale decodes give the reference pixels.
        return _resize_box_pil(pixels, box, crop, crop)


class DeviceNormalize:
    """Convert a uint8 image batch to normalised floats on ``device``: ``(x / 255 - mean) / std``.

    Accepts ``[N, C, H, W]`` (or a single ``[C, H, W]``) uint8 tensors on any device; the result is on ``device``,
    in ``dtype``, channels-last when asked (for 4-D input). The arithmetic is done in float32, then cast.
    """

    def __init__(self, device, mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.channels_last = channels_last
        self.dtype = dtype
        mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        # (x / 255 - mean) / std == x * scale - shift: one multiply and one subtract, both in place.
        self.scale = (1.0 / (255.0 * std)).to(self.device)
        self.shift = (mean / std).to(self.device)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device={self.device}, channels_last={self.channels_last}, "
                f"dtype={self.dtype})")

    def __call__(self, images_uint8: torch.Tensor) -> torch.Tensor:
        if images_uint8.dtype != torch.uint8:
            raise TypeError(f"DeviceNormalize expects uint8 images (from TrainTransform/ValTransform), "
                            f"got {images_uint8.dtype}")
        images = images_uint8.to(self.device, non_blocking=True).to(torch.float32)
        images.mul_(self.scale).sub_(self.shift)
        if self.channels_last and images.dim() == 4:
            # After the float conversion: on CPU, converting and permuting in one step is 2x slower.
            images = images.contiguous(memory_format=torch.channels_last)
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
