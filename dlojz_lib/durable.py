"""Files that are whole or as they were: `atomic_write(path, write_to)` writes through a temporary name in the same
folder (flushed, fsynced) and renames it into place; `fsync_folder(folder)` makes renames and creations durable;
`sha256_of(path)` tells a file from another, read in chunks (checkpoints' checksums, the weights cache, an export
folder's record). Checkpoints (dlojz_lib/checkpoint.py) and packed data sets (dlojz_pack.py) are written with them.
No torch here."""

import errno
import hashlib
import os
import tempfile
from pathlib import Path

NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # the disk, or the user's quota on it, is full (checkpoints, packs)


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_folder(folder):
    """Make the renames and creations in `folder` durable."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write(path, write_to, before_rename=None):
    """Write `path` through a temporary name in its folder (`write_to(file)`, flushed and fsynced), then rename it
    into place and fsync the folder: `path` is whole or as it was. `before_rename(tmp)` runs on the complete file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write_to(f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_folder(path.parent)  # make the rename itself durable
