"""An augmentation's error is the augmentation's, never the image's: only what does not decode is skipped as
unreadable (dlojz_lib.data.augment.CropThenPolicies), and timm's AutoAugment draws of Posterize with 0 bits, which
Pillow 10+ refuses, give the black image the Pillow timm was written for gave."""

import random

import pytest
import torch
from PIL import Image

from dlojz_lib.data import datasets
from dlojz_lib.data.augment import AugmentationError, CropThenPolicies, TimmAugment
from dlojz_lib.data.transforms import TrainTransform, lazy_image_loader


class Refuses:
    """A policy that fails as timm's Posterize did: a ValueError, which the data sets take for a bad file."""

    def __call__(self, image):
        raise ValueError("bits must be between or equal to 1 and 8")

    def __repr__(self):
        return "Refuses()"


def test_a_policy_s_error_names_the_policy_and_skips_no_image(tiny_data, monkeypatch):
    skipped = set()
    monkeypatch.setattr(datasets, "SKIPPED", skipped)
    transform = CropThenPolicies([TrainTransform(32), Refuses()])
    train_set = datasets.SafeImageFolder(str(tiny_data / "train"), transform=transform, loader=lazy_image_loader)
    with pytest.raises(
        AugmentationError, match=r"the augmentation Refuses\(\) failed on a readable image \(ValueError"
    ):
        train_set[(0, 0)]
    assert not skipped, "a readable image was taken for an unreadable one"


def test_a_file_that_does_not_decode_is_still_skipped(tiny_data, tmp_path, monkeypatch, capsys):
    import shutil

    root = tmp_path / "train"
    shutil.copytree(tiny_data / "train", root)
    broken = sorted(root.rglob("*.JPEG"))[0]
    broken.write_bytes(b"not an image")
    monkeypatch.setattr(datasets, "SKIPPED", set())
    transform = CropThenPolicies([TrainTransform(32), lambda image: image])
    train_set = datasets.SafeImageFolder(str(root), transform=transform, loader=lazy_image_loader)
    index = [path for path, _ in train_set.samples].index(str(broken))
    image, _ = train_set[(0, index)]  # the next readable one instead
    assert image.shape == (3, 32, 32) and "skipping unreadable image" in capsys.readouterr().err


def test_timm_s_autoaugment_posterizes_to_zero_bits_as_the_pillow_it_was_written_for():
    """v0 draws Posterize with 0 bits kept on some images: Pillow 10+ raises, which the data sets took for an
    unreadable file; the old Pillow's black image instead, on every draw."""
    from timm.data import auto_augment

    policy = TimmAugment("v0", 32)
    image = (torch.rand(3, 32, 32) * 255).to(torch.uint8)
    zero_bits = 0
    for seed in range(300):
        random.seed(seed)
        policy(image)  # never raises
    for chain in policy.transform.policy:  # the draws of 0 bits this policy can make
        for op in chain:
            if op.name.startswith("Posterize"):
                bits = op.level_fn(op.magnitude, op.hparams)[0] if op.level_fn else None
                zero_bits += bits == 0
                if bits == 0:
                    black = op.aug_fn(Image.new("RGB", (4, 4), (200, 100, 50)), 0)
                    assert black.getpixel((0, 0)) == (0, 0, 0)
                    with pytest.raises(ValueError, match="bits must be"):  # what Pillow itself does
                        auto_augment.posterize(Image.new("RGB", (4, 4)), 0)
    assert zero_bits, "v0 has no draw of 0 bits any more: this test no longer tests the clamp"


def test_a_worker_s_error_is_said_in_one_line():
    from dlojz_lib.checks import one_line

    wrapped = AugmentationError(
        "Caught AugmentationError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n    g()\ndlojz_lib.data.augment.AugmentationError: the augmentation X failed'
    )
    assert one_line(wrapped) == "the augmentation X failed"
    assert one_line(AugmentationError("plain")) == "plain"
