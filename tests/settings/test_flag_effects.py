"""Each flag changes what the training loop computes: tests that fail when the flag is ignored.

The loop runs in-process on bench/in_process.py's synthetic_loop (the parts main() builds from the flags, on --synthetic batches);
hooks on the model see the batch and the activations it gets."""

import pytest
import torch
from in_process import synthetic_run

import dlojz
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import get_args_parser

BASE = ["--device", "cpu", "--arch", "resnet18", "--image-size", "32", "-b", "4", "--val-batch-size", "4"]


def loop_for(*flags, n_batches=2):
    return run_for(*flags, n_batches=n_batches)[1]


def run_for(*flags, n_batches=2):
    """(Config, loop_for's loop): for a test that also reads the flags."""
    return synthetic_run([*BASE, *map(str, flags)], n_batches=n_batches)


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir is made under ./runs


def seen_by_model(loop):
    """Run one epoch; return the inputs of the model's forwards and the outputs dtype of its first conv."""
    inputs, conv_dtypes = [], []
    module = loop["model"].module
    handles = [
        module.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone())),
        module.conv1.register_forward_hook(lambda m, args, out: conv_dtypes.append(out.dtype)),
    ]
    try:
        dlojz.train_one_epoch(**loop)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, conv_dtypes


def test_channels_last_reaches_weights_and_batch():
    for flag, expected in (("--channels-last", True), ("--no-channels-last", False)):
        loop = loop_for(flag)
        inputs, _ = seen_by_model(loop)
        weight = loop["model"].module.conv1.weight
        assert weight.is_contiguous(memory_format=torch.channels_last) is expected, flag
        assert inputs[0].is_contiguous(memory_format=torch.channels_last) is expected, flag
        assert inputs[0].is_contiguous() is not expected, flag


def test_amp_dtype_is_the_dtype_of_the_convolutions():
    assert set(seen_by_model(loop_for("--amp", "--amp-dtype", "bfloat16"))[1]) == {torch.bfloat16}
    assert set(seen_by_model(loop_for("--no-amp"))[1]) == {torch.float32}
    float16 = seen_by_model(loop_for("--amp", "--amp-dtype", "float16"))[1]  # CPU autocast takes float16 too
    assert set(float16) == {torch.float16}


@pytest.mark.parametrize("flag", ["--mixup-alpha", "--cutmix-alpha"])
def test_mixing_changes_the_batch_and_gives_soft_labels(flag):
    loop = loop_for(flag, "1.0")
    plain_images = next(iter(loop["loaders"].train_batches))[0].clone()
    targets = []
    criterion = loop["training"].criterion
    loop["training"].criterion = lambda outputs, target: (targets.append(target), criterion(outputs, target))[1]
    inputs, _ = seen_by_model(loop)
    assert not torch.equal(inputs[0], plain_images)
    soft = targets[0]
    assert soft.shape == (4, 1000) and torch.allclose(soft.sum(1), torch.ones(4))
    assert not torch.equal(soft, torch.nn.functional.one_hot(soft.argmax(1), 1000).to(soft.dtype))
    loop = loop_for()  # without the flag: the batch as loaded, class indices
    assert loop["training"].mix is None and torch.equal(seen_by_model(loop)[0][0], plain_images)


def test_model_ema_is_the_exponential_average_of_the_weights():
    decay = 0.5
    loop = loop_for("--model-ema", "--model-ema-decay", decay, n_batches=4)
    after_step = []
    loop["training"].optimizer.register_step_post_hook(
        lambda *args: after_step.append([p.detach().clone() for p in loop["model"].module.parameters()])
    )
    dlojz.train_one_epoch(**loop)
    assert len(after_step) == 4
    expected = after_step[0]  # AveragedModel's first update copies the weights
    for weights in after_step[1:]:
        expected = [decay * e + (1 - decay) * w for e, w in zip(expected, weights)]
    ema = list(loop["model"].ema.module.parameters())
    for e, got in zip(expected, ema):
        assert torch.allclose(e, got, atol=1e-6)
    assert not torch.allclose(ema[0], after_step[-1][0])  # an average, not the last weights


def saved_for_backward_bytes(loop):
    """Bytes autograd keeps for the backward of one training forward of the run's model."""
    kept = {}
    images = next(iter(loop["loaders"].train_batches))[0]
    loop["model"].net.train()

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loop["model"].net(images).sum().backward()
    return sum(kept.values())


def test_grad_checkpointing_keeps_less_for_the_backward():
    plain = saved_for_backward_bytes(loop_for())
    checkpointed = saved_for_backward_bytes(loop_for("--grad-checkpointing"))
    assert checkpointed < plain / 2, (checkpointed, plain)


def test_grad_checkpointing_trains_as_the_plain_model():
    """The recomputed forward must not count a batch twice in BatchNorm's running statistics: after 3 steps the
    checkpointed model's weights and buffers (running means, variances, batch counts) are the plain model's."""
    states = []
    for flags in ([], ["--grad-checkpointing"]):
        loop = loop_for("--no-amp", *flags, n_batches=3)
        dlojz.train_one_epoch(**loop)
        states.append(loop["model"].module.state_dict())
    plain, checkpointed = states
    assert int(plain["bn1.num_batches_tracked"]) == 3
    for key in plain:
        torch.testing.assert_close(checkpointed[key], plain[key], rtol=1e-4, atol=1e-5, msg=key)


CHECKPOINTING = {
    "none": [],
    "full": ["--activation-checkpointing", "full"],
    "selective": ["--activation-checkpointing", "selective"],
    "full, every 2nd block": ["--activation-checkpointing", "full", "--ac-every", "2"],
    "selective, every 2nd block": ["--activation-checkpointing", "selective", "--ac-every", "2"],
}


@pytest.mark.parametrize("arch, size", [("timm:test_vit", 32), ("resnet18", 32), ("timm:coatnet_pico_rw_224", 64)])
def test_activation_checkpointing_keeps_less_and_trains_as_the_plain_model(arch, size):
    """--activation-checkpointing full | selective and --ac-every 2: after 2 steps the weights and buffers are the
    plain model's (BatchNorm's running statistics counted once), and the bytes its forward holds for the backward
    (measured on the CPU) order as the modes say: full the least, selective more (the matrix products' and
    convolutions' outputs kept), every 2nd block between each mode and none. CoAtNet's squeeze-excitation writes an
    activation in place into a convolution's output, which selective keeps: made out-of-place, not refused."""
    from dlojz_lib.torch_internals import held_after_forward

    held, states = {}, {}
    for mode, flags in CHECKPOINTING.items():
        loop = loop_for("--no-amp", "--arch", arch, "--image-size", size, *flags, n_batches=2)
        dlojz.train_one_epoch(**loop)
        states[mode] = loop["model"].module.state_dict()
        images = next(iter(loop["loaders"].train_batches))[0]
        held[mode] = held_after_forward(loop["model"].net, images)
    for mode in CHECKPOINTING:
        for key, value in states["none"].items():
            torch.testing.assert_close(states[mode][key], value, rtol=1e-4, atol=1e-5, msg=f"{mode}: {key}")
    assert held["full"] < held["selective"] < held["none"], held
    assert held["full"] < held["full, every 2nd block"] < held["none"], held
    assert held["selective"] < held["selective, every 2nd block"] < held["none"], held


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--grad-checkpointing", "--activation-checkpointing", "none"], "one recomputes, the other not"),
        (["--ac-every", "2"], "--ac-every 2 sets which blocks --activation-checkpointing recomputes"),
        (
            ["--arch", "mobilenet_v3_small", "--activation-checkpointing", "selective"],
            "--arch mobilenet_v3_small is none of",
        ),
    ],
)
def test_what_activation_checkpointing_cannot_do_is_one_line(flags, fragment):
    from dlojz_lib.checks import UserError

    with pytest.raises(UserError, match=fragment):
        loop_for(*flags)


@pytest.mark.parametrize(
    "flags",
    [
        ["--randaugment", "2", "9"],
        ["--randaugment", "2", "9", "--randaugment-mstd", "2"],
        ["--trivialaugment"],
        ["--autoaugment", "imagenet"],
        ["--autoaugment", "svhn"],
        ["--augmix", "3"],
        ["--random-erase", "1"],
        ["--timm-augment", "rand-m9-mstd0.5-inc1"],
        ["--timm-augment", "original"],
    ],
)
def test_augmentation_policies_change_the_crops(flags, tiny_data):
    from dlojz_lib.data.augment import train_transform
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.transforms import ValTransform

    def crops(*extra):
        cfg = resolve_config(get_args_parser().parse_args([*BASE, *extra]))
        train_set = build_datasets(
            tiny_data,
            train_transform(cfg.section("augmentation"), cfg.section("validation"), cfg.image_size),
            ValTransform(36, 32),
            seed=cfg.seed,
        )[0]
        return torch.stack([train_set[(0, i)][0] for i in range(8)])

    plain = crops()
    assert torch.equal(plain, crops())  # same seed, same crops: a difference below is the flag's
    augmented = crops(*flags)
    assert not torch.equal(plain, augmented) and augmented.dtype == torch.uint8 and augmented.shape == plain.shape
    if flags[0] == "--autoaugment":  # the policy given, not another
        other = "cifar10" if flags[1] != "cifar10" else "svhn"
        assert not torch.equal(augmented, crops("--autoaugment", other))


def randaugment_magnitudes(*flags, draws=300):
    """The magnitude each Rotate op of --randaugment gets over many crops (torchvision's bins: degrees)."""
    from torchvision.transforms import v2

    from dlojz_lib.data.augment import fixed_size_train_transform

    cfg = resolve_config(get_args_parser().parse_args([*BASE, *flags]))
    (randaugment,) = [
        t
        for t in fixed_size_train_transform(cfg.section("augmentation"), 32).transforms
        if isinstance(t, v2.RandAugment)
    ]
    apply, seen = randaugment._apply_image_or_video_transform, []

    def recorded(image, transform_id, magnitude, **kwargs):
        if transform_id == "Rotate":
            seen.append(abs(magnitude))
        return apply(image, transform_id, magnitude, **kwargs)

    randaugment._apply_image_or_video_transform = recorded
    torch.manual_seed(0)
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    for _ in range(draws):
        randaugment(image)
    return torch.tensor(seen)


def test_randaugment_mstd_draws_each_op_s_magnitude_around_m():
    plain = randaugment_magnitudes("--randaugment", "2", "15")
    assert plain.unique().tolist() == [15.0]  # torchvision's: every op at M
    noisy = randaugment_magnitudes("--randaugment", "2", "15", "--randaugment-mstd", "3")
    assert len(noisy.unique()) > 10 and abs(noisy.mean() - 15) < 1 and 2 < noisy.std() < 4
    clipped = randaugment_magnitudes("--randaugment", "2", "30", "--randaugment-mstd", "3")
    assert clipped.max() == 30 and 0.3 < (clipped == 30).float().mean() < 0.7  # the draws above 30 held at 30


def test_noisy_randaugment_s_finer_bins_are_torchvision_s_bins():
    from dlojz_lib.data.augment import NoisyRandAugment

    fine = NoisyRandAugment.MAX * NoisyRandAugment.BINS_PER_STEP + 1
    for name, (magnitudes, _) in NoisyRandAugment._AUGMENTATION_SPACE.items():
        if magnitudes(31, 32, 32) is not None:  # the same values, to the linspace's rounding (posterize's exactly)
            every_tenth = magnitudes(fine, 32, 32)[:: NoisyRandAugment.BINS_PER_STEP]
            assert torch.allclose(every_tenth.double(), magnitudes(31, 32, 32).double(), rtol=0, atol=1e-5), name


def test_grad_acc_gives_the_same_update_as_one_big_batch():
    """timm's test ViT (LayerNorm, no dropout: a batch of 4 and 2 x 2 accumulated are the same computation),
    in-process: nothing written to disk. lr 1 makes the update large: a missing 1/N loss scaling or an extra step
    would show."""
    common = [
        "--device",
        "cpu",
        "--arch",
        "timm:test_vit",
        "--image-size",
        "32",
        "--val-resize-size",
        "36",
        "--val-crop-size",
        "32",
        "--epochs",
        "2",
        "--optimizer",
        "sgd",
        "--mom",
        "0",
        "--lr",
        "1",
        "--lr-scheduler",
        "constant",
        "--label-smoothing",
        "0",
    ]
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 1000, (4,), generator=generator)
    initial, weights = {}, {}
    for name, flags, batches in (
        ("one", ["-b", "4"], [(images, labels)]),
        ("acc", ["-b", "2", "--grad-acc", "2"], [(images[:2], labels[:2]), (images[2:], labels[2:])]),
    ):
        cfg, loop = synthetic_run(common + flags, n_batches=len(batches))
        module = loop["model"].module
        initial = initial or {k: v.clone() for k, v in module.state_dict().items()}
        module.load_state_dict(initial)  # the same initial weights for both
        loop["loaders"].train_batches = batches
        dlojz.train_one_epoch(**loop)
        assert loop["state"].global_step == 1, name  # one optimizer step in each
        weights[name] = {k: v.clone() for k, v in module.state_dict().items()}
    assert cfg.batch_size * cfg.grad_acc == 4
    for key, value in weights["one"].items():
        assert torch.allclose(value, weights["acc"][key], rtol=1e-5, atol=1e-6), key
    assert not torch.equal(weights["one"]["head.weight"], initial["head.weight"])


def test_random_erase_fills_with_the_mean_colour_which_normalises_to_zero():
    """torchvision's reference erases after normalisation with 0: the data set's mean colour. The crops here are
    uint8, normalised on the device: the erased box holds the mean's uint8 value, about 0 once normalised (within
    half a uint8 level), not black."""
    from torchvision.transforms import v2

    from dlojz_lib.data.augment import fixed_size_train_transform
    from dlojz_lib.data.prefetch import DeviceNormalize

    cfg = resolve_config(get_args_parser().parse_args([*BASE, "--random-erase", "1"]))
    (erase,) = [
        t
        for t in fixed_size_train_transform(cfg.section("augmentation"), 32).transforms
        if isinstance(t, v2.RandomErasing)
    ]
    torch.manual_seed(0)
    image = torch.full((3, 32, 32), 255, dtype=torch.uint8)  # white: the box is what is not white
    erased = erase(image)
    box = (erased != 255).all(dim=0)
    assert box.sum() > 0
    normalised = DeviceNormalize(torch.device("cpu"))(erased[None])[0]
    assert normalised[:, box].abs().max() < 0.5 / 255 / 0.224, normalised[:, box].abs().max()


def test_the_policies_interpolate_bilinear_as_torchvision_s_reference():
    from torchvision.transforms import v2

    from dlojz_lib.data.augment import fixed_size_train_transform

    for flags in (["--randaugment", "2", "9"], ["--randaugment", "2", "9", "--randaugment-mstd", "1"],
                  ["--trivialaugment"], ["--autoaugment", "imagenet"], ["--augmix", "3"]):  # fmt: skip
        cfg = resolve_config(get_args_parser().parse_args([*BASE, *flags]))
        (policy,) = fixed_size_train_transform(cfg.section("augmentation"), 32).transforms[1:]
        assert policy.interpolation == v2.InterpolationMode.BILINEAR, flags


def test_timm_augment_is_timm_s_own_as_its_train_py_builds_it():
    """rand-m7-mstd0.5-inc1 (RSB's): timm's RandAugment, each op with probability 0.5 and magnitude 7 +- 0.5, the
    mean colour as fill, random bilinear or bicubic; the same sample seed gives the same crop, numpy's op choice
    included; a string timm does not read is one line."""
    import random

    from PIL import Image

    from dlojz_lib.checks import UserError
    from dlojz_lib.data.augment import MEAN_UINT8, TimmAugment, fixed_size_train_transform

    cfg = resolve_config(get_args_parser().parse_args([*BASE, "--timm-augment", "rand-m7-mstd0.5-inc1"]))
    (policy,) = fixed_size_train_transform(cfg.section("augmentation"), 32).transforms[1:]
    assert isinstance(policy, TimmAugment) and policy.transform.num_layers == 2
    ops = policy.transform.ops
    assert {op.name for op in ops} >= {"Invert", "SolarizeAdd", "PosterizeIncreasing"}  # timm's set, not torchvision's
    for op in ops:
        assert (op.prob, op.magnitude, op.magnitude_std) == (0.5, 7, 0.5), op
        assert op.kwargs["fillcolor"] == MEAN_UINT8
        assert set(op.kwargs["resample"]) == {Image.Resampling.BILINEAR, Image.Resampling.BICUBIC}
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    out = []
    for seed in (5, 5):
        random.seed(seed)
        torch.manual_seed(seed)
        out.append(policy(image))
    assert torch.equal(out[0], out[1]) and out[0].dtype == torch.uint8 and out[0].shape == image.shape
    for bad in ("rand-m7-", "randaugment", "m7-rand"):
        with pytest.raises(UserError, match="is not one of timm's augmentation strings"):
            resolve_config(get_args_parser().parse_args([*BASE, "--timm-augment", bad]))
    with pytest.raises(UserError, match="one augmentation policy at a time"):
        resolve_config(get_args_parser().parse_args([*BASE, "--timm-augment", "v0", "--trivialaugment"]))
    # timm clips the magnitude to 10 (or -mmax): rand-m100 trained as rand-m10, said nowhere
    for bad, fix in (("rand-m100", "give m10 or less"), ("augmix-m12-w3", "-mmax12"), ("rand-m30-mmax20", "m20")):
        with pytest.raises(UserError, match=f"--timm-augment {bad}: magnitude .* above timm's ceiling.*{fix}"):
            resolve_config(get_args_parser().parse_args([*BASE, "--timm-augment", bad]))
    for fine in ("rand-m10-mstd0.5", "rand-m30-mmax30", "original", "augmix-m5-w3"):
        assert resolve_config(get_args_parser().parse_args([*BASE, "--timm-augment", fine])).timm_augment == fine


def test_model_ema_adjust_gives_the_ema_torchvision_s_decay(tiny_data, tmp_path, run_inline):
    """One GPU's worth: 1 rank x 8 images x 1 step / 2 epochs: 1 - 1e-4 x 4 = 0.9996 per update, said at start-up."""
    from conftest import TINY

    common = [*TINY, "--data-root", tiny_data, "-e", "2", "--test", "--test-nsteps", "1", "--model-ema"]
    proc = run_inline(*common, "--model-ema-decay", "0.9999", "--model-ema-adjust", "--output-dir", tmp_path / "a")
    assert proc.returncode == 0, proc.stderr
    assert "EMA decay 0.999600 per update: torchvision's rule from --model-ema-decay 0.9999" in proc.stdout
    proc = run_inline(*common, "--model-ema-decay", "0.9999", "--output-dir", tmp_path / "b")
    assert proc.returncode == 0 and "EMA decay" not in proc.stdout, proc.stderr


def test_ema_judges_chooses_best_and_reaches_the_target_by_the_ema_s_figures():
    """torchvision's published figures are the EMA weights': with --ema-judges the EMA's validation chooses `best`
    and reaches --target-accuracy; without it, the model's does."""
    from types import SimpleNamespace

    from dlojz_lib.log import NoWandb
    from dlojz_lib.resume import TrainState, record_best
    from dlojz_lib.run_record import record_validation

    def figures(top1, ema_top1):
        return dict(val_loss=1.0, val_accuracy=top1, val_top5_accuracy=1.0, ema_val_loss=1.0,
                    ema_val_accuracy=ema_top1, ema_val_top5_accuracy=1.0)  # fmt: skip

    epochs = [figures(0.9, 0.3), figures(0.2, 0.6)]  # the model's best first, the EMA's second
    chosen = {}
    for judges in (False, True):
        flags = ["--model-ema", "--target-accuracy", "0.5", *(["--ema-judges"] if judges else [])]
        cfg = resolve_config(get_args_parser().parse_args([*BASE, *flags]))
        state, metrics, ranks = TrainState(), {}, SimpleNamespace(is_main=True)
        bests = [
            record_best(cfg.best_metric, cfg.ema_judges, epoch, validation, state, metrics)
            for epoch, validation in enumerate(epochs)
        ]
        reached = [
            record_validation(cfg, epoch, v, state, dict(metrics), 0.0, NoWandb(), ranks, lambda line: None)
            for epoch, v in enumerate(epochs)
        ]
        chosen[judges] = (bests, state.best_epoch, reached)
    assert chosen[False] == ([True, False], 1, [True, False])  # the model: 0.9 then 0.2
    assert chosen[True] == ([True, True], 2, [False, True])  # the EMA: 0.3 then 0.6


def test_val_interpolation_reaches_the_validation_set(tiny_data, tmp_path):
    from types import SimpleNamespace

    from dlojz_lib.data.loaders import build_data

    for interpolation in ("bilinear", "bicubic"):
        argv = [
            *BASE,
            "--data-root",
            str(tiny_data),
            "--val-interpolation",
            interpolation,
            "--output-dir",
            str(tmp_path),
        ]
        cfg = resolve_config(get_args_parser().parse_args(argv))
        ranks = SimpleNamespace(is_main=True, enabled=False, world_size=1, rank=0, device=torch.device("cpu"))
        _, val_set, _ = build_data(cfg, ranks, lambda line: None)
        assert val_set.transform.interpolation == interpolation
