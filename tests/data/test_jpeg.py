"""Tests of dlojz_lib.data.jpeg: region decoding gives the pixels of a full decode, errors are clear, the build falls back.

Every JPEG is made here with PIL. The comparisons are exact (0 levels): the region decoder and PIL/simplejpeg run
the same libjpeg-turbo algorithms (accurate integer IDCT, fancy upsampling). Tests that need the compiled decoder
skip, with the reason, where it cannot be built, except under CI=true, where that is a failure (CI installs gcc and
libjpeg-dev so that the fast path is the one tested).
"""

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import dlojz_lib.data.jpeg  # noqa: E402


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_region_decoder():
    """Skip the calling test when the region decoder cannot be built here, with the reason; fail instead under
    CI=true, where a missing decoder would otherwise leave the fast path untested without anyone noticing."""
    if dlojz_lib.data.jpeg.load() is None:
        reason = f"region decoding: {dlojz_lib.data.jpeg.status()}"
        if in_ci():
            pytest.fail(f"{reason} (CI=true: the region decoder must be built and tested)", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def needs_library():
    require_region_decoder()


def photo_jpeg(width, height, seed=0, mode="RGB", **options):
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(max(2, height // 16), max(2, width // 16), 3)).astype(np.uint8)
    pixels = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.float64)
    pixels += rng.normal(0, 20, size=pixels.shape)  # texture, so that every block has AC coefficients
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode)
    buffer = io.BytesIO()
    img.save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def full_decode(data, reduction):
    """PIL's decode of the whole image at 1/reduction (libjpeg's DCT scaling, through draft mode)."""
    img = Image.open(io.BytesIO(data))
    width, height = img.size
    if reduction > 1:
        img.draft("RGB", (width // reduction, height // reduction))
    assert img.size == dlojz_lib.data.jpeg.scaled_size(width, height, reduction)
    return np.asarray(img.convert("RGB"))


KINDS = {
    "4:2:0": dict(subsampling=2),
    "4:2:2": dict(subsampling=1),
    "4:4:4": dict(subsampling=0),
    "progressive": dict(progressive=True),
    "grayscale": dict(mode="L"),
}


@pytest.mark.usefixtures("needs_library")
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("width,height", [(500, 375), (97, 61)])
def test_region_has_the_pixels_of_a_full_decode(kind, width, height):
    options = dict(KINDS[kind])
    data = photo_jpeg(width, height, seed=width, mode=options.pop("mode", "RGB"), **options)
    assert dlojz_lib.data.jpeg.info(data) == (width, height, True)
    rng = np.random.default_rng(0)
    for reduction in (1, 2, 4, 8):
        full = full_decode(data, reduction)
        scaled_height, scaled_width = full.shape[:2]
        regions = [
            (0, 0, scaled_width, scaled_height),
            (0, 0, 1, 1),
            (scaled_width - 1, scaled_height - 1, scaled_width, scaled_height),
        ]
        for _ in range(12):  # random regions, with edges on and off the iMCU grid
            left, top = int(rng.integers(0, scaled_width)), int(rng.integers(0, scaled_height))
            right = int(rng.integers(left + 1, scaled_width + 1))
            bottom = int(rng.integers(top + 1, scaled_height + 1))
            regions.append((left, top, right, bottom))
        if scaled_width > 40 and scaled_height > 40:
            regions.append((16, 16, 32, 32))  # edges exactly on iMCU boundaries, where upsampling needs care
        for left, top, right, bottom in regions:
            region = dlojz_lib.data.jpeg.decode_region(data, width, height, reduction, left, top, right, bottom)
            assert region.shape == (bottom - top, right - left, 3) and region.dtype == np.uint8
            difference = np.abs(region.astype(int) - full[top:bottom, left:right].astype(int))
            assert difference.max() == 0, (
                f"{kind} {width}x{height} 1/{reduction} region "
                f"{(left, top, right, bottom)}: {difference.max()} levels off"
            )


@pytest.mark.usefixtures("needs_library")
def test_corrupt_truncated_and_unsupported_data_raise_clear_errors():
    data = photo_jpeg(200, 160)
    with pytest.raises(dlojz_lib.data.jpeg.JpegError, match="Not a JPEG"):
        dlojz_lib.data.jpeg.info(b"this is not a picture at all")
    truncated = data[: len(data) // 2]
    with pytest.raises(dlojz_lib.data.jpeg.JpegError, match="[Pp]remature end"):
        dlojz_lib.data.jpeg.decode_region(truncated, 200, 160, 1, 0, 120, 200, 160)  # rows past the end of the data
    # Rows before the cut decode: the region decoder never reads further than its region (the transforms check
    # that a file is complete before using it, so that it reads the files the reference pipeline reads).
    top_rows = dlojz_lib.data.jpeg.decode_region(truncated, 200, 160, 1, 0, 0, 200, 16)
    assert np.array_equal(top_rows, full_decode(data, 1)[:16])
    cmyk = photo_jpeg(64, 48, mode="CMYK")
    assert dlojz_lib.data.jpeg.info(cmyk)[2] is False
    with pytest.raises(dlojz_lib.data.jpeg.UnsupportedJpeg):
        dlojz_lib.data.jpeg.decode_region(cmyk, 64, 48, 1, 0, 0, 64, 48)
    for bad_region, bad_reduction in [((0, 0, 201, 10), 1), ((5, 5, 5, 10), 1), ((0, 0, 30, 30), 8), ((0, 0, 8, 8), 3)]:
        with pytest.raises(ValueError):
            dlojz_lib.data.jpeg.decode_region(data, 200, 160, bad_reduction, *bad_region)


def _status_in_subprocess(tmp_path, **env):
    """dlojz_lib.data.jpeg's status and whether it loaded, in a fresh interpreter with a private cache and ``env``."""
    code = "import dlojz_lib.data.jpeg; loaded = dlojz_lib.data.jpeg.load() is not None; print(loaded); print(dlojz_lib.data.jpeg.status())"
    environment = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    environment.pop("DLOJZ_JPEG_DECODER", None)
    environment.update(env)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded, status = result.stdout.splitlines()[:2]
    return loaded == "True", status


def test_a_failed_build_leaves_a_reason_and_no_library(tmp_path):
    loaded, status = _status_in_subprocess(tmp_path, CC="false")
    assert not loaded
    assert status.startswith("unavailable") and "C compiler" in status and "libjpeg" in status
    assert not list((tmp_path / "cache" / "dlojz").glob("*.so")) and not list((tmp_path / "cache").rglob("*.tmp"))


@pytest.mark.parametrize("choice", ["simplejpeg", "pil", " PIL "])
def test_region_decoding_can_be_turned_off(tmp_path, choice):
    loaded, status = _status_in_subprocess(tmp_path, DLOJZ_JPEG_DECODER=choice)
    assert not loaded and status == f"off (DLOJZ_JPEG_DECODER={choice.strip().lower()})"
    assert not (tmp_path / "cache" / "dlojz").exists()  # nothing compiled


@pytest.mark.usefixtures("needs_library")
def test_concurrent_first_builds_share_one_library(tmp_path):
    # Ranks of a job start together and may all find no library: each builds aside and renames into place.
    code = "import dlojz_lib.data.jpeg; assert dlojz_lib.data.jpeg.load() is not None, dlojz_lib.data.jpeg.status(); print(dlojz_lib.data.jpeg.status())"
    environment = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    environment.pop("DLOJZ_JPEG_DECODER", None)
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), [error for _, error in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    libraries = list((tmp_path / "cache" / "dlojz").iterdir())
    assert [p.name for p in libraries] == [Path(paths.pop()).name]


def test_region_decoding_is_built_in_ci():
    # CI installs a C compiler and libjpeg's headers (.ci/run): there the fast path must be the one tested.
    if not in_ci():
        pytest.skip("only asserted under CI=true")
    assert dlojz_lib.data.jpeg.load() is not None, dlojz_lib.data.jpeg.status()


@pytest.mark.parametrize("ci", ["true", None])
def test_a_missing_region_decoder_fails_in_ci_and_skips_elsewhere(monkeypatch, ci):
    monkeypatch.setattr(dlojz_lib.data.jpeg, "load", lambda: None)
    monkeypatch.setattr(dlojz_lib.data.jpeg, "status", lambda: "unavailable (no C compiler here)")
    if ci:
        monkeypatch.setenv("CI", ci)
    else:
        monkeypatch.delenv("CI", raising=False)
    # Both outcomes are BaseExceptions: catch either, so that a skip where a failure is due fails this test.
    with pytest.raises(BaseException, match="no C compiler here") as outcome:
        require_region_decoder()
    assert outcome.type is (pytest.fail.Exception if ci else pytest.skip.Exception)
