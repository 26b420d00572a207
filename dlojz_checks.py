"""Bad input, shared by dlojz.py and its sibling scripts: the one-line error (`UserError`, `fail`) and the checks
of the paths they write and read, made before any work: an output that cannot be written, a file name that is a
folder, an input that cannot be read, each said in one line naming the flag, before the run rather than after it
(a metrics file lost after hours, a traceback at the first validation). The lowest of dlojz's modules: it imports
none of them, and no torch.

- `check_output_folder(path, flag)`: the folder exists or can be made, and a file can be written in it.
- `check_output_file(path, flag)`: not a folder, writable if it exists, and its folder as above.
- `check_input_folder(path, flag)`: exists, is a folder, can be listed.
Each raises UserError: one line, exit status 2 in every script.
"""

import os
from pathlib import Path


class UserError(Exception):
    """Bad input the user can fix: printed as one line, exit status 2."""


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


def check_input_folder(path, flag):
    path = Path(path)
    if not path.exists():
        fail(f"{flag} {path}: no such folder")
    if not path.is_dir():
        fail(f"{flag} {path} is a file, not a folder")
    try:
        next(os.scandir(path), None)
    except OSError as err:
        fail(f"{flag} {path}: cannot be read ({err.strerror}); check its permissions")
