"""Bad input, shared by dlojz.py and its sibling scripts: the one-line error (`UserError`, `fail`) and the checks
made before any work: an output that cannot be written or a file name that is a folder, said in one line naming the
flag before the run rather than after it (a metrics file lost after hours, a traceback at the first validation),
and a $DLOJZ_DATA that names no folder. The lowest of dlojz's modules: it imports none of them, and no torch.

- `check_output_folder(path, flag)`: the folder exists or can be made, and a file can be written in it.
- `check_output_file(path, flag)`: not a folder, writable if it exists, and its folder as above.
  Both raise UserError: one line, exit status 2 in every script.
- `DataError`: a problem with the data (dlojz_data, dlojz_shards), one line naming the path.
- `missing_data_variable(environ)`: the line saying that $DLOJZ_DATA names no folder, or None.
"""

import os
from pathlib import Path


class UserError(Exception):
    """Bad input the user can fix: printed as one line, exit status 2."""


class DataError(Exception):
    """A problem with the data the user can fix; the message is one line and names the path."""


def fail(message):
    raise UserError(message)


def check_output_folder(path, flag, named=None):
    """`named`: the path the user gave, when `path` is its folder (check_output_file)."""
    path, named = Path(path), Path(named or path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        fail(f"{flag} {named}: {existing} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        fail(f"{flag} {named}: cannot write in {path} ({err.strerror}); choose another folder")


def check_output_file(path, flag):
    path = Path(path)
    if path.is_dir():
        fail(f"{flag} {path} is a folder: give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        fail(f"{flag} {path}: the file cannot be written (Permission denied); choose another file")
    check_output_folder(path.resolve().parent, flag, named=path)


def missing_data_variable(environ):
    """The line saying that $DLOJZ_DATA names no folder, or None. It is the user's own way to name the data: a typo
    in it must not train on the embedded toy set ($ALL_CCFRSCRATCH and $DSDIR are the site's: their imagenet/ may be
    absent, and the next fall-back is tried)."""
    data = environ.get("DLOJZ_DATA")
    if data and not os.path.isdir(data):
        return f"$DLOJZ_DATA={data}: no such folder (give the folder holding train/ and val/, or unset it)"
    return None
