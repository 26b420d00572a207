"""The augmentations of dlojz's flags around the fast crop and flip of dlojz_lib/data/transforms.py: the training
transform a run gets (`train_transform`: the crop and flip, then --randaugment, --trivialaugment, --autoaugment,
--augmix or --random-erase, torchvision v2 on the uint8 crop, or --timm-augment, timm's own), progressive resizing's resolution per epoch
(--min-res/--max-res, FFCV's), timm's RandAugment with a noisy magnitude, and MixUp/CutMix on the device batch
(`batch_mixing`). An augmentation is a flag in dlojz_lib/settings/flags.py's "augmentation" group and a line in
`fixed_size_train_transform` here (a policy also joins dlojz_lib/settings/flag_checks.py's `augmentation_policies`: one at a time).
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torchvision.transforms import v2

from dlojz_lib.checks import DataError
from dlojz_lib.data.transforms import IMAGENET_MEAN, TrainTransform

# The mean colour as a uint8 crop holds it: what a normalised image's 0 is (random erasing's fill).
MEAN_UINT8 = tuple(round(255 * m) for m in IMAGENET_MEAN)


def resolution_at(epoch, min_res, max_res, start_ramp, end_ramp, res_step):
    """FFCV's progressive resizing: `min_res` up to epoch `start_ramp`, `max_res` from `end_ramp`, linear in
    between, rounded to a multiple of `res_step` (epochs counted from 0, as FFCV counts them)."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    res = min_res + (max_res - min_res) * (epoch - start_ramp) / (end_ramp - start_ramp)
    return int(round(res / res_step)) * res_step


def training_resolution(validation, image_size, epoch):
    """The crop size of epoch `epoch`: --image-size, or the progressive resizing schedule's."""
    if validation.min_res is None:
        return image_size
    return resolution_at(
        epoch, validation.min_res, validation.max_res, validation.start_ramp, validation.end_ramp, validation.res_step
    )


class EpochTransforms:
    """A transform per training resolution: the data set asks `for_epoch(epoch)` with the epoch of each sample's
    key, so that every worker (persistent ones too) and a run resumed mid-epoch crop at that epoch's resolution.
    The batch size stays the same; each new size is built once per worker."""

    def __init__(self, make, resolution):
        self.make, self.resolution = make, resolution
        self._by_size = {}

    def for_epoch(self, epoch):
        size = self.resolution(epoch)
        if size not in self._by_size:
            self._by_size[size] = self.make(size)
        return self._by_size[size]

    def __call__(self, img):  # a sample without an epoch: epoch 0
        return self.for_epoch(0)(img)


def train_transform(augmentation, validation, image_size):
    """The fast crop + flip above, then the optional policies (torchvision v2, on uint8 tensors); with progressive
    resizing (--min-res/--max-res, in the validation settings), one such transform per epoch's resolution."""
    if validation.min_res is not None:
        return EpochTransforms(
            lambda size: fixed_size_train_transform(augmentation, size),
            lambda epoch: training_resolution(validation, image_size, epoch),
        )
    return fixed_size_train_transform(augmentation, image_size)


def fixed_size_train_transform(augmentation, image_size):
    """The crop and flip at `image_size`, then the flags' policies as torchvision's reference (presets.py) runs
    them: bilinear interpolation for the policies' geometric ops, and random erasing that fills with the data
    set's mean colour (torchvision erases after normalisation with 0, which is the mean; the crops here are uint8,
    normalised on the device, so the box takes the mean's uint8 value, 0 once normalised)."""
    bilinear = dict(interpolation=v2.InterpolationMode.BILINEAR)
    extra = []
    if augmentation.randaugment:
        num_ops, magnitude = augmentation.randaugment
        if augmentation.randaugment_mstd:
            extra.append(NoisyRandAugment(num_ops, magnitude, augmentation.randaugment_mstd, **bilinear))
        else:
            extra.append(v2.RandAugment(num_ops=num_ops, magnitude=magnitude, **bilinear))
    if augmentation.trivialaugment:
        extra.append(v2.TrivialAugmentWide(**bilinear))
    if augmentation.autoaugment:
        extra.append(v2.AutoAugment(policy=v2.AutoAugmentPolicy(augmentation.autoaugment), **bilinear))
    if augmentation.augmix:
        extra.append(v2.AugMix(severity=augmentation.augmix, **bilinear))
    if augmentation.timm_augment:
        extra.append(TimmAugment(augmentation.timm_augment, image_size))
    if augmentation.random_erase > 0:
        extra.append(v2.RandomErasing(p=augmentation.random_erase, value=list(MEAN_UINT8)))
    crop_flip = TrainTransform(image_size)
    return CropThenPolicies([crop_flip, *extra]) if extra else crop_flip


class AugmentationError(DataError):
    """An augmentation policy failed on an image that decodes: the policy's one line, not the image's (the data
    sets skip only what does not decode)."""


class CropThenPolicies(v2.Compose):
    """The crop (which decodes) then the augmentation policies, whose exceptions are AugmentationErrors naming the
    policy and its error: the data sets take an OSError or a ValueError for an unreadable file and drop it, and a
    policy's error is not the image's."""

    def forward(self, *inputs):
        image = self.transforms[0](*inputs)
        for policy in self.transforms[1:]:
            try:
                image = policy(image)
            except Exception as err:  # noqa: BLE001  (any policy's own: one line, never taken for a bad file)
                raise AugmentationError(
                    f"the augmentation {policy!r} failed on a readable image ({type(err).__name__}: {err}); "
                    "change or drop that augmentation flag"
                ) from None
        return image


class NoisyRandAugment(v2.RandAugment):
    """torchvision's RandAugment whose magnitude is drawn for each op from a normal law around M (timm's
    ``mstd``), clipped to the 0-30 scale. The same ranges over 301 bins instead of 31 give the drawn magnitude a
    tenth of a bin's resolution (bin 10 x M of 301 is bin M of 31, posterize's bits included). torchvision's ranges
    are already timm's "increasing" ones (a larger magnitude, a stronger op)."""

    BINS_PER_STEP = 10
    MAX = 30

    def __init__(self, num_ops, magnitude, std, **options):
        self.std = std
        bins = self.MAX * self.BINS_PER_STEP + 1
        super().__init__(num_ops=num_ops, magnitude=magnitude, num_magnitude_bins=bins, **options)

    @property
    def magnitude(self):  # RandAugment.forward reads it once for each op that has a magnitude
        drawn = self.mean + self.std * float(torch.randn(()))  # torch's generator: the sample's seed decides
        return min(max(round(drawn * self.BINS_PER_STEP), 0), self.MAX * self.BINS_PER_STEP)

    @magnitude.setter
    def magnitude(self, value):
        self.mean = value


class TimmAugment:
    """timm's own RandAugment, AugMix or AutoAugment from its config string (timm's --aa), with the parameters timm's
    training transform gives it (timm.data.transforms_factory): translations up to 45 % of the image size, the data
    set's mean colour as fill, and, as timm's train.py's default --train-interpolation random, each geometric op
    bilinear or bicubic at random. It runs on PIL images: the uint8 crop goes through PIL and back. timm's ops draw
    from Python's generator, seeded per sample, and its op choice from numpy's, seeded here from Python's: the
    sample's seed decides, as for every other transform."""

    def __init__(self, config, image_size, fill=MEAN_UINT8):
        from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform

        hparams = dict(translate_const=int(image_size * 0.45), img_mean=tuple(fill))
        if config.startswith("rand"):
            self.transform = rand_augment_transform(config, hparams)
        elif config.startswith("augmix"):
            self.transform = augment_and_mix_transform(config, dict(hparams, translate_pct=0.3))
        else:
            self.transform = auto_augment_transform(config, hparams)
        self.config = config
        keep_posterizing_to_zero_bits(self.transform)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        np.random.seed(random.getrandbits(32))
        out = self.transform(v2.functional.to_pil_image(img))
        return torch.from_numpy(np.array(out, dtype=np.uint8)).permute(2, 0, 1)

    def __repr__(self):
        return f"TimmAugment({self.config!r})"


def keep_posterizing_to_zero_bits(policy):
    """timm's AutoAugment policies (v0, original) draw Posterize with 0 bits kept, which the Pillow timm was written
    for turned into a black image and Pillow 10+ refuses ("bits must be between or equal to 1 and 8"): the black
    image again, as timm's train.py trained with it."""
    from PIL import Image
    from timm.data import auto_augment

    def posterize(img, bits_to_keep, **options):
        if bits_to_keep < 1:
            return Image.new(img.mode, img.size)  # every bit masked out
        return auto_augment.posterize(img, bits_to_keep, **options)

    ops = [*getattr(policy, "ops", ()), *(op for chain in getattr(policy, "policy", ()) for op in chain)]
    for op in ops:
        if getattr(op, "aug_fn", None) is auto_augment.posterize:
            op.aug_fn = posterize


def batch_mixing(augmentation, num_classes):
    """MixUp and/or CutMix on the device batch (soft labels), or None."""
    mixes = []
    if augmentation.mixup_alpha > 0:
        mixes.append(v2.MixUp(alpha=augmentation.mixup_alpha, num_classes=num_classes))
    if augmentation.cutmix_alpha > 0:
        mixes.append(v2.CutMix(alpha=augmentation.cutmix_alpha, num_classes=num_classes))
    if not mixes:
        return None
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)
