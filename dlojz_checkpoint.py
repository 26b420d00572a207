"""Checkpoints that survive a crash mid-write and a preempted job.

- `save(state, output_dir, name, keep)`: write `name` atomically (temp file in the same folder, fsync, os.replace),
  then point `latest` at it (atomically too), then delete all but the `keep` newest dlojz checkpoints.
- `load(path)`: `torch.load(weights_only=True)`; a truncated, foreign or unreadable file raises `CheckpointError`.
- `load_latest(output_dir)`: the newest complete checkpoint: the one `latest` names, else the newest that loads;
  each refused file is reported with a warning and the previous one is tried.

- `CheckpointSaver(output_dir, keep, device, fixed, model=..., optimizer=..., ...)`: what dlojz.py saves: the
  `state_dict()` of each part given (None for a part that is off), the training position, what stays the same all
  run (`fixed`: the run's config as `args`, the schedule's length) and the random generators' states (`rng`: torch,
  python, cuda), through `save`.
- `restore_rng(state, device)`: put the random generators back as they were saved.

A checkpoint is a plain dict with `FORMAT_KEY` set, so a file written by another program is refused clearly.
"""
import os
import random
import re
import sys
import tempfile
from pathlib import Path

import torch

FORMAT_KEY = "dlojz_checkpoint_format"
FORMAT_VERSION = 1
LATEST = "latest"
NAME_RE = re.compile(r"^ckpt_e(\d+)_s(\d+)\.pt$")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line naming the file."""


def checkpoint_name(epoch, global_step):
    return f"ckpt_e{epoch:04d}_s{global_step:09d}.pt"


def _atomic_write(path, write):
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    # make the rename itself durable
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def list_checkpoints(output_dir):
    """dlojz checkpoints in `output_dir`, oldest first (by epoch then global step)."""
    found = []
    for p in Path(output_dir).glob("ckpt_e*_s*.pt"):
        m = NAME_RE.match(p.name)
        if m:
            found.append(((int(m.group(1)), int(m.group(2))), p))
    return [p for _, p in sorted(found)]


def save(state, output_dir, name, keep=3):
    output_dir = Path(output_dir)
    state = dict(state, **{FORMAT_KEY: FORMAT_VERSION})
    path = output_dir / name
    _atomic_write(path, lambda f: torch.save(state, f))
    _atomic_write(output_dir / LATEST, lambda f: f.write((name + "\n").encode()))
    if keep and keep > 0:
        for old in list_checkpoints(output_dir)[:-keep]:
            if old.name != name:
                old.unlink(missing_ok=True)
    return path


def load(path):
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, pickle of foreign objects, not a torch file at all
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint {path} is unreadable or truncated ({reason[:160]})") from None
    if not isinstance(state, dict) or state.get(FORMAT_KEY) != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} was not written by dlojz (no '{FORMAT_KEY}' key)")
    return state


def load_latest(output_dir):
    """Return (state, path) of the newest usable checkpoint in output_dir, or (None, None) if there is none."""
    output_dir = Path(output_dir)
    candidates = list(reversed(list_checkpoints(output_dir)))
    latest = output_dir / LATEST
    if latest.is_file():
        named = output_dir / latest.read_text().strip()
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
    """Saves the parts of a run (objects with `state_dict()`, or None) with the training position, on rank 0."""

    def __init__(self, output_dir, keep, device, fixed, **parts):
        self.output_dir, self.keep, self.device, self.fixed, self.parts = Path(output_dir), keep, device, fixed, parts

    def save(self, position):
        """Write a checkpoint of the parts at `position` (a dict: epoch, batch, global_step, ...); return its path."""
        state = {name: part.state_dict() if part is not None else None for name, part in self.parts.items()}
        state.update(self.fixed, **position, rng=rng_state(self.device))
        return save(state, self.output_dir, checkpoint_name(position["epoch"], position["global_step"]), keep=self.keep)


def rng_state(device):
    return dict(torch=torch.get_rng_state(), python=random.getstate(),
                cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def restore_rng(state, device):
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if device.type == "cuda" and state["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)
