"""--data-backend dali (dlojz_lib/data/dali.py) on DALI's CPU backend: the samplers' order epoch after epoch and after a
resume, exact validation on 1 and 2 ranks (on shards), RandomResizedCrop's distribution, a corrupt file skipped,
and the one line when DALI is not installed. The GPU's "mixed" decoder runs in tests/test_gpu.py."""

import sys

import numpy as np

# DALI is in requirements.txt: a missing DALI fails here (ImportError), it is not skipped
import nvidia.dali  # noqa: E402,F401
import pytest
import torch
from conftest import SMALL, read_json, run_dlojz, show
from test_packed_data import TINY, pack
from test_transforms import (
    CROP_OUT,
    DRAWS,
    assert_same_distribution,
    crop_geometry,
    distribution_gaps,  # noqa: F401
    gradient_jpeg,  # noqa: F401  (fixtures, found by name)
    reference_geometry,  # noqa: F401
)

from dlojz_lib.data.dali import DaliBatches, DaliSettings, EncodedSamples, train_pipeline, val_pipeline  # noqa: E402
from dlojz_lib.data.datasets import build_datasets  # noqa: E402
from dlojz_lib.data.samplers import EpochSampler, ShardSampler  # noqa: E402

ONE_THREAD = DaliSettings(threads=1, prefetch=2, hw_decoder_load=0.9, antialias=False)


def identity(images):
    return images


def labels_of(batches):
    return [labels.tolist() for _, labels in batches]


def in_batches(keys, targets, size):
    flat = [targets[i] for _, i in keys]
    return [flat[k : k + size] for k in range(0, len(flat), size)]


def train_batches(dataset, sampler, batch=8, size=16, drop_last=False):
    return DaliBatches(
        dataset,
        sampler,
        batch,
        lambda source: train_pipeline(source, batch, size, None, ONE_THREAD, 7),
        torch.device("cpu"),
        identity,
        drop_last=drop_last,
    )


def test_dali_follows_the_sampler_epoch_after_epoch_and_after_a_resume(tiny_data):
    train, _, _, _ = build_datasets(tiny_data, None, None)
    sampler = EpochSampler(train, 1, 0, shuffle=True, seed=5)
    batches = train_batches(train, sampler)
    assert len(batches) == 9
    for epoch in range(3):  # DALI prefetches the next epoch as one ends: it must be the sampler's next epoch
        sampler.set_epoch(epoch)
        sampler.skip = 0
        expected = in_batches(list(iter(sampler)), train.targets, 8)
        got = [(images.shape, labels.tolist()) for images, labels in batches]
        assert [labels for _, labels in got] == expected, epoch
        assert all(shape == (len(labels), 3, 16, 16) for shape, labels in got)
    # A resume mid-epoch: epoch 1 from its 4th batch, as the training loop sets it.
    sampler.set_epoch(1)
    sampler.skip = 3 * 8
    resumed = labels_of(batches)
    sampler.skip = 0
    assert resumed == in_batches(list(iter(sampler)), train.targets, 8)[3:]
    # An iteration left before its end (a stop signal, --loader-only), then the next epoch.
    sampler.set_epoch(2)
    next(iter(batches))
    sampler.set_epoch(3)
    assert labels_of(batches) == in_batches(list(iter(sampler)), train.targets, 8)


def test_drop_last_leaves_out_the_partial_batch(tiny_data):
    train, _, _, _ = build_datasets(tiny_data, None, None)
    sampler = EpochSampler(train, 1, 0, shuffle=True, seed=5, drop_last=True)
    batches = train_batches(train, sampler, batch=10, drop_last=True)
    assert len(batches) == 7 and [len(b) for b in labels_of(batches)] == [10] * 7
    sampler.set_epoch(1)
    assert [len(b) for b in labels_of(batches)] == [10] * 7  # the next epoch starts where it should


@pytest.mark.parametrize("world_size", [1, 2])
def test_validation_sees_every_image_once(tiny_data, world_size):
    _, val, _, _ = build_datasets(tiny_data, None, None)
    seen = []
    for rank in range(world_size):
        sampler = ShardSampler(val, world_size, rank)
        batches = DaliBatches(
            val, sampler, 4, lambda s: val_pipeline(s, 4, 18, 16, None, ONE_THREAD, 1), torch.device("cpu"), identity
        )
        for _ in range(2):  # twice: validation after validation
            out = [(images.shape, labels.tolist()) for images, labels in batches]
        assert all(shape[1:] == (3, 16, 16) for shape, _ in out)
        seen += [(i, t) for i, t in zip(sampler.indices, sum((labels for _, labels in out), []))]
    assert sorted(seen) == [(i, t) for i, t in enumerate(val.targets)]  # 15 images, each once, with its label


def test_one_and_two_ranks_validate_the_same_images_with_dali_on_shards(tiny_data, tmp_path):
    shards = pack(tiny_data, tmp_path / "packed")
    proc = run_dlojz(
        *TINY, "--epochs", "1", "--data-root", shards, "--output-dir", tmp_path / "run", "--data-backend", "dali"
    )
    assert proc.returncode == 0, show(proc)
    assert "DALI: decoding on the CPU (no GPU)" in proc.stdout
    metrics = {}
    for ranks in (1, 2):
        proc = run_dlojz(
            *TINY,
            "--data-root",
            shards,
            "--val-batch-size",
            "4",
            "--eval-only",
            "--resume",
            "auto",
            "--output-dir",
            tmp_path / "run",
            "--metrics-json",
            tmp_path / f"{ranks}.json",
            "--data-backend",
            "dali",
            ranks=ranks,
        )
        assert proc.returncode == 0, show(proc)
        metrics[ranks] = read_json(tmp_path / f"{ranks}.json")
    assert metrics[1]["val_images"] == metrics[2]["val_images"] == 15 and metrics[2]["world_size"] == 2
    assert metrics[1]["val_accuracy"] == metrics[2]["val_accuracy"]
    assert metrics[1]["val_loss"] == pytest.approx(metrics[2]["val_loss"], rel=1e-5)


def test_dali_crops_follow_torchvision_distribution(gradient_jpeg, reference_geometry):
    data = np.fromfile(gradient_jpeg, dtype=np.uint8)

    class Repeat:
        def __iter__(self):
            yield [data] * DRAWS, [np.array([0], dtype=np.int64)] * DRAWS

    pipeline = train_pipeline(Repeat(), DRAWS, CROP_OUT, None, ONE_THREAD, 11)
    pipeline.build()
    images = np.array(pipeline.run()[0].as_tensor())
    samples = np.array([crop_geometry(torch.from_numpy(image).permute(2, 0, 1)) for image in images])  # HWC
    assert 0.3 < samples[:, 4].mean() < 0.7  # flipped about half the time
    assert_same_distribution(distribution_gaps(samples, reference_geometry))


def test_a_corrupt_file_is_skipped_with_its_name(tiny_data, tmp_path, capfd):
    import shutil

    root = shutil.copytree(tiny_data, tmp_path / "data")
    train, _, _, _ = build_datasets(root, None, None)
    victim = train.samples[4][0]
    with open(victim, "r+b") as file:
        file.truncate(200)  # cut short: no end-of-image marker
    source = EncodedSamples(train, ShardSampler(train, 1, 0), batch_size=72)
    ((encoded, labels),) = list(iter(source))
    assert len(encoded) == 72 and labels[4][0] == train.samples[5][1]  # the next file instead
    assert f"WARNING: skipping unreadable image {victim}" in capfd.readouterr().err


def test_without_dali_the_flag_is_one_line(run_inline, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    proc = run_inline(*SMALL, "--data-backend", "dali")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--data-backend dali needs NVIDIA DALI" in proc.stderr and "pip install nvidia-dali-cuda130" in proc.stderr


def test_augmentations_dali_does_not_do_are_one_line(run_inline):
    proc = run_inline(*SMALL, "--data-backend", "dali", "--randaugment", "2", "9")
    assert proc.returncode == 2 and "--randaugment needs --data-backend pytorch" in proc.stderr, proc.stderr


def test_loader_only_times_the_dali_pipeline(tiny_data, tmp_path):
    proc = run_dlojz(
        *TINY,
        "--data-root",
        tiny_data,
        "--data-backend",
        "dali",
        "--loader-only",
        "--test-nsteps",
        "5",
        "--metrics-json",
        tmp_path / "m.json",
    )
    assert proc.returncode == 0 and "DALI: decoding on the CPU" in proc.stdout, show(proc)
    metrics = read_json(tmp_path / "m.json")
    assert metrics["loader_batches"] == 5 and metrics["loader_images_per_second"] > 0, metrics


def test_loader_only_times_uint8_batches_as_for_the_dataloader(tiny_data):
    """--loader-only times DALI's decoded uint8 batches (the DataLoader's are uint8 too): the float normalisation
    is training's, on the device, for both backends."""
    import dlojz_lib.data.loaders
    from dlojz_lib.config import resolve_config
    from dlojz_lib.dist import Distribution
    from dlojz_lib.flags import get_args_parser

    cfg = resolve_config(get_args_parser().parse_args([*TINY, "--data-root", str(tiny_data), "--data-backend", "dali"]))
    ranks = Distribution(1, 0, 0, torch.device("cpu"))
    train_set, val_set, classes = dlojz_lib.data.loaders.build_data(cfg, ranks, lambda line: None)
    loaders = dlojz_lib.data.loaders.build_loaders(cfg, train_set, val_set, len(classes), ranks, lambda line: None)
    timed, _ = next(iter(loaders.train))
    trained, _ = next(iter(loaders.train_batches))
    assert timed.dtype == torch.uint8 and trained.dtype == torch.float32, (timed.dtype, trained.dtype)
    assert timed.shape == trained.shape


def dali_loaders_for(tiny_data, *flags):
    import dlojz_lib.data.loaders
    from dlojz_lib.config import resolve_config
    from dlojz_lib.dist import Distribution
    from dlojz_lib.flags import get_args_parser

    args = [*TINY, "--data-root", str(tiny_data), "--data-backend", "dali", "--num-workers", "1", *flags]
    cfg = resolve_config(get_args_parser().parse_args(args))
    ranks = Distribution(1, 0, 0, torch.device("cpu"))
    train_set, val_set, classes = dlojz_lib.data.loaders.build_data(cfg, ranks, lambda line: None)
    return cfg, dlojz_lib.data.loaders.build_loaders(cfg, train_set, val_set, len(classes), ranks, lambda line: None)


def test_dali_flags_reach_the_pipeline(tiny_data):
    """--dali-threads, --dali-prefetch and --dali-antialias set the training pipeline DALI runs: its threads and
    queue depth, and its pixels (the same crops resized with or without antialiasing)."""
    cfg, plain = dali_loaders_for(tiny_data)
    plain_images, _ = next(iter(plain.train))
    assert (plain.train.pipeline.num_threads, plain.train.pipeline.prefetch_queue_depth) == (1, 2)
    cfg, tuned = dali_loaders_for(tiny_data, "--dali-threads", "3", "--dali-prefetch", "4", "--dali-antialias")
    tuned_images, _ = next(iter(tuned.train))
    assert (tuned.train.pipeline.num_threads, tuned.train.pipeline.prefetch_queue_depth) == (3, 4)
    assert cfg.dali_antialias and plain_images.shape == tuned_images.shape
    assert not torch.equal(plain_images, tuned_images)
    # ... and the difference is the antialiasing alone, not the thread count (DALI's draws are per sample)
    _, one_thread = dali_loaders_for(tiny_data, "--dali-antialias")
    assert torch.equal(next(iter(one_thread.train))[0], tuned_images)


def test_hardware_decoder_share_follows_the_threads_unless_given():
    from types import SimpleNamespace

    from dlojz_lib.data.dali import dali_settings

    def cfg(**flags):
        values = dict(
            dali_threads=None, num_workers=3, dali_prefetch=2, dali_hw_decoder_load=None, dali_antialias=False
        )
        return SimpleNamespace(**{**values, **flags})

    assert dali_settings(cfg()).threads == 3 and dali_settings(cfg()).hw_decoder_load == 0.9  # few cores: to the HW
    assert dali_settings(cfg(num_workers=15)).hw_decoder_load == 0.65
    assert dali_settings(cfg(dali_hw_decoder_load=0.3)).hw_decoder_load == 0.3
    assert dali_settings(cfg(num_workers=0)).threads == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dali-threads", "4"], "--dali-threads set DALI's pipeline: add --data-backend dali"),
        (["--dali-antialias", "--dali-prefetch", "3"], "--dali-prefetch, --dali-antialias set DALI's pipeline"),
        (["--data-backend", "dali", "--dali-hw-decoder-load", "1.5"], "--dali-hw-decoder-load: must be in [0, 1]"),
    ],
)
def test_dali_flags_without_dali_or_out_of_range_are_one_line(run_inline, flags, message):
    proc = run_inline(*SMALL, *flags)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
