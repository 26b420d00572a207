"""dlojz_export.py: ONNX, torch.export, TorchScript and safetensors exports of a checkpoint, each read back the way
its users read it and checked against the PyTorch model; the preprocessing beside them; the one-line errors."""

import json

import numpy as np
import pytest
import torch

import dlojz_export

TOLERANCE = 1e-4  # float32 on the CPU: the exporters' kernels sum in another order (measured: up to 7e-7)


@pytest.fixture
def run(trained_run):
    return trained_run


def exported(tmp_path, capsys, *args):
    status = dlojz_export.main([*map(str, args), "-o", str(tmp_path / "out")])
    return status, capsys.readouterr()


def test_every_format_matches_the_pytorch_model(run, tiny_data, tmp_path, capsys):
    from dlojz_lib.export import check_images
    from dlojz_lib.inference import image_files, load_for_inference

    status, captured = exported(tmp_path, capsys, run)  # the check images: the run's own validation set
    assert status == 0, captured.err
    for fmt in ("onnx", "export", "torchscript", "safetensors"):
        assert f"{fmt}: " in captured.out and "largest logit difference from PyTorch on 8 images" in captured.out
    folder = tmp_path / "out"
    preprocessing = json.loads((folder / "preprocessing.json").read_text())
    assert preprocessing["classes"] == sorted(p.name for p in (tiny_data / "train").iterdir())
    assert (preprocessing["resize_size"], preprocessing["crop_size"], preprocessing["arch"]) == (18, 16, "resnet18")
    # Read back here, on other images (and a batch size the export did not see), as a user would.
    model = load_for_inference(run)
    images = check_images(model, image_files([tiny_data / "train"]), limit=5)
    with torch.no_grad():
        reference = model.module(images)
    import onnxruntime
    from safetensors.torch import load_file

    outputs = {
        "onnx": torch.from_numpy(
            onnxruntime.InferenceSession(str(folder / "model.onnx")).run(None, {"images": images.numpy()})[0]
        ),
        "export": torch.export.load(str(folder / "model.pt2")).module()(images),
        "torchscript": torch.jit.load(str(folder / "model.torchscript.pt"))(images),
    }
    fresh = model.fresh()
    fresh.load_state_dict(load_file(str(folder / "model.safetensors")))
    outputs["safetensors"] = fresh.eval()(images)
    for fmt, logits in outputs.items():
        assert logits.shape == (5, 3) and (logits - reference).abs().max() < TOLERANCE, fmt
    assert np.isfinite(reference.numpy()).all() and reference.abs().max() > 0.01


def test_format_ema_and_tolerance_reach_the_export(run, tiny_data, tmp_path, capsys):
    from safetensors.torch import load_file

    import dlojz_lib.checkpoint as ckpt

    status, captured = exported(tmp_path, capsys, run, "--ema", "--format", "safetensors", "--check-images", tiny_data)
    assert status == 0, captured.err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "preprocessing.json"]
    saved, _ = ckpt.load_latest(run)
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    ema = {k[len("module.") :]: v for k, v in saved["ema"].items() if k.startswith("module.")}
    assert torch.equal(weights["fc.weight"], ema["fc.weight"])
    assert not torch.equal(weights["fc.weight"], saved["model"]["fc.weight"])
    status, captured = exported(tmp_path, capsys, run, "--format", "onnx", "--tolerance", "0")
    assert status == 1 and "differs by" in captured.err and "> --tolerance 0" in captured.err


def test_a_model_that_cannot_be_exported_is_one_line(run, tmp_path, capsys, monkeypatch):
    import dlojz_lib.inference

    class Branching(torch.nn.Module):  # control flow on the data: torch.export cannot trace it
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, images):
            logits = self.net(images)
            return logits if logits.sum().item() > 0 else -logits

    load = dlojz_lib.inference.load_for_inference

    def branching(*args):
        model = load(*args)
        model.module = Branching(model.module)
        return model

    monkeypatch.setattr(dlojz_lib.inference, "load_for_inference", branching)
    status, captured = exported(tmp_path, capsys, run, "--format", "export")
    assert status == 2 and captured.err.count("\n") == 1, captured.err
    assert "--format export: --arch resnet18 cannot be exported this way" in captured.err


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "name the model"),
        (["{tmp}/nothing.pt"], "no such file"),
        (["{run}", "--check-images", "{tmp}/empty"], "no images in"),
    ],
)
def test_bad_input_is_one_line(run, tmp_path, capsys, args, message):
    (tmp_path / "empty").mkdir()
    status, captured = exported(tmp_path, capsys, *[a.format(run=run, tmp=tmp_path) for a in args])
    assert status == 2 and captured.err.count("\n") == 1 and message in captured.err, captured.err


def test_without_check_images_and_without_the_run_s_data_is_one_line(run, tmp_path, capsys):
    import dlojz_lib.checkpoint as ckpt

    saved, _ = ckpt.load_latest(run)
    saved["args"]["data_root"] = str(tmp_path / "gone")
    ckpt.write(saved, tmp_path / "ckpt_e0001_s000000009.pt")
    status, captured = exported(tmp_path, capsys, tmp_path / "ckpt_e0001_s000000009.pt")
    assert status == 2 and "give --check-images PATH" in captured.err, captured.err


def test_exports_into_the_run_s_data_set_are_refused(run, tiny_data, tmp_path, capsys):
    """-o inside the data set the checkpoint's run read (a class folder), or another data set's class folder: one
    line naming the data set, nothing written there (a run's next scan would read the exports as that class's
    images)."""
    import shutil

    import dlojz_lib.checkpoint as ckpt

    data = shutil.copytree(tiny_data, tmp_path / "data")
    saved, _ = ckpt.load_latest(run)
    saved["args"]["data_root"] = str(data)
    ckpt.write(saved, tmp_path / "ckpt_e0001_s000000009.pt")
    before = sorted(data.rglob("*"))
    inside = data / "train" / sorted(p.name for p in (data / "train").iterdir())[0] / "exports"
    status = dlojz_export.main([str(tmp_path / "ckpt_e0001_s000000009.pt"), "-o", str(inside)])
    error = capsys.readouterr().err
    assert status == 2 and error.count("\n") == 1, error
    assert f"-o {inside} is inside the data set {data}" in error and "give a folder outside it" in error, error
    assert sorted(data.rglob("*")) == before
    other = shutil.copytree(tiny_data, tmp_path / "other")  # a data set the run did not read: its class folder
    inside = other / "val" / sorted(p.name for p in (other / "val").iterdir())[0]
    before = sorted(other.rglob("*"))
    status = dlojz_export.main([str(tmp_path / "ckpt_e0001_s000000009.pt"), "-o", str(inside)])
    error = capsys.readouterr().err
    assert status == 2 and f"-o {inside} is inside the data set {other}" in error, error
    assert sorted(other.rglob("*")) == before


@pytest.mark.parametrize("tolerance", ["nan", "inf", "-1"])
def test_a_tolerance_that_checks_nothing_is_one_line(tolerance, tmp_path, capsys):
    """NaN compares false, so --tolerance nan turned the check off in silence; a negative one fails every export."""
    with pytest.raises(SystemExit) as refused:
        dlojz_export.main(
            ["--arch", "resnet18", "--pretrained", "DEFAULT", "--tolerance", tolerance, "-o", str(tmp_path)]
        )
    error = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(error.splitlines()) == 1, error
    assert "argument --tolerance: must be" in error and ">= 0" in error, error
