"""--initial-checkpoint: the file's tensors in the model, a new head for another number of classes, each format
(state dict, wrapped keys, .safetensors, a dlojz checkpoint), one line for a file that is not there or weights of
another architecture, and a run that trains from them."""

import os

import pytest
import torch
import torchvision

from conftest import SMALL, read_json, run_dlojz, show
from dlojz_lib.checks import UserError
from dlojz_lib.config import resolve_config
from dlojz_lib.dist import Distribution
from dlojz_lib.flags import get_args_parser
from dlojz_lib.parallel import build_model


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir (./runs/...) is made and checked writable


def model_from(weights, num_classes=3, arch="resnet18", *flags):
    lines = []
    cfg = resolve_config(
        get_args_parser().parse_args(["--device", "cpu", "--arch", arch, "--initial-checkpoint", str(weights), *flags])
    )
    model = build_model(cfg, num_classes, Distribution(1, 0, 0, torch.device("cpu")), lines.append)
    return model.module, lines


def imagenet_resnet18(seed=0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=1000).state_dict()


def test_the_file_s_tensors_are_loaded_and_the_head_is_new_for_the_data_s_classes(tmp_path):
    saved = imagenet_resnet18()
    torch.save(saved, tmp_path / "resnet18.pth")
    module, lines = model_from(tmp_path / "resnet18.pth")
    own = module.state_dict()
    body = [key for key in saved if not key.startswith("fc.")]
    assert all(torch.equal(own[key], saved[key]) for key in body)
    assert own["fc.weight"].shape == (3, 512) and own["fc.bias"].shape == (3,)
    line = next(line for line in lines if line.startswith("initial weights:"))
    assert (
        f"{len(body)} of {len(own)} tensors" in line
        and "new, freshly initialised for 3 classes: fc.bias, fc.weight" in line
    )


def test_the_same_number_of_classes_keeps_the_file_s_head(tmp_path):
    torch.manual_seed(1)
    saved = torchvision.models.resnet18(num_classes=3).state_dict()
    torch.save({"state_dict": {f"module.{key}": value for key, value in saved.items()}}, tmp_path / "ddp.pt")
    module, lines = model_from(tmp_path / "ddp.pt")  # DDP's prefix, under timm's 'state_dict' key
    assert all(torch.equal(module.state_dict()[key], value) for key, value in saved.items())
    assert not any("new" in line for line in lines)


def test_a_safetensors_file_and_a_dlojz_checkpoint_load(tmp_path):
    from safetensors.torch import save_file

    import dlojz_lib.checkpoint as ckpt

    saved = imagenet_resnet18(seed=2)
    save_file(saved, tmp_path / "w.safetensors")
    module, _ = model_from(tmp_path / "w.safetensors")
    assert torch.equal(module.state_dict()["conv1.weight"], saved["conv1.weight"])
    ckpt.write({"model": saved, "epoch": 3}, tmp_path / "ckpt_e0003_s000000030.pt")
    module, lines = model_from(tmp_path / "ckpt_e0003_s000000030.pt")
    assert torch.equal(module.state_dict()["layer4.1.bn2.weight"], saved["layer4.1.bn2.weight"])
    assert any("dlojz checkpoint's model" in line for line in lines)


def test_weights_of_another_architecture_are_one_line_naming_a_key(tmp_path):
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet34(num_classes=3).state_dict(), tmp_path / "resnet34.pth")
    with pytest.raises(UserError, match=r"^--initial-checkpoint .*resnet34\.pth: its tensor layer1\.2\.conv1\.weight"):
        model_from(tmp_path / "resnet34.pth")
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "r18.pth")
    with pytest.raises(UserError, match=r"conv1\.weight is \(64, 3, 7, 7\) there, \(32, 3, 7, 7\) in this model"):
        _narrow(tmp_path / "r18.pth")


def _narrow(weights):
    """A model whose stem is narrower than the file's: a shape mismatch outside the head."""
    from dlojz_lib.pretrained import load_initial_weights

    module = torchvision.models.resnet18(num_classes=3)
    module.conv1 = torch.nn.Conv2d(3, 32, 7, 2, 3, bias=False)
    return load_initial_weights(module, weights, 3)


def test_a_missing_or_unreadable_file_is_one_line_before_the_run(tmp_path):
    parser = get_args_parser()
    with pytest.raises(UserError, match=r"^--initial-checkpoint .*gone\.pth: no such file; give a \.pt/\.pth"):
        resolve_config(parser.parse_args(["--device", "cpu", "--initial-checkpoint", str(tmp_path / "gone.pth")]))
    os.mkfifo(tmp_path / "pipe.pth")  # torch.load would wait on it for a writer, for ever
    with pytest.raises(UserError, match=r"^--initial-checkpoint .*pipe\.pth: not a regular file \(a pipe"):
        resolve_config(parser.parse_args(["--device", "cpu", "--initial-checkpoint", str(tmp_path / "pipe.pth")]))
    (tmp_path / "text.pth").write_text("not weights")
    with pytest.raises(UserError, match=r"^--initial-checkpoint .*text\.pth: not a weights file torch can read"):
        model_from(tmp_path / "text.pth")


def test_a_run_trains_from_the_weights_of_another_run(tiny_data, tmp_path):
    """A model trained on the tiny set's 3 classes, then fine-tuned from its checkpoint: the run says what it loaded
    and starts from those weights (its first validation is the first run's, not chance's)."""
    first = tmp_path / "first"
    proc = run_dlojz(
        *SMALL, "--data-root", tiny_data, "--epochs", "1", "--output-dir", first, "--metrics-json", first / "m.json"
    )
    assert proc.returncode == 0, show(proc)
    checkpoint = sorted(first.glob("ckpt_e*.pt"))[-1]
    proc = run_dlojz(
        *SMALL, "--data-root", tiny_data, "--epochs", "1", "--lr", "1e-9", "--initial-checkpoint", checkpoint,
        "--output-dir", tmp_path / "second", "--metrics-json", tmp_path / "second.json",
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    assert f"initial weights: 122 of 122 tensors from {checkpoint} (dlojz checkpoint's model)" in proc.stdout
    assert read_json(tmp_path / "second.json")["epochs"] == 1  # a fresh epoch count, not the first run's


def test_pretrained_reads_torchvision_s_file_from_the_local_hub_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    missing = r"--pretrained DEFAULT: .*torch/hub/checkpoints/resnet18-f37072fd\.pth is not in torch hub's cache, .*"
    with pytest.raises(UserError, match=missing + r"get_weight\('ResNet18_Weights\.IMAGENET1K_V1'\)"):
        resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", "--pretrained"]))
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    saved = imagenet_resnet18(seed=4)
    torch.save(saved, cache / "resnet18-f37072fd.pth")  # the name torchvision's download gives it
    cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", "--pretrained"]))
    model = build_model(cfg, 5, Distribution(1, 0, 0, torch.device("cpu")), lambda line: None)
    assert torch.equal(model.module.state_dict()["layer3.0.conv1.weight"], saved["layer3.0.conv1.weight"])
    assert model.module.fc.out_features == 5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pretrained", "IMAGENET1K_V9"], r"--pretrained IMAGENET1K_V9: --arch resnet18's weights are IMAGENET1K_V1"),
        (
            ["--arch", "timm:resnet10t", "--pretrained"],
            r"--pretrained: timm:resnet10t is a timm model: .*--initial-checkpoint",
        ),
        (
            ["--pretrained", "--initial-checkpoint", "w.pt"],
            r"--pretrained and --initial-checkpoint both give the starting",
        ),
    ],
)
def test_pretrained_refuses_in_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", *flags]))


def test_pretrained_takes_the_weights_sizes_unless_given(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    (tmp_path / "hub" / "checkpoints" / "resnet50-11ad3fa6.pth").touch()  # there: read when the model is made

    def sizes(*flags):
        cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet50", *flags]))
        return cfg.image_size, cfg.val_resize_size, cfg.val_crop_size, cfg.notes

    assert sizes()[:3] == (64, 73, 64)  # the CPU profile without --pretrained
    image, resize, crop, notes = sizes("--pretrained", "IMAGENET1K_V2")  # evaluated at 232 -> 224
    assert (image, resize, crop) == (224, 232, 224)
    assert any(
        note.startswith("--pretrained IMAGENET1K_V2: the weights' preprocessing: --val-resize-size 232")
        for note in notes
    )
    assert sizes("--pretrained", "IMAGENET1K_V2", "--val-resize-size", "240")[:3] == (224, 240, 224)
