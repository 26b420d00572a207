"""Tests of dlojz_lib.data.datasets: where the data is found, the two layouts, unreadable files, and per-sample augmentation that
depends only on (seed, epoch, index), hence is the same whatever the number of DataLoader workers.

Small data only (the session's tiny_data set of 48x40 JPEGs, or a few files made here); a few seconds on 2 cores.
"""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dlojz_lib.data.datasets import DataError, SafeImageFolder, build_datasets, resolve_data_root  # noqa: E402
from dlojz_lib.data.loaders import close_loader, make_loader  # noqa: E402
from dlojz_lib.data.samplers import EpochSampler  # noqa: E402
from dlojz_lib.data.transforms import TrainTransform, ValTransform, lazy_image_loader  # noqa: E402

DATA_VARIABLES = ("DLOJZ_DATA", "ALL_CCFRSCRATCH", "DSDIR")


def train_transform():
    """The training transform of `--randaugment 2 9 --random-erase 0.5`, so that torchvision's random policies
    draw from the per-sample seed too."""
    return v2.Compose([TrainTransform(32), v2.RandAugment(num_ops=2, magnitude=9), v2.RandomErasing(p=0.5)])


# ---------------------------------------------------------------------------------------------------------------
# Where the data is


def test_data_root_fallbacks_in_order(tmp_path, monkeypatch):
    for name in DATA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    mine = tmp_path / "mine"
    scratch, dsdir = tmp_path / "scratch", tmp_path / "dsdir"
    for folder in (mine, scratch / "imagenet", dsdir / "imagenet"):
        folder.mkdir(parents=True)
    assert resolve_data_root(None) == (None, "embedded")
    monkeypatch.setenv("DSDIR", str(dsdir))
    assert resolve_data_root(None) == (dsdir / "imagenet", "$DSDIR/imagenet")
    monkeypatch.setenv("ALL_CCFRSCRATCH", str(scratch))
    assert resolve_data_root(None) == (scratch / "imagenet", "$ALL_CCFRSCRATCH/imagenet")
    monkeypatch.setenv("DLOJZ_DATA", str(mine))
    assert resolve_data_root(None) == (mine, "$DLOJZ_DATA")
    # The site's variables naming no imagenet/ are passed over: the next one is tried.
    monkeypatch.delenv("DLOJZ_DATA")
    shutil.rmtree(scratch / "imagenet")
    assert resolve_data_root(None) == (dsdir / "imagenet", "$DSDIR/imagenet")
    # $DLOJZ_DATA is the user's own: naming a missing folder is an error, not a fall-back to the next one.
    monkeypatch.setenv("DLOJZ_DATA", str(tmp_path / "gone"))
    with pytest.raises(DataError, match=r"^\$DLOJZ_DATA=.*gone: no such folder"):
        resolve_data_root(None)
    monkeypatch.delenv("DLOJZ_DATA")
    # An explicit --data-root wins over all of them.
    assert resolve_data_root(str(mine)) == (mine, "--data-root")


def test_missing_explicit_data_root_is_an_error_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("DLOJZ_DATA", str(tmp_path))  # an existing fall-back must not hide the mistake
    with pytest.raises(DataError, match=r"^--data-root .*nowhere: no such directory"):
        resolve_data_root(str(tmp_path / "nowhere"))


# ---------------------------------------------------------------------------------------------------------------
# Layouts


def test_imagenet_layout_gives_readable_class_names(tmp_path, tiny_data):
    # torchvision's ImageNet layout: one folder per WordNet id, meta.bin = (wnid -> names, val wnids).
    wnids = {"disc": "n01440764", "square": "n01443537", "triangle": "n01484850"}
    root = tmp_path / "imagenet"
    for split in ("train", "val"):
        for name, wnid in wnids.items():
            shutil.copytree(tiny_data / split / name, root / split / wnid)
    names = {"n01440764": ("tench", "Tinca tinca"), "n01443537": ("goldfish", "Carassius auratus")}
    torch.save((names, sorted(wnids.values()) * 5), root / "meta.bin")
    train_set, val_set, classes, layout = build_datasets(root, TrainTransform(32), ValTransform(36, 32))
    assert layout == "imagenet"
    # The first name of each id, in the order of the class indices; an id meta.bin lacks keeps its id.
    assert classes == ["tench", "goldfish", "n01484850"]
    assert train_set.classes == sorted(wnids.values()) and len(train_set) == 72 and len(val_set) == 15
    _, _, plain_classes, plain_layout = build_datasets(tiny_data, TrainTransform(32), ValTransform(36, 32))
    assert plain_layout == "imagefolder" and plain_classes == ["disc", "square", "triangle"]


# ---------------------------------------------------------------------------------------------------------------
# Unreadable files


def _garbage_folder(root, classes=("a", "b"), per_class=2):
    for split in ("train", "val"):
        for cls in classes:
            (root / split / cls).mkdir(parents=True)
            for k in range(per_class):
                (root / split / cls / f"{cls}{k}.JPEG").write_text("not a picture")
    return root


def test_a_set_without_any_readable_image_raises(tmp_path, capsys):
    root = _garbage_folder(tmp_path / "garbage")
    train_set = SafeImageFolder(str(root / "train"), transform=TrainTransform(32), loader=lazy_image_loader)
    with pytest.raises(DataError, match="no readable image in .*train"):
        train_set[(0, 1)]
    warnings = capsys.readouterr().err
    # Each file was tried once, each named in its warning.
    assert sorted(Path(path).name for path, _ in train_set.samples) == ["a0.JPEG", "a1.JPEG", "b0.JPEG", "b1.JPEG"]
    for path, _ in train_set.samples:
        assert warnings.count(f"skipping unreadable image {path}") == 1


def test_an_unreadable_image_is_replaced_by_the_next_one(tmp_path, tiny_data, capsys):
    root = tmp_path / "one_bad"
    shutil.copytree(tiny_data, root)
    bad = root / "train" / "square" / "square_0003.JPEG"
    bad.write_bytes(b"\xff\xd8\xff" + b"not really a JPEG" * 10 + b"\xff\xd9")
    train_set, _, _, _ = build_datasets(root, train_transform(), ValTransform(36, 32), seed=7)
    index = [path for path, _ in train_set.samples].index(str(bad))
    image, label = train_set[(2, index)]
    assert f"skipping unreadable image {bad}" in capsys.readouterr().err
    # The next sample, with its own (seed, epoch, index) augmentation: exactly what asking for it gives.
    next_image, next_label = train_set[(2, index + 1)]
    assert label == next_label == train_set.class_to_idx["square"] and torch.equal(image, next_image)


@pytest.mark.parametrize("bad", ["empty", "text", "bomb"])
def test_a_bad_file_first_in_sort_order_is_skipped_as_anywhere_else(tmp_path, tiny_data, capsys, bad):
    """Before, the first file of the listing was opened alone and a bad one refused the whole run, while the same
    file elsewhere was skipped with a warning."""
    from PIL import Image

    root = tmp_path / "first_bad"
    shutil.copytree(tiny_data, root)
    first = root / "train" / "disc" / "disc_0000.JPEG"
    if bad == "bomb":  # a header claiming more pixels than PIL decodes (its decompression-bomb limit)
        Image.new("L", (48, 40)).save(first, format="PNG")
        data = bytearray(first.read_bytes())
        data[16:24] = (60000).to_bytes(4, "big") * 2  # the IHDR's width and height
        first.write_bytes(bytes(data))
    else:
        first.write_bytes(b"" if bad == "empty" else b"not a picture")
    train_set, _, classes, _ = build_datasets(root, TrainTransform(32), ValTransform(36, 32))
    assert str(first) in capsys.readouterr().err  # the class's warning names it
    index = next(i for i, (path, _) in enumerate(train_set.samples) if path == str(first))
    assert train_set[(0, index)][1] == classes.index("disc")


def test_a_folder_of_non_images_is_refused_naming_a_class_and_its_first_file(tmp_path):
    with pytest.raises(DataError, match=r"class 'a': none of its 2 training images can be read \(first: .*a0\.JPEG\)"):
        build_datasets(_garbage_folder(tmp_path / "garbage"), TrainTransform(32), ValTransform(36, 32))


# ---------------------------------------------------------------------------------------------------------------
# Augmentation: a function of (seed, epoch, index) only


def test_augmentation_depends_only_on_seed_epoch_and_index(tiny_data):
    train_set, _, _, _ = build_datasets(tiny_data, train_transform(), ValTransform(36, 32), seed=123)
    image, label = train_set[(3, 10)]
    # Whatever was drawn before (other samples, other random numbers), the same key gives the same tensor.
    torch.rand(100)
    train_set[(3, 11)]
    train_set[(0, 10)]
    again, again_label = train_set[(3, 10)]
    assert torch.equal(image, again) and label == again_label
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
    assert not torch.equal(image, train_set[(4, 10)][0]), "another epoch must give another augmentation"
    other_seed, _, _, _ = build_datasets(tiny_data, train_transform(), ValTransform(36, 32), seed=124)
    assert not torch.equal(image, other_seed[(3, 10)][0]), "another --seed must give another augmentation"


def _loader_epochs(train_set, num_workers, epochs=(0, 1)):
    """{epoch: (indices in the sampler's order, the batches' images, their labels)}, with persistent workers
    serving every epoch as in training with --persistent-workers."""
    sampler = EpochSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=123)
    loader = make_loader(
        train_set,
        sampler,
        batch_size=8,
        num_workers=num_workers,
        pin_memory=False,
        persistent_workers=num_workers > 0,
        prefetch_factor=2,
        drop_last=False,
    )
    out = {}
    try:
        for epoch in epochs:
            sampler.set_epoch(epoch)
            batches = list(loader)
            out[epoch] = (
                [index for _, index in sampler],
                [images for images, _ in batches],
                [labels for _, labels in batches],
            )
    finally:
        close_loader(loader)
    return out


def test_augmentation_is_the_same_for_any_number_of_workers(tiny_data):
    train_set, _, _, _ = build_datasets(tiny_data, train_transform(), ValTransform(36, 32), seed=123)
    by_workers = {workers: _loader_epochs(train_set, workers) for workers in (0, 1, 2)}
    reference = by_workers[1]
    for workers in (0, 2):
        for epoch in (0, 1):
            order, images, labels = by_workers[workers][epoch]
            assert order == reference[epoch][0]
            assert len(images) == len(reference[epoch][1]) == 9  # 72 images, batches of 8
            for batch, (got, expected) in enumerate(zip(images, reference[epoch][1])):
                assert torch.equal(got, expected), f"{workers} vs 1 workers, epoch {epoch}: batch {batch} differs"
            assert all(torch.equal(a, b) for a, b in zip(labels, reference[epoch][2]))
    # Between epochs, each image gets a new augmentation (not only a new place in the order).
    assert reference[0][0] != reference[1][0]
    first, second = (
        {index: image for index, image in zip(reference[epoch][0], torch.cat(reference[epoch][1]))} for epoch in (0, 1)
    )
    same = [index for index in first if torch.equal(first[index], second[index])]
    assert not same, f"images {same} have the same augmentation in epochs 0 and 1"


def test_loader_timing_starts_after_the_batches_prefetched_at_start_up():
    """3 workers x prefetch_factor 2: 6 batches are ready before the loop asks; timed, they would inflate the rate."""
    import time

    from dlojz_lib.data.loaders import measure_loader

    class Loader:
        prefetch_factor = 2

        def __iter__(self):
            for index in range(1000):
                if index >= 6:  # made while the loop waits: 20 ms a batch of 4
                    time.sleep(0.02)
                yield torch.zeros(4, 3, 2, 2), torch.zeros(4)

    class Sampler:
        def set_epoch(self, epoch):
            pass

    metrics = measure_loader(Loader(), Sampler(), nsteps=8, num_workers=3, log=lambda line: None)
    assert metrics["loader_images_per_second_per_process"] <= 4 / 0.02, metrics


def test_repeated_augmentation_deals_each_image_s_copies_to_different_ranks_and_augments_each(tiny_data):
    """--ra-reps 3 on 3 ranks: an image's 3 copies go to the 3 ranks at the same position (the same step), with 3
    different augmentations; each rank has EpochSampler's number of samples; a resume goes on at the same draw."""
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.samplers import EpochSampler, RepeatedAugmentationSampler
    from dlojz_lib.data.transforms import TrainTransform, ValTransform

    train_set = build_datasets(tiny_data, TrainTransform(16), ValTransform(18, 16), seed=5)[0]  # 72 images
    ranks = [RepeatedAugmentationSampler(train_set, 3, r, reps=3, seed=5) for r in range(3)]
    for sampler in ranks:
        sampler.set_epoch(2)
    drawn = [list(sampler) for sampler in ranks]
    assert [len(d) for d in drawn] == [len(EpochSampler(train_set, 3, r, seed=5)) for r in range(3)] == [24] * 3
    for position in range(24):
        keys = [drawn[r][position] for r in range(3)]
        assert len({index for _, index, _ in keys}) == 1 and sorted(copy for _, _, copy in keys) == [0, 1, 2]
    assert len({index for _, index, _ in drawn[0]}) == 24  # an epoch: a third of the 72 images, 3 times each
    epoch, index, _ = drawn[0][0]
    crops = [train_set[(epoch, index, copy)][0] for copy in range(3)]
    assert not torch.equal(crops[0], crops[1]) and not torch.equal(crops[1], crops[2])
    assert torch.equal(crops[0], train_set[(epoch, index)][0])  # copy 0: the augmentation without --ra-reps
    ranks[1].skip = 5
    assert list(ranks[1]) == drawn[1][5:]


def test_val_interpolation_bicubic_is_pil_s_bicubic_resize(tmp_path):
    """--val-interpolation bicubic (timm's evaluation): torchvision's Resize(BICUBIC) + CenterCrop on the PIL image,
    to a level; bilinear (the default) is not that."""
    import numpy as np
    import torchvision.transforms as T
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))
    reference = T.Compose([T.Resize(70, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(64), T.PILToTensor()])
    expected = reference(image).int()
    bicubic = ValTransform(70, 64, interpolation="bicubic")(image).int()
    bilinear = ValTransform(70, 64)(image).int()
    assert (bicubic - expected).abs().max() <= 1
    assert (bilinear - expected).abs().max() > 1
