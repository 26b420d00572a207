"""Decode only the part of a JPEG that a crop needs, with libjpeg-turbo (``dlojz_lib/data/jpeg.c``, loaded through ctypes).

Entropy decoding is sequential, so the rows above a crop must still be read, but libjpeg-turbo can skip their
inverse DCT and colour conversion (``jpeg_skip_scanlines``), work only on the crop's columns
(``jpeg_crop_scanline``) and stop after the crop's last row; with ``reduction`` 2, 4 or 8 it also downscales in the
DCT domain. The pixels are those of a full decode by PIL (same library, same settings) cut to the region.

No Python package exposes this (simplejpeg, PyTurboJPEG 1.x and torchvision decode whole images), so the C file
ships with dlojz and is compiled on first use (``cc -O2 -shared -fPIC dlojz_lib/data/jpeg.c -ljpeg``, a second or so) into
``$XDG_CACHE_HOME/dlojz/`` (default ``~/.cache/dlojz/``), keyed by the source and the platform, written atomically
so that concurrent ranks and jobs can share it. That needs a C compiler and libjpeg-turbo's headers (Debian/Ubuntu:
``apt install gcc libjpeg-dev``; RHEL: ``libjpeg-turbo-devel``; a cluster module: ``module load libjpeg-turbo``,
which sets ``CPATH``/``LIBRARY_PATH`` for the compiler). Without them ``load()`` returns None, ``status()`` says
why, and dlojz_lib/data/transforms.py decodes whole images with simplejpeg or PIL instead (same augmentation, slower).

``DLOJZ_JPEG_DECODER`` (read here only, once per process: ``decoder_choice()``) picks the decoders:
``auto`` (default: the fastest available), ``simplejpeg`` (region decoding off, simplejpeg then PIL) or ``pil``
(region decoding and simplejpeg off: PIL only). ``CC`` picks the compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["JpegError", "UnsupportedJpeg", "decoder_choice", "load", "status", "info", "decode_region", "scaled_size"]

SOURCE = Path(__file__).with_name("jpeg.c")
_OK, _ERROR, _UNSUPPORTED = 0, 1, 2
_MESSAGE_SIZE = 200

DECODER_CHOICES = ("auto", "simplejpeg", "pil")

_choice = None
_library = None
_load_tried = False
_status = "not loaded yet"


class JpegError(ValueError):
    """Data that libjpeg cannot decode (corrupt or truncated)."""


class UnsupportedJpeg(JpegError):
    """A valid JPEG that this decoder does not handle (e.g. CMYK): decode it another way."""


def _cache_dir() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "dlojz"


def _library_path(source: bytes) -> Path:
    key = hashlib.sha256(source + sysconfig.get_platform().encode()).hexdigest()[:16]
    return _cache_dir() / f"libdlojz_jpeg-{key}.so"


class CacheNotWritable(OSError):
    """The library's cache folder cannot be written: a compiler would not help."""


def _build(target: Path, source_path: Path) -> None:
    """Compile the shared library into ``target`` atomically (temporary file in the same folder, then rename)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    except OSError as error:
        raise CacheNotWritable(f"its cache folder {target.parent} cannot be written ({error.strerror})") from None
    os.close(handle)
    compiler = os.environ.get("CC", "cc")
    try:
        # Implicit declarations are errors: an IJG libjpeg (no jpeg_crop_scanline) must fail here, not at run time.
        command = [
            compiler,
            "-O2",
            "-shared",
            "-fPIC",
            "-Werror=implicit-function-declaration",
            str(source_path),
            "-o",
            temporary,
            "-ljpeg",
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            lines = (
                [line for line in result.stderr.splitlines() if "error" in line.lower()]
                or result.stderr.splitlines()
                or ["(no output)"]
            )
            raise OSError(f"'{' '.join(command[:2])} ... -ljpeg' failed: {lines[0].strip()}")
        os.chmod(temporary, 0o755)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    int_p = ctypes.POINTER(ctypes.c_int)
    library.dlojz_jpeg_info.argtypes = [
        ctypes.c_char_p,
        ctypes.c_ulong,
        int_p,
        int_p,
        int_p,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    library.dlojz_jpeg_info.restype = ctypes.c_int
    library.dlojz_jpeg_decode_region.argtypes = [
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_long,
        int_p,
        int_p,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    library.dlojz_jpeg_decode_region.restype = ctypes.c_int
    return library


def decoder_choice() -> str:
    """``DLOJZ_JPEG_DECODER`` as one of ``DECODER_CHOICES`` ("auto" when unset or not one of them), read once per
    process: the one place that reads it, for this module and dlojz_lib/data/transforms.py alike."""
    global _choice
    if _choice is None:
        value = os.environ.get("DLOJZ_JPEG_DECODER", "auto").strip().lower()
        _choice = value if value in DECODER_CHOICES else "auto"
    return _choice


def load():
    """The compiled library (building it on first use), or None when region decoding is off or cannot be built.

    Tried once per process; ``status()`` tells the outcome in one line.
    """
    global _library, _load_tried, _status
    if _load_tried:
        return _library
    _load_tried = True
    choice = decoder_choice()
    if choice != "auto":
        _status = f"off (DLOJZ_JPEG_DECODER={choice})"
        return None
    try:
        source = SOURCE.read_bytes()
        path = _library_path(source)
        if not path.exists():
            _build(path, SOURCE)
        _library = _declare(ctypes.CDLL(str(path)))
        _status = str(path)
    except CacheNotWritable as error:
        _library = None
        _status = (
            f"unavailable ({error}); whole images are decoded instead. To enable it: set XDG_CACHE_HOME to a "
            "folder this user can write (the library is built there once, for every job)"
        )
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        _library = None
        _status = (
            f"unavailable ({error}); whole images are decoded instead. To enable it: a C compiler and "
            f"libjpeg-turbo's headers (e.g. apt install gcc libjpeg-dev, or module load libjpeg-turbo)"
        )
    return _library


def status() -> str:
    """One line: the compiled library in use, or why there is none."""
    load()
    return _status


def _check(code: int, message: ctypes.Array) -> None:
    if code == _OK:
        return
    text = message.value.decode(errors="replace") or "unknown libjpeg error"
    raise (UnsupportedJpeg if code == _UNSUPPORTED else JpegError)(text)


def info(data: bytes) -> tuple[int, int, bool]:
    """``(width, height, rgb_capable)`` of a JPEG; rgb_capable is False for colour spaces decoded elsewhere (CMYK)."""
    library = load()
    if library is None:
        raise RuntimeError(f"dlojz_jpeg: {status()}")
    width, height, rgb_capable = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    message = ctypes.create_string_buffer(_MESSAGE_SIZE)
    _check(
        library.dlojz_jpeg_info(
            data,
            len(data),
            ctypes.byref(width),
            ctypes.byref(height),
            ctypes.byref(rgb_capable),
            message,
            _MESSAGE_SIZE,
        ),
        message,
    )
    return width.value, height.value, bool(rgb_capable.value)


def scaled_size(width: int, height: int, reduction: int) -> tuple[int, int]:
    """Size of the image decoded at 1/reduction: libjpeg rounds up."""
    return -(-width // reduction), -(-height // reduction)


def decode_region(
    data: bytes, width: int, height: int, reduction: int, left: int, top: int, right: int, bottom: int
) -> np.ndarray:
    """RGB pixels ``[top:bottom, left:right]`` (HWC uint8 view) of the JPEG ``data`` decoded at 1/``reduction``.

    ``width``/``height`` are the original size (from ``info``); the region is in the coordinates of the scaled
    image (``scaled_size``). Raises ``JpegError`` for corrupt or truncated data, ``UnsupportedJpeg`` for colour
    spaces it does not convert (the caller then decodes another way).
    """
    library = load()
    if library is None:
        raise RuntimeError(f"dlojz_jpeg: {status()}")
    if reduction not in (1, 2, 4, 8):
        raise ValueError(f"reduction must be 1, 2, 4 or 8, got {reduction}")
    scaled_width, scaled_height = scaled_size(width, height, reduction)
    if not (0 <= left < right <= scaled_width and 0 <= top < bottom <= scaled_height):
        raise ValueError(f"region {(left, top, right, bottom)} is not inside the {scaled_width}x{scaled_height} image")
    # One more column on each side when there is one: with fancy upsampling, the edge columns of a cropped decode
    # lack their outer chroma neighbour and differ from a full decode. They are decoded, then left out.
    decode_left, decode_right = max(left - 1, 0), min(right + 1, scaled_width)
    # libjpeg widens the columns to whole iMCUs (at most 32 pixels at full scale, fewer when scaled).
    out = np.empty((bottom - top, decode_right - decode_left + 64, 3), dtype=np.uint8)
    decoded_left, decoded_columns = ctypes.c_int(), ctypes.c_int()
    message = ctypes.create_string_buffer(_MESSAGE_SIZE)
    _check(
        library.dlojz_jpeg_decode_region(
            data,
            len(data),
            reduction,
            decode_left,
            top,
            decode_right - decode_left,
            bottom - top,
            out.ctypes.data,
            out.strides[0],
            out.nbytes,
            ctypes.byref(decoded_left),
            ctypes.byref(decoded_columns),
            message,
            _MESSAGE_SIZE,
        ),
        message,
    )
    offset = left - decoded_left.value
    return out[:, offset : offset + (right - left)]
