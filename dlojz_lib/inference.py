"""A trained model outside training: its weights, classes and preprocessing from any dlojz checkpoint or published
weights, its predictions on image files, and its exports (dlojz_predict.py, dlojz_export.py).

- `load_for_inference(checkpoint, arch, pretrained, ema)`: an `InferenceModel`: the module in eval mode on the CPU,
  its class names, its `Preprocessing` (validation's resize, crop, interpolation, mean and std, as the run
  validated it or as the weights were published), and a line saying where it all came from. A dlojz checkpoint:
  raw, its EMA (`ema=True`), averaged (dlojz_avg.py) or consolidated (dlojz_fsdp.py consolidate); a run's folder
  stands for its newest checkpoint. Or `--arch` with `--pretrained` weights from the offline cache.
- `image_files(paths)`: the images under files and folders (recursive), sorted; one line when there are none.
- `predict(model, files, ...)`: top-k classes and probabilities per readable file, batched, on any device, AMP
  where asked, flip TTA as validation does it; each unreadable file one warning, counted.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

import torch

from dlojz_lib.checks import UserError, fail

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm")


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """What a model's input is made with: the shorter side resized to `resize_size`, a center crop of `crop_size`,
    PIL's `interpolation`, then (x / 255 - mean) / std per RGB channel."""

    resize_size: int
    crop_size: int
    interpolation: str
    mean: tuple
    std: tuple

    def as_json(self, classes) -> dict:
        """The file written beside an exported model: enough to feed it without dlojz."""
        return dict(
            dataclasses.asdict(self),
            mean=list(self.mean),
            std=list(self.std),
            input="RGB, NCHW float32, resize the shorter side to resize_size, center crop crop_size, x / 255, "
            "then (x - mean) / std per channel",
            classes=list(classes),
        )


@dataclasses.dataclass
class InferenceModel:
    module: torch.nn.Module
    classes: list
    preprocessing: Preprocessing
    arch: str
    source: str  # where the weights, classes and preprocessing came from, in a line
    fresh: object  # () -> a new module of the same architecture (random weights): what a weights file loads into
    settings: dict = dataclasses.field(default_factory=dict)  # the checkpoint's run settings (none for published)


def load_for_inference(checkpoint=None, arch=None, pretrained=None, ema=False) -> InferenceModel:
    """The model of a dlojz checkpoint (a file, a run's folder: its newest) or of `arch`'s published weights
    `pretrained`; UserError in one line for anything else."""
    if checkpoint is not None:
        return _from_checkpoint(Path(checkpoint), ema)
    return _from_published(arch, pretrained)


def _from_checkpoint(path, ema) -> InferenceModel:
    import dlojz_lib.checkpoint as ckpt
    from dlojz_lib.data.transforms import IMAGENET_MEAN, IMAGENET_STD
    from dlojz_lib.model.pretrained import strip_wrappers
    from dlojz_lib.model.zoo import apply_blurpool, create_model

    if path.is_dir() and not ckpt.NAME_RE.match(path.name):  # a run's folder: its newest checkpoint
        saved, found = ckpt.load_latest(path)
        if saved is None:
            fail(
                f"{path}: no dlojz checkpoint in this folder (ckpt_e*_s*.pt): give a checkpoint file or a run's folder"
            )
        path = found
    else:
        try:
            saved = ckpt.load(path)
        except ckpt.CheckpointError as err:
            fail(f"{err}: give a dlojz checkpoint, or --arch NAME --pretrained WEIGHTS for published weights")
    if saved.get("sharded_path"):
        fail(
            f"{path} is a sharded checkpoint (--fsdp): make it one file first with python dlojz_fsdp.py consolidate "
            f"{path} consolidated.pt, then give consolidated.pt"
        )
    args, num_classes = saved.get("args") or {}, saved.get("num_classes")
    if "arch" not in args or num_classes is None:
        fail(f"{path}: a dlojz checkpoint without its run's settings (arch, classes): written by an older dlojz?")

    def fresh():
        module = create_model(args["arch"], num_classes, args.get("zero_init_residual", False), args.get("image_size"))
        if args.get("blurpool"):  # the run's blurred downsampling is part of the model it trained
            apply_blurpool(module, maxpool=args.get("blurpool_maxpool", True))
        return module

    module = fresh()
    weights = ckpt.ema_weights(saved, path, "--ema") if ema else saved["model"]
    try:
        module.load_state_dict({strip_wrappers(key): value for key, value in weights.items()})
    except RuntimeError as err:
        fail(f"{path}: its weights do not fit --arch {args['arch']} ({ckpt.short_reason(err)})")
    classes, named_by = saved.get("classes"), "the checkpoint"
    if not classes:
        classes, named_by = _classes_of_data(args.get("data_root"), num_classes)
    preprocessing = Preprocessing(
        args["val_resize_size"],
        args["val_crop_size"],
        args.get("val_interpolation", "bilinear"),
        tuple(args.get("mean") or IMAGENET_MEAN),  # the run's --mean/--std, ImageNet's when it gave none
        tuple(args.get("std") or IMAGENET_STD),
    )
    source = (
        f"{path}{' (its EMA weights)' if ema else ''}: --arch {args['arch']}, {num_classes} classes named by "
        f"{named_by}, validation's preprocessing (resize {preprocessing.resize_size}, crop {preprocessing.crop_size}, "
        f"{preprocessing.interpolation})"
    )
    return InferenceModel(module.eval(), list(classes), preprocessing, args["arch"], source, fresh, args)


def _classes_of_data(data_root, num_classes):
    """Class names for a checkpoint that has none (older dlojz): its data set's train/ folders if they are still
    there, else the class indices."""
    train = Path(data_root) / "train" if data_root else None
    if train is not None and train.is_dir():
        names = sorted(entry.name for entry in os.scandir(train) if entry.is_dir())
        if len(names) == num_classes:
            return names, f"the folders of {train}"
    return [str(i) for i in range(num_classes)], "their indices (the checkpoint names none)"


def _from_published(arch, name) -> InferenceModel:
    from dlojz_lib.model.pretrained import load_initial_weights, published_preprocessing, published_weights_file
    from dlojz_lib.model.zoo import check_arch, create_model

    check_arch(arch)
    preprocessing = published_preprocessing(arch, name)
    if preprocessing is None:
        fail(f"--pretrained {name}: no published weights of that name for --arch {arch}")
    if arch.startswith("timm:"):
        from dlojz_lib.model.pretrained import timm_weights

        num_classes, classes = timm_weights(arch, name).num_classes, None
    else:
        from dlojz_lib.model.pretrained import torchvision_weights

        classes = list(torchvision_weights(arch, name).meta["categories"])
        num_classes = len(classes)

    def fresh():
        return create_model(arch, num_classes, False, preprocessing["val_crop_size"])

    module = fresh()
    path = published_weights_file(arch, name)
    load_initial_weights(module, path, num_classes, f"--pretrained {name}")
    classes = classes or [str(i) for i in range(num_classes)]
    found = Preprocessing(
        preprocessing["val_resize_size"],
        preprocessing["val_crop_size"],
        preprocessing["interpolation"],
        preprocessing["mean"],
        preprocessing["std"],
    )
    source = f"--arch {arch} --pretrained {name} ({path}): {num_classes} classes, the published preprocessing"
    return InferenceModel(module.eval(), classes, found, arch, source, fresh)


def image_files(paths) -> list[str]:
    """The image files named or under the folders named (recursively), each once, sorted within each folder."""
    found = []
    for given in map(Path, paths):
        if given.is_dir():
            found += sorted(str(p) for p in given.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        elif given.is_file():
            found.append(str(given))
        else:
            fail(f"{given}: {what_is_not_there(given)}")
    if not found:
        fail(f"no images in {', '.join(map(str, paths))} (looked for {', '.join(IMAGE_SUFFIXES)}, in sub-folders too)")
    return list(dict.fromkeys(found))


def what_is_not_there(path) -> str:
    """Why `path`, neither a folder nor a regular file, holds no image, in words: a pipe or device, a link that
    leads nowhere or round in a loop, or nothing at all."""
    import errno
    import os

    try:
        path.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symbolic link that leads round in a loop (each link names another): give the file it should name"
        if os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which does not exist: give an image file or a folder"
        return "no such file or folder"
    return "not an image file nor a folder (a named pipe, a device or a socket): give an image file or a folder"


class ImageFiles(torch.utils.data.Dataset):
    """The files as validation's uint8 crops; an unreadable one is a zero image flagged False, and a warning."""

    def __init__(self, files, preprocessing):
        from dlojz_lib.data.transforms import ValTransform

        self.files = files
        self.transform = ValTransform(
            preprocessing.resize_size, preprocessing.crop_size, interpolation=preprocessing.interpolation
        )
        self.crop = preprocessing.crop_size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from dlojz_lib.data.transforms import lazy_image_loader

        try:
            return self.transform(lazy_image_loader(self.files[i])), True
        except (OSError, ValueError, SyntaxError) as err:  # PIL's and the decoder's ways of saying it
            print(f"WARNING: skipping unreadable image {self.files[i]}: {err}", file=sys.stderr, flush=True)
            return torch.zeros(3, self.crop, self.crop, dtype=torch.uint8), False


def predict(model, files, batch_size, device, amp_dtype=None, tta_flip=False, top_k=5, num_workers=0):
    """(rows, unreadable count, images/s after the first batch): per readable file (path, [(class, probability)] * top_k), in the files' order.
    The logits are validation's: the model's on the crop, averaged with its mirror's with `tta_flip`."""
    from dlojz_lib.data.loaders import _worker_init
    from dlojz_lib.data.prefetch import DeviceNormalize

    preprocessing = model.preprocessing
    # channels-last: what convolutions run fastest on, GPU and CPU (measured here: ResNet-18 on 2 cores, 44 img/s
    # against 32); the logits differ from NCHW's by rounding only
    normalize = DeviceNormalize(device, mean=preprocessing.mean, std=preprocessing.std, channels_last=True)
    loader = torch.utils.data.DataLoader(
        ImageFiles(files, preprocessing),
        batch_size=batch_size,
        num_workers=num_workers,
        multiprocessing_context="forkserver" if num_workers else None,
        worker_init_fn=functools.partial(_worker_init, parent=os.getpid()) if num_workers else None,  # 1 thread each
        pin_memory=device.type == "cuda",
    )
    net = model.module.to(device, memory_format=torch.channels_last).eval()
    k = min(top_k, len(model.classes))
    rows, unreadable, seen, started = [], 0, 0, None
    with torch.no_grad():
        for images, readable in loader:
            if started is None:  # the rate leaves out the workers' start and the first batch, as validation's time
                started, first = time.perf_counter(), len(readable)
            images = normalize(images.to(device, non_blocking=True))
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = net(images).float()
                if tta_flip:
                    logits = (logits + net(images.flip(3)).float()) / 2
            probabilities, classes = logits.softmax(1).topk(k, dim=1)
            for i, (ok, top, p) in enumerate(zip(readable.tolist(), classes.tolist(), probabilities.tolist())):
                if ok:
                    rows.append((files[seen + i], [(model.classes[c], q) for c, q in zip(top, p)]))
                else:
                    unreadable += 1
            seen += len(readable)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = (seen - first) / (time.perf_counter() - started) if seen > first else None
    return rows, unreadable, rate


def write_csv(path, rows, k):
    """image, predicted_class, class_1, probability_1, ... class_k, probability_k; written whole, then renamed."""
    from dlojz_lib.metrics import durable_csv

    with durable_csv(Path(path)) as writer:
        writer.writerow(
            ["image", "predicted_class", *(c for r in range(1, k + 1) for c in (f"class_{r}", f"probability_{r}"))]
        )
        for image, top in rows:
            writer.writerow([image, top[0][0], *(v for name, p in top for v in (name, f"{p:.6f}"))])


def check_checkpoint_or_weights(checkpoint, arch, pretrained):
    """One line unless a checkpoint or --arch with --pretrained names the model."""
    if checkpoint is None and (arch is None or pretrained is None):
        raise UserError("name the model: a dlojz checkpoint (or a run's folder), or --arch NAME --pretrained WEIGHTS")
