"""Fast input pipeline for dlojz: decode only what the crop needs, ship uint8, normalise on the device.

The torchvision reference pipeline (``ImageFolder`` + ``RandomResizedCrop`` + ``RandomHorizontalFlip`` +
``ToTensor`` + ``Normalize``) decodes every JPEG at full size and does the float conversion and normalisation in the
DataLoader workers, so that each sample travels to the main process as 4-byte floats. This module keeps the same
augmentation statistics while doing less work per image:

* ``lazy_image_loader(path)`` reads a file without decoding it: a JPEG as its bytes and size (``EncodedJpeg``),
  anything else as a lazily opened PIL image (``lazy_pil_loader``), so that the transform can choose how to decode.
* ``TrainTransform(image_size)`` draws the crop box on the original image size with torchvision's own
  ``RandomResizedCrop.get_params`` (same random numbers, same distribution), then decodes only the region of the
  JPEG around the crop (libjpeg-turbo: rows above it skipped, columns outside it left out, rows below it never
  read; see dlojz_lib/data/jpeg.py), at 1/2, 1/4 or 1/8 scale in the DCT domain when the crop will be shrunk by 2x or more,
  resizes (bilinear with antialiasing, as torchvision does on PIL images) and flips. It returns a ``uint8`` tensor
  ``[3, image_size, image_size]`` (RGB).
* ``ValTransform(resize_size, crop_size)`` is the reference ``Resize(resize_size) + CenterCrop(crop_size)`` done as
  one resize of the matching box of the original (same pixels up to rare 1-level rounding), decoding only that box
  (at reduced scale for large images).
* JPEG decoders, fastest first, all libjpeg-turbo with the same settings (identical pixels): the region decoder of
  dlojz_lib/data/jpeg.py (compiled on first use; needs a C compiler and libjpeg headers), simplejpeg (whole image, straight
  into a packed RGB array), PIL (everything else, and CMYK or files the others refuse).
  ``DLOJZ_JPEG_DECODER=simplejpeg`` turns region decoding off, ``DLOJZ_JPEG_DECODER=pil`` turns both faster
  decoders off (read by ``dlojz_lib.data.jpeg.decoder_choice()``).
* The policies of dlojz's flags after ``TrainTransform`` (``--randaugment``, ``--trivialaugment``, ...) and
  MixUp/CutMix on the device batch are dlojz_lib/data/augment.py's.
* The batches are normalised on the device, and prefetched there on a GPU, by dlojz_lib/data/prefetch.py.

Typical use (the DataLoader's default collate stacks the uint8 samples)::

    train_set = torchvision.datasets.ImageFolder(root, transform=TrainTransform(224), loader=lazy_image_loader)
    loader = torch.utils.data.DataLoader(train_set, batch_size=128, num_workers=8, pin_memory=True)
    for images, labels in loader:  # uint8 [128, 3, 224, 224]
        ...

Unreadable files raise ``UnreadableImageError`` (an ``OSError``) whose message starts with the file name.
Everything here is picklable, as DataLoader workers started with ``spawn`` or ``forkserver`` require.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import RandomResizedCrop

import dlojz_lib.data.jpeg

try:  # optional, faster JPEG decoder (same libjpeg-turbo pixels as PIL); PIL is used when it is absent
    import simplejpeg
except ImportError:
    simplejpeg = None

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "UnreadableImageError",
    "decoder_description",
    "EncodedJpeg",
    "lazy_image_loader",
    "open_regular",
    "image_from_bytes",
    "lazy_pil_loader",
    "TrainTransform",
    "ValTransform",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Errors PIL raises on files that are not images, truncated or corrupt, or too large to be safe.
_PIL_READ_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def _simplejpeg():
    """The simplejpeg module when it is installed and allowed (not ``DLOJZ_JPEG_DECODER=pil``), else None."""
    return simplejpeg if simplejpeg is not None and dlojz_lib.data.jpeg.decoder_choice() != "pil" else None


def decoder_description() -> str:
    """One line for reports: which JPEG decoder the transforms use, and why not a faster one."""
    if dlojz_lib.data.jpeg.load() is not None:
        return f"region decoding with libjpeg-turbo ({dlojz_lib.data.jpeg.status()})"
    if _simplejpeg() is not None:
        return f"simplejpeg {simplejpeg.__version__}, whole images (region decoding {dlojz_lib.data.jpeg.status()})"
    if dlojz_lib.data.jpeg.decoder_choice() == "pil":
        return "PIL, whole images (DLOJZ_JPEG_DECODER=pil: region decoding and simplejpeg off)"
    return f"PIL, whole images (simplejpeg not installed; region decoding {dlojz_lib.data.jpeg.status()})"


class UnreadableImageError(OSError):
    """A file that cannot be opened or decoded as an image; the message starts with its path."""


def _image_name(img: Image.Image) -> str:
    return getattr(img, "filename", "") or "<in-memory image>"


class EncodedJpeg:
    """A JPEG file read into memory but not decoded: the transforms decode only the region their crop needs.

    ``size`` is ``(width, height)`` as PIL gives it; ``filename`` names the file in messages.
    """

    __slots__ = ("filename", "data", "size")

    def __init__(self, filename: str, data: bytes, size: tuple):
        self.filename, self.data, self.size = filename, data, size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.filename!r}, {len(self.data)} bytes, size={self.size})"

    def close(self) -> None:
        """Nothing to release (the file is already closed); here so that callers treat both kinds alike."""


def open_regular(path: str):
    """``path`` opened for reading if it is a regular file (or a link to one). A named pipe, a device or a socket
    with an image's name would block its reader forever or never end: refused with an OSError, never waited on
    (the open itself does not block: O_NONBLOCK)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (a named pipe, device or socket)", path)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def lazy_image_loader(path: str):
    """The DataLoader's loader: a file ready for the transforms, not decoded yet, as ``image_from_bytes`` makes its
    bytes: with libjpeg-turbo region decoding available (dlojz_lib/data/jpeg.py), a JPEG in an RGB-decodable colour space
    comes back as an ``EncodedJpeg`` (its bytes and size, read without PIL's header parsing); anything else (PNG,
    CMYK, a file libjpeg rejects) as a lazily opened PIL image. The file is read once, whole. Raises
    ``UnreadableImageError`` naming the file if it is missing, not a regular file, or not an image.
    """
    return image_from_bytes(path, _read_image_file(path))


def _read_image_file(path: str) -> bytes:
    try:
        with open_regular(path) as file:
            return file.read()
    except OSError as error:
        raise UnreadableImageError(f"{path}: cannot be read as an image ({error})") from error


def image_from_bytes(name: str, data: bytes):
    """A sample's bytes (a file's, or from a packed shard, dlojz_pack.py) made ready for the transforms: an
    ``EncodedJpeg`` for region decoding, else a lazily opened PIL image. ``name`` (the file's path, or e.g.
    ``train-000003.tar:n01440764_10026``) stands for the sample in messages."""
    if dlojz_lib.data.jpeg.load() is not None and _complete_jpeg(data):
        try:
            width, height, rgb_decodable = dlojz_lib.data.jpeg.info(data)
        except dlojz_lib.data.jpeg.JpegError:
            rgb_decodable = False
        if rgb_decodable:
            limit = Image.MAX_IMAGE_PIXELS  # PIL's decompression-bomb limit: the same images refused either way
            if limit and width * height > 2 * limit:
                raise UnreadableImageError(
                    f"{name}: {width}x{height} pixels in its header, more than PIL decodes ({2 * limit:,}): a "
                    "decompression bomb, or a damaged header"
                )
            if limit and width * height > limit:
                warn_of_a_large_image(name, width, height)
            return EncodedJpeg(name, data, (width, height))
    return _pil_from_bytes(name, data)


def warn_of_a_large_image(name: str, width: int, height: int) -> None:
    """PIL's DecompressionBombWarning, naming the file (PIL's own names none): an image of more pixels than PIL's
    limit, decoded all the same, at that much memory."""
    warnings.warn(
        f"{name}: {width}x{height} = {width * height:,} pixels, more than PIL's limit of {Image.MAX_IMAGE_PIXELS:,} "
        "(a decompression bomb, or a very large photo): decoded, at that much memory",
        Image.DecompressionBombWarning,
        stacklevel=3,
    )


def _pil_from_bytes(name: str, data: bytes) -> Image.Image:
    large = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                img = Image.open(io.BytesIO(data))
            except Image.DecompressionBombWarning:  # (raised, to name the file): opened again, quietly
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img, large = Image.open(io.BytesIO(data)), True
    except _PIL_READ_ERRORS as error:
        raise UnreadableImageError(f"{name}: cannot be read as an image ({error})") from error
    if large:
        warn_of_a_large_image(name, *img.size)
    img.filename = name  # names the sample in messages; its bytes stay in img.fp for the faster decoders
    return img


def _complete_jpeg(data: bytes) -> bool:
    """A JPEG from its start-of-image to its end-of-image marker. Region decoding stops after the crop's rows, so it
    would not notice a truncated file that PIL (hence the reference pipeline) refuses: such files, and those with
    bytes after the end marker, are left to PIL, which reads them or reports them."""
    return data[:3] == b"\xff\xd8\xff" and data[-2:] == b"\xff\xd9"


def lazy_pil_loader(path: str) -> Image.Image:
    """Open ``path`` as a PIL image without decoding its pixels.

    Decoding is left to the transform, which can then ask for a reduced-size decode (JPEG draft mode). The file is
    read whole and closed here (the pixels decode from memory, as a packed shard's). Raises ``UnreadableImageError``
    naming the file if it is missing, not a regular file, or not an image that PIL recognises.
    """
    return _pil_from_bytes(path, _read_image_file(path))


def _reduction_for_crop(box: tuple, out_width: int, out_height: int) -> int:
    """1, 2, 4 or 8: the DCT-domain reduction that keeps the crop ``box`` at least as large as the output."""
    shrink = min((box[2] - box[0]) / out_width, (box[3] - box[1]) / out_height)
    return 8 if shrink >= 8 else 4 if shrink >= 4 else 2 if shrink >= 2 else 1


def _scale_box(box: tuple, fx: float, fy: float) -> tuple:
    return (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)


def _snap_box(box: tuple, width: int, height: int) -> tuple:
    """``box`` with each edge rounded to the nearest pixel of a ``width`` x ``height`` image (at least 1 pixel)."""
    left, right = min(max(round(box[0]), 0), width - 1), min(max(round(box[2]), 1), width)
    top, bottom = min(max(round(box[1]), 0), height - 1), min(max(round(box[3]), 1), height)
    return left, top, max(right, left + 1), max(bottom, top + 1)


def _jpeg_file_bytes(img: Image.Image) -> bytes | None:
    """The raw bytes of ``img`` when a faster decoder than PIL can take it: a JPEG opened by path and not decoded
    yet (so the file is ours to read and close), in YCbCr/RGB or grayscale (CMYK and other rare colour spaces stay
    with PIL, which converts them correctly); else None."""
    if (
        img.format != "JPEG"
        or img.mode not in ("RGB", "L")
        or not getattr(img, "filename", None)
        or getattr(img, "fp", None) is None
        or not img.tile
        or (_simplejpeg() is None and dlojz_lib.data.jpeg.load() is None)
    ):
        return None
    img.fp.seek(0)
    return img.fp.read()


def _decode_region(data: bytes, size: tuple, box: tuple, reduction: int, out_width: int, out_height: int, snap: bool):
    """libjpeg-turbo decode of the part of the image around ``box`` that a resize of ``box`` to the output size
    reads (see dlojz_lib/data/jpeg.py), at 1/reduction; with ``snap``, of the box rounded to whole decoded pixels. Returns
    ``(pixels, box)`` with ``box`` in the region's coordinates, or None when the file is left to the other
    decoders (which then decode it or report it)."""
    width, height = size
    left, top, right, bottom = _scale_box(box, 1 / reduction, 1 / reduction)
    scaled_width, scaled_height = dlojz_lib.data.jpeg.scaled_size(width, height, reduction)
    if snap:
        left, top, right, bottom = _snap_box((left, top, right, bottom), scaled_width, scaled_height)
    # PIL's antialiased resize of a box reads up to (shrink factor x filter support) pixels beyond it; an integral
    # box is sliced exactly by the caller, so it needs none.
    integral = all(float(c).is_integer() for c in (left, top, right, bottom))
    margin_x = 0 if integral else int(np.ceil((right - left) / out_width)) + 2
    margin_y = 0 if integral else int(np.ceil((bottom - top) / out_height)) + 2
    region_left = max(int(np.floor(left)) - margin_x, 0)
    region_top = max(int(np.floor(top)) - margin_y, 0)
    region_right = min(int(np.ceil(right)) + margin_x, scaled_width)
    region_bottom = min(int(np.ceil(bottom)) + margin_y, scaled_height)
    try:
        pixels = dlojz_lib.data.jpeg.decode_region(
            data, width, height, reduction, region_left, region_top, region_right, region_bottom
        )
    except dlojz_lib.data.jpeg.JpegError:
        return None  # corrupt, truncated or unsupported: PIL decides, as in the reference pipeline
    return pixels, (left - region_left, top - region_top, right - region_left, bottom - region_top)


def _size_only(img):
    """What ``RandomResizedCrop.get_params`` may read: a PIL image as it is, an ``EncodedJpeg`` as an empty tensor
    view of its shape (no memory behind it)."""
    if isinstance(img, EncodedJpeg):
        width, height = img.size
        return torch.empty((), dtype=torch.uint8).expand(3, height, width)
    return img


def _decode(img, box: tuple, out_width: int, out_height: int, draft: bool, snap: bool = False):
    """Decode ``img`` to RGB, at reduced scale when ``draft`` and the crop ``box`` allow it.

    Returns ``(pixels, box)``: pixels as an HWC uint8 ndarray (libjpeg-turbo region decode or simplejpeg) or an RGB
    PIL image, and ``box`` (left, top, right, bottom) mapped into them, rounded to whole pixels with ``snap``.
    libjpeg-turbo does the reduction in the DCT domain (1/2, 1/4, 1/8), skipping most of the inverse DCT and colour
    conversion work. The three decoders give identical pixels (same libjpeg-turbo, same settings); the region
    decoder only decodes around the box, simplejpeg decodes the whole image straight into a packed RGB array, PIL
    is the slowest and handles every format.
    """
    reduction = _reduction_for_crop(box, out_width, out_height) if draft else 1
    width, height = img.size
    if isinstance(img, EncodedJpeg):
        decoded = _decode_region(img.data, img.size, box, reduction, out_width, out_height, snap)
        if decoded is not None:
            return decoded
        img = _pil_from_bytes(img.filename, img.data)  # libjpeg refused it: PIL decodes it, or names it as unreadable
        data = None
    else:
        data = _jpeg_file_bytes(img)
        if data is not None and dlojz_lib.data.jpeg.load() is not None and _complete_jpeg(data):
            decoded = _decode_region(data, img.size, box, reduction, out_width, out_height, snap)
            if decoded is not None:
                img.close()
                return decoded
    fast_whole_decoder = _simplejpeg()
    if data is not None and fast_whole_decoder is not None:
        try:
            # Asking for at least ceil(size / reduction) selects libjpeg-turbo's 1/reduction scaling factor.
            pixels = fast_whole_decoder.decode_jpeg(
                data, colorspace="RGB", min_height=-(-height // reduction), min_width=-(-width // reduction)
            )
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
            return pixels, (_snap_box(box, decoded_width, decoded_height) if snap else box)
    if data is not None:
        img.fp.seek(0)
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
    if snap:
        box = _snap_box(box, *img.size)
    return as_rgb(img), box


def as_rgb(img: Image.Image) -> Image.Image:
    """The image in 8-bit RGB. PIL's own conversion clips 16- and 32-bit grey levels at 255 (a 16-bit PNG comes out
    almost white): those are scaled to 0-255 first."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        levels = np.asarray(img).astype(np.float64)
        top = 65535 if img.mode.startswith("I;16") or levels.max(initial=0) <= 65535 else 2**32 - 1
        img = Image.fromarray(np.clip(np.rint(levels * (255 / top)), 0, 255).astype(np.uint8), "L")
    return img.convert("RGB")


def _pil_to_uint8_chw(img: Image.Image) -> torch.Tensor:
    # np.array copies into a writable buffer (torch warns on PIL's read-only one); permute is a free view.
    return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)


RESAMPLE = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}  # --val-interpolation's PIL filters


def _resize_box_pil(pixels, box: tuple, out_width: int, out_height: int, resample=Image.BILINEAR) -> torch.Tensor:
    """PIL's (antialiased) resize of ``box`` (fractional coordinates allowed) to a uint8 CHW tensor: bilinear, or
    the filter given."""
    if isinstance(pixels, np.ndarray):
        pixels = Image.fromarray(pixels)
    return _pil_to_uint8_chw(pixels.resize((out_width, out_height), resample, box=box))


class TrainTransform:
    """RandomResizedCrop(image_size, scale, ratio) + RandomHorizontalFlip(flip_p), producing uint8 CHW RGB tensors.

    The crop box is drawn on the original size with ``torchvision.transforms.RandomResizedCrop.get_params`` (same
    torch random numbers, same distribution); the flip uses ``torch.rand(1) < flip_p`` like torchvision. Only the
    decoding differs: with ``draft=True``, a JPEG whose crop shrinks by 2x or more is decoded at 1/2, 1/4 or 1/8
    scale, and the box is rounded to whole decoded pixels (each edge moves by less than half an output pixel) so
    that torch's fast uint8 resize can take it.
    """

    def __init__(
        self, image_size: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip_p: float = 0.5, draft: bool = True
    ):
        if image_size < 1:
            raise ValueError(f"TrainTransform: image_size must be a positive number of pixels, got {image_size}")
        self.image_size = int(image_size)
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        self.flip_p = flip_p
        self.draft = draft

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(image_size={self.image_size}, scale={self.scale}, ratio={self.ratio}, "
            f"flip_p={self.flip_p}, draft={self.draft})"
        )

    def __call__(self, img: Image.Image) -> torch.Tensor:
        size = self.image_size
        top, left, height, width = RandomResizedCrop.get_params(_size_only(img), self.scale, self.ratio)
        pixels, box = _decode(img, (left, top, left + width, top + height), size, size, self.draft, snap=True)
        # Slice the crop (whole pixels) and resize it with torch's vectorised uint8 antialiased bilinear kernel:
        # the same filter as PIL's to within rounding, and 2-3x faster.
        left, top, right, bottom = box
        if isinstance(pixels, np.ndarray):
            crop = torch.from_numpy(pixels)[top:bottom, left:right]
        else:
            crop = torch.from_numpy(np.array(pixels.crop((left, top, right, bottom)), dtype=np.uint8))
        crop = crop.permute(2, 0, 1).unsqueeze(0)  # HWC memory seen as NCHW: the kernel's fast layout
        out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
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

    def __init__(self, resize_size: int = 256, crop_size: int = 224, draft: bool = True, interpolation="bilinear"):
        if not 0 < crop_size <= resize_size:
            raise ValueError(
                f"ValTransform: need 0 < crop_size <= resize_size, got crop_size={crop_size}, "
                f"resize_size={resize_size} (check --val-crop-size and --val-resize-size)"
            )
        self.resize_size = int(resize_size)
        self.crop_size = int(crop_size)
        self.draft = draft
        self.interpolation = interpolation  # --val-interpolation: PIL's bilinear (torchvision's) or bicubic (timm's)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(resize_size={self.resize_size}, crop_size={self.crop_size}, draft={self.draft}, "
            f"interpolation={self.interpolation})"
        )

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
        return _resize_box_pil(pixels, box, crop, crop, RESAMPLE[self.interpolation])
