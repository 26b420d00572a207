"""--blurpool: anti-aliased downsampling on strided convolutions and max-pools; same shapes, same state dict keys,
less aliasing (a one-pixel shift of the input changes the output less)."""

import copy

import pytest
import torch
import torchvision
from test_flag_effects import loop_for

from dlojz_lib.model.zoo import BlurConv2d, MaxBlurPool2d, apply_blurpool, binomial_kernel, blur


def test_the_blur_is_the_binomial_kernel():
    impulse = torch.zeros(1, 2, 5, 5)
    impulse[:, :, 2, 2] = 1
    expected = torch.tensor([1.0, 2.0, 1.0])
    expected = expected[:, None] * expected[None, :] / 16
    out = blur(impulse, binomial_kernel(), 1)
    assert torch.allclose(out[0, 0, 1:4, 1:4], expected) and torch.allclose(out[0, 1], out[0, 0])
    assert out.sum().item() == pytest.approx(2.0)  # a low-pass filter keeps the mean


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_shapes_and_state_dict_keys_are_kept(arch):
    torch.manual_seed(0)
    plain = torchvision.models.get_model(arch, num_classes=10).eval()
    blurred = copy.deepcopy(plain)
    changed = apply_blurpool(blurred)
    kinds = [type(m) for m in blurred.modules()]
    assert MaxBlurPool2d in kinds and kinds.count(BlurConv2d) + 1 == changed
    assert type(blurred.conv1) is torch.nn.Conv2d  # the 3-channel stem conv keeps its own stride
    x = torch.randn(2, 3, 64, 64)
    assert blurred(x).shape == plain(x).shape
    assert blurred.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(blurred.state_dict())  # loads into the model without it, and back
    blurred.load_state_dict(plain.state_dict())
    assert not torch.allclose(blurred(x), plain(x))


def test_a_shifted_input_changes_a_blurred_downsampling_less():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 16, 3, stride=2, padding=1, bias=False)
    blurred = copy.deepcopy(conv)
    apply_blurpool(blurred)
    pool, maxblur = torch.nn.MaxPool2d(3, 2, 1), torch.nn.MaxPool2d(3, 2, 1)
    apply_blurpool(maxblur)
    x = torch.randn(4, 16, 32, 32)
    shifted = torch.roll(x, shifts=1, dims=3)

    def change(layer):  # relative change of the output under a one-pixel shift of the input
        with torch.no_grad():
            a, b = layer(x)[..., 2:-2], layer(shifted)[..., 2:-2]
        return ((a - b).norm() / a.norm()).item()

    assert change(blurred) < 0.8 * change(conv)
    assert change(maxblur) < 0.8 * change(pool)


def test_the_flag_reaches_the_trained_model(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    kinds = {type(m) for m in loop_for("--blurpool")["model"].module.modules()}
    assert {BlurConv2d, MaxBlurPool2d} <= kinds
    assert not {BlurConv2d, MaxBlurPool2d} & {type(m) for m in loop_for()["model"].module.modules()}
    ffcv = {type(m) for m in loop_for("--blurpool", "--no-blurpool-maxpool")["model"].module.modules()}
    assert BlurConv2d in ffcv and MaxBlurPool2d not in ffcv and torch.nn.MaxPool2d in ffcv  # FFCV's: convolutions


def test_the_race_recipes_blur_as_ffcv_does():
    """FFCV's apply_blurpool (ffcv-imagenet's rn50 train_imagenet.py) replaces strided convolutions of 16 or more
    input channels and leaves the max-pool: the race recipes, which cite it, do the same."""
    from conftest import ROOT

    from dlojz_lib.settings.flags import get_args_parser

    for name in ("race_rn50_16ep.toml", "race_rn50_88ep.toml"):
        values = vars(get_args_parser().parse_args(["--config", str(ROOT / "recipes" / name)]))
        assert (values["blurpool"], values["blurpool_maxpool"]) == (True, False), name
    from dlojz_lib.checks import UserError
    from dlojz_lib.settings.flag_checks import checked_values

    with pytest.raises(UserError, match="--no-blurpool-maxpool sets which layers --blurpool blurs: add --blurpool"):
        checked_values(["--device", "cpu", "--no-blurpool-maxpool"])


def test_a_model_with_nothing_to_blur_is_one_line(run_inline):
    from conftest import SMALL

    vit_size = ("--image-size", "224", "--val-resize-size", "256", "--val-crop-size", "224")  # the one it takes
    proc = run_inline(*SMALL, "--arch", "vit_b_32", *vit_size, "--blurpool", "--synthetic", "--test")
    assert proc.returncode == 2
    assert proc.stderr.startswith("dlojz: error: --blurpool: --arch vit_b_32 has no strided convolution")
