"""The source tree dlojz_pack.py packs: its layout, classes and samples in ImageFolder's order (torchvision's own
functions, dlojz's image extensions), its classes' readable names (ImageNet's meta.bin), a digest of its listing
(files added, removed or renamed) and its files' sizes (stat'ed by threads: on a parallel file system each stat is a
round trip to a metadata server). Every problem is a PackError naming SRC.
"""

import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor

from dlojz_lib.data.layout import IMG_EXTENSIONS, find_layout, has_class_dirs
from dlojz_lib.data.shards import PackError, first_line

SPLITS = ("train", "val")


def is_image(path):
    return path.lower().endswith(IMG_EXTENSIONS)  # what build_datasets gives ImageFolder


def list_source(src):
    """(layout, classes, {split: [(path, target)]}) in ImageFolder's order (torchvision's own functions)."""
    if not src.is_dir():
        what = "a file, not a folder" if src.exists() else "no such folder"
        raise PackError(f"SRC {src}: {what}; give the folder holding train/ and val/")
    for split in SPLITS:
        if not has_class_dirs(src / split):
            raise PackError(
                f"SRC {src}: not a data tree (no {split}/<class>/ folders); give the folder holding "
                "train/<class>/ and val/<class>/ (ImageNet layout with meta.bin, or ImageFolder)"
            )
    layout = find_layout(src)
    from torchvision.datasets.folder import find_classes, make_dataset  # (torch's import: after the checks above)

    samples, classes = {}, {}
    for split in SPLITS:
        folder = str(src / split)
        try:
            classes[split], class_to_idx = find_classes(folder)
            samples[split] = make_dataset(folder, class_to_idx, is_valid_file=is_image)
        except (FileNotFoundError, ValueError) as err:
            raise PackError(f"SRC {folder}: {first_line(err)}") from None
    if classes["train"] != classes["val"]:
        only_train = sorted(set(classes["train"]) - set(classes["val"]))[:5]
        only_val = sorted(set(classes["val"]) - set(classes["train"]))[:5]
        raise PackError(
            f"SRC {src}: train/ and val/ have different classes (only in train: {only_train}, only in val: {only_val})"
        )
    return layout, classes["train"], samples


def class_names_of(src, classes, layout):
    """meta.bin's first name of each WordNet id, as build_datasets shows them; the folder name otherwise."""
    if layout != "imagenet":
        return list(classes)
    import torch

    try:
        wnid_to_names = torch.load(src / "meta.bin", weights_only=True)[0]
        names = [wnid_to_names.get(w, (w,)) for w in classes]
        return [n if isinstance(n, str) else str(n[0]) for n in names]
    except Exception as err:
        raise PackError(
            f"SRC {src}/meta.bin: unreadable ({type(err).__name__}: {first_line(err)}); fix or "
            "remove it (the classes then keep their folder names)"
        ) from None


def listing_digest(src, classes, samples):
    """What the folder listing says (no stat): enough to notice files added, removed or renamed."""
    h = hashlib.sha256("\0".join(classes).encode("utf-8", "surrogateescape"))
    for split in SPLITS:
        h.update(f"\0{split}\0".encode())
        for path, target in samples[split]:
            h.update(f"{os.path.relpath(path, src)}\t{target}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def stat_sizes(paths):
    """File sizes, stat'ed by threads: on a parallel file system each stat is a round trip to a metadata server."""

    def sizes_of(chunk):
        out = []
        for p in chunk:
            try:
                info = os.stat(p)
            except OSError as err:
                raise PackError(f"SRC file {p}: {err.strerror or err}; fix it and rerun") from None
            if not stat.S_ISREG(info.st_mode):  # reading it would block (a named pipe) or never end (a device)
                raise PackError(
                    f"SRC file {p}: not a regular file (a named pipe, device or socket); remove it and rerun"
                )
            out.append(info.st_size)
        return out

    chunks = [paths[i : i + 1000] for i in range(0, len(paths), 1000)]
    with ThreadPoolExecutor(16) as pool:
        return [size for chunk in pool.map(sizes_of, chunks) for size in chunk]
