"""Read a dlojz pack (webdataset tar shards made by dlojz_pack.py) at random: what training needs of a pack.

- `is_packed(root) -> bool`: root holds a dlojz pack (finished or not: PackedSplit says what is wrong).
- `PackedSplit(root, split)`: `classes`, `class_names`, `len()`, `targets`, `key(i)`, `shard_path(i)`,
  `location(i)`, `read_bytes(i)` (os.pread on descriptors opened lazily, cached per process, reopened after a
  fork, never pickled: `OpenFiles`), `rows()` (the index).
- `intact_rows(packed)`: the start-up check, the samples whose bytes are whole in their shards, with a warning per
  shard cut short or missing (a shard larger than the pack made it is a PackError).
- `read_manifest(root, hint)`, `pack_files(manifest)`, `repack_hint(manifest, root)`: the manifest, shared with the
  writer.

Errors: `PackError` (a `DataError`: one line naming the path and what to do); `ShardReadError` (a `PackError` and
an `OSError`, as an unreadable image file is) names the shard and the key of a sample that cannot be read. The
format (files, index, manifest) is described in dlojz_pack.py, the writer.
"""

import json
import operator
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from dlojz_lib.checks import DataError

FORMAT = "dlojz_pack"
FORMAT_VERSION = 1
MANIFEST = "dlojz_pack.json"
# Random access touches every shard: keeping them open saves an open() (a metadata request) per sample. ImageNet in
# 1 GB shards is ~150 files; the bound keeps a process well under the usual 1024 descriptors.
MAX_OPEN = 128


class PackError(DataError):
    """A pack that cannot be made or read as asked; the message is one line naming the path and what to do."""


class ShardReadError(PackError, OSError):
    """A sample whose bytes cannot be read from its shard; the message names the shard and the key. An OSError,
    like an unreadable image file, so that code skipping those skips these too."""


def first_line(err):
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def read_manifest(root, hint):
    """The manifest of the pack in `root`; PackError (ending with `hint`, what to do) if it is not one."""
    path = Path(root) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PackError(f"{root}: not a dlojz pack (no {MANIFEST}); {hint}") from None
    except (OSError, ValueError) as err:
        raise PackError(f"{path}: unreadable ({first_line(err)}); {hint}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PackError(f"{path}: not a dlojz_pack manifest; {hint}")
    if manifest.get("version") != FORMAT_VERSION:
        raise PackError(
            f"{path}: pack format version {manifest.get('version')}, this dlojz_pack.py reads version "
            f"{FORMAT_VERSION}; repack with this one: python dlojz_pack.py {manifest.get('source')} {root}"
        )
    return manifest


def pack_files(manifest):
    names = {MANIFEST}
    for info in manifest.get("splits", {}).values():
        names.update(info.get("shards", []))
        names.add(info.get("index"))
    return names


def repack_hint(manifest, root):
    return f"repack: python dlojz_pack.py {manifest.get('source', 'SRC')} {root}"


def is_packed(root):
    """True if `root` holds a dlojz pack, finished, damaged or not (PackedSplit then says what is wrong with it: a
    corrupt manifest is named as such, not taken for a folder data set)."""
    return (Path(root) / MANIFEST).is_file()


class OpenFiles:
    """Read-only descriptors kept open, the `max_open` most recently used, per process: a forked process closes the
    copies it inherited and opens its own (the parent's bookkeeping counted them)."""

    def __init__(self, max_open=MAX_OPEN):
        self.max_open, self._fds, self.pid = max_open, OrderedDict(), os.getpid()

    def get(self, path):
        if self.pid != os.getpid():
            self._close_all()
            self.pid = os.getpid()
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._fds[path] = fd
        while len(self._fds) > self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def __len__(self):
        return len(self._fds)

    def close(self):
        """Close this process's descriptors; another process's copies are left to it."""
        if self.pid == os.getpid():
            self._close_all()
        self._fds = OrderedDict()

    def _close_all(self):
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = OrderedDict()


class PackedSplit:
    """One split of a pack, read at random: sample i is sample i of ImageFolder(SRC/split).

    Picklable for DataLoader workers: the index (mmap) and the open shards are not pickled, but opened again by the
    process that uses them; a forked process drops the descriptors it inherited and opens its own."""

    def __init__(self, root, split, max_open=MAX_OPEN):
        self.root = Path(root)
        manifest = read_manifest(self.root, f"make one with python dlojz_pack.py SRC {self.root}")
        if manifest.get("state") != "complete":
            raise PackError(
                f"{self.root}: the pack is not finished (interrupted?); finish it: python dlojz_pack.py "
                f"{manifest.get('source')} {self.root}"
            )
        if split not in manifest["splits"]:
            raise PackError(f"{self.root}: no split {split!r} in the pack (it has {', '.join(manifest['splits'])})")
        info = manifest["splits"][split]
        self.split, self.source, self.layout = split, manifest["source"], manifest["layout"]
        self.classes, self.class_names = list(manifest["classes"]), list(manifest["class_names"])
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.shards, self.shard_sizes = list(info["shards"]), list(info["shard_sizes"])
        self.index_path = self.root / info["index"]
        self._len, self.max_open = info["samples"], max_open
        self._rows = self._targets = None
        self._files = OpenFiles(max_open)
        self.rows()  # a missing or foreign index fails here, not in a worker

    def rows(self):
        """The index (memory-mapped): shard, offset, size, target, key of every sample."""
        if self._rows is None:
            try:
                rows = np.load(self.index_path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as err:
                raise PackError(
                    f"{self.index_path}: unreadable index ({first_line(err)}); "
                    f"{repack_hint(dict(source=self.source), self.root)}"
                ) from None
            if rows.dtype.names != ("shard", "offset", "size", "target", "key") or len(rows) != self._len:
                raise PackError(
                    f"{self.index_path}: not the index the manifest describes ({len(rows)} rows, "
                    f"{self._len} expected); {repack_hint(dict(source=self.source), self.root)}"
                )
            self._rows = rows
        return self._rows

    def __len__(self):
        return self._len

    def __repr__(self):
        return f"PackedSplit({str(self.root)!r}, {self.split!r}: {self._len} samples, {len(self.shards)} shards)"

    @property
    def targets(self):
        if self._targets is None:
            self._targets = self.rows()["target"].tolist()
        return self._targets

    def _row(self, i):
        i = operator.index(i)
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} out of range: {self.split} has {self._len}")
        return self.rows()[i]

    def key(self, i):
        return self._row(i)["key"].decode("ascii")

    def shard_path(self, i):
        return self.root / self.shards[int(self._row(i)["shard"])]

    def location(self, i):
        """'DST/train-000003.tar:KEY', for messages (where a folder data set gives the file's path)."""
        return f"{self.shard_path(i)}:{self.key(i)}"

    def read_bytes(self, i):
        """The bytes of sample i's image file, as they were in SRC."""
        row = self._row(i)
        shard, offset, size = int(row["shard"]), int(row["offset"]), int(row["size"])
        path = self.root / self.shards[shard]
        try:
            fd = self._files.get(path)
            chunks, got = [], 0
            while got < size:  # pread may return less than asked for (network file systems)
                chunk = os.pread(fd, size - got, offset + got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
        except OSError as err:
            raise ShardReadError(
                f"{path}: cannot read sample {row['key'].decode('ascii')} ({err.strerror or err})"
            ) from None
        if got != size:
            raise ShardReadError(
                f"{path}: sample {row['key'].decode('ascii')} is cut short ({got} of {size} bytes "
                f"at offset {offset}: the shard is truncated); "
                f"{repack_hint(dict(source=self.source), self.root)}"
            )
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self):
        """Close this process's descriptors (they are opened again when needed)."""
        self._files.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self):
        # Descriptors are per process and the mmap would be pickled as a full copy: the receiver opens its own.
        state = self.__dict__.copy()
        state.update(_files=OpenFiles(self.max_open), _rows=None, _targets=None)
        return state


def intact_rows(packed):
    """(the samples whose bytes are all in their shard, one warning line per shard cut short or missing). A
    truncated shard costs the samples it lost, as a corrupt file costs one sample; a shard larger than the
    pack made it (replaced by something else) is a PackError."""
    actual = []
    for name, expected in zip(packed.shards, packed.shard_sizes):
        try:
            size = (packed.root / name).stat().st_size
        except OSError:
            size = 0
        if size > expected:
            raise PackError(
                f"{packed.root / name}: {size} bytes, the pack made it {expected} (replaced?); "
                f"{repack_hint(dict(source=packed.source), packed.root)}"
            )
        actual.append(size)
    rows = packed.rows()
    intact = rows["offset"].astype(np.int64) + rows["size"] <= np.asarray(actual, dtype=np.int64)[rows["shard"]]
    warnings = []
    for shard in np.unique(rows["shard"][~intact]).tolist():
        lost = int(np.count_nonzero(~intact & (rows["shard"] == shard)))
        state = "missing" if actual[shard] == 0 else f"cut short ({actual[shard]} of {packed.shard_sizes[shard]} bytes)"
        warnings.append(
            f"WARNING: shard {packed.root / packed.shards[shard]} is {state}: {lost} of its samples are "
            f"left out; {repack_hint(dict(source=packed.source), packed.root)}"
        )
    return np.flatnonzero(intact).tolist(), warnings
