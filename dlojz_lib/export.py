"""A trained model in the formats other tools read (dlojz_export.py), each checked against the PyTorch model on real
images in the same command.

- `EXPORTERS`: format -> (file name, what reads it): ONNX (torch.onnx's exporter; checked with onnxruntime), a
  `torch.export` program (.pt2: torch.export.load, AOTInductor), TorchScript (torch.jit.trace: C++ libtorch) and
  a safetensors state dict (the weights alone, for any code that builds the architecture).
- `export(model, fmt, folder, example)`: write one format; one line (UserError) when the model cannot be exported so.
- `max_difference(model, fmt, path, images)`: the largest absolute difference between the exported model's logits
  and PyTorch's on `images` (a normalised NCHW float32 batch).
- `check_images(model, paths)`: a batch of real images prepared as the model's validation prepared them.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

from dlojz_lib.checks import fail

EXPORTERS = {
    "onnx": ("model.onnx", "ONNX runtimes (onnxruntime, TensorRT, OpenVINO), checked here with onnxruntime"),
    "export": ("model.pt2", "torch.export.load, AOTInductor: PyTorch's own deployable program"),
    "torchscript": ("model.torchscript.pt", "torch.jit.load, libtorch in C++"),
    "safetensors": ("model.safetensors", "the weights alone: load_state_dict into the architecture"),
}
PREPROCESSING_FILE = "preprocessing.json"


def _short(err, limit=200):
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def export(model, fmt, folder, example):
    """Write `model` (an InferenceModel) in `fmt` into `folder`; its path. `example`: a batch of the model's input
    (its batch size left free in the exported graph where the format allows)."""
    path = Path(folder) / EXPORTERS[fmt][0]
    net = model.module.eval()
    try:  # the exporters log their graphs to stderr when they fail: the error is said in one line instead
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            if fmt == "safetensors":
                from safetensors.torch import save_file

                state = {name: tensor.contiguous() for name, tensor in net.state_dict().items()}
                save_file(state, str(path), metadata={"arch": model.arch})
            elif fmt == "export":
                batch = torch.export.Dim("batch", min=1, max=4096)
                program = torch.export.export(net, (example,), dynamic_shapes=({0: batch},))
                torch.export.save(program, str(path))
            elif fmt == "torchscript":
                traced = torch.jit.trace(net, example, check_trace=False)
                traced.save(str(path))
            else:
                torch.onnx.export(
                    net,
                    (example,),
                    str(path),
                    input_names=["images"],
                    output_names=["logits"],
                    dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=4096)},),
                    dynamo=True,
                    external_data=False,
                    verbose=False,
                )
    except Exception as err:  # each exporter has its own errors: one line naming the format and the model
        fail(
            f"--format {fmt}: --arch {model.arch} cannot be exported this way ({_short(err)}); "
            f"the other formats may: {', '.join(f for f in EXPORTERS if f != fmt)}"
        )
    return path


def run_exported(model, fmt, path, images):
    """The exported file's logits on `images`, read back by what reads that format."""
    with torch.no_grad():
        if fmt == "safetensors":
            from safetensors.torch import load_file

            net = model.fresh()  # the same architecture, its own initial weights, then the file's
            net.load_state_dict(load_file(str(path)))
            return net.eval()(images)
        if fmt == "export":
            return torch.export.load(str(path)).module()(images)
        if fmt == "torchscript":
            return torch.jit.load(str(path))(images)
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"images": images.numpy()})
    return torch.from_numpy(logits)


def max_difference(model, fmt, path, images):
    with torch.no_grad():
        reference = model.module.eval()(images)
    return (run_exported(model, fmt, path, images).float() - reference.float()).abs().max().item()


def check_images(model, paths, limit=8):
    """Up to `limit` of the image files, prepared as validation prepares them: a float32 NCHW batch."""
    from dlojz_lib.data.prefetch import DeviceNormalize
    from dlojz_lib.inference import ImageFiles

    dataset = ImageFiles(paths, model.preprocessing)
    crops = [image for image, ok in (dataset[i] for i in range(len(paths))) if ok][:limit]
    if not crops:
        fail(f"no readable image among the {len(paths)} given to check the exports with")
    normalize = DeviceNormalize("cpu", mean=model.preprocessing.mean, std=model.preprocessing.std)
    return normalize(torch.stack(crops)).contiguous()


def write_preprocessing(model, folder):
    path = Path(folder) / PREPROCESSING_FILE
    path.write_text(json.dumps(dict(model.preprocessing.as_json(model.classes), arch=model.arch), indent=1) + "\n")
    return path
