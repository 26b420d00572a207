"""--arch timm:NAME: any timm model trains, checkpoints, resumes for --eval-only, checkpoints its activations and
counts its FLOPs; a wrong name is one line with suggestions."""

import pytest
import torch
from conftest import SMALL, read_json, run_dlojz, show

RUN = [*SMALL, "-b", "8", "--no-wandb", "--num-workers", "0"]


@pytest.mark.parametrize("arch", ["timm:resnet10t", "timm:vit_tiny_patch16_224"])
def test_a_timm_model_trains_checkpoints_and_evaluates(tiny_data, tmp_path, arch):
    import timm

    flags = [*RUN, "--arch", arch, "--data-root", tiny_data, "--output-dir", tmp_path / "run"]
    if "vit" in arch:  # its own block checkpointing; a size other than the 224 px it was named for
        flags += ["--grad-checkpointing", "--image-size", "32", "--val-resize-size", "56", "--val-crop-size", "48"]
    proc = run_dlojz(*flags, "--epochs", "1", "--metrics-json", tmp_path / "train.json")
    assert proc.returncode == 0, show(proc)
    size = dict(img_size=32) if "vit" in arch else {}  # its position embedding is sized for the training images
    expected = sum(p.numel() for p in timm.create_model(arch[5:], num_classes=3, **size).parameters())
    assert f"model: {arch}, {expected:,} parameters" in proc.stdout, show(proc)  # timm's model, 3 classes
    state = torch.load(tmp_path / "run" / (tmp_path / "run" / "latest").read_text().strip(), weights_only=True)
    assert any(key.startswith("blocks." if "vit" in arch else "layer1.") for key in state["model"]), list(
        state["model"]
    )[:5]
    proc = run_dlojz(*flags, "--eval-only", "--resume", "auto", "--metrics-json", tmp_path / "eval.json")
    assert proc.returncode == 0, show(proc)
    trained, evaluated = read_json(tmp_path / "train.json"), read_json(tmp_path / "eval.json")
    assert evaluated["val_images"] == 15 and evaluated["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-5)


def attention_calls(checkpointed):
    from dlojz_lib.model.recompute import enable_grad_checkpointing
    from dlojz_lib.model.zoo import create_model

    model = create_model("timm:vit_tiny_patch16_224", 3, image_size=32)
    attention, calls = model.blocks[0].attn, []
    forward = attention.forward
    attention.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)  # (hooks do not see
    if checkpointed:  # the recomputation)
        enable_grad_checkpointing(model, "timm:vit_tiny_patch16_224")
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    return len(calls)


def test_timm_grad_checkpointing_recomputes_the_blocks():
    assert attention_calls(checkpointed=False) == 1
    assert attention_calls(checkpointed=True) == 2  # forward, then again in the backward


def test_timm_flops_are_counted():
    from dlojz_lib.model.zoo import create_model, train_flops_per_image

    small, large = (train_flops_per_image(create_model("timm:resnet10t", 10), size) for size in (32, 64))
    assert small > 0 and 3.5 < large / small < 4.5  # a convolutional network: FLOPs grow with the pixels


def test_a_val_crop_larger_than_its_resize_is_one_line(run_inline):
    proc = run_inline(*RUN, "--val-resize-size", "40", "--val-crop-size", "48")
    assert proc.returncode == 2 and "--val-crop-size 48 must be at most --val-resize-size 40" in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize(
    "arch, needle",
    [
        ("timm:resnet10", "unknown timm model (did you mean timm:resnet10t"),
        ("vit_tiny_patch16_224", "not a torchvision classification model; timm models: --arch timm:NAME"),
    ],
)
def test_a_wrong_model_name_is_one_line(run_inline, tiny_data, tmp_path, arch, needle):
    proc = run_inline(*RUN, "--arch", arch, "--data-root", tiny_data, "--output-dir", tmp_path)
    assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_channels_last_bfloat16_and_ema_reach_a_timm_model():
    """In-process on --synthetic batches: the timm model's convolutions get channels-last inputs and weights and
    compute in bfloat16, and --model-ema's copy moves with the training."""
    from in_process import synthetic_loop

    import dlojz

    loop = synthetic_loop(
        [
            "--device",
            "cpu",
            "--arch",
            "timm:resnet10t",
            "--image-size",
            "32",
            "-b",
            "4",
            "--channels-last",
            "--amp",
            "--amp-dtype",
            "bfloat16",
            "--model-ema",
            "--model-ema-decay",
            "0.5",
        ],
        n_batches=2,
    )
    module, seen = loop["model"].module, []
    conv = module.conv1[0]  # timm's ResNet-D stem: a sequence of convolutions
    conv.register_forward_hook(
        lambda m, args, out: seen.append((args[0].is_contiguous(memory_format=torch.channels_last), out.dtype))
    )
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    ema_before = loop["model"].ema.module.conv1[0].weight.detach().clone()
    dlojz.train_one_epoch(**loop)
    assert seen and set(seen) == {(True, torch.bfloat16)}, seen
    assert not torch.equal(loop["model"].ema.module.conv1[0].weight, ema_before)
