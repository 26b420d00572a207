"""Checkpoints that survive a crash mid-write and a preempted job.

- `write(state, path)`: one checkpoint file, atomically, with its SHA-256 in `NAME.sha256` beside it (written
  first; `sha256sum -c` reads it); `load` refuses a file whose bytes no longer match (a flipped bit, a bad copy).
- `save(state, output_dir, name, keep, best)`: write `name` atomically (temp file in the same folder, fsync,
  os.replace), then point `latest` at it (atomically too), and `best` too when it is the run's best so far, then
  delete all but the `keep` newest dlojz checkpoints, never the one `best` names.
- `load(path)`: `torch.load(weights_only=True)`; a truncated, foreign or unreadable file raises `CheckpointError`.
- `load_latest(output_dir)`: the newest complete checkpoint: the one `latest` names, else the newest that loads;
  each refused file is reported with a warning and the previous one is tried.

- `CheckpointSaver(output_dir, keep, device, fixed, model=..., optimizer=..., ...)`: what dlojz.py saves: the
  `state_dict()` of each part given (None for a part that is off), the training position, what stays the same all
  run (`fixed`: the run's config as `args`, the schedule's length) and the random generators' states (`rng`: torch,
  python, cuda), through `save`.
- `restore_rng(state, device)`: put the random generators back as they were saved.

A checkpoint is a plain dict with `FORMAT_KEY` set, so a file written by another program is refused clearly.

Sharded checkpoints (--fsdp, written by dlojz_lib.parallelism.fsdp.ShardedCheckpointSaver) are folders `ckpt_e*_s*.dcp`: the
shards of every rank (torch.distributed.checkpoint's files and `.metadata`) and `SHARDED_META`, the same dict
without the model and optimizer. They are written under a hidden staging name and renamed into place
(`publish_folder`), then named by `latest` and pruned like the files; `load` of such a folder checks that every
shard file the metadata lists is there whole, and returns the dict with `sharded_path` set.
"""

import os
import random
import re
import shutil
import sys
import threading
from pathlib import Path

import torch

from dlojz_lib.checks import OneLineError, fail
from dlojz_lib.durable import NO_ROOM, atomic_write, fsync_folder, sha256_of

FORMAT_KEY = "dlojz_checkpoint_format"
FORMAT_VERSION = 2  # 2: a SHA-256 file beside each checkpoint file; 1 (no checksum) is still read
LATEST = "latest"
BEST = "best"  # names the checkpoint of the best validation (--best-metric); pruning keeps it
RUN_LOCK = ".dlojz.lock"  # held by the run writing in the folder, for its life (the kernel drops it at any exit)
CHECKSUM_SUFFIX = ".sha256"
NAME_RE = re.compile(r"^ckpt_e(\d+)_s(\d+)\.(pt|dcp)$")
SHARDED_META = "dlojz.pt"


class CheckpointError(OneLineError):
    """A checkpoint that cannot be used; the message is one line naming the file."""


class CheckpointNotWritten(Exception):
    """A checkpoint the run cannot end without (a stop's, the last epoch's) is not on disk: the run ends non-zero,
    with one line naming the last good checkpoint."""


def not_written_message(output_dir, what, reason):
    kept = latest_name(output_dir)
    return (
        f"{what} not written to {output_dir} ({reason}): "
        + (f"the last good checkpoint is {Path(output_dir) / kept}" if kept else "no checkpoint of this run is on disk")
        + f"; free space in {output_dir} (or give another --output-dir), then continue with --resume auto"
    )


def checkpoint_name(epoch, global_step, sharded=False):
    return f"ckpt_e{epoch:04d}_s{global_step:09d}.{'dcp' if sharded else 'pt'}"


def list_checkpoints(output_dir):
    """dlojz checkpoints in `output_dir`, oldest first (by epoch then global step)."""
    found = []
    for p in Path(output_dir).glob("ckpt_e*_s*.*"):
        m = NAME_RE.match(p.name)
        if m:
            found.append(((int(m.group(1)), int(m.group(2))), p))
    return [p for _, p in sorted(found)]


def checksum_path(path):
    """The checkpoint's SHA-256, beside it: `NAME.sha256`, in `sha256sum` format (`sha256sum -c` checks it)."""
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def newest_checkpoint(output_dir):
    """The newest dlojz checkpoint in `output_dir` (by epoch then step), or None (none there, or no such folder)."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def resumes_a_checkpoint(resume, output_dir) -> bool:
    """Whether a run given --resume `resume` starts from a checkpoint's weights: a path given (a bad one is
    --resume's own line), or `auto` with a checkpoint in `output_dir`. Its --initial-checkpoint or --pretrained
    weights are then not needed: the checkpoint's replace them."""
    if not resume:
        return False
    return resume != "auto" or newest_checkpoint(output_dir) is not None


def write(state, path):
    """`state` as one dlojz checkpoint file at `path`, atomically (no `latest`, no pruning), with its SHA-256
    beside it: written before the checkpoint takes its name, so that a checkpoint never appears without it."""
    state = dict(state, **{FORMAT_KEY: FORMAT_VERSION})
    path = Path(path)

    def write_checksum(tmp):
        line = f"{sha256_of(tmp)}  {path.name}\n"
        atomic_write(checksum_path(path), lambda f: f.write(line.encode()))

    atomic_write(path, lambda f: torch.save(state, f), before_rename=write_checksum)
    return path


def out_of_room(err, path, needed_bytes):
    """CheckpointError saying in one line that the disk holding `path` has no room for the `needed_bytes` of what a
    command writes there (`err`: the write's OSError, or torch's zip writer's RuntimeError over it), or None when
    `err` is another failure."""
    failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException: each rank's
    if isinstance(failures, dict):
        return next((said for exc, _ in failures.values() if (said := out_of_room(exc, path, needed_bytes))), None)
    folder = Path(path).resolve().parent
    try:
        free_bytes = shutil.disk_usage(folder).free
        free = f"{free_bytes / 2**20:,.0f} MiB free"
    except OSError:
        free_bytes, free = None, "its free space unknown"
    found = os_error_in(err)
    # torch's zip writer says a full disk in its own words ("file write failed", "iostream error"), no OSError kept
    torch_writer = isinstance(err, RuntimeError) and free_bytes is not None and free_bytes < needed_bytes
    if (found is None or found.errno not in NO_ROOM) and not torch_writer:
        return None
    return CheckpointError(
        f"{path}: no room on the disk of {folder} ({free}, about {needed_bytes / 2**20:,.0f} MiB needed): free some "
        "space there, or give a path on another disk; nothing half-written was left"
    )


def tensor_bytes(state):
    """The bytes of the tensors in `state` (nested dicts and lists): about what its file takes."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def write_whole(state, path):
    """write() for a command's own output (dlojz_avg.py's, consolidate's): a disk without room for it is one line
    (out_of_room), and atomic_write has removed its temporary file."""
    try:
        return write(state, path)
    except (OSError, RuntimeError) as err:
        said = out_of_room(err, path, tensor_bytes(state))
        if said is None:
            raise
    raise said  # (outside the handler: the failed write's frames, and its open file, are let go first)


def os_error_in(err):
    """The OSError behind `err` (itself, or its cause: torch.save reports a full disk as a RuntimeError of its zip
    writer), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def save(state, output_dir, name, keep=3, best=False):
    output_dir = Path(output_dir)
    path = write(state, output_dir / name)
    _point_latest_and_prune(output_dir, name, keep, best)
    return path


def publish_folder(meta, staging, output_dir, name, keep=3, best=False):
    """Complete the sharded checkpoint being written in the folder `staging` with `meta` (SHARDED_META), then
    rename it to `output_dir/name` (a folder appears whole or not at all), point `latest` at it and prune."""
    output_dir = Path(output_dir)
    write(meta, Path(staging) / SHARDED_META)
    fsync_folder(staging)
    final = output_dir / name
    if final.exists():  # the same step saved again (a stop right after a checkpoint): the new one wins
        replaced = output_dir / f".{name}.old"
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
        os.replace(staging, final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_folder(output_dir)
    _point_latest_and_prune(output_dir, name, keep, best)
    return final


def _point_latest_and_prune(output_dir, name, keep, best=False):
    atomic_write(output_dir / LATEST, lambda f: f.write((name + "\n").encode()))
    if best:  # after the checkpoint is whole on disk: `best` never names a file being written
        atomic_write(output_dir / BEST, lambda f: f.write((name + "\n").encode()))
    if keep and keep > 0:
        kept_best = pointed_name(output_dir, BEST)
        for old in list_checkpoints(output_dir)[:-keep]:
            if old.name not in (name, kept_best):
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
                    checksum_path(old).unlink(missing_ok=True)


def is_sharded_folder(path) -> bool:
    """Whether the folder `path` is a sharded checkpoint, by its name (ckpt_e*_s*.dcp, any *.dcp, an unfinished
    *.dcp.tmp) or its contents (a copy under another name: DCP's .metadata, or dlojz's SHARDED_META)."""
    path = Path(path)
    named = NAME_RE.match(path.name) or path.name.endswith((".dcp", ".dcp.tmp"))
    return bool(named) or (path / ".metadata").exists() or (path / SHARDED_META).exists()


def check_shards(path):
    """Raise CheckpointError unless the sharded checkpoint folder `path` has its metadata and every shard file
    it lists, long enough for every piece it holds."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path}: no readable shard metadata ({type(err).__name__}); it was not written completely"
        ) from None
    needed = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for relative, size in sorted(needed.items()):
        shard = Path(path) / relative
        if not shard.is_file() or shard.stat().st_size < size:
            raise CheckpointError(f"checkpoint {path}: shard file {relative} is missing or truncated")


def load(path):
    path = Path(path)
    if path.name == BEST and path.is_file():  # the run's best checkpoint, by the name the pointer holds
        named = pointed_name(path.parent, BEST)
        if named is None:
            raise CheckpointError(f"checkpoint {path}: names no checkpoint; give a checkpoint file")
        path = path.parent / named
    if path.name == LATEST or path.name.endswith(CHECKSUM_SUFFIX):  # a checkpoint's side file, not a checkpoint
        pointer = path.name == LATEST
        named = latest_name(path.parent) if pointer else path.name[: -len(CHECKSUM_SUFFIX)]
        raise CheckpointError(
            f"checkpoint {path}: {'the pointer to the newest checkpoint' if pointer else 'a checksum file'}, not a "
            f"checkpoint: give {path.parent / named if named else 'a checkpoint file'}, or --resume auto "
            f"--output-dir {path.parent}"
        )
    if path.is_dir() and not is_sharded_folder(path):  # not a sharded checkpoint, by name or contents: a run's folder?
        found = list_checkpoints(path)
        raise CheckpointError(
            f"checkpoint {path} is a folder, not a checkpoint: "
            + (
                f"its newest is {found[-1].name}; give --resume auto --output-dir {path}, or one checkpoint file"
                if found
                else "give a checkpoint file (ckpt_e*_s*.pt) or a sharded checkpoint folder (ckpt_e*_s*.dcp)"
            )
        )
    if path.is_dir():
        if path.name.endswith(".tmp"):
            raise CheckpointError(
                f"checkpoint {path}: an unfinished write (a sharded checkpoint's folder while it is written: its run "
                "or command stopped before the rename); give the run's previous checkpoint, or --resume auto"
            )
        check_shards(path)
        if not (path / SHARDED_META).is_file():
            raise CheckpointError(
                f"checkpoint {path}: its {SHARDED_META} (the run's state beside the shards) is missing: it was not "
                "written completely, or not by dlojz"
            )
        state = load(path / SHARDED_META)
        state["sharded_path"] = str(path)
        return state
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    recorded = checksum_path(path)
    if recorded.is_file():  # before torch.load: a damaged file is not unpickled at all
        expected = (recorded.read_text().split() or [""])[0]
        if sha256_of(path) != expected:
            raise CheckpointError(
                f"checkpoint {path}: its SHA-256 differs from the one recorded in {recorded.name} when it was "
                "written: damaged on disk or in a copy"
            )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, pickle of foreign objects, not a torch file at all
        raise CheckpointError(f"checkpoint {path} {why_unreadable(path, err)}") from None
    if not isinstance(state, dict) or state.get(FORMAT_KEY) not in (1, FORMAT_VERSION):
        raise CheckpointError(f"checkpoint {path} was not written by dlojz (no '{FORMAT_KEY}' key)")
    if state[FORMAT_KEY] >= 2 and not recorded.is_file():  # format 1 (older dlojz): written without a checksum
        raise CheckpointError(
            f"checkpoint {path}: its checksum file {recorded.name} is missing; copy it with the checkpoint"
        )
    return state


def written_by_command(path, key) -> bool:
    """Whether `path` is a dlojz checkpoint that a command wrote, not a run: it loads (its checksum verified) and
    holds `key` (dlojz_avg.py's `averaged_from`, dlojz_fsdp.py consolidate's `consolidated_from`)."""
    try:
        return load(path).get(key) is not None
    except CheckpointError:
        return False


def why_unreadable(path, err) -> str:
    """Why torch.load refused `path`, as a user can act on it (torch's own reasons for a file that is not one of its
    own are a bare key, '105', or errno 22): a phrase after the path; the caller says what to do."""
    with open(path, "rb") as file:
        head = file.read(4)
    if not head.startswith((b"PK", b"\x80")):
        return "is not a PyTorch file (neither a zip archive nor a pickle)"
    if "Weights only load failed" in str(err) and "Unsupported" in str(err):  # a class weights_only does not know
        return "holds objects other than tensors and plain values, which dlojz never unpickles (weights_only)"
    if head.startswith(b"PK"):  # torch.save's zip archive
        return f"is truncated or damaged (torch: {short_reason(err)})"
    return f"cannot be read (torch: {short_reason(err)})"  # a pickle (torch's legacy format)


def short_reason(err, limit=160):
    """An exception's first line for a one-line message: terminal colour codes out, cut at a word."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def latest_name(output_dir):
    """The checkpoint that `latest` names in `output_dir`, or None (none yet, unreadable, or not a checkpoint's
    name: the newest on disk is used then)."""
    return pointed_name(output_dir, LATEST)


def pointed_name(output_dir, pointer):
    """The checkpoint name the file `pointer` (LATEST, BEST) holds in `output_dir`, or None."""
    try:
        name = (Path(output_dir) / pointer).read_text(errors="replace").strip()
    except OSError:
        return None
    return name if NAME_RE.match(name) else None


def load_latest(output_dir):
    """Return (state, path) of the newest usable checkpoint in output_dir, or (None, None) if there is none."""
    output_dir = Path(output_dir)
    candidates = list(reversed(list_checkpoints(output_dir)))
    if latest := latest_name(output_dir):
        named = output_dir / latest
        if named in candidates:
            candidates.remove(named)
        candidates.insert(0, named)
    for path in candidates:
        try:
            return load(path), path
        except CheckpointError as err:
            print(f"WARNING: {err}; trying the previous checkpoint", file=sys.stderr, flush=True)
    return None, None


class CheckpointSaver:
    """Saves the parts of a run (objects with `state_dict()`, or None) with the training position, on rank 0:
    every rank calls `save`, the others return None. With `background`, `save` only copies the state into host
    memory (the one pause of training) and a thread writes it; the next `save` waits for that write first, and
    `wait()` waits for it (before a run ends). A write that fails with an OSError (disk full, quota, a file system
    gone) is one warning line: the previous checkpoint stays `latest` and training goes on; `unwritten` lists those
    writes, and `last_unwritten()` says whether the most recent one is among them (a stop's or the last epoch's
    checkpoint must not be: the run then ends non-zero)."""

    def __init__(self, output_dir, keep, device, fixed, is_main=True, background=False, **parts):
        self.output_dir, self.keep, self.device, self.fixed, self.parts = Path(output_dir), keep, device, fixed, parts
        self.is_main, self.background = is_main, background
        self._writer, self._error = None, None  # the background write in flight; what it raised, for wait()
        self.unwritten = []  # (path, reason) of each write that failed
        self._last = None  # the path of the most recent save

    def save(self, position, best=False):
        """Checkpoint the parts at `position` (a dict: epoch, batch, global_step, ...), and name it `best` once
        written when `best`. Returns its path (being written, in the background), or None: not rank 0, or the
        write failed (said in one line)."""
        if not self.is_main:
            return None
        self.wait()  # one write at a time, in order
        state = {name: part.state_dict() if part is not None else None for name, part in self.parts.items()}
        state.update(self.fixed, **position, rng=rng_state(self.device))
        name = checkpoint_name(position["epoch"], position["global_step"])
        self._last = self.output_dir / name
        if not self.background:
            return self._write(state, name, best)
        state = to_host(state)  # the parts' tensors go on changing as training goes on: a copy is written
        self._writer = threading.Thread(target=self._write, args=(state, name, best), name="dlojz-checkpoint")
        self._writer.start()
        return self.output_dir / name

    def wait(self):
        """Wait for the write in flight, if any; an error it met other than an OSError is raised here."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def last_unwritten(self):
        """After `wait()`: why the most recent save did not reach the disk, or None (written, or none made)."""
        if self.unwritten and self.unwritten[-1][0] == self._last:
            return self.unwritten[-1][1]
        return None

    def _write(self, state, name, best=False):
        try:
            return save(state, self.output_dir, name, keep=self.keep, best=best)
        except BaseException as err:
            os_error = os_error_in(err)
            if os_error is None:
                if not self.background:
                    raise
                self._error = err  # raised by wait(), in the training thread
                return None
            reason = os_error.strerror or str(os_error)
            self.unwritten.append((self.output_dir / name, reason))
            kept = latest_name(self.output_dir)
            print(
                f"WARNING: checkpoint {self.output_dir / name} not written ({reason}); "
                + (f"{kept} stays the latest" if kept else "no earlier checkpoint")
                + f"; training goes on: free space in {self.output_dir}",
                file=sys.stderr,
                flush=True,
            )
            return None


def to_host(obj):
    """`obj` with every tensor copied into host memory and every container rebuilt: a snapshot that training's
    next steps do not change."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: to_host(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(value) for value in obj)
    return obj


def rng_state(device):
    return dict(
        torch=torch.get_rng_state(),
        python=random.getstate(),
        cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    )


def restore_rng(state, device):
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if device.type == "cuda" and state["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)


def average(paths):
    """One checkpoint whose model is the mean of the models of `paths` (dlojz checkpoints of one run, .pt): every
    floating tensor of the state dict (parameters and BatchNorm's running statistics) averaged in float64, the
    integer buffers (BatchNorm's num_batches_tracked) the newest's; torchvision's MobileNetV3 recipe and timm's
    avg_checkpoints.py do the same. The rest (args, position, optimizer) is the newest checkpoint's, its EMA left
    out, and `averaged_from` names the files. CheckpointError for a sharded checkpoint or models that differ."""
    paths = [Path(p) for p in paths]
    saved = []
    for path in paths:
        state = load(path)
        if state.get("sharded_path"):
            raise CheckpointError(
                f"checkpoint {path} is sharded (--fsdp): consolidate it first (python dlojz_fsdp.py consolidate)"
            )
        saved.append(state)
    newest = saved[-1]
    keys = {name: value.shape for name, value in newest["model"].items()}
    for path, state in zip(paths, saved):
        if {name: value.shape for name, value in state["model"].items()} != keys:
            raise CheckpointError(
                f"checkpoint {path}: another model than {paths[-1]}'s ({state['args'].get('arch')}, "
                f"{newest['args'].get('arch')}): average the checkpoints of one run"
            )
    model = {}
    for name, value in newest["model"].items():
        if value.is_floating_point():
            total = sum(state["model"][name].double() for state in saved)
            model[name] = (total / len(saved)).to(value.dtype)
        else:
            model[name] = value.clone()
    return dict(newest, model=model, ema=None, averaged_from=[str(p) for p in paths])


def ema_weights(saved, path, flag="--eval-ema"):
    """`flag` (dlojz.py's --eval-ema, the inference commands' --ema): the model's state dict of the checkpoint's EMA
    (ModelEma keeps the model under `module.`)."""
    if saved.get("sharded_path"):
        fail(f"{flag}: {path} is a sharded checkpoint (--fsdp), which keeps no EMA weights")
    ema = saved.get("ema")
    if not ema:
        fail(f"{flag}: {path} has no EMA weights (its run had no --model-ema): leave {flag} out")
    return {name[len("module.") :]: tensor for name, tensor in ema.items() if name.startswith("module.")}
