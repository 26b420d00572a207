"""A trained model in the formats other tools read (dlojz_export.py), each checked against the PyTorch model on real
images in the same command.

- `EXPORTERS`: one row per format (its file name, what reads it, its writer and its reader): ONNX (torch.onnx's
  exporter; checked with onnxruntime), a `torch.export` program (.pt2: torch.export.load, AOTInductor), TorchScript
  (torch.jit.trace: C++ libtorch) and a safetensors state dict (the weights alone, for any code that builds the
  architecture). A new format is one row; the command's `--format` choices are the table's keys. Importing this
  module imports no torch (the command reads the table before its flags are checked).
- `export(model, fmt, folder, example)`: write one format; one line (UserError) when the model cannot be exported so.
- `max_difference(model, fmt, path, images)`: the largest absolute difference between the exported model's logits
  and PyTorch's on `images` (a normalised NCHW float32 batch).
- `check_images(model, paths)`: a batch of real images prepared as the model's validation prepared them.
- `is_exported(path)`, `record_export(path)`: what an export folder holds of dlojz_export.py's own, by content: its
  preprocessing.json records each file it wrote with the file's SHA-256 (`exported`), so that a later export
  replaces those and nothing else (checks.claim_output).
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dlojz_lib.checks import fail
from dlojz_lib.durable import sha256_of

MAX_BATCH = 4096  # the exported graphs' batch dimension is free up to this


@dataclass(frozen=True)
class Exporter:
    file: str
    readers: str  # who reads the file, as the command's report says
    write: Callable  # (net, path, example, arch): the file written
    read: Callable  # (model, path) -> a callable from images to logits


def batch_dim():
    import torch

    return torch.export.Dim("batch", min=1, max=MAX_BATCH)


def write_onnx(net, path, example, arch):
    import torch

    torch.onnx.export(net, (example,), str(path), input_names=["images"], output_names=["logits"],
                      dynamic_shapes=({0: batch_dim()},), dynamo=True, external_data=False, verbose=False)  # fmt: skip


def read_onnx(model, path):
    import onnxruntime
    import torch

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda images: torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])


def write_program(net, path, example, arch):
    import torch

    torch.export.save(torch.export.export(net, (example,), dynamic_shapes=({0: batch_dim()},)), str(path))


def read_program(model, path):
    import torch

    return torch.export.load(str(path)).module()


def write_torchscript(net, path, example, arch):
    import torch

    torch.jit.trace(net, example, check_trace=False).save(str(path))


def read_torchscript(model, path):
    import torch

    return torch.jit.load(str(path))


def write_safetensors(net, path, example, arch):
    from safetensors.torch import save_file

    state = {name: tensor.contiguous() for name, tensor in net.state_dict().items()}
    save_file(state, str(path), metadata={"arch": arch})


def read_safetensors(model, path):
    from safetensors.torch import load_file

    net = model.fresh()  # the same architecture, its own initial weights, then the file's
    net.load_state_dict(load_file(str(path)))
    return net.eval()


EXPORTERS = {
    "onnx": Exporter(
        "model.onnx", "ONNX runtimes (onnxruntime, TensorRT, OpenVINO), checked here with onnxruntime", write_onnx,
        read_onnx,
    ),
    "export": Exporter(
        "model.pt2", "torch.export.load, AOTInductor: PyTorch's own deployable program", write_program, read_program
    ),
    "torchscript": Exporter(
        "model.torchscript.pt", "torch.jit.load, libtorch in C++", write_torchscript, read_torchscript
    ),
    "safetensors": Exporter(
        "model.safetensors", "the weights alone: load_state_dict into the architecture", write_safetensors,
        read_safetensors,
    ),
}  # fmt: skip
PREPROCESSING_FILE = "preprocessing.json"


def _short(err, limit=200):
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def export(model, fmt, folder, example):
    """Write `model` (an InferenceModel) in `fmt` into `folder`; its path. `example`: a batch of the model's input
    (its batch size left free in the exported graph where the format allows)."""
    import torch

    path = Path(folder) / EXPORTERS[fmt].file
    net = model.module.eval()
    try:  # the exporters log their graphs to stderr when they fail: the error is said in one line instead
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            EXPORTERS[fmt].write(net, path, example, model.arch)
    except Exception as err:  # each exporter has its own errors: one line naming the format and the model
        fail(
            f"--format {fmt}: --arch {model.arch} cannot be exported this way ({_short(err)}); "
            f"the other formats may: {', '.join(f for f in EXPORTERS if f != fmt)}"
        )
    return path


def run_exported(model, fmt, path, images):
    """The exported file's logits on `images`, read back by what reads that format."""
    import torch

    with torch.no_grad():
        return EXPORTERS[fmt].read(model, path)(images)


def max_difference(model, fmt, path, images):
    import torch

    with torch.no_grad():
        reference = model.module.eval()(images)
    return (run_exported(model, fmt, path, images).float() - reference.float()).abs().max().item()


def check_images(model, paths, limit=8):
    """Up to `limit` of the image files, prepared as validation prepares them: a float32 NCHW batch."""
    import torch

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
    record = dict(model.preprocessing.as_json(model.classes), arch=model.arch, exported={})
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def export_record(folder) -> dict | None:
    """The preprocessing.json dlojz_export.py wrote in `folder` (with its `exported` record), or None."""
    try:
        record = json.loads((Path(folder) / PREPROCESSING_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("exported"), dict) else None


def is_exported(path) -> bool:
    """Whether `path` is a file dlojz_export.py wrote: its folder's preprocessing.json, or a file that json records
    with the SHA-256 the file has now."""
    path = Path(path)
    record = export_record(path.parent)
    if record is None:
        return False
    return path.name == PREPROCESSING_FILE or record["exported"].get(path.name) == sha256_of(path)


def record_export(path):
    """Add the file at `path`, just written, to its folder's record."""
    path = Path(path)
    record = export_record(path.parent)
    record["exported"][path.name] = sha256_of(path)
    (path.parent / PREPROCESSING_FILE).write_text(json.dumps(record, indent=1) + "\n")
