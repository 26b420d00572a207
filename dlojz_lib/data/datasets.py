"""The data sets of dlojz.py: where the data is, its layouts read as data sets, validation splits, class counts.

- `resolve_data_root(arg)`: --data-root, then $DLOJZ_DATA, $ALL_CCFRSCRATCH/imagenet, $DSDIR/imagenet, else the
  embedded data set (dlojz_lib/data/embedded.py, generated once into the cache folder).
- `build_datasets(root, train_tf, val_tf)`: torchvision ImageNet layout (meta.bin + train/ + val/, as on Jean Zay),
  plain ImageFolder (train/<class>/, val/<class>/), or the webdataset shards dlojz_pack.py makes of either (found
  by their manifest; `PackedImages`, read by index), as dlojz_lib/data/layout.py finds and lists them. Unreadable
  samples are skipped with a warning naming them.
- `select_train_subset(dataset, spec)`: --train-subset, a fixed stratified part of the training set.
- The samplers that pick their indices are dlojz_lib/data/samplers.py's, the DataLoaders dlojz_lib/data/loaders.py's.

Every bad input raises `DataError` with a one-line message that dlojz.py prints.
"""

import collections
import copy
import os
import random
import sys
from pathlib import Path

import torch
import torchvision
from PIL import Image

from dlojz_lib.checks import DataError, missing_data_variable
from dlojz_lib.data.layout import find_layout, has_class_dirs, list_split, unreadable
from dlojz_lib.data.transforms import image_from_bytes, lazy_image_loader, open_regular


# ---------------------------------------------------------------------------------------------------------------
# Where the data is
def default_cache_dir():
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dlojz"


def resolve_data_root(data_root):
    """Return (path, how it was found). An explicit --data-root must exist; the fall-backs are tried in order."""
    if data_root:
        path = Path(data_root)
        if not path.is_dir():
            raise DataError(f"--data-root {data_root}: no such directory (give the folder holding train/ and val/)")
        return path, "--data-root"
    candidates = [("$DLOJZ_DATA", os.environ.get("DLOJZ_DATA"))]
    for var in ("ALL_CCFRSCRATCH", "DSDIR"):
        if os.environ.get(var):
            candidates.append((f"${var}/imagenet", os.path.join(os.environ[var], "imagenet")))
    if problem := missing_data_variable(os.environ):
        raise DataError(problem)
    for name, value in candidates:
        if value and Path(value).is_dir():
            return Path(value), name
    return None, "embedded"


def written_inside_data(data_root, written):
    """The line refusing a path a run writes (`written`: {flag: path}) that lies inside the data set it reads, or
    in a split of any other (data_set_holding): its next scan would take checkpoints and event files for images,
    or a split's folder for a class. None where there is none."""
    try:
        root, _ = resolve_data_root(data_root)
    except DataError:
        return None  # (said by the data's own check)
    for flag, path in written.items():  # (root None: the embedded data set, in dlojz's cache)
        if path is None:
            continue
        inside = root if root is not None and Path(path).resolve().is_relative_to(root.resolve()) else None
        if (inside := inside or data_set_holding(path)) is not None:
            return (
                f"{flag} {path} is inside the data set {inside} (its next scan would read what the run writes there "
                "as data): give a folder outside it"
            )
    return None


def data_set_holding(path):
    """The data set (a folder with train/ and val/, ImageFolder's or ImageNet's layout) whose split `path` lies in,
    whichever data set it is, or None."""
    for folder in Path(path).resolve().parents:
        if folder.name in ("train", "val") and (folder.parent / "train").is_dir() and (folder.parent / "val").is_dir():
            return folder.parent
    return None


# ---------------------------------------------------------------------------------------------------------------
# Data sets
class SeededSamples:
    """What dlojz's data sets share: `__getitem__((epoch, index))` seeds the augmentation from (seed, epoch, index)
    and skips an unreadable sample with a warning naming it (the next readable sample is used instead). A data set
    gives `samples` (a list of (where, target)), `transform`, `root`, `load(i)`, `describe(i)` and `read_bytes(i)`
    (the encoded file, for --data-backend dali)."""

    seed = 0
    # Validation sets: an unreadable image is returned blank, labelled MISSING_LABEL, which the validation leaves
    # out of its loss and counts; another image in its place would be counted twice.
    unreadable_as_missing = False

    def __getitem__(self, key):
        # (epoch, index), or (epoch, index, copy): --ra-reps's copies of an image, each its own augmentation
        epoch, index, *copy = key if isinstance(key, tuple) else (0, key)
        for attempt in range(len(self.samples)):
            i = (index + attempt) % len(self.samples)
            # Per-sample seed: augmentation independent of worker count and resume position.
            sample_seed = (self.seed * 1_000_003 + epoch) * 10_000_019 + i + (copy[0] * 1_000_000_007 if copy else 0)
            # The CPU generator only: torch.manual_seed would also queue a CUDA seeding with a stack trace, 0.1 ms
            # per sample. The transforms draw from these two generators only.
            torch.default_generator.manual_seed(sample_seed)
            random.seed(sample_seed)
            # Progressive resizing: the transform of this sample's epoch (dlojz_lib.data.augment.EpochTransforms).
            transform = self.transform.for_epoch(epoch) if hasattr(self.transform, "for_epoch") else self.transform
            try:
                return transform(self.load(i)), self.samples[i][1]
            except (OSError, ValueError, SyntaxError) as err:
                if self.describe(i) not in SKIPPED:  # named once per process, not again every epoch
                    SKIPPED.add(self.describe(i))
                    print(f"WARNING: skipping unreadable image {self.describe(i)}: {err}", file=sys.stderr, flush=True)
                if self.unreadable_as_missing:
                    size = getattr(self.transform, "crop_size", 1)
                    return torch.zeros(3, size, size, dtype=torch.uint8), MISSING_LABEL
        raise DataError(f"no readable image in {self.root}")


MISSING_LABEL = -100  # CrossEntropyLoss's ignore_index: no loss, and never equal to a prediction


SKIPPED = set()  # the unreadable samples this process (a DataLoader worker, or the main one) has named


class SafeImageFolder(SeededSamples, torchvision.datasets.ImageFolder):
    """ImageFolder that receives (epoch, index), seeds the augmentation and skips unreadable files (SeededSamples),
    its classes and images listed by `list_split`; `notes`, the lines that listing has to say."""

    def find_classes(self, directory):
        self._listing = list_split(directory)
        classes = self._listing[0]
        return classes, {name: index for index, name in enumerate(classes)}

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        classes, samples, self.notes = self._listing
        return samples

    def load(self, i):
        return self.loader(self.samples[i][0])

    def read_bytes(self, i):
        with open_regular(self.samples[i][0]) as file:
            return file.read()

    def describe(self, i):
        return self.samples[i][0]


class PackedImages(SeededSamples, torch.utils.data.Dataset):
    """One split of a packed data set (dlojz_pack.py's webdataset shards), read by index: sample i is the folder's
    sample i, its bytes read with pread from a shard, so the samplers, the seeding, exact validation and resume
    work as on folders. The samples of a truncated or missing shard are left out with one warning per shard; a
    sample that cannot be read or decoded is skipped like a corrupt file, named by shard and key."""

    def __init__(self, root, split, transform):
        from dlojz_lib.data.shards import PackedSplit, intact_rows

        self.shards = PackedSplit(root, split)
        self.root, self.transform = f"{root} ({split})", transform
        self.classes, self.class_to_idx = self.shards.classes, self.shards.class_to_idx
        rows, warnings = intact_rows(self.shards)
        for line in warnings:
            print(line, file=sys.stderr, flush=True)
        targets = self.shards.targets
        self.samples = [(row, targets[row]) for row in rows]  # (row of the index, target)
        self.targets = [target for _, target in self.samples]
        if not self.samples:
            raise DataError(f"{root}: no readable sample in the {split} shards; repack with dlojz_pack.py")

    def __len__(self):
        return len(self.samples)

    def load(self, i):
        return image_from_bytes(self.describe(i), self.read_bytes(i))

    def read_bytes(self, i):
        return self.shards.read_bytes(self.samples[i][0])

    def describe(self, i):
        return self.shards.location(self.samples[i][0])


VAL_SPLIT_FILE = "val_split.txt"  # in the output folder: the validation images of --val-split, one path a line


def stratified_choice(samples, spec, seed_of, keep=0):
    """Indices chosen in each class of `samples` ((where, target) pairs), in the data set's order: `spec` < 1 that
    fraction of the class (rounded, at least one), `spec` >= 1 that many images (all of a smaller class), and never
    more than all but `keep` of them. Each class's choice is seeded by `seed_of(target)` alone."""
    by_class = {}
    for index, (_, target) in enumerate(samples):
        by_class.setdefault(target, []).append(index)
    chosen = []
    for target, indices in sorted(by_class.items()):
        wanted = max(1, round(spec * len(indices))) if spec < 1 else min(int(spec), len(indices))
        chosen.extend(random.Random(seed_of(target)).sample(indices, min(wanted, len(indices) - keep)))
    return sorted(chosen)


def describe_spec(spec):
    """--train-subset's and --val-split's value in words."""
    return f"{spec:.0%} of each class" if spec < 1 else f"{int(spec)} images per class"


def split_for_validation(samples, classes, spec):
    """Indices of the validation images of --val-split `spec` (as stratified_choice takes it): at least one image of
    a class stays in training and, for a class of 2 or more, one goes to validation. Chosen by a seed of the class's
    name alone: the same on every rank, in every run, whatever --seed."""
    return stratified_choice(samples, spec, lambda target: f"dlojz-val-split-{classes[target]}", keep=1)


def split_folder(root, train_transform, val_transform, spec, saved=None):
    """--val-split: (train set, val set) of one folder of classes (`root`/train/ if there, else `root`), stratified
    as split_for_validation says, or as the list of validation files `saved` (a run's VAL_SPLIT_FILE) says: an image
    not on that list trains. Both share one listing of the folder."""
    source = root / "train" if has_class_dirs(root / "train") else root
    train_set = SafeImageFolder(str(source), transform=train_transform, loader=lazy_image_loader)
    val_set = copy.copy(train_set)
    val_set.transform = val_transform
    samples = train_set.samples
    if saved is None:
        chosen = set(split_for_validation(samples, train_set.classes, spec))
        line = (
            f"--val-split {spec:g}: {len(chosen)} of {len(samples)} images of {source} validate ({describe_spec(spec)}, "
            "stratified)"
        )
        sizes = collections.Counter(target for _, target in samples)
        alone = [train_set.classes[target] for target, size in sorted(sizes.items()) if size == 1]
        if alone:  # its one image trains: the class is never validated, and its recall never measured
            line += (
                f"; {len(alone)} class{'es' if len(alone) > 1 else ''} of one image ({', '.join(alone[:3])}"
                f"{', ...' if len(alone) > 3 else ''}) only train{'' if len(alone) > 1 else 's'}, never validated: "
                "add images, or give a validation folder"
            )
    else:
        path, listed = saved
        relative = [os.path.relpath(where, source) for where, _ in samples]
        chosen = {index for index, name in enumerate(relative) if name in listed}
        line = f"--val-split {spec:g}: the split of {path}, {len(chosen)} validation images"
        if len(chosen) < len(listed):
            line += f" ({len(listed) - len(chosen)} listed there are gone)"
        line += "; every other image trains"
    val_set.samples = val_set.imgs = [sample for index, sample in enumerate(samples) if index in chosen]
    train_set.samples = train_set.imgs = [sample for index, sample in enumerate(samples) if index not in chosen]
    for dataset in (train_set, val_set):
        dataset.targets = [target for _, target in dataset.samples]
    val_set.notes = []
    train_set.notes = [*train_set.notes, line]
    train_set.val_split_root = val_set.val_split_root = source
    return train_set, val_set


def read_val_split(path):
    """The validation files a run's VAL_SPLIT_FILE lists (paths relative to the split folder), or None."""
    from dlojz_lib.checks import read_text

    if Path(path).exists() and not Path(path).is_file():
        from dlojz_lib.checks import fail

        fail(
            f"--val-split: {path} is not the run's list of validation images (a folder?): remove it, and the folder "
            "is split again, or give another --output-dir"
        )
    if not Path(path).is_file():
        return None
    text = read_text(path, "--val-split's list", "remove it to split the folder again")
    return path, {line for line in text.splitlines() if line.strip()}


def write_val_split(val_set, path):
    """The validation images of a --val-split, relative to its folder, one a line, written atomically."""
    lines = "".join(f"{os.path.relpath(where, val_set.val_split_root)}\n" for where, _ in val_set.samples)
    temporary = Path(path).with_name(f".{Path(path).name}.tmp")
    temporary.write_text(lines)
    os.replace(temporary, path)


def build_datasets(root, train_transform, val_transform, seed=0, val_split=None, saved_split=None):
    """Return (train_set, val_set, classes, layout). Each set has `notes`: the lines its listing has to say (entries
    left out, a single class, classes of very unequal sizes). `val_split`: --val-split of one folder of classes
    (`saved_split`: the list of a run that split it before, from read_val_split)."""
    root = Path(root)
    from dlojz_lib.data.shards import is_packed

    try:
        if is_packed(root):
            if val_split is not None:
                raise DataError(f"--val-split: {root} is packed with its own val split: leave --val-split out")
            return build_packed_datasets(root, train_transform, val_transform, seed)
        layout = find_layout(root, val_split)
        if val_split is not None:
            sets = split_folder(root, train_transform, val_transform, val_split, saved_split)
        else:
            sets = [
                SafeImageFolder(str(root / split), transform=tf, loader=lazy_image_loader)
                for split, tf in (("train", train_transform), ("val", val_transform))
            ]
        for ds in sets:
            ds.seed = seed
    except PermissionError as err:
        raise unreadable(err) from None
    train_set, val_set = sets
    if train_set.classes != val_set.classes:
        only_train = sorted(set(train_set.classes) - set(val_set.classes))[:5]
        only_val = sorted(set(val_set.classes) - set(train_set.classes))[:5]
        raise DataError(
            f"data root {root}: train/ and val/ have different classes "
            f"(only in train: {only_train}, only in val: {only_val})"
        )
    if layout == "imagenet":
        # meta.bin maps WordNet ids to readable names, as torchvision.datasets.ImageNet does
        wnid_to_names = read_meta_bin(root / "meta.bin")
        classes = [wnid_to_names.get(w, (w,))[0] for w in train_set.classes]
    else:
        classes = list(train_set.classes)
    train_set.notes = [*train_set.notes, *val_set.notes, *class_balance_notes(train_set.targets, classes)]
    val_set.notes, val_set.unreadable_as_missing = [], True
    check_classes_readable(train_set, classes)
    return train_set, val_set, classes, layout


def count_per_class(targets, num_classes):
    counts = [0] * num_classes
    for target in targets:
        counts[target] += 1
    return counts


def class_counts(dataset, num_classes):
    """The images of each class in `dataset` (None without one: --synthetic)."""
    return None if dataset is None else count_per_class(dataset.targets, num_classes)


def class_counts_line(counts, classes):
    """The start-up line on the training set's classes: how many, and the fewest and most images of one."""
    small, large = min(range(len(counts)), key=counts.__getitem__), max(range(len(counts)), key=counts.__getitem__)
    if counts[small] == counts[large]:
        return f"classes: {len(classes)}, {counts[small]} training images each"
    return (
        f"classes: {len(classes)}, training images per class from {counts[small]} ({classes[small]}) to "
        f"{counts[large]} ({classes[large]})"
    )


IMBALANCE_WARNED = 10  # the largest class this many times the smallest: the smallest's errors weigh little in top-1


def class_balance_notes(targets, classes):
    """Warning lines for a training set of one class (every prediction right: nothing is learnt) or of classes of
    very unequal sizes (top-1 then hides a class the model never predicts)."""
    if len(classes) == 1:
        return [
            f"WARNING: data: one class ({classes[0]!r}): every prediction is right, loss and accuracy say nothing; "
            "a classifier needs two classes or more"
        ]
    counts = count_per_class(targets, len(classes))
    small, large = min(counts), max(counts)
    if small and large >= IMBALANCE_WARNED * small:
        return [
            f"WARNING: data: unequal classes: {classes[counts.index(large)]!r} has {large} training images, "
            f"{classes[counts.index(small)]!r} {small} ({large / small:.0f}x): top-1 can stay high while the "
            "small classes are never predicted"
        ]
    return []


def read_meta_bin(path):
    """meta.bin's WordNet id -> class names map (torchvision's ImageNet format); DataError naming the file."""
    try:
        meta = torch.load(path, weights_only=True)
        names = meta[0]
        if not isinstance(names, dict):
            raise TypeError(f"its first item is a {type(names).__name__}, not a dict")
        return names
    except Exception as err:  # noqa: BLE001  (torch.load's errors: truncated zip, pickle, a text file)
        reason = str(err).strip().splitlines()[0][:100] if str(err).strip() else type(err).__name__
        raise DataError(
            f"{path}: not torchvision's ImageNet meta.bin ({reason}); remove it to name the classes by their "
            "folders, or rebuild it with torchvision.datasets.ImageNet"
        ) from None


def check_classes_readable(dataset, classes):
    """Refuse a class that has no readable training image: it would train on nothing (each of its files skipped with
    a warning, every epoch). One file per class is opened (its header: milliseconds); a class whose first file
    fails is then read whole. A class with some unreadable files gets one warning line with their count."""

    def readable(path):
        try:
            with Image.open(path) as image:
                image.verify()  # the header and the file's structure, without decoding the pixels
            return True
        except Exception:  # PIL raises many kinds for a file that is not an image
            return False

    first_of_class = {}
    for index, (_, target) in enumerate(dataset.samples):
        first_of_class.setdefault(target, index)
    for target, first in sorted(first_of_class.items()):
        if readable(dataset.samples[first][0]):
            continue
        files = [path for path, t in dataset.samples if t == target]
        bad = [path for path in files if not readable(path)]
        if len(bad) == len(files):
            raise DataError(
                f"class {classes[target]!r}: none of its {len(files)} training images can be read (first: "
                f"{files[0]}); fix or remove the files, or remove the class from train/ and val/"
            )
        print(
            f"WARNING: class {classes[target]!r}: {len(bad)} of its {len(files)} training images cannot be read "
            f"(first: {bad[0]}); each is skipped when its turn comes",
            file=sys.stderr,
            flush=True,
        )


def select_train_subset(dataset, spec):
    """Keep a fixed part of an ImageFolder's samples, in place: `spec` < 1 a fraction of each class (rounded, at
    least one image), `spec` >= 1 that many images per class (all of a smaller class). The choice is seeded by the
    class alone, never by --seed: every run and every process of a hyper-parameter search sees the same images.
    Returns a one-line description."""
    kept = stratified_choice(dataset.samples, spec, lambda target: f"dlojz-train-subset-{target}")
    total = len(dataset.samples)
    dataset.samples = dataset.imgs = [dataset.samples[i] for i in kept]
    dataset.targets = [target for _, target in dataset.samples]
    return (
        f"--train-subset {spec:g}: {len(kept)} of {total} training images ({describe_spec(spec)}, the same in every "
        "run)"
    )


def build_packed_datasets(root, train_transform, val_transform, seed=0):
    """build_datasets for a packed data set: (train_set, val_set, classes, layout)."""
    sets = []
    for split, tf in (("train", train_transform), ("val", val_transform)):
        ds = PackedImages(root, split, tf)
        ds.seed = seed
        sets.append(ds)
    train_set, val_set = sets
    try:  # the first-image check of a folder data set
        image_from_bytes(train_set.describe(0), train_set.shards.read_bytes(train_set.samples[0][0]))
    except OSError as err:
        raise DataError(f"{err}; check --data-root") from None
    layout = (
        f"packed shards: {len(train_set.shards.shards)} train + {len(val_set.shards.shards)} val webdataset tar "
        f"files of an {train_set.shards.layout} tree, read by index"
    )
    train_set.notes, val_set.notes = class_balance_notes(train_set.targets, train_set.shards.class_names), []
    val_set.unreadable_as_missing = True
    return train_set, val_set, train_set.shards.class_names, layout
