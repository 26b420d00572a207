"""Weights to start from: torchvision's published weights from torch hub's local cache (`--pretrained`), or
(`--initial-checkpoint`) a torchvision or timm state dict (.pt/.pth), a .safetensors file or a dlojz checkpoint's
model; loaded into the model before it is wrapped, with a new, freshly initialised head where the data's number of
classes differs from the file's. A fresh optimizer, schedule and epoch count follow: unlike
`--resume`, which wins when it finds a checkpoint (a preempted fine-tuning resumes from its own checkpoints).

One start-up line says how many tensors were loaded and which layers are new; a key that does not match outside the
head is one line naming it, exit status 2 (another architecture's weights), never a partly loaded model.
"""

from pathlib import Path

import torch

from dlojz_lib.checks import UserError, check_input_file, fail
from dlojz_lib.model import classifier_name

# Prefixes that wrappers add to a saved state dict's keys: DDP's and torch.compile's.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def check_weights_file(path):
    """Before any process group: the file is there, a regular file (a pipe would block torch.load) and readable;
    its contents are read when the model is built."""
    check_input_file(
        path, "--initial-checkpoint", "give a .pt/.pth state dict, a .safetensors file or a dlojz checkpoint"
    )


def published_weights_file(arch, name):
    """The file of torchvision's published weights `name` for `arch` in torch hub's cache ($TORCH_HOME/hub/
    checkpoints, where torchvision downloads them), or one line naming the file expected and the command that
    fetches it where the internet is (a login node): a training run never downloads."""
    import torchvision

    if arch.startswith("timm:"):
        fail(
            f"--pretrained: {arch} is a timm model: fetch its weights where the internet is (timm.create_model("
            f"'{arch[5:]}', pretrained=True) fills Hugging Face's cache) and give the file with --initial-checkpoint"
        )
    try:
        enum = torchvision.models.get_model_weights(arch)
    except (ValueError, KeyError):
        fail(f"--pretrained: torchvision publishes no weights for --arch {arch}")
    names = [member for member in enum.__members__ if member != "DEFAULT"]
    if name not in enum.__members__:
        fail(f"--pretrained {name}: --arch {arch}'s weights are {', '.join(names)} (or DEFAULT)")
    weights = enum[name]
    path = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if not path.is_file():
        fail(
            f"--pretrained {name}: {path} is not in torch hub's cache, and a run does not download: fetch it where "
            f"the internet is with python -c \"import torchvision; torchvision.models.get_weight('{weights}')"
            f'.get_state_dict()" (same TORCH_HOME), then run again'
        )
    return path


def published_preprocessing(arch, name):
    """The validation resize and crop (px) torchvision's weights `name` were evaluated with, and what else their
    preprocessing says, or None where there are none (a timm model, an unknown name: the checks say so)."""
    import torchvision

    try:
        weights = torchvision.models.get_model_weights(arch)[name]
    except (ValueError, KeyError):
        return None
    preprocessing = weights.transforms()
    return dict(
        val_resize_size=preprocessing.resize_size[0],
        val_crop_size=preprocessing.crop_size[0],
        interpolation=preprocessing.interpolation.value,
        imagenet_normalisation=(list(preprocessing.mean), list(preprocessing.std))
        == ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    )


def read_weights(path):
    """{name: tensor} from the file, whatever its kind, and what kind it was."""
    import dlojz_lib.checkpoint as ckpt

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu"), "safetensors file"
        except (SafetensorError, OSError) as err:
            fail(f"--initial-checkpoint {path}: not a readable .safetensors file ({err})")
    if ckpt.NAME_RE.match(path.name) or ckpt.checksum_path(path).exists():  # dlojz's: checked against its SHA-256
        try:
            saved = ckpt.load(path)
        except ckpt.CheckpointError as err:
            fail(f"--initial-checkpoint: {err}")
        return saved["model"], "dlojz checkpoint's model"
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip or torch's own errors: one line, not a traceback
        fail(f"--initial-checkpoint {path}: not a weights file torch can read safely ({ckpt.short_reason(err)})")
    for key in ("model", "state_dict", "model_state_dict"):  # the layouts of dlojz, timm and common scripts
        if isinstance(saved, dict) and isinstance(saved.get(key), dict):
            return saved[key], f"state dict (its '{key}')"
    if not isinstance(saved, dict) or not all(isinstance(value, torch.Tensor) for value in saved.values()):
        fail(f"--initial-checkpoint {path}: holds no state dict of tensors (a {type(saved).__name__})")
    return saved, "state dict"


def load_initial_weights(module, path, num_classes):
    """Load the file's tensors into `module` (unwrapped, before DDP or FSDP). Returns the start-up line."""
    weights, kind = read_weights(path)
    weights = {strip_wrappers(key): value for key, value in weights.items()}
    own = module.state_dict()
    head = classifier_name(module, num_classes)
    in_head = lambda key: head is not None and key.startswith(head + ".")  # noqa: E731
    loaded, new = {}, []
    for key, value in weights.items():
        if key not in own:
            if in_head(key):
                continue
            raise UserError(
                f"--initial-checkpoint {path}: its tensor {key} has no place in --arch's model (another "
                f"architecture's weights?); the model's first keys: {', '.join(list(own)[:3])}"
            )
        if own[key].shape != value.shape:
            if in_head(key):
                new.append(key)
                continue
            raise UserError(
                f"--initial-checkpoint {path}: {key} is {tuple(value.shape)} there, {tuple(own[key].shape)} in "
                f"this model (another architecture or width?)"
            )
        loaded[key] = value
    missing = [key for key in own if key not in loaded and key not in new]
    outside = [key for key in missing if not in_head(key)]
    if outside:
        raise UserError(
            f"--initial-checkpoint {path}: no tensor for {outside[0]} ({len(outside)} of the model's "
            f"{len(own)} missing; another architecture?)"
        )
    new += missing
    module.load_state_dict(loaded, strict=False)
    line = f"initial weights: {len(loaded)} of {len(own)} tensors from {path} ({kind})"
    if new:
        line += f"; new, freshly initialised for {num_classes} classes: {', '.join(sorted(new))}"
    return line


def strip_wrappers(key):
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key
