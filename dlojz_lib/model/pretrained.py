"""Weights to start from: torchvision's or timm's published weights from the local caches (`--pretrained`, which
`--fetch-weights` fills where the internet is), or
(`--initial-checkpoint`) a torchvision or timm state dict (.pt/.pth), a .safetensors file or a dlojz checkpoint's
model; loaded into the model before it is wrapped, with a new, freshly initialised head where the data's number of
classes differs from the file's. A fresh optimizer, schedule and epoch count follow: unlike
`--resume`, which wins when it finds a checkpoint (a preempted fine-tuning resumes from its own checkpoints).

One start-up line says how many tensors were loaded and which layers are new; a key that does not match outside the
head is one line naming it, exit status 2 (another architecture's weights), never a partly loaded model.
`load_starting_weights` is the build's one call: the flags' weights, or none when the run resumes.
"""

import math
import os
from pathlib import Path

import torch

from dlojz_lib.checks import UserError, check_input_file, check_output_folder, fail
from dlojz_lib.durable import sha256_of
from dlojz_lib.model.zoo import classifier_name

# Prefixes that wrappers add to a saved state dict's keys: DDP's and torch.compile's.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def check_weights_file(path):
    """Before any process group: the file is there, a regular file (a pipe would block torch.load) and readable;
    its contents are read when the model is built."""
    check_input_file(
        path, "--initial-checkpoint", "give a .pt/.pth state dict, a .safetensors file or a dlojz checkpoint"
    )


def published_weights_file(arch, name):
    """The file of the published weights `name` for `arch` in its local cache: torchvision's in torch hub's
    ($TORCH_HOME/hub/checkpoints, where torchvision downloads them), timm's in Hugging Face's ($HF_HUB_CACHE or
    $HF_HOME/hub). Or one line naming what is expected and the command that fetches it where the internet is (a
    login node): a training run never downloads."""
    fetch = f"python dlojz.py --arch {arch} --pretrained {name} --fetch-weights"
    if arch.startswith("timm:"):
        repo = timm_weights(arch, name).hf_hub_id
        path = timm_cached_file(repo)
        if path is None:
            fail(
                f"--pretrained {name}: timm's {repo} is not in Hugging Face's cache ({hf_cache_dir()}), and a run "
                f"does not download: fetch it where the internet is with {fetch} (same HF_HOME), then run again"
            )
        return path
    path = torchvision_weights_path(torchvision_weights(arch, name))
    if not path.is_file():
        fail(
            f"--pretrained {name}: {path} is not in torch hub's cache, and a run does not download: fetch it where "
            f"the internet is with {fetch} (same TORCH_HOME), then run again"
        )
    return path


def published_preprocessing(arch, name):
    """The validation resize and crop (px) the weights `name` were evaluated with, their interpolation, mean and
    std, or None where they are not known (an unknown name: the checks say so)."""
    try:
        if arch.startswith("timm:"):
            weights = timm_weights(arch, name)
            crop = weights.input_size[-1]
            resize = math.floor(crop / weights.crop_pct)  # as timm's eval transform sizes it
            interpolation, mean, std = weights.interpolation, weights.mean, weights.std
        else:
            preprocessing = torchvision_weights(arch, name).transforms()
            resize, crop = preprocessing.resize_size[0], preprocessing.crop_size[0]
            interpolation, mean, std = preprocessing.interpolation.value, preprocessing.mean, preprocessing.std
    except UserError:
        return None
    return dict(
        val_resize_size=resize, val_crop_size=crop, interpolation=interpolation, mean=tuple(mean), std=tuple(std)
    )


def torchvision_weights(arch, name):
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(arch)
    except (ValueError, KeyError):
        fail(f"--pretrained: torchvision publishes no weights for --arch {arch}")
    if name not in enum.__members__:
        names = [member for member in enum.__members__ if member != "DEFAULT"]
        fail(f"--pretrained {name}: --arch {arch}'s weights are {', '.join(names)} (or DEFAULT)")
    return enum[name]


def torchvision_weights_path(weights):
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name


def timm_weights(arch, name):
    """timm's pretrained configuration of `arch` (timm:NAME) for the tag `name` (DEFAULT: the model's first)."""
    import timm
    import timm.models

    model = arch[len("timm:") :]
    try:
        weights = timm.models.get_pretrained_cfg(model if name == "DEFAULT" else f"{model}.{name}")
    except RuntimeError:  # an unknown tag
        weights = None
    if weights is None or not weights.hf_hub_id:
        tags = [full.split(".", 1)[1] for full in timm.list_pretrained(f"{model}.*")]
        if not tags:
            fail(f"--pretrained: timm publishes no weights on Hugging Face for --arch {arch}")
        fail(f"--pretrained {name}: --arch {arch}'s weights are {', '.join(tags)} (or DEFAULT)")
    return weights


# timm's weights on Hugging Face, in the order timm reads them.
HF_WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")


def hf_cache_dir():
    """Hugging Face's cache folder, from the environment as it is now (huggingface_hub reads it once, at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home) / "hub"


def timm_cached_file(repo):
    from huggingface_hub import try_to_load_from_cache

    for filename in HF_WEIGHTS_FILES:
        found = try_to_load_from_cache(repo, filename, cache_dir=hf_cache_dir())
        if isinstance(found, str):  # (a marker object records a file known to be absent)
            return Path(found)
    return None


def fetch_weights(arch, name):
    """`--fetch-weights`, where the internet is: the published weights into their local cache, checked against
    the hash their source publishes (torchvision: the SHA-256 prefix in the file's name; Hugging Face: the SHA-256
    that names a stored large file). Returns the line to print; a failed check keeps nothing."""
    if arch.startswith("timm:"):
        repo = timm_weights(arch, name).hf_hub_id
        path = timm_cached_file(repo)
        if path is not None:
            blob = Path(path).resolve()  # a large file is stored under its SHA-256: a truncated one is fetched again
            if len(blob.name) != 64 or sha256_of(blob) == blob.name:
                return f"{path}: already in Hugging Face's cache"
            Path(path).unlink()
            blob.unlink()
        return fetch_from_hugging_face(repo)
    weights = torchvision_weights(arch, name)
    path = torchvision_weights_path(weights)
    prefix = torch.hub.HASH_REGEX.search(path.name).group(1)
    again = ""
    if path.is_file():
        if sha256_of(path).startswith(prefix):
            return f"{path}: already in torch hub's cache (its SHA-256 starts with {prefix} as published)"
        path.unlink()  # truncated or damaged: fetched again below
        again = " again (the cached file was damaged: its SHA-256 did not match)"
    fetch_file(weights.url, path, prefix)
    return f"{path}: fetched{again} from {weights.url}, its SHA-256 starts with {prefix} as published"


def fetch_file(url, path, sha256_prefix):
    """`url` into `path` through a temporary file beside it, kept only when its SHA-256 starts with the prefix."""
    from urllib.error import URLError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        check_output_folder(path.parent, "--fetch-weights")  # a read-only cache: one line, before the download
        torch.hub.download_url_to_file(url, str(path), hash_prefix=sha256_prefix, progress=True)
    except RuntimeError as err:  # torch's hash check: its temporary file is removed
        fail(f"--fetch-weights: {url} does not match its published SHA-256 ({err}); nothing was kept: try again")
    except PermissionError as err:
        fail(f"--fetch-weights: cannot write {path} ({err.strerror}): set TORCH_HOME to a folder you can write in")
    except (URLError, OSError) as err:
        fail(f"--fetch-weights: cannot download {url} ({err}): run it where the internet is (a login node)")


def fetch_from_hugging_face(repo):
    import huggingface_hub

    reasons = []
    for filename in HF_WEIGHTS_FILES:
        try:
            path = Path(huggingface_hub.hf_hub_download(repo, filename, cache_dir=hf_cache_dir()))
        except Exception as err:  # noqa: BLE001  (not in the repository, no network: the next, then one line)
            reasons.append(f"{filename}: {str(err).strip().splitlines()[0] if str(err).strip() else repr(err)}")
            continue
        blob = path.resolve()
        digest = sha256_of(blob)
        if len(blob.name) == 64 and digest != blob.name:  # a large file is stored under its SHA-256
            path.unlink()
            blob.unlink()
            fail(f"--fetch-weights: {repo}'s {filename} does not match its SHA-256 {blob.name}; nothing was kept")
        return f"{path}: fetched from Hugging Face's {repo}, SHA-256 {digest}"
    fail(f"--fetch-weights: cannot download {repo} ({'; '.join(reasons)}): run it where the internet is")


def weights_source(training):
    """The weights file a run starts from, how the user named it, and what to do when it is damaged: the
    --initial-checkpoint file as given, or the cache's file of --pretrained (delete it, fetch it again). `training`:
    the run's training settings (--arch, --pretrained, --initial-checkpoint)."""
    if training.initial_checkpoint is not None:
        return training.initial_checkpoint, "--initial-checkpoint", ""
    path = published_weights_file(training.arch, training.pretrained)
    fetch = f"python dlojz.py --arch {training.arch} --pretrained {training.pretrained} --fetch-weights"
    return path, f"--pretrained {training.pretrained}: the cached file", f"; delete it and fetch it again with {fetch}"


def read_weights(path, what="--initial-checkpoint", fix=""):
    """{name: tensor} from the file, whatever its kind, and what kind it was. `what` names the file in an error
    (the flag the user gave), `fix` ends it ("; what to do")."""
    import dlojz_lib.checkpoint as ckpt

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu"), "safetensors file"
        except (SafetensorError, OSError) as err:
            fail(f"{what} {path}: not a readable .safetensors file ({err}){fix}")
    side_file = path.name in (ckpt.LATEST, ckpt.BEST) or path.name.endswith(ckpt.CHECKSUM_SUFFIX)  # (a run's)
    if ckpt.NAME_RE.match(path.name) or ckpt.checksum_path(path).exists() or side_file:  # checked against its SHA-256
        try:
            saved = ckpt.load(path)
        except ckpt.CheckpointError as err:
            fail(f"{what}: {err}{fix}")
        return saved["model"], "dlojz checkpoint's model"
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip or torch's own errors: one line, not a traceback
        fail(f"{what} {path} {ckpt.why_unreadable(path, err)}{fix}")
    for key in ("model", "state_dict", "model_state_dict"):  # the layouts of dlojz, timm and common scripts
        if isinstance(saved, dict) and isinstance(saved.get(key), dict):
            return saved[key], f"state dict (its '{key}')"
    if not isinstance(saved, dict) or not all(isinstance(value, torch.Tensor) for value in saved.values()):
        fail(f"{what} {path}: holds no state dict of tensors (a {type(saved).__name__}){fix}")
    return saved, "state dict"


def load_initial_weights(module, path, num_classes, what="--initial-checkpoint", fix=""):
    """Load the file's tensors into `module` (unwrapped, before DDP or FSDP). Returns the start-up line. BatchNorm's
    `num_batches_tracked`, absent from older files, stays the model's own (0), as torch's strict load fills it;
    weights of a non-floating dtype (int8, quantised) for floating parameters are refused. `what`, `fix`: as
    read_weights'."""
    weights, kind = read_weights(path, what, fix)
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
                f"{what} {path}: its tensor {key} has no place in --arch's model (another "
                f"architecture's weights?); the model's first keys: {', '.join(list(own)[:3])}"
            )
        if own[key].shape != value.shape:
            if in_head(key):
                new.append(key)
                continue
            raise UserError(
                f"{what} {path}: {key} is {tuple(value.shape)} there, {tuple(own[key].shape)} in "
                f"this model (another architecture or width?)"
            )
        if own[key].is_floating_point() and not value.is_floating_point():
            raise UserError(
                f"{what} {path}: {key} is {str(value.dtype).removeprefix('torch.')} there, not floating point "
                "(quantised weights?): give the floating-point weights to train from"
            )
        if value.is_floating_point() and not bool(value.isfinite().all()):  # (else the loss, and --lr, is blamed)
            raise UserError(
                f"{what} {path}: {key} holds NaN or infinite values (weights saved after a diverged step?): give "
                "weights from before it"
            )
        loaded[key] = value
    untracked = [key for key in own if key.endswith(".num_batches_tracked") and key not in loaded]
    missing = [key for key in own if key not in loaded and key not in new and key not in untracked]
    outside = [key for key in missing if not in_head(key)]
    if outside:
        raise UserError(
            f"{what} {path}: no tensor for {outside[0]} ({len(outside)} of the model's "
            f"{len(own)} missing; another architecture?){fix}"
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


def load_starting_weights(training, resume, output_dir, module, num_classes, log):
    """--pretrained's or --initial-checkpoint's weights into `module`, before any wrapper or copy; not read when the
    run resumes from a checkpoint (`resume`, `output_dir`), whose weights replace them."""
    if training.initial_checkpoint is None and training.pretrained is None:
        return
    from dlojz_lib.checkpoint import resumes_a_checkpoint

    if resumes_a_checkpoint(resume, output_dir):  # the file may be gone since: not read
        log("initial weights: not read, the run resumes from its checkpoint, whose weights replace them")
        return
    weights, what, fix = weights_source(training)  # the file, the flag as given, what to do with a damaged cache file
    log(load_initial_weights(module, weights, num_classes, what, fix))
