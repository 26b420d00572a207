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

from dlojz_lib.checks import UserError  # noqa: E402
from dlojz_lib.data.dali import DaliBatches, DaliSettings, train_pipeline, val_pipeline  # noqa: E402
from dlojz_lib.data.datasets import build_datasets  # noqa: E402
from dlojz_lib.data.samplers import EpochSampler, ShardSampler  # noqa: E402

ONE_THREAD = DaliSettings(threads=1)
PIXELS = DaliSettings(threads=1, mean=(0, 0, 0), std=(1 / 255,) * 3)  # the pixels unnormalised, as floats


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
    # DALI's queue ran on across both epoch boundaries: one pipeline, built once
    assert batches.rebuilds == 1
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


def test_the_decoder_cache_s_keys_are_the_files_paths(tiny_data):
    """--dali-cache: DALI's decoder caches an image under its source_info, which its file reader sets to the path
    and an external source leaves empty (nothing is ever cached then). The cached pipeline reads each epoch's files
    with the reader: the keys reaching the decoder are this rank's paths in the sampler's order, from a resume's
    place too."""
    from nvidia.dali import fn, pipeline_def

    from dlojz_lib.data.dali import encoded_samples
    from dlojz_lib.data.dali_feed import SampleFeed

    train, _, _, _ = build_datasets(tiny_data, None, None)
    sampler = EpochSampler(train, 2, 1, shuffle=True, seed=5)  # rank 1 of 2: 36 images
    feed = SampleFeed(train, sampler, 4)

    def keys_of(source, batches):
        @pipeline_def(batch_size=4, num_threads=1, device_id=None, seed=0)
        def keys():
            encoded, labels = encoded_samples(source, True)
            return fn.get_property(encoded, key="source_info"), labels

        pipeline = keys()
        pipeline.build()
        found = []
        for _ in range(batches):
            info, labels = pipeline.run()
            found += [(bytes(info.at(k)).decode(), int(labels.at(k)[0])) for k in range(len(labels))]
        return found

    sampler.set_epoch(1)
    expected = [train.samples[index] for _, index in iter(sampler)][8:]
    assert keys_of(feed.epoch_files((1, 8)), 7) == expected  # epoch 1 from its 9th sample: 28 images
    assert {key for key, _ in keys_of(feed, 2)} == {""}  # the external source's bytes: no key, nothing cached


def test_the_cached_pipeline_follows_the_sampler_a_pipeline_an_epoch(tiny_data):
    """--dali-cache's pipeline (by_epoch): the sampler's order epoch after epoch and after a resume, the partial
    last batch cut to its images, its draws an epoch's own; each epoch's pipeline built while the last one is still
    held (the decoder's cache lives as long as one does)."""
    train, _, _, _ = build_datasets(tiny_data, None, None)
    sampler = EpochSampler(train, 1, 0, shuffle=True, seed=5)
    held = []

    def make(source):
        held.append(batches.pipeline is not None)
        return train_pipeline(source, 10, 16, None, ONE_THREAD, 7)

    batches = DaliBatches(train, sampler, 10, make, torch.device("cpu"), by_epoch=True)
    assert len(batches) == 8
    firsts = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        sampler.skip = 0
        got = [(images, labels.tolist()) for images, labels in batches]
        assert [labels for _, labels in got] == in_batches(list(iter(sampler)), train.targets, 10), epoch
        assert [len(images) for images, _ in got] == [10] * 7 + [2]
        firsts.append(got[0][0].clone())
    assert not torch.equal(firsts[0], firsts[1])  # (the same pixels would be the same crops of other images)
    sampler.set_epoch(1)
    sampler.skip = 3 * 10
    resumed = labels_of(batches)
    sampler.skip = 0
    assert resumed == in_batches(list(iter(sampler)), train.targets, 10)[3:]
    assert batches.rebuilds == 3 and held == [False, True, True]


def test_dali_cache_reads_the_files_an_epoch_at_a_time(tiny_data, tmp_path, monkeypatch):
    """--dali-cache reaches the training batches (on a GPU, faked here: the cache is refused on the CPU) as the
    pipeline an epoch that keys images by path; without it, the external source's one pipeline. Packed shards have
    no paths: one line."""
    import dataclasses

    import dlojz_lib.data.loaders
    from dlojz_lib.dist import Distribution
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    args = [*TINY, "--data-root", str(tiny_data), "--data-backend", "dali", "--num-workers", "1"]
    plain = resolve_config(get_args_parser().parse_args(args))
    ranks = Distribution(1, 0, 0, torch.device("cuda", 0))
    for cfg, by_epoch in ((plain, False), (dataclasses.replace(plain, dali_cache=0.5, dali_decode="whole"), True)):
        train_set, val_set, classes = dlojz_lib.data.loaders.build_data(cfg, ranks, lambda line: None)
        loaders = dlojz_lib.data.loaders.build_loaders(cfg, train_set, val_set, len(classes), ranks, lambda line: None)
        assert (loaders.train.by_epoch, loaders.val_batches.by_epoch) == (by_epoch, False)
    shards = pack(tiny_data, tmp_path / "packed")
    cfg = dataclasses.replace(cfg, data_root=str(shards))
    train_set, val_set, classes = dlojz_lib.data.loaders.build_data(cfg, ranks, lambda line: None)
    with pytest.raises(UserError, match="--dali-cache keeps decoded images under their files' paths, which packed"):
        dlojz_lib.data.loaders.build_loaders(cfg, train_set, val_set, len(classes), ranks, lambda line: None)


def test_an_image_whose_header_is_too_large_is_skipped_as_the_pytorch_backend_skips_it(tiny_data, tmp_path):
    """A whole JPEG whose header says 65,000 x 65,000: PIL refuses it (its decompression-bomb limit), so the pytorch
    backend skips it; DALI's failed pipeline names it among the files it was preparing, to be skipped the same way."""
    import shutil

    from PIL import Image

    from dlojz_lib.data.dali_feed import SampleFeed, oversized

    root = shutil.copytree(tiny_data, tmp_path / "data")
    victim = sorted((root / "train").rglob("*.JPEG"))[0]
    data = bytearray(victim.read_bytes())
    sof = data.index(b"\xff\xc0")  # baseline frame header: length (2), precision (1), height (2), width (2)
    data[sof + 5 : sof + 9] = (65000).to_bytes(2, "big") * 2
    victim.write_bytes(bytes(data))
    assert "exceeds limit" in oversized(bytes(data))
    assert oversized(sorted((root / "val").rglob("*.JPEG"))[0].read_bytes()) is None
    with pytest.raises(Image.DecompressionBombError):  # what the pytorch backend's decode meets
        Image.open(victim).load()
    train, _, _, _ = build_datasets(root, None, None)
    feed = SampleFeed(train, EpochSampler(train, 1, 0), 8)
    found = feed.unreadable((0, 0), 9)  # the epoch's 9 batches
    assert {train.samples[i][0] for i in found} == {str(victim)}


def test_batches_are_dalis_buffers_not_copies(tiny_data):
    """The images and labels handed to training are DALI's output buffers seen through DLPack: no allocation and no
    copy per batch (on a GPU the same call binds them to the training's stream)."""
    train, _, _, _ = build_datasets(tiny_data, None, None)
    batches = train_batches(train, EpochSampler(train, 1, 0))
    iterator = iter(batches)
    next(iterator)
    run, outputs = batches.pipeline.run, []
    batches.pipeline.run = lambda *args: outputs.append(run(*args)) or outputs[-1]
    images, labels = next(iterator)
    assert images.data_ptr() == outputs[0][0].as_tensor().data_ptr()
    assert labels.data_ptr() == outputs[0][1].as_tensor().data_ptr()


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
            val, sampler, 4, lambda s: val_pipeline(s, 4, 18, 16, None, ONE_THREAD, 1), torch.device("cpu")
        )
        for _ in range(2):  # twice: validation after validation
            out = [(images.shape, labels.tolist()) for images, labels in batches]
        assert all(shape[1:] == (3, 16, 16) for shape, _ in out)
        seen += [(i, t) for i, t in zip(sampler.indices, sum((labels for _, labels in out), []))]
    assert sorted(seen) == [(i, t) for i, t in enumerate(val.targets)]  # 15 images, each once, with its label


@pytest.mark.multirank
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

    pipeline = train_pipeline(Repeat(), DRAWS, CROP_OUT, None, PIXELS, 11)
    pipeline.build()
    images = torch.from_numpy(np.array(pipeline.run()[0].as_tensor())).round().to(torch.uint8)
    samples = np.array([crop_geometry(image.permute(2, 0, 1)) for image in images])  # HWC
    assert 0.3 < samples[:, 4].mean() < 0.7  # flipped about half the time
    assert_same_distribution(distribution_gaps(samples, reference_geometry))


@pytest.mark.parametrize("packed", [False, True], ids=["folder", "shards"])
def test_a_corrupt_file_is_skipped_with_its_name(tiny_data, tmp_path, capfd, packed):
    """A file DALI cannot decode stops its pipeline: the batches it was preparing are checked, the file skipped with
    a warning naming it (the next sample in its place, as the pytorch backend does), and the epoch goes on in the
    sampler's order, then the next one without another rebuild."""
    import shutil

    root = shutil.copytree(tiny_data, tmp_path / "data")
    train, _, _, _ = build_datasets(root, None, None)
    victim = 40
    with open(train.samples[victim][0], "wb") as file:
        file.write(b"not an image" * 20)
    if packed:
        train, _, _, _ = build_datasets(pack(root, tmp_path / "packed"), None, None)
    sampler = EpochSampler(train, 1, 0, shuffle=True, seed=5)
    batches = train_batches(train, sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        keys = [(e, victim + 1 if i == victim else i) for e, i in iter(sampler)]
        assert labels_of(batches) == in_batches(keys, train.targets, 8), epoch
    err = capfd.readouterr().err
    assert err.count("WARNING: skipping unreadable image") == 1 and train.describe(victim) in err, err
    assert batches.rebuilds == 2  # the first pipeline, and the one without the file


def test_an_error_dali_cannot_blame_on_a_file_goes_on(tiny_data):
    train, _, _, _ = build_datasets(tiny_data, None, None)

    def failing(source):
        raise RuntimeError("DALI: out of memory")

    batches = DaliBatches(
        train,
        EpochSampler(train, 1, 0),
        8,
        lambda s: train_pipeline(s, 8, 16, None, ONE_THREAD, 7),
        torch.device("cpu"),
    )
    iterator = iter(batches)
    next(iterator)
    batches.pipeline.run = failing
    with pytest.raises(RuntimeError, match="out of memory"):
        next(iterator)


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
        "--dali-threads",
        "2",
    )
    assert proc.returncode == 0 and "DALI: decoding on the CPU" in proc.stdout, show(proc)
    metrics = read_json(tmp_path / "m.json")
    assert metrics["loader_batches"] == 5 and metrics["loader_images_per_second"] > 0, metrics
    assert metrics["dali_threads"] == 2 and metrics["jpeg_engine_utilisation"] is None  # (the threads DALI ran)


@pytest.mark.parametrize("flags, dtype", [([], torch.float32), (["--amp"], torch.float16)])
def test_dali_writes_the_models_input_in_channels_last(tiny_data, flags, dtype):
    """DALI's batches are the model's input: normalised by --mean/--std in its crop_mirror_normalize, float16 under
    --amp (float32 without), NCHW over NHWC memory; --loader-only times these same batches."""
    cfg, loaders = dali_loaders_for(tiny_data, *flags)
    assert loaders.train is loaders.train_batches
    for batches in (loaders.train_batches, loaders.val_batches):
        images, labels = next(iter(batches))
        assert images.dtype == dtype and labels.dtype == torch.int64 and images.shape[1:] == (3, 16, 16)
        assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
        assert -2.2 <= images.min() and images.max() <= 2.7  # ImageNet's normalisation of [0, 255]
    _, shifted = dali_loaders_for(tiny_data, *flags, "--mean", "0", "0", "0", "--std", "1", "1", "1")
    plain = next(iter(shifted.val_batches))[0]
    assert 0 <= plain.min() and plain.max() <= 1 and plain.max() > 0.5  # x / 255 alone: the flags reach DALI


def dali_loaders_for(tiny_data, *flags, log=None):
    import dlojz_lib.data.loaders
    from dlojz_lib.dist import Distribution
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    args = [*TINY, "--data-root", str(tiny_data), "--data-backend", "dali", "--num-workers", "1", *flags]
    cfg = resolve_config(get_args_parser().parse_args(args))
    ranks = Distribution(1, 0, 0, torch.device("cpu"))
    log = log or (lambda line: None)
    train_set, val_set, classes = dlojz_lib.data.loaders.build_data(cfg, ranks, log)
    return cfg, dlojz_lib.data.loaders.build_loaders(cfg, train_set, val_set, len(classes), ranks, log)


def test_dali_pixels_match_the_pytorch_backends(tiny_data):
    """The same validation crops give the same normalised pixels as the pytorch backend's (decode, resize, crop,
    then DeviceNormalize): each image's channel means within 0.15 and 0.04 on average (measured: 0.077 and 0.022,
    the two resizes' interpolations differ by a few grey levels on these 48x40 images; RGB read as BGR is off by 0.41
    on average, a missing normalisation by ~2). The training crops are each backend's own draws: over 4 epochs the
    channels' means within 0.1 and their standard deviations within 10% (measured: 0.029 and 1.7%)."""
    pixels = {}
    for backend in ("pytorch", "dali"):
        _, loaders = dali_loaders_for(tiny_data, "--data-backend", backend)
        val = torch.cat([images.float() for images, _ in loaders.val_batches])
        train = []
        for epoch in range(4):
            loaders.start_epoch(epoch, 0)
            train += [images.float() for images, _ in loaders.train_batches]
        pixels[backend] = val, torch.cat(train)
    (val_pt, train_pt), (val_dali, train_dali) = pixels["pytorch"], pixels["dali"]
    assert val_pt.shape == val_dali.shape == (15, 3, 16, 16)
    per_image = (val_pt.mean((2, 3)) - val_dali.mean((2, 3))).abs()
    assert per_image.max() < 0.15 and per_image.mean() < 0.04, per_image
    assert (train_pt.mean((0, 2, 3)) - train_dali.mean((0, 2, 3))).abs().max() < 0.1
    torch.testing.assert_close(train_dali.std((0, 2, 3)), train_pt.std((0, 2, 3)), rtol=0.1, atol=0)


def test_dali_flags_reach_the_pipeline(tiny_data):
    """--dali-threads, --dali-prefetch and --dali-antialias set the training pipeline DALI runs: its threads and
    queue depth, and its pixels (the same crops resized with or without antialiasing)."""
    cfg, plain = dali_loaders_for(tiny_data)
    plain_images, _ = next(iter(plain.train))
    assert (plain.train.pipeline.num_threads, plain.train.pipeline.prefetch_queue_depth) == (1, 3)
    cfg, tuned = dali_loaders_for(tiny_data, "--dali-threads", "3", "--dali-prefetch", "4", "--dali-antialias")
    tuned_images, _ = next(iter(tuned.train))
    assert (tuned.train.pipeline.num_threads, tuned.train.pipeline.prefetch_queue_depth) == (3, 4)
    assert cfg.dali_antialias and plain_images.shape == tuned_images.shape
    assert not torch.equal(plain_images, tuned_images)
    # ... and the difference is the antialiasing alone, not the thread count (DALI's draws are per sample)
    _, one_thread = dali_loaders_for(tiny_data, "--dali-antialias")
    assert torch.equal(next(iter(one_thread.train))[0], tuned_images)


def test_pad_channels_adds_a_zero_channel_and_the_stem_takes_it(tiny_data):
    """--dali-pad-channels: 4 channels out of DALI, the 4th zeros, the first 3 those of the run without it; the
    stem's weight padded to take them, with the unpadded model's outputs and state dict."""
    import torchvision

    from dlojz_lib.model.zoo import ChannelPaddedConv2d, pad_stem_channels

    _, plain = dali_loaders_for(tiny_data)
    _, padded = dali_loaders_for(tiny_data, "--dali-pad-channels")
    for kind in ("train_batches", "val_batches"):
        three, four = next(iter(getattr(plain, kind)))[0], next(iter(getattr(padded, kind)))[0]
        assert four.shape[1] == 4 and four.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(four[:, :3], three) and not four[:, 3].any(), kind
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).eval()
    reference, state = model(three), {k: v.clone() for k, v in model.state_dict().items()}
    assert pad_stem_channels(model) == "conv1" and type(model.conv1) is ChannelPaddedConv2d
    torch.testing.assert_close(model(four), reference, rtol=1e-5, atol=1e-5)  # zeros add nothing but rounding
    assert model.state_dict().keys() == state.keys() and model.conv1.weight.shape == (64, 3, 7, 7)
    loss = model(four).sum()
    loss.backward()
    assert model.conv1.weight.grad.shape == (64, 3, 7, 7)


def test_pad_channels_trains_through_dlojz(tiny_data, tmp_path):
    proc = run_dlojz(
        *TINY,
        "--data-root",
        tiny_data,
        "--data-backend",
        "dali",
        "--dali-pad-channels",
        "--epochs",
        "1",
        "--metrics-json",
        tmp_path / "m.json",
        "--output-dir",
        tmp_path / "run",
    )
    assert proc.returncode == 0, show(proc)
    assert "padded to 4 channels" in proc.stdout and "'s weight is padded with zeros" in proc.stdout, show(proc)
    assert read_json(tmp_path / "m.json")["val_images"] == 15


def test_pad_channels_without_a_convolution_stem_is_one_line(run_inline, tiny_data, tmp_path):
    proc = run_inline(
        *TINY,
        "--data-root",
        tiny_data,
        "--data-backend",
        "dali",
        "--dali-pad-channels",
        "--arch",
        "timm:tf_efficientnet_b0",
        "--output-dir",
        tmp_path,
    )
    assert proc.returncode == 2 and "--dali-pad-channels: --arch" in proc.stderr, proc.stderr


def test_decoder_options_on_a_gpu_are_mlperfs():
    """On a GPU: 99% of the JPEGs to the hardware decoder unless --dali-hw-decoder-load, unpinned threads, buffers
    sized once; on the CPU, none of them (DALI's CPU decoder takes no such option)."""
    from dlojz_lib.data.dali import decoder_options

    options = decoder_options(0, DaliSettings(1, size_hint=(500, 375)))
    assert options["device"] == "mixed" and options["hw_decoder_load"] == 0.99 and options["affine"] is False
    assert (options["preallocate_width_hint"], options["preallocate_height_hint"]) == (500, 375)
    assert options["device_memory_padding"] > 0 and "cache_size" not in options
    assert "preallocate_width_hint" not in decoder_options(0, ONE_THREAD)  # no size known: DALI's default
    assert decoder_options(0, DaliSettings(1, hw_decoder_load=0.5))["hw_decoder_load"] == 0.5
    assert decoder_options(None, ONE_THREAD) == {"device": "cpu"}
    validation = decoder_options(0, DaliSettings(1, size_hint=(500, 375), cache_mib=1024), training=False)
    assert validation == {"device": "mixed", "hw_decoder_load": 0.99, "affine": False}  # DALI's default buffers
    cached = decoder_options(0, DaliSettings(1, decode="whole", cache_mib=12 * 1024))
    assert (cached["cache_size"], cached["cache_type"], cached["cache_threshold"]) == (12 * 1024, "threshold", 0)
    from nvidia.dali import backend

    for operator, given in (("decoders__ImageRandomCrop", options), ("decoders__Image", {**options, **cached})):
        schema = backend.GetSchema(operator)  # each option is one the GPU decoder takes
        assert [name for name in given if name != "device" and not schema.HasArgument(name)] == [], operator


def test_hardware_decoder_share_and_output_follow_the_flags():
    from types import SimpleNamespace

    from dlojz_lib.data.dali import dali_settings

    def settings(num_workers=3, amp=False, **flags):  # the data settings, the DataLoader's workers, --amp
        values = dict(
            dali_threads=None,
            dali_prefetch=3,
            dali_hw_decoder_load=None,
            dali_antialias=False,
            dali_pad_channels=False,
            dali_decode=None,
            dali_cache=None,
            mean=None,
            std=None,
        )
        on_gpu, size_hint = flags.pop("on_gpu", False), flags.pop("size_hint", (0, 0))
        return dali_settings(SimpleNamespace(**{**values, **flags}), num_workers, amp, on_gpu, size_hint)

    assert settings().threads == 3 and settings().hw_decoder_load == 0.99
    assert settings(dali_hw_decoder_load=0.3).hw_decoder_load == 0.3
    assert settings(num_workers=0).threads == 1
    # On a GPU: MLPerf's 6 threads, or the task's CPUs where fewer; validation 3 at most; --dali-threads wins.
    assert [settings(num_workers=n, on_gpu=True).threads for n in (15, 6, 4, 0)] == [6, 6, 4, 1]
    assert settings(num_workers=15).threads == 15  # (the CPU backend: every core decodes)
    assert [settings(num_workers=n, on_gpu=True).val_threads for n in (15, 2)] == [3, 2]
    assert settings(num_workers=15, on_gpu=True, dali_threads=9).threads == 9
    assert settings().decode == "roi" and settings(dali_decode="whole").decode == "whole"
    assert (settings(dali_cache=1.5).cache_mib, settings(dali_cache=1.5).decode) == (1536, "whole")
    assert settings(size_hint=(640, 480)).size_hint == (640, 480)
    assert settings(amp=True).half and not settings().half
    assert settings(dali_pad_channels=True).pad_channels
    assert settings(mean=(0.5, 0.5, 0.5)).mean == (0.5, 0.5, 0.5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dali-threads", "4"], "--dali-threads set DALI's pipeline: add --data-backend dali"),
        (["--dali-antialias", "--dali-prefetch", "4"], "--dali-prefetch, --dali-antialias set DALI's pipeline"),
        (["--dali-pad-channels"], "--dali-pad-channels set DALI's pipeline"),
        (["--data-backend", "dali", "--dali-hw-decoder-load", "1.5"], "--dali-hw-decoder-load: must be in [0, 1]"),
        (["--dali-decode", "whole"], "--dali-decode set DALI's pipeline"),
        (["--dali-cache", "2"], "--dali-cache set DALI's pipeline"),
        (["--data-backend", "dali", "--dali-cache", "2", "--dali-decode", "roi"], "--dali-cache keeps whole decoded"),
        (["--data-backend", "dali", "--dali-cache", "2"], "--dali-cache keeps decoded images in GPU memory: drop it"),
        (["--data-backend", "dali", "--dali-cache", "0"], "--dali-cache: must be"),
    ],
)
def test_dali_flags_without_dali_or_out_of_range_are_one_line(run_inline, flags, message):
    proc = run_inline(*SMALL, *flags)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_validation_counts_the_images_the_pytorch_backend_counts(trained_run, tiny_data, tmp_path):
    """A truncated validation JPEG decodes in DALI (grey where its bytes are missing) and not in PIL: DALI's
    validation leaves it out, named, as the pytorch backend does: the same images counted."""
    import shutil

    root = shutil.copytree(tiny_data, tmp_path / "data")
    victim = sorted((root / "val").rglob("*.JPEG"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # cut short, its start intact
    checkpoint = sorted(trained_run.glob("ckpt_e*.pt"))[-1]
    metrics = {}
    for backend in ("pytorch", "dali"):
        proc = run_dlojz(
            *TINY, "--arch", "resnet18", "--data-root", root, "--eval-only", "--resume", checkpoint,
            "--output-dir", tmp_path / backend, "--metrics-json", tmp_path / f"{backend}.json",
            "--data-backend", backend,
        )  # fmt: skip
        assert proc.returncode == 0, show(proc)
        assert f"skipping unreadable image {victim}" in proc.stderr, (backend, proc.stderr[-2000:])
        metrics[backend] = read_json(tmp_path / f"{backend}.json")
    assert (
        metrics["dali"]["val_images"]
        == metrics["pytorch"]["val_images"]
        == len(list((root / "val").rglob("*.JPEG"))) - 1
    )


def test_whole_decode_reaches_the_training_pipeline(tiny_data):
    """--dali-decode whole: the training pipeline decodes whole images then crops them (random_resized_crop), not
    the region (image_random_crop); the crops keep the geometry: the same batch (DALI 2.4 on the CPU draws the same
    windows from the same seed, and the region decode is exact: measured equal)."""
    _, roi = dali_loaders_for(tiny_data)
    _, whole = dali_loaders_for(tiny_data, "--dali-decode", "whole")
    roi_images, whole_images = next(iter(roi.train))[0], next(iter(whole.train))[0]
    operators = {name: pipe.train.pipeline.serialize() for name, pipe in (("roi", roi), ("whole", whole))}
    assert b"ImageRandomCrop" in operators["roi"] and b"RandomResizedCrop" not in operators["roi"]
    assert b"RandomResizedCrop" in operators["whole"] and b"ImageRandomCrop" not in operators["whole"]
    assert roi_images.shape == whole_images.shape and (roi_images - whole_images).abs().mean() < 0.05


def test_the_start_up_line_says_the_decoder_threads_and_buffers():
    """Which decoder really runs: the JPEG engines on a GPU known to have them; elsewhere the line says that the
    hardware share does not apply (DALI would fall back without a word)."""
    from dlojz_lib.data.dali import jpeg_engines, start_line

    gpu = DaliSettings(6, size_hint=(500, 375))
    h100 = start_line(gpu, 0, "NVIDIA H100 80GB HBM3")
    assert "NVIDIA H100 80GB HBM3: its JPEG engines expected to take 99% (by the GPU's name" in h100
    assert "training 6 threads" in h100
    assert "validation 3" in h100 and "preallocated at 500x375" in h100 and "the random crop's region" in h100
    l40 = start_line(gpu, 0, "NVIDIA L40S")
    assert "not known to have JPEG engines" in l40 and "JPEG engines expected" not in l40
    assert "--dali-hw-decoder-load 0" in start_line(DaliSettings(6, hw_decoder_load=0.0), 0, "NVIDIA H200")
    cpu = start_line(DaliSettings(2, decode="whole"), None, None)
    assert "the CPU (no GPU)" in cpu and "whole images, then the crop" in cpu and "preallocated" not in cpu
    names = ["NVIDIA A100-SXM4-80GB", "NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA B200", "NVIDIA A30", "NVIDIA GB300"]
    assert [jpeg_engines(name) for name in names] == [True] * 6
    assert [jpeg_engines(name) for name in ("Tesla V100-SXM2-32GB", "NVIDIA L4", "NVIDIA RTX A6000")] == [False] * 3


def test_loader_only_reports_the_jpeg_engines_use_that_nvml_reads(tiny_data, monkeypatch):
    """The start-up line's JPEG engines are an expectation from the GPU's name; --loader-only on a GPU reads their
    use through NVML at each timed batch (a fake NVML here: 30% then 50%), and says it. On the CPU, or without the
    reading, nothing is said."""
    import types

    from dlojz_lib.data.dali import jpeg_utilisation_reader
    from dlojz_lib.data.loaders import jpeg_reader, measure_loader

    readings = iter([40, 30, 50, 30, 50])  # (the first: the reader's own check)
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: f"gpu{index}",
        nvmlDeviceGetJpgUtilization=lambda handle: (next(readings), 1_000_000),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert jpeg_utilisation_reader(torch.device("cpu")) is None
    reader = jpeg_utilisation_reader(torch.device("cuda", 0))
    lines = []
    train, _, _, _ = build_datasets(tiny_data, None, None)
    sampler = EpochSampler(train, 1, 0)
    metrics = measure_loader(train_batches(train, sampler), sampler, 4, 0, None, lines.append, reader)
    assert metrics["jpeg_engine_utilisation"] == 40 and lines[-1] == (
        ">>> the GPU's JPEG engines: 40% busy on average, 50% at most (NVML, 4 readings)"
    )
    assert jpeg_reader(object(), torch.device("cuda", 0)) is None  # the DataLoader's batches: no engine at work
    nvml.nvmlDeviceGetJpgUtilization = lambda handle: (_ for _ in ()).throw(RuntimeError("not supported"))
    assert jpeg_utilisation_reader(torch.device("cuda", 0)) is None


def test_size_hints_and_the_cache_share_come_from_the_images_headers(tiny_data, tmp_path):
    """The hardware decoder's preallocation is the largest of the sampled images (headers read, JPEG and PNG), and
    the cache's share of the epoch is its size over the mean decoded image's."""
    from PIL import Image

    from dlojz_lib.data.dali import cached_share, image_size, largest, sampled_sizes

    for size, kind in (((500, 375), "JPEG"), ((64, 48), "PNG"), ((31, 17), "JPEG")):
        path = tmp_path / f"x.{kind.lower()}"
        Image.new("RGB", size).save(path, kind, **({"progressive": True} if size == (31, 17) else {}))
        assert image_size(path.read_bytes()[:1024]) == size, kind
    assert image_size(b"not an image") is None
    from torchvision.datasets import ImageFolder

    sizes = sampled_sizes(ImageFolder(tiny_data / "train"))
    assert len(sizes) == 72 and largest(sizes) == (48, 40) and largest([]) == (0, 0)
    assert cached_share(1, [(1024, 1024)], 100) == pytest.approx(1 / 3 / 100)  # a MiB holds a third of a 1 MP image
    assert cached_share(12 * 1024, [(500, 375)], 1000) == 1.0 and cached_share(1, [], 10) is None


def test_a_batch_is_kept_until_the_step_that_reads_it_has_run():
    """BatchLifetimes: the batch handed out last is kept; when the next is asked for, an event is recorded on the
    stream for it, and it is let go only once that event has passed (query(), no wait)."""
    from dlojz_lib.data.dali import BatchLifetimes

    class Event:
        def __init__(self):
            self.passed, self.stream = False, None

        def record(self, stream):
            self.stream = stream

        def query(self):
            return self.passed

    events = []
    lifetimes = BatchLifetimes(lambda: events.append(Event()) or events[-1])
    first, second, third = object(), object(), object()
    lifetimes.next_batch("stream")
    lifetimes.handed_out(first)
    assert events == [] and lifetimes.last is first
    lifetimes.next_batch("stream")  # the step reading `first` is queued: an event after it
    lifetimes.handed_out(second)
    assert [batch for _, batch in lifetimes.held] == [first] and events[0].stream == "stream"
    lifetimes.next_batch("stream")  # `first`'s step has not run yet: both kept
    lifetimes.handed_out(third)
    assert [batch for _, batch in lifetimes.held] == [first, second]
    events[0].passed = True
    lifetimes.next_batch("stream")
    assert [batch for _, batch in lifetimes.held] == [second, third]  # first let go, the others still queued
    events[1].passed = events[2].passed = True
    lifetimes.next_batch("stream")
    assert not lifetimes.held and lifetimes.last is None


def test_dali_batches_hold_their_batches_on_a_gpu_only(tiny_data):
    """On the CPU no stream runs behind the host: nothing is held. The run's log says the start-up line once, then
    each pipeline's threads and memory once its prefetch queue is filled and a batch past it (measured once, not at
    each rebuild)."""
    lines = []
    _, loaders = dali_loaders_for(tiny_data, "--dali-decode", "whole", log=lines.append)
    said = [line for line in lines if line.startswith("DALI")]
    assert len(said) == 1 and said[0].startswith("DALI: decoding on the CPU (no GPU); training 1 thread decoding")
    assert "whole images, then the crop" in said[0]
    loaders.start_epoch(0, 0)
    batches = iter(loaders.train_batches)
    for _ in range(3):  # DALI's prefetch queue (3) still filling: nothing said yet
        next(batches)
    assert loaders.train.memory_taken is None and not any(line.startswith("DALI training") for line in lines)
    next(batches)
    assert loaders.train.memory_taken is not None and lines[-1].startswith("DALI training pipeline")
    list(batches)
    loaders.start_epoch(1, 0)
    list(loaders.train_batches)
    list(loaders.val_batches)  # (2 batches: said at the last)
    assert loaders.train.lifetimes is None and loaders.train.memory_taken is not None
    said = [line for line in lines if line.startswith("DALI ")]
    assert [line.split(":")[0] for line in said] == ["DALI training pipeline", "DALI validation pipeline"], said
    assert said[0].startswith("DALI training pipeline: 1 thread, took ") and "GPU memory" not in said[0]
