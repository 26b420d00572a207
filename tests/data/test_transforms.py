"""Tests of dlojz_lib.data.transforms: same augmentation statistics and validation pixels as torchvision, uint8 outputs,
device normalisation and prefetching, clear errors on unreadable files.

Every image is made here with PIL (small, in tmp_path); the whole file runs in a few seconds on 2 CPU cores.
Decoding tests run three times, selected with DLOJZ_JPEG_DECODER: with libjpeg-turbo region decoding (dlojz_lib/data/jpeg.c;
skipped with the reason where it cannot be built, a failure under CI=true), with simplejpeg (when installed) and
with PIL alone.
"""

import io
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_jpeg import require_region_decoder  # noqa: E402

import dlojz_lib.data.jpeg  # noqa: E402
import dlojz_lib.data.transforms  # noqa: E402
from dlojz_lib.data.prefetch import DeviceNormalize, DevicePrefetcher  # noqa: E402
from dlojz_lib.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EncodedJpeg,  # noqa: E402
    TrainTransform,
    UnreadableImageError,
    ValTransform,
    lazy_image_loader,
    lazy_pil_loader,
)

# ----------------------------------------------------------------------------------------------------------------
# Helpers


@pytest.fixture
def decoder_env(monkeypatch):
    """``set_choice(value)``: DLOJZ_JPEG_DECODER=value as a new process would see it. dlojz_lib.data.jpeg reads the variable
    and loads its library once per process: that state is reset here, and restored after the test."""

    def set_choice(value):
        monkeypatch.setenv("DLOJZ_JPEG_DECODER", value)
        for name, fresh in (
            ("_choice", None),
            ("_library", None),
            ("_load_tried", False),
            ("_status", "not loaded yet"),
        ):
            monkeypatch.setattr(dlojz_lib.data.jpeg, name, fresh)

    return set_choice


@pytest.fixture(params=["region", "simplejpeg", "pil"])
def decoder(request, decoder_env):
    """Run a test with each JPEG decoder the module can use (the faster ones turned off for the slower ones)."""
    decoder_env("auto" if request.param == "region" else request.param)
    if request.param == "region":
        require_region_decoder()
    elif request.param == "simplejpeg" and dlojz_lib.data.transforms.simplejpeg is None:
        pytest.skip("simplejpeg is not installed")
    return request.param


class _CountingSimplejpeg:
    """Stands in for the simplejpeg module: counts the decodes asked of it, then does them with the real one when it
    is installed (else declines, as simplejpeg does on libjpeg warnings, and PIL decodes)."""

    def __init__(self, real):
        self.real, self.calls = real, 0
        self.__version__ = getattr(real, "__version__", "(test stand-in)")

    def decode_jpeg(self, data, **options):
        self.calls += 1
        if self.real is None:
            raise ValueError("simplejpeg is not installed")
        return self.real.decode_jpeg(data, **options)


@pytest.mark.parametrize("choice", ["pil", "simplejpeg"])
def test_decoder_env_var_turns_the_faster_decoders_off(tmp_path, monkeypatch, decoder_env, choice):
    # =simplejpeg: no region decoding; =pil: no region decoding and no simplejpeg either. Both in what the run
    # reports (decoder_description) and in what actually decodes.
    decoder_env(choice)
    counting = _CountingSimplejpeg(dlojz_lib.data.transforms.simplejpeg)
    monkeypatch.setattr(dlojz_lib.data.transforms, "simplejpeg", counting)
    region_calls = []
    monkeypatch.setattr(dlojz_lib.data.jpeg, "decode_region", lambda *args: region_calls.append(args))
    path = save(photo_like(200, 150), tmp_path / "a.jpg")
    assert isinstance(lazy_image_loader(path), Image.Image)  # no EncodedJpeg: that is for region decoding only
    expected = (
        reference_val(Image.open(path), 64, 56) * torch.tensor(IMAGENET_STD).view(3, 1, 1)
        + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    ) * 255
    assert_reference_pixels(ValTransform(64, 56, draft=False)(lazy_image_loader(path)).float(), expected, choice)
    assert TrainTransform(32)(lazy_image_loader(path)).shape == (3, 32, 32)
    description = dlojz_lib.data.transforms.decoder_description()
    assert not region_calls
    if choice == "pil":
        assert counting.calls == 0, "DLOJZ_JPEG_DECODER=pil, yet simplejpeg decoded"
        assert description.startswith("PIL, whole images") and "DLOJZ_JPEG_DECODER=pil" in description, description
    else:
        assert counting.calls == 2, "DLOJZ_JPEG_DECODER=simplejpeg, yet simplejpeg was not used"
        assert description.startswith("simplejpeg ") and "DLOJZ_JPEG_DECODER=simplejpeg" in description, description


def photo_like(width, height, seed=0):
    """An RGB image with photograph-like content: smooth colour regions plus fine texture and sharp edges."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(max(2, height // 40), max(2, width // 40), 3)).astype(np.uint8)
    pixels = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.float64)
    pixels += rng.normal(0, 12, size=pixels.shape)  # texture
    pixels[height // 3 : height // 2, width // 4 : width // 2] = (250, 30, 30)  # a sharp-edged object
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def save(img, path, **options):
    img.save(path, **options)
    return str(path)


def reference_val(img, resize_size=256, crop_size=224):
    """torchvision's validation transform, the reference the project's ValTransform must match."""
    transform = T.Compose(
        [T.Resize(resize_size), T.CenterCrop(crop_size), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    return transform(img.convert("RGB"))


def assert_reference_pixels(got, expected, what=""):
    """Same pixel levels (0-255) as the reference, up to rare 1-level rounding: PIL's resize of a box of the
    original computes its filter weights from slightly different floats than resize-then-crop."""
    error = (got - expected).abs()
    assert error.max() < 1.001 and (error > 0.5).float().mean() < 0.05, (
        f"{what}: max |diff| {error.max():.2f} levels, {(error > 0.5).float().mean():.2%} of values differ"
    )


def ks_statistic(a, b):
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return np.abs(
        np.searchsorted(a, grid, side="right") / len(a) - np.searchsorted(b, grid, side="right") / len(b)
    ).max()


def ks_critical(n, m, c_alpha=1.949):
    """The KS statistic two samples of the same distribution exceed with probability 0.001."""
    return c_alpha * np.sqrt((n + m) / (n * m))


# ----------------------------------------------------------------------------------------------------------------
# Train crops: same distribution as torchvision's RandomResizedCrop + RandomHorizontalFlip

GRADIENT_SIZE = (320, 240)  # the 64 px crops of such an image decode at full scale or at 1/2 (draft)
CROP_OUT = 64
DRAWS = 400


@pytest.fixture(scope="module")
def gradient_jpeg(tmp_path_factory):
    """A JPEG whose red channel encodes x and green encodes y, so that a crop's box can be read from its pixels."""
    width, height = GRADIENT_SIZE
    pixels = np.zeros((height, width, 3), dtype=np.float64)
    pixels[..., 0] = np.linspace(0, 255, width)[None, :]
    pixels[..., 1] = np.linspace(0, 255, height)[:, None]
    pixels[..., 2] = 128
    path = tmp_path_factory.mktemp("gradient") / "gradient.jpg"
    Image.fromarray(np.round(pixels).astype(np.uint8)).save(path, quality=95)
    return str(path)


def _line_fit(values):
    """Least-squares slope and intercept of ``values`` against pixel-centre positions 0.5, 1.5, ..."""
    positions = np.arange(len(values)) + 0.5
    centred = positions - positions.mean()
    slope = (centred * (values - values.mean())).sum() / (centred * centred).sum()
    return slope, values.mean() - slope * positions.mean()


def crop_geometry(out):
    """(area fraction, log aspect ratio, left fraction, top fraction, flipped) of the crop that produced ``out``,
    measured from the gradient's pixel values by a straight-line fit along each axis."""
    width, height = GRADIENT_SIZE
    size = out.shape[-1]
    columns = out[0].double().mean(0).numpy()  # red along x
    rows = out[1].double().mean(1).numpy()  # green along y
    slope_x, intercept_x = _line_fit(columns)
    slope_y, intercept_y = _line_fit(rows)
    flipped = slope_x < 0
    crop_width = abs(slope_x) * size * (width - 1) / 255
    crop_height = slope_y * size * (height - 1) / 255
    left_value = intercept_x + slope_x * size if flipped else intercept_x
    left = left_value * (width - 1) / 255
    top = intercept_y * (height - 1) / 255
    return (
        crop_width * crop_height / (width * height),
        np.log(crop_width / crop_height),
        left / (width - crop_width + 1e-9),
        top / (height - crop_height + 1e-9),
        flipped,
    )


def geometry_samples(make_output, seed):
    torch.manual_seed(seed)
    return np.array([crop_geometry(make_output()) for _ in range(DRAWS)])


@pytest.fixture(scope="module")
def reference_geometry(gradient_jpeg):
    img = Image.open(gradient_jpeg).convert("RGB")
    reference = T.Compose([T.RandomResizedCrop(CROP_OUT), T.RandomHorizontalFlip(), T.PILToTensor()])
    return geometry_samples(lambda: reference(img), seed=1)


def distribution_gaps(samples, reference):
    """KS statistics of area, log-ratio, left and top positions, and the flip-rate gap in standard errors."""
    gaps = {
        name: ks_statistic(samples[:, k], reference[:, k])
        for k, name in enumerate(["area", "log_ratio", "left", "top"])
    }
    flip_rate, reference_rate = samples[:, 4].mean(), reference[:, 4].mean()
    gaps["flip_sigma"] = abs(flip_rate - reference_rate) / np.sqrt(0.5 / DRAWS)
    return gaps


def assert_same_distribution(gaps):
    critical = ks_critical(DRAWS, DRAWS)
    for name in ["area", "log_ratio", "left", "top"]:
        assert gaps[name] < critical, f"{name}: KS statistic {gaps[name]:.3f} >= {critical:.3f}"
    assert gaps["flip_sigma"] < 4, f"flip rate differs by {gaps['flip_sigma']:.1f} standard errors"


def test_train_crops_follow_torchvision_distribution(gradient_jpeg, reference_geometry, decoder):
    transform = TrainTransform(CROP_OUT)
    samples = geometry_samples(lambda: transform(lazy_image_loader(gradient_jpeg)), seed=2)
    # Both decode paths must have been exercised: crops shrunk by 2x or more (draft) and the others.
    area = samples[:, 0] * GRADIENT_SIZE[0] * GRADIENT_SIZE[1]
    shortest_side = np.sqrt(area) * np.exp(-np.abs(samples[:, 1]) / 2)
    assert (shortest_side > 2.1 * CROP_OUT).mean() > 0.1 and (shortest_side < 1.9 * CROP_OUT).mean() > 0.1
    assert_same_distribution(distribution_gaps(samples, reference_geometry))


@pytest.mark.parametrize(
    "wrong",
    [
        dict(scale=(0.25, 1.0)),  # a narrower scale range
        dict(ratio=(0.9, 1.1)),  # nearly square crops only
    ],
)
def test_distribution_criterion_catches_a_wrong_distribution(gradient_jpeg, reference_geometry, wrong):
    # The criterion above is only worth something if it fails for an augmentation with other statistics.
    img = Image.open(gradient_jpeg).convert("RGB")
    wrong_transform = T.Compose([T.RandomResizedCrop(CROP_OUT, **wrong), T.RandomHorizontalFlip(), T.PILToTensor()])
    samples = geometry_samples(lambda: wrong_transform(img), seed=3)
    with pytest.raises(AssertionError):
        assert_same_distribution(distribution_gaps(samples, reference_geometry))


def test_train_transform_matches_torchvision_draw_for_draw(tmp_path, decoder):
    # Same seed, same random numbers: the same crop and flip as torchvision, pixel for pixel up to resampling
    # rounding (full-scale decode) or DCT-domain scaling (draft), on a JPEG and on a PNG.
    photo = photo_like(500, 375)
    for path, draft_tolerance in [
        (save(photo, tmp_path / "a.jpg", quality=92), 6.0),
        (save(photo, tmp_path / "a.png"), 0.0),
    ]:
        reference_img = Image.open(path).convert("RGB")
        for image_size, seed in [(224, 0), (224, 1), (96, 2), (96, 3), (64, 4)]:
            reference = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), T.PILToTensor()])
            torch.manual_seed(seed)
            expected = reference(reference_img).int()
            torch.manual_seed(seed)
            got = TrainTransform(image_size)(lazy_image_loader(path))
            assert got.dtype == torch.uint8 and got.shape == (3, image_size, image_size)
            difference = (got.int() - expected).abs().float().mean().item()
            torch.manual_seed(seed)
            top, left, height, width = T.RandomResizedCrop.get_params(reference_img, (0.08, 1), (3 / 4, 4 / 3))
            drafted = path.endswith(".jpg") and min(width, height) >= 2 * image_size
            limit = draft_tolerance if drafted else 0.5
            assert difference <= limit, f"{path} size {image_size} seed {seed}: mean |diff| {difference:.2f}"


# ----------------------------------------------------------------------------------------------------------------
# Validation: uint8 path + DeviceNormalize == torchvision's Resize + CenterCrop + ToTensor + Normalize


@pytest.mark.parametrize("width,height", [(500, 375), (375, 500), (256, 300), (1200, 900)])
def test_val_path_matches_reference(tmp_path, decoder, width, height):
    path = save(photo_like(width, height, seed=width), tmp_path / "val.jpg", quality=90)
    expected = reference_val(Image.open(path))
    out = ValTransform(256, 224)(lazy_image_loader(path))
    assert out.dtype == torch.uint8 and out.shape == (3, 224, 224)
    got = DeviceNormalize("cpu")(out.unsqueeze(0))[0]
    # Back to pixel levels (0-255) to state the tolerance in JPEG terms.
    level_error = ((got - expected) * torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255).abs()
    if min(width, height) >= 2 * 256:  # decoded at 1/2 scale in the DCT domain
        assert level_error.mean() < 2.0 and np.percentile(level_error.numpy(), 99) < 12
    else:  # full decode: the reference's pixels
        assert_reference_pixels(level_error, torch.zeros_like(level_error), f"{width}x{height}")


def test_val_transform_rejects_crop_larger_than_resize():
    with pytest.raises(ValueError, match="crop_size"):
        ValTransform(resize_size=200, crop_size=224)


# ----------------------------------------------------------------------------------------------------------------
# Inputs of every kind give RGB uint8 tensors


@pytest.mark.parametrize(
    "kind", ["rgb_jpeg", "gray_jpeg", "cmyk_jpeg", "progressive_jpeg", "rgba_png", "palette_png", "gray_png"]
)
def test_any_input_gives_rgb_uint8(tmp_path, decoder, kind):
    photo = photo_like(300, 220, seed=5)
    images = {
        "rgb_jpeg": (photo, "jpg", {}),
        "gray_jpeg": (photo.convert("L"), "jpg", {}),
        "cmyk_jpeg": (photo.convert("CMYK"), "jpg", {}),
        "progressive_jpeg": (photo, "jpg", {"progressive": True}),
        "rgba_png": (photo.convert("RGBA"), "png", {}),
        "palette_png": (photo.convert("P"), "png", {}),
        "gray_png": (photo.convert("L"), "png", {}),
    }
    img, extension, options = images[kind]
    path = save(img, tmp_path / f"{kind}.{extension}", **options)
    for transform, size in [(TrainTransform(48), 48), (ValTransform(64, 56), 56)]:
        out = transform(lazy_image_loader(path))
        assert out.dtype == torch.uint8 and out.shape == (3, size, size), kind
        if kind.startswith("gray"):
            assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
    # Colours are those of PIL's own conversion to RGB (the reference's pil_loader); full-scale decode to compare
    # pixels exactly (reduced decoding has its own tolerance test above).
    expected = (
        reference_val(Image.open(path), 64, 56) * torch.tensor(IMAGENET_STD).view(3, 1, 1)
        + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    ) * 255
    got = ValTransform(64, 56, draft=False)(lazy_image_loader(path)).float()
    assert_reference_pixels(got, expected, kind)


# ----------------------------------------------------------------------------------------------------------------
# Unreadable files and pickling


@pytest.mark.parametrize("loader", [lazy_image_loader, lazy_pil_loader])
def test_loader_names_non_image_and_missing_files(tmp_path, loader):
    not_an_image = tmp_path / "notes.JPEG"
    not_an_image.write_text("this is not a picture")
    with pytest.raises(UnreadableImageError, match="notes.JPEG"):
        loader(str(not_an_image))
    fake_jpeg = tmp_path / "fake.JPEG"  # starts and ends like a JPEG, but is not one
    fake_jpeg.write_bytes(b"\xff\xd8\xff" + b"garbage" * 10 + b"\xff\xd9")
    with pytest.raises(UnreadableImageError, match="fake.JPEG"):
        TrainTransform(32)(loader(str(fake_jpeg)))
    with pytest.raises(UnreadableImageError, match="missing.JPEG"):
        loader(str(tmp_path / "missing.JPEG"))
    assert issubclass(UnreadableImageError, OSError)


def test_image_loader_gives_encoded_jpegs_only_to_region_decoding(tmp_path, decoder):
    photo = photo_like(90, 70)
    jpeg, png = save(photo, tmp_path / "a.jpg"), save(photo, tmp_path / "a.png")
    cmyk = save(photo.convert("CMYK"), tmp_path / "cmyk.jpg")
    loaded = lazy_image_loader(jpeg)
    if decoder == "region":
        assert isinstance(loaded, EncodedJpeg) and loaded.size == (90, 70) and loaded.filename == jpeg
    else:
        assert isinstance(loaded, Image.Image) and loaded.size == (90, 70)
    assert isinstance(lazy_image_loader(png), Image.Image)
    assert isinstance(lazy_image_loader(cmyk), Image.Image)  # libjpeg does not convert CMYK to RGB: PIL does


def test_truncated_jpeg_is_reported_with_its_name(tmp_path, decoder):
    data = io.BytesIO()
    photo_like(300, 200).save(data, "JPEG")
    truncated = tmp_path / "truncated.JPEG"
    truncated.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    for transform in (TrainTransform(32), ValTransform(40, 32)):
        with pytest.raises(UnreadableImageError, match="truncated.JPEG"):
            transform(lazy_image_loader(str(truncated)))


def test_jpeg_with_libjpeg_warning_is_read_like_the_reference(tmp_path, decoder):
    # Stray bytes before a marker: libjpeg warns, PIL (hence the reference pipeline) reads the image anyway, and
    # so must we, whichever decoder is in use.
    data = io.BytesIO()
    photo_like(120, 90).save(data, "JPEG")
    data = data.getvalue()
    start_of_scan = data.index(b"\xff\xda")
    path = tmp_path / "stray_bytes.JPEG"
    path.write_bytes(data[:start_of_scan] + b"\x00\x00" + data[start_of_scan:])
    expected = (
        reference_val(Image.open(path), 64, 56) * torch.tensor(IMAGENET_STD).view(3, 1, 1)
        + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    ) * 255
    assert_reference_pixels(ValTransform(64, 56)(lazy_image_loader(str(path))).float(), expected, "stray bytes")
    assert TrainTransform(32)(lazy_image_loader(str(path))).shape == (3, 32, 32)


def test_everything_workers_need_is_picklable(tmp_path):
    path = save(photo_like(120, 90), tmp_path / "p.jpg")
    for obj in (lazy_image_loader, lazy_pil_loader, TrainTransform(32), ValTransform(40, 32), DeviceNormalize("cpu")):
        clone = pickle.loads(pickle.dumps(obj))
        assert type(clone) is type(obj) or clone is obj
    loader = pickle.loads(pickle.dumps(lazy_image_loader))
    out = pickle.loads(pickle.dumps(ValTransform(40, 32)))(pickle.loads(pickle.dumps(loader(path))))
    assert out.shape == (3, 32, 32)


# ----------------------------------------------------------------------------------------------------------------
# DeviceNormalize and DevicePrefetcher


def test_device_normalize_values_layout_and_dtype():
    images = torch.randint(0, 256, (4, 3, 10, 12), dtype=torch.uint8)
    original = images.clone()
    expected = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(images.float() / 255)
    got = DeviceNormalize("cpu")(images)
    # On the CPU .to(device) and .contiguous() return the input itself: the in-place arithmetic must not reach it
    # (the caller's batch, e.g. one still held by a DataLoader).
    assert torch.equal(images, original), "DeviceNormalize modified its uint8 input"
    assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-5)
    last = DeviceNormalize("cpu", channels_last=True)(images)
    assert last.is_contiguous(memory_format=torch.channels_last) and torch.allclose(last, expected, atol=1e-5)
    # A batch in channels-last memory (as stacked from HWC samples) gives the same values in the asked layout.
    nhwc = images.contiguous(memory_format=torch.channels_last)
    nhwc_original = nhwc.clone(memory_format=torch.channels_last)
    from_nhwc = DeviceNormalize("cpu")(nhwc)
    assert from_nhwc.is_contiguous() and torch.allclose(from_nhwc, expected, atol=1e-5)
    from_nhwc_last = DeviceNormalize("cpu", channels_last=True)(nhwc)
    assert from_nhwc_last.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(from_nhwc_last, expected, atol=1e-5)
    half = DeviceNormalize("cpu", dtype=torch.bfloat16)(images)
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), expected, atol=0.02)
    assert torch.equal(images, original) and torch.equal(nhwc, nhwc_original)  # inputs left untouched
    with pytest.raises(TypeError, match="uint8"):
        DeviceNormalize("cpu")(images.float())


class _Uint8Samples(torch.utils.data.Dataset):
    def __init__(self, count):
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (count, 3, 8, 8), dtype=torch.uint8, generator=generator)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], index % 3


def _prefetched_batches(device):
    dataset = _Uint8Samples(10)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    prefetcher = DevicePrefetcher(loader, device, DeviceNormalize(device))
    assert len(prefetcher) == 3
    return dataset, list(prefetcher)


def test_device_prefetcher_on_cpu_yields_normalised_batches_with_labels():
    dataset, batches = _prefetched_batches("cpu")
    assert [images.shape[0] for images, _ in batches] == [4, 4, 2]
    images = torch.cat([images for images, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    assert images.dtype == torch.float32
    expected = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(dataset.images.float() / 255)
    assert torch.allclose(images, expected, atol=1e-5)
    assert labels.tolist() == [index % 3 for index in range(10)]


def test_device_prefetcher_cuda_stream_protocol(monkeypatch):
    # No GPU here: replace the CUDA stream API by recorders and check the order of the side-stream protocol
    # (the tensors stay on the CPU). Batch k+1 must be queued on the side stream before batch k is handed out,
    # and every batch handed out must be waited for and recorded on the compute stream.
    log = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    class FakeStreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(f"enter {self.stream.name}")

        def __exit__(self, *exc):
            log.append(f"exit {self.stream.name}")

    compute, copy = FakeStream("compute"), FakeStream("copy")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: copy)
    monkeypatch.setattr(torch.cuda, "stream", FakeStreamContext)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda tensor, stream: log.append(f"record {stream.name}"), raising=False
    )

    class LoggingNormalize(DeviceNormalize):
        def __call__(self, images):
            log.append("normalize")
            return super().__call__(images)

    loader = torch.utils.data.DataLoader(_Uint8Samples(4), batch_size=2)
    prefetcher = DevicePrefetcher(loader, "cpu", LoggingNormalize("cpu"))
    for index, (images, labels) in enumerate(prefetcher._iter_cuda()):
        assert images.dtype == torch.float32 and labels.shape == (2,)
        log.append(f"use {index}")
    handout = ["compute waits copy", "record compute", "record compute"]
    queue_copy = ["enter copy", "normalize", "exit copy"]
    assert log == (["copy waits compute"] + queue_copy + handout + queue_copy + ["use 0"] + handout + ["use 1"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_prefetcher_on_cuda_matches_cpu():
    _, cpu_batches = _prefetched_batches("cpu")
    _, cuda_batches = _prefetched_batches("cuda")
    for (cpu_images, cpu_labels), (cuda_images, cuda_labels) in zip(cpu_batches, cuda_batches):
        assert cuda_images.is_cuda and cuda_labels.is_cuda
        assert torch.allclose(cuda_images.cpu(), cpu_images, atol=1e-5)
        assert torch.equal(cuda_labels.cpu(), cpu_labels)


def test_imagefolder_dataloader_batches_are_uint8(tmp_path):
    from torchvision.datasets import ImageFolder

    for class_index in range(2):
        class_dir = tmp_path / f"class{class_index}"
        class_dir.mkdir()
        for image_index in range(3):
            save(photo_like(90, 70, seed=image_index), class_dir / f"{image_index}.JPEG")
    dataset = ImageFolder(str(tmp_path), transform=TrainTransform(32), loader=lazy_image_loader)
    # forkserver: a fork of this process (torch's threads) can hang, and its shutdown waits for it
    loader = torch.utils.data.DataLoader(dataset, batch_size=6, num_workers=1, multiprocessing_context="forkserver")
    images, labels = next(iter(loader))
    assert images.dtype == torch.uint8 and images.shape == (6, 3, 32, 32)
    assert sorted(labels.tolist()) == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_very_large_image_s_warning_names_its_file(tmp_path, monkeypatch, fmt):
    """PIL's DecompressionBombWarning names no file: an image over PIL's pixel limit (here lowered to 1,000) is
    decoded with one warning naming it, through PIL (a PNG) and through the faster JPEG path alike."""
    import warnings

    from PIL import Image

    from dlojz_lib.data.transforms import lazy_image_loader, lazy_pil_loader

    path = tmp_path / f"big.{fmt.lower()}"
    Image.new("RGB", (50, 40), (200, 10, 10)).save(path, fmt)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for loader in (lazy_pil_loader, lazy_image_loader):  # (the second: libjpeg-turbo's header read, for a JPEG)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader(str(path))
        said = [str(w.message) for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
        assert len(said) == 1 and said[0].startswith(f"{path}: 50x40 = 2,000 pixels, more than PIL's limit"), said
