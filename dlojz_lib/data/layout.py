"""What a data folder holds, read from the disk alone (no torch): the layouts dlojz reads (`find_layout`: the
ImageNet layout with meta.bin, ImageFolder's train/ and val/, or one folder of classes to split) and the one listing
that decides what a class and an image are (`list_split`). Each bad folder is a `DataError` with a one-line message.
dlojz_lib/data/datasets.py builds its data sets on them; dlojz_pack.py packs what they list."""

import os
from pathlib import Path

from dlojz_lib.checks import DataError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# Folders and files that tools leave beside the data: never a class, never an image (a Jupyter checkpoint folder
# would train as one more class, macOS's ._NAME resource forks as unreadable images).
TOOL_NAMES = ("__MACOSX", "__pycache__", "Thumbs.db", "desktop.ini")


def is_tool_entry(name):
    return name.startswith(".") or name in TOOL_NAMES


def list_split(split_dir):
    """(classes, samples, notes) of one split folder, the one place that decides what a class and an image are:
    each visible subfolder is a class; its images are the files with an image extension under it, links followed,
    in torchvision's ImageFolder order (folders then names sorted). Hidden and tool entries (`.ipynb_checkpoints`,
    `__MACOSX`, `._img.jpg`) are left out; a link that loops, or leads to a folder of the data root outside its
    class (another class's images, which would be labelled as this one), is left out; each kind is one note line.
    DataError for a folder that cannot be read or a class without an image."""
    split_dir = Path(split_dir)
    data_root = os.path.realpath(split_dir.parent)
    ignored, left_out = [], []
    classes = []
    for entry in sorted(os.scandir(split_dir), key=lambda entry: entry.name):
        try:
            folder = entry.is_dir()
        except OSError:  # a link to itself: ELOOP
            folder = None
        if is_tool_entry(entry.name):
            ignored.append(entry.name)
        elif folder:
            classes.append(entry.name)
        elif entry.is_symlink() and not os.path.exists(entry.path):
            left_out.append(f"{entry.path} (a link that loops or leads nowhere)")
    if not classes:
        raise DataError(f"{split_dir}: no class folder (<class>/ holding its images) in it")
    samples = []
    for target, name in enumerate(classes):
        class_real = os.path.realpath(split_dir / name)
        walked = []
        seen = {class_real}

        def stop(err):
            if isinstance(err, PermissionError):
                raise unreadable(err)
            left_out.append(f"{err.filename} ({err.strerror})")

        for folder, subfolders, files in os.walk(split_dir / name, followlinks=True, onerror=stop):
            kept = []
            for sub in subfolders:
                path = os.path.join(folder, sub)
                real = os.path.realpath(path)
                if is_tool_entry(sub):
                    ignored.append(os.path.relpath(path, split_dir))
                elif real in seen or class_real.startswith(real + os.sep):
                    left_out.append(f"{path} (a link to a folder listed already: a loop)")
                elif (real + os.sep).startswith(data_root + os.sep) and not real.startswith(class_real + os.sep):
                    left_out.append(f"{path} (a link to {real}, outside its class {name}/)")
                else:
                    seen.add(real)
                    kept.append(sub)
            subfolders[:] = kept
            images = []
            for file in files:
                if is_tool_entry(file):
                    ignored.append(os.path.relpath(os.path.join(folder, file), split_dir))
                elif file.lower().endswith(IMG_EXTENSIONS):
                    images.append(file)
            walked.append((folder, sorted(images)))
        found = [(os.path.join(folder, file), target) for folder, images in sorted(walked) for file in images]
        if not found:
            raise DataError(
                f"{split_dir / name}: a class folder without an image (extensions: {', '.join(IMG_EXTENSIONS)}); "
                "add its images or remove the folder"
            )
        samples.extend(found)
    notes = []
    if ignored:
        shown = ", ".join(sorted(ignored)[:4]) + (", ..." if len(ignored) > 4 else "")
        notes.append(f"data: {split_dir}: {len(ignored)} hidden or tool entries left out ({shown})")
    if left_out:
        notes.append(
            f"WARNING: data: {split_dir}: {len(left_out)} links not followed: {'; '.join(left_out[:3])}"
            + ("; ..." if len(left_out) > 3 else "")
        )
    return classes, samples, notes


def has_class_dirs(path):
    """Whether `path` is a folder with at least one subfolder (a class)."""
    return path.is_dir() and any(p.is_dir() for p in path.iterdir())


def unreadable(err):
    """A DataError for a folder or file the user may not read (PermissionError)."""
    return DataError(f"{err.filename}: cannot be read ({err.strerror}); check its permissions (ls -ld)")


def find_layout(root, val_split=None):
    try:
        return _find_layout(Path(root), val_split)
    except PermissionError as err:
        raise unreadable(err) from None


def _find_layout(root, val_split=None):
    if not root.is_dir() or not any(root.iterdir()):
        raise DataError(f"data root {root} is missing or empty (give --data-root with train/ and val/ inside)")
    if val_split is not None:
        if has_class_dirs(root / "val"):
            raise DataError(
                f"--val-split {val_split:g}: data root {root} has its own val/: leave --val-split out (or give a "
                "folder of classes alone)"
            )
        return "folder of classes, split"
    for split in ("train", "val"):
        if not has_class_dirs(root / split):
            alone = split == "train" or not has_class_dirs(root / "train")
            raise DataError(
                f"data root {root}: no {split}/<class>/ folders; expected the ImageNet layout "
                "(meta.bin, train/, val/) or ImageFolder (train/<class>/, val/<class>/)"
                + ("; a single folder of classes: add --val-split 0.1 to validate on 10 % of it" if alone else "")
            )
    return "imagenet" if (root / "meta.bin").exists() else "imagefolder"
