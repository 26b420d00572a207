"""The embedded data set: small real JPEGs in ImageFolder layout whose classes a model can learn (coloured shapes on
noise), generated once into the cache folder. dlojz.py trains on it when no data is given; the tests and benches
make their own sets with `make_embedded_dataset`.
"""

import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from dlojz_lib.checks import DataError
from dlojz_lib.data.datasets import default_cache_dir

EMBEDDED_CLASSES = (
    "disc",
    "square",
    "triangle",
    "h_stripes",
    "v_stripes",
    "checker",
    "ring",
    "cross",
    "diagonal",
    "dots",
)


CLASS_COLOURS = (
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
    (128, 0, 0),
    (0, 0, 128),
)


def _draw_sample(cls, rng, size):
    """One image of class `cls`: a coloured shape/texture at a random place, size and colour on a noisy background."""
    w, h = size
    # Each class has its own hue (learnable in a few hundred steps) and its own shape (learnable later);
    # backgrounds are grey-ish so that the hue stands out.
    grey = rng.randint(20, 235)
    bg = tuple(min(255, max(0, grey + rng.randint(-25, 25))) for _ in range(3))
    fg = tuple(min(255, max(0, c + rng.randint(-30, 30))) for c in CLASS_COLOURS[EMBEDDED_CLASSES.index(cls)])
    img = Image.new("RGB", size, bg)
    d = ImageDraw.Draw(img)
    s = rng.randint(min(w, h) // 2, min(w, h) * 9 // 10)
    x0, y0 = rng.randint(0, w - s), rng.randint(0, h - s)
    box = (x0, y0, x0 + s, y0 + s)
    step = max(3, s // rng.randint(4, 7))
    if cls == "disc":
        d.ellipse(box, fill=fg)
    elif cls == "square":
        d.rectangle(box, fill=fg)
    elif cls == "triangle":
        d.polygon([(x0, y0 + s), (x0 + s // 2, y0), (x0 + s, y0 + s)], fill=fg)
    elif cls == "h_stripes":
        for y in range(y0, y0 + s, 2 * step):
            d.rectangle((x0, y, x0 + s, y + step - 1), fill=fg)
    elif cls == "v_stripes":
        for x in range(x0, x0 + s, 2 * step):
            d.rectangle((x, y0, x + step - 1, y0 + s), fill=fg)
    elif cls == "checker":
        for i, y in enumerate(range(y0, y0 + s, step)):
            for j, x in enumerate(range(x0, x0 + s, step)):
                if (i + j) % 2 == 0:
                    d.rectangle((x, y, x + step - 1, y + step - 1), fill=fg)
    elif cls == "ring":
        d.ellipse(box, outline=fg, width=max(2, s // 8))
    elif cls == "cross":
        t = max(2, s // 6)
        d.rectangle((x0 + s // 2 - t, y0, x0 + s // 2 + t, y0 + s), fill=fg)
        d.rectangle((x0, y0 + s // 2 - t, x0 + s, y0 + s // 2 + t), fill=fg)
    elif cls == "diagonal":
        d.line((x0, y0, x0 + s, y0 + s), fill=fg, width=max(2, s // 6))
    elif cls == "dots":
        for y in range(y0, y0 + s, step):
            for x in range(x0, x0 + s, step):
                d.ellipse((x, y, x + step // 2, y + step // 2), fill=fg)
    # sensor-like noise so that JPEG files differ and the task is not trivial
    noise = Image.effect_noise(size, rng.randint(10, 30)).convert("RGB")
    return Image.blend(img, noise, 0.15)


def make_embedded_dataset(root, n_classes=10, train_per_class=120, val_per_class=25, size=(96, 80), seed=0, grain=0.0):
    """Write an ImageFolder-layout JPEG data set into `root` (once: a `.complete` marker makes it reusable).
    `grain` (0-1): more sensor noise blended in, for files of a photograph's weight (0.6 at 500x375, quality 90:
    ~110 KB, ImageNet's mean; 0: ~35 KB)."""
    root = Path(root)
    if (root / ".complete").exists():
        return root
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    rng = random.Random(seed)
    try:
        for split, per_class in (("train", train_per_class), ("val", val_per_class)):
            for cls in EMBEDDED_CLASSES[:n_classes]:
                folder = tmp / split / cls
                folder.mkdir(parents=True, exist_ok=True)
                for k in range(per_class):
                    image = _draw_sample(cls, rng, size)
                    if grain:
                        image = Image.blend(image, Image.effect_noise(size, 60).convert("RGB"), grain)
                    image.save(folder / f"{cls}_{k:04d}.JPEG", quality=90)
        (tmp / ".complete").write_text("dlojz embedded data set\n")
    except OSError as err:
        raise DataError(
            f"the embedded data set cannot be written into {root.parent} ({err.strerror}): set XDG_CACHE_HOME to a "
            "folder you can write, or give --data-root"
        ) from None
    try:
        os.replace(tmp, root)  # atomic: concurrent ranks/jobs never see a half-written folder
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return root


EMBEDDED_NAME = "embedded-v3"  # bump when the generator changes: old caches are then left alone


def embedded_dataset_root():
    return make_embedded_dataset(default_cache_dir() / EMBEDDED_NAME)
