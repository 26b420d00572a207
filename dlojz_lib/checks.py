"""Bad input, shared by dlojz.py and its sibling scripts: the one-line error (`UserError`, `fail`) and the checks
made before any work: an output that cannot be written or a file name that is a folder, said in one line naming the
flag before the run rather than after it (a metrics file lost after hours, a traceback at the first validation),
and a $DLOJZ_DATA that names no folder. The lowest of dlojz's modules: it imports none of them, and no torch.

- `check_output_folder(path, flag)`: the folder exists or can be made, and a file can be written in it.
- `check_output_file(path, flag)`: not a folder, writable if it exists, and its folder as above.
  Both raise UserError: one line, exit status 2 in every script.
- `OneLineArgumentParser`: argparse's parser whose errors are one line (argparse prints the whole usage first), for
  every script and bench.
- `claim_output(path, flag, kind, is_own)`: the one rule for every file a dlojz command writes: a new file, or a
  file of the command's own kind (`is_own` reads its content), or any regular file with `--force`; never a folder,
  a device, a pipe or a socket, never one of the command's inputs. `check_side_outputs({flag: (path, kind)})`:
  dlojz.py's --metrics-json, --val-history, --predictions by that rule, and no two the same path.
  `claim_outputs_in(folder, {name: (kind, is_own)})`: a command's report files in one folder, each by that rule.
  `starts_with(path, prefix)`, `is_png_drawn_by(path, software)`: how a command knows its own CSV and figures.
- `check_input_file(path, what, fix)`: a file to read is there, regular (not a folder or a pipe) and readable.
- `read_text(path, what, fix)`, `read_json(path, what, fix)`: the one way a side file (a trace, a sweep's plan, a
  run's status, a checkpoint pointer) is read: a missing file, a folder, bad bytes, truncated or other JSON is one
  line naming the file and saying `fix`, never a traceback.
- `DataError`: a problem with the data (dlojz_lib.data.datasets, dlojz_lib.data.shards), one line naming the path.
- `missing_data_variable(environ)`: the line saying that $DLOJZ_DATA names no folder, or None.
- `say_refusal(line, rank, world_size, first)`: a refusal's line said once by whichever rank of a job finds it first,
  never lost to the launcher ending the job at another rank's exit.
- `command(name)`: every sibling command's door: a one-line error (`OneLineError`) exits 2, Ctrl-C 130, each in one line;
  `ended_on_interrupt(proc)`: a child process (a lab run, an HPO trial) told of the Ctrl-C and waited for.
"""

import argparse
import functools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path


class OneLineError(Exception):
    """What a command ends on with its message as one line and exit status 2 (`command`): bad input, bad data, a
    checkpoint that cannot be used, a sweep's bad settings. The kinds below, and CheckpointError and LabError."""


class UserError(OneLineError):
    """Bad input the user can fix: printed as one line, exit status 2."""


class DataError(OneLineError):
    """A problem with the data the user can fix; the message is one line and names the path."""


def fail(message):
    raise UserError(message)


def one_line(err) -> str:
    """An error's message as one line. A DataLoader worker's error reaches the main process as its own type with the
    worker's traceback in the message ("Caught DataError in DataLoader worker process 0. Original Traceback ..."):
    its last line's message then."""
    text = str(err).strip()
    lines = text.splitlines()
    if len(lines) > 1 and lines[0].startswith("Caught ") and "Original Traceback" in text:
        return lines[-1].split(": ", 1)[-1]
    return text


class OneLineArgumentParser(argparse.ArgumentParser):
    """A bad flag is one line naming it, exit status 2, as every other bad input; its sub-commands' parsers too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


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


def check_output_file(path, flag, create_folder=True):
    """A file a command or a run will write: not a folder, writable, its folder writable (created where missing,
    unless `create_folder` is False: a command's single output file names a folder that must exist)."""
    path = Path(path)
    if path.is_dir():
        fail(f"{flag} {path} is a folder: give a file name")
    if not create_folder and not path.resolve().parent.is_dir():
        fail(f"{flag} {path}: its folder does not exist; create it, or give a file in a folder that does")
    if path.exists() and not os.access(path, os.W_OK):
        fail(f"{flag} {path}: the file cannot be written (Permission denied); choose another file")
    check_output_folder(path.resolve().parent, flag, named=path)


# What each side output of a run is, and how a file already of that kind is known by its content: dlojz writes over
# (or appends to) such a file only, never over a checkpoint, weights, an image or a file of the user's.
PREDICTIONS_HEADER = "image,true_class,predicted_class"
SIDE_OUTPUTS = {
    "metrics": "a dlojz metrics JSON",
    "history": "a dlojz validation history (JSON lines)",
    "predictions": "a dlojz predictions CSV",
}


def is_side_output(path, kind) -> bool:
    """Whether the existing file `path` is already the side output `kind` (see SIDE_OUTPUTS), by its content; an
    empty file counts as new."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            return True
        with open(path, "rb") as file:
            head = file.read(1 << 20)
    except OSError:
        return False
    try:
        text = head.decode()
    except UnicodeDecodeError:  # (a checkpoint, weights, an image)
        return False
    if kind == "predictions":
        return text.startswith(PREDICTIONS_HEADER)
    if kind == "history":
        first = text.split("\n", 1)[0]
        try:
            return "epoch" in json.loads(first)
        except (ValueError, TypeError):
            return False
    try:  # metrics: one JSON object, whole within the first MiB
        return "world_size" in json.loads(text)
    except (ValueError, TypeError):
        return False


# A run folder's own files (dlojz_lib.checkpoint's names): a checkpoint, its checksum, the `latest` and `best`
# pointers, the run's args.toml. Resuming reads them; no command replaces one, even with --force.
RUN_FILE_RE = re.compile(r"^(ckpt_e\d+_s\d+\.(pt|dcp)(\.sha256)?|latest|best|args\.toml)$")


def is_run_file(path) -> bool:
    """Whether `path` is one of a run folder's own files (RUN_FILE_RE) in a folder that holds a run's checkpoint or
    its args.toml."""
    path = Path(path)
    if not RUN_FILE_RE.match(path.name):
        return False
    folder = path.parent
    return (folder / "args.toml").is_file() or any(RUN_FILE_RE.match(p.name) for p in folder.glob("ckpt_e*_s*.*"))


def claim_output(path, flag, kind, is_own, inputs=(), force=False, create_folder=True, force_flag="--force"):
    """The rule for every file a dlojz command writes (dlojz.py's side outputs, dlojz_predict.py's CSV,
    dlojz_avg.py's and dlojz_fsdp.py consolidate's checkpoints, dlojz_export.py's files): `path` is a new (or empty)
    file, or an existing regular file that is already `kind` (a phrase: "a dlojz predictions CSV"), as
    `is_own(path)` tells by its content, or any regular file with `force` (the command's --force). Never, even with
    `force`: a folder, anything that is not a regular file (a device node, a pipe, a socket: the atomic rename would
    replace it), a run's own file (is_run_file: a checkpoint, its checksum, latest, best, args.toml), one of the
    command's `inputs`, or a file inside an input folder that is not the command's own.
    Then check_output_file. UserError naming `flag` otherwise, and `force_flag` where the command has one."""
    path = Path(path)
    if path.is_dir():
        fail(f"{flag} {path} is a folder: give a file name")
    if path.exists():
        if not stat.S_ISREG(path.stat().st_mode):
            fail(
                f"{flag} {path}: not a regular file (a device, pipe or socket), which a command never replaces; give a file path"
            )
        for given in inputs:
            if Path(given).is_file() and os.path.samefile(path, given):
                fail(f"{flag} {path}: also an input of this command ({given}); give a new path")
            if Path(given).is_dir() and is_inside(path, given) and not is_own(path):  # (its images, its shards)
                fail(f"{flag} {path}: a file inside {given}, an input of this command; give a path outside it")
        if is_run_file(path):
            fail(
                f"{flag} {path}: a run's own file (a checkpoint, its checksum, latest, best or args.toml), which "
                "resuming reads: no command replaces it, even with --force; give a path outside the run's files"
            )
        if path.stat().st_size and not force and not is_own(path):
            fail(
                f"{flag} {path}: an existing file that is not {kind} (a checkpoint, its checksum, a run's args.toml, "
                "weights, an image or a file of yours?): a command writes only a new file or one of its own kind; "
                f"give a new path, or {f'add {force_flag} to replace it' if force_flag else 'move that file away'}"
            )
    check_output_file(path, flag, create_folder=create_folder)


def is_inside(path, folder) -> bool:
    """Whether `path` lies inside `folder`, links followed."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def starts_with(path, prefix: bytes) -> bool:
    """Whether the file `path` begins with `prefix` (a CSV's header, a recipe's first comment)."""
    try:
        with open(path, "rb") as file:
            return file.read(len(prefix)) == prefix
    except OSError:
        return False


def is_png_drawn_by(path, software: str) -> bool:
    """Whether `path` is a PNG whose Software entry (near the start: matplotlib writes its text chunks before the
    image) names `software`, as the command's savefig(metadata={"Software": software}) wrote it."""
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and software.encode() in head


def claim_outputs_in(folder, files, flag, force=False, inputs=()):
    """A command's report files in `folder` (`flag` names it): the folder can be written (made where missing), and
    each of `files` ({name: (kind, is_own)}) is new or the command's own by claim_output's rule, all checked before
    any is written: a refusal leaves every file there as it was."""
    check_output_folder(folder, flag)
    for name, (kind, is_own) in files.items():
        claim_output(Path(folder) / name, flag, kind, is_own, inputs, force)


def check_side_outputs(outputs):
    """`outputs`: {flag: (path, kind)} of the side outputs a run is given. Each is a new file or already its kind,
    and no two share a path; UserError naming the flag otherwise."""
    seen = {}
    for flag, (path, kind) in outputs.items():
        if path is None:
            continue
        where = Path(path).resolve()
        if where in seen:
            fail(f"{seen[where]} and {flag} both name {path}: each writes a file of its own; give two paths")
        seen[where] = flag
        claim_output(
            path, flag, SIDE_OUTPUTS[kind], lambda file, kind=kind: is_side_output(file, kind), force_flag=None
        )


def check_input_file(path, what, fix):
    """`path` is a regular file this process can open; UserError "`what` PATH: <why>; `fix`" otherwise (nothing is
    read: a weights file may be gigabytes). `what` names the flag or the file's role (e.g. "--config")."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            fail(f"{what} {path}: a folder, not a file; {fix}")
        if not stat.S_ISREG(mode):  # a named pipe would block the read, a device never end it
            fail(f"{what} {path}: not a regular file (a pipe, device or socket); {fix}")
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        fail(f"{what} {path}: no such file; {fix}")
    except OSError as err:
        fail(f"{what} {path}: cannot be read ({err.strerror or err}); {fix}")


def read_text(path, what, fix):
    """The UTF-8 text of the regular file `path`; UserError "`what` PATH: <why>; `fix`" otherwise, as
    check_input_file says it. `what` names the flag or the file's role (e.g. "--config", "sweep plan")."""
    path = Path(path)
    check_input_file(path, what, fix)
    try:
        data = path.read_bytes()
    except OSError as err:  # gone or unreadable since the check
        fail(f"{what} {path}: cannot be read ({err.strerror or err}); {fix}")
    try:
        return data.decode("utf-8-sig")  # (a byte-order mark, which some editors write first, left out)
    except UnicodeDecodeError as err:
        fail(f"{what} {path}: not a text file (byte 0x{data[err.start]:02x} at offset {err.start} is not UTF-8); {fix}")


def read_json(path, what, fix, kind=dict):
    """The JSON value of `path`, of type `kind` (an object unless said), as read_text reads the file: invalid or
    truncated JSON, or another kind of value, is one line."""
    text = read_text(path, what, fix)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        ends_early = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")  # runs to the end
        cut = " (the file ends early: truncated?)" if ends_early else ""
        fail(f"{what} {path}: not valid JSON{cut} ({err.msg}, line {err.lineno} column {err.colno}); {fix}")
    if not isinstance(value, kind):
        found = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")
        fail(
            f"{what} {path}: holds {'null' if value is None else found}, not {'an object' if kind is dict else 'an array'}; {fix}"
        )
    return value


def missing_data_variable(environ):
    """The line saying that $DLOJZ_DATA names no folder, or None. It is the user's own way to name the data: a typo
    in it must not train on the embedded toy set ($ALL_CCFRSCRATCH and $DSDIR are the site's: their imagenet/ may be
    absent, and the next fall-back is tried)."""
    data = environ.get("DLOJZ_DATA")
    if data and not os.path.isdir(data):
        return f"$DLOJZ_DATA={data}: no such folder (give the folder holding train/ and val/, or unset it)"
    return None


# How long a rank other than 0 waits, before the process group forms, for rank 0 to say a refusal that every rank
# reads alike (the command line, the shared file system) and end the job; rank 0 may be held back by a data scan.
REFUSAL_GRACE_S = 5.0


def say_refusal(line, rank, world_size, first=None):
    """Print a refusal's one `line` so that it reaches the user whichever rank of a job finds it first. A launcher
    (torchrun, srun --kill-on-bad-exit) ends every rank at the first one's exit, so a line left to rank 0 is lost
    when another rank ends first. `first`: once the process group has formed, a callable saying whether this rank is
    the job's first to refuse (the job's store counts the refusals): that rank says it, the others do not. Before it
    (None), rank 0 says it; any other rank waits REFUSAL_GRACE_S for the launcher to end the job at rank 0's exit
    (its stop ends the wait: SIGTERM's own action is put back), then says it itself, naming its rank."""
    if first is not None:
        try:
            said_first = first()
        except Exception:  # the store's host is gone: better said twice than lost
            said_first = True
        if said_first:
            print(line, file=sys.stderr, flush=True)
        return
    if world_size > 1 and rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(REFUSAL_GRACE_S)
        line = f"{line} (said by rank {rank}: rank 0 had not ended the job)"
    print(line, file=sys.stderr, flush=True)


INTERRUPTED_STATUS = 130  # the shell's status for a process ended by SIGINT (128 + 2)


def command(name):
    """The one door of every sibling command's main(argv): a OneLineError (bad input, data, a checkpoint; anywhere
    in it) ends it with `NAME: error: MESSAGE` on one line and exit status 2; Ctrl-C (KeyboardInterrupt) with one
    line naming the command and exit status 130, not a traceback. What it writes is written whole or not at all
    (each output goes to a temporary name, then is renamed), so nothing half-written is left; what it was in (an
    HPO trial, a lab run) is marked stopped where it was caught first."""

    def door(main):
        @functools.wraps(main)
        def run(argv=None):
            try:
                return main(argv)
            except OneLineError as err:
                print(f"{name}: error: {' '.join(one_line(err).splitlines())}", file=sys.stderr, flush=True)
                return 2
            except KeyboardInterrupt:
                print(f"{name}: interrupted (Ctrl-C): stopped, nothing half-written left", file=sys.stderr, flush=True)
                return INTERRUPTED_STATUS

        return run

    return door


INTERRUPT_GRACE_S = 120  # what a run given Ctrl-C has to write its checkpoint before it is killed


def ended_on_interrupt(proc, grace=INTERRUPT_GRACE_S):
    """A child process at Ctrl-C: told (SIGINT; the terminal's reached it already, a `kill -INT` of this process
    did not), then waited for while it checkpoints, killed past `grace` seconds. Its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
