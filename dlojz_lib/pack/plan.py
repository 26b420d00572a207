"""The plan of a pack (dlojz_pack.py): which sample goes in which shard, every member's offset and every shard's size,
computed up front from the file sizes alone, so that the same source gives byte-identical shards whatever the
number of writers, and a rerun knows which shards are already whole.

- `plan_split(src, split, classes, samples, sizes, shard_size) -> (index, shards)`: the random-access index (a numpy
  structured array: shard, offset of the image's bytes, size, target, key) in ImageFolder's order, and the shards,
  each `dict(name, size, members)`.
- Keys: the file's path in its class folder with `<class>_` in front, every character but letters, digits, `-` and
  `_` made `_`, unique in the split; train samples in a fixed shuffled order (a hash of the key).
- Every tar header is one 512-byte block (a key and its extension fit ustar's 100-byte name field).
"""

import hashlib
import os
import re
import tarfile

import numpy as np

from dlojz_lib.data.shards import PackError

SHUFFLE_SEED = 0
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
# A key and its extension fit the 100-byte name field of one ustar header: no extra header, offsets computable.
MAX_KEY = 80
MAX_SAMPLE = 2**32 - 1  # the index stores sizes as uint32

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def padded(n):
    return -(-n // BLOCK) * BLOCK


def _tar_size(body):
    """A tar of `body` bytes of members: two zero blocks at the end, then padding to a whole record (tarfile)."""
    return -(-(body + 2 * BLOCK) // RECORD) * RECORD


def _footprint(size):
    return BLOCK + padded(size) + 2 * BLOCK  # image header + data, .cls header + data


def _image_offset(ext):
    # Members in sorted extension order, as webdataset's TarWriter writes them: `.cls` comes first for `.jpg`.
    return 3 * BLOCK if "cls" < ext else BLOCK


def _keys(split_dir, classes, samples):
    keys, used = [], set()
    for path, target in samples:
        cls = classes[target]
        rel = os.path.relpath(path, os.path.join(split_dir, cls))
        key = _UNSAFE.sub("_", os.path.splitext(rel)[0])
        prefix = _UNSAFE.sub("_", cls) + "_"
        if not key.startswith(prefix):
            key = prefix + key
        if len(key) > MAX_KEY:
            digest = hashlib.blake2b(os.fsencode(rel), digest_size=8).hexdigest()
            key = f"{key[: MAX_KEY - 17]}_{digest}"
        base, n = key, 0
        while key in used:  # a.png next to a.jpg, or a_b.jpg next to a/b.jpg
            n += 1
            key = f"{base}_{n}"
        used.add(key)
        keys.append(key)
    return keys


def _extension(path):
    ext = os.path.splitext(path)[1][1:].lower()
    return "jpg" if ext == "jpeg" else ext


def _shuffle_rank(key):
    return hashlib.blake2b(f"{SHUFFLE_SEED}:{key}".encode(), digest_size=8).digest()


def plan_split(src, split, classes, samples, sizes, shard_size):
    """(index array in ImageFolder order, [shard: dict(name, size, members)]) for one split."""
    big = next((i for i, size in enumerate(sizes) if size > MAX_SAMPLE), None)
    if big is not None:
        raise PackError(f"SRC file {samples[big][0]}: {sizes[big]} bytes, more than an image can be; remove it")
    keys = _keys(str(src / split), classes, samples)
    n = len(samples)
    order = sorted(range(n), key=lambda i: _shuffle_rank(keys[i])) if split == "train" else range(n)
    dtype = np.dtype(
        [
            ("shard", "<u4"),
            ("offset", "<u8"),
            ("size", "<u4"),
            ("target", "<u4"),
            ("key", f"S{max(len(k) for k in keys)}"),
        ]
    )
    index = np.zeros(n, dtype=dtype)
    index["key"] = keys
    index["target"] = [t for _, t in samples]
    index["size"] = sizes
    shard_of, offset_of = np.zeros(n, dtype="<u4"), np.zeros(n, dtype="<u8")
    shards, members, body = [], [], 0

    def close_shard():
        shards.append(dict(name=f"{split}-{len(shards):06d}.tar", size=_tar_size(body), members=members))

    for i in order:
        path, target = samples[i]
        size, ext = sizes[i], _extension(path)
        if members and _tar_size(body + _footprint(size)) > shard_size:
            close_shard()
            members, body = [], 0
        shard_of[i], offset_of[i] = len(shards), body + _image_offset(ext)
        members.append((path, keys[i], ext, target, size, body + _image_offset(ext)))
        body += _footprint(size)
    close_shard()
    index["shard"], index["offset"] = shard_of, offset_of
    return index, shards
