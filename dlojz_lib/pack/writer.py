"""The shard writer: an image tree into webdataset tar shards (dlojz_lib/data/shards.py reads them back at random).

A parallel file system serves a few large files far better than 1.28 million small ones (every open is a request to
the metadata servers). `python dlojz_pack.py SRC DST [--shard-size 1GB] [--workers N]` turns SRC, torchvision's
ImageNet layout (meta.bin, train/<wnid>/, val/<wnid>/) or ImageFolder (train/<class>/, val/<class>/), into:

- `DST/train-000000.tar`, `DST/train-000001.tar`, ..., `DST/val-000000.tar`, ...: webdataset's format, plain tars
  that tarfile, GNU tar and webdataset read. Two members per sample: `KEY.jpg` (or the source's own extension,
  lower-case, jpeg -> jpg) holding the source file's bytes unchanged, never re-encoded, and `KEY.cls`, the class
  index in ASCII decimal, as webdataset's ImageNet examples write them. KEY is the file's path in its class folder
  with `<class>_` in front (unless already there, as in ImageNet's `n01440764_10026`), every character but letters,
  digits, `-` and `_` made `_` (webdataset cuts the key at the first dot), unique in its split. Train samples are in
  a fixed shuffled order (a hash of the key: the same on every machine and Python), so that a sequential reader
  such as webdataset sees mixed classes; val samples in the source's order.
- `DST/train-index.npy`, `DST/val-index.npy`: the random-access index. Row i is sample i of
  `ImageFolder(SRC/split)` with dlojz's IMG_EXTENSIONS, so a packed set and the folder give the same sample at the
  same index, and dlojz's samplers and per-sample seeding behave identically. A numpy structured array (shard,
  offset of the image's bytes in the tar, size, target, key): `np.load(mmap_mode="r")` opens it at once whatever
  its size (1.28 M rows are not parsed, pages are read when used and shared by the DataLoader workers of a node),
  a row is a few microseconds, and the keys, fixed-width ASCII in the same file, cost nothing until asked for
  (ImageNet's train index: 34 bytes a row, 44 MB, opened in a millisecond; its targets listed in 30 ms).
- `DST/dlojz_pack.json`, the manifest: format version, source path, layout, classes (ImageFolder order) and their
  readable names (meta.bin's first name, as dlojz shows them), and per split the shard names, sizes and sample
  counts. Written first as "in progress", marked "complete" at the end: a reader refuses an unfinished pack.

Determinism and resume: the whole layout (which sample goes in which shard, every offset, every shard's size) is
computed up front from the file sizes, and every tar header is one 512-byte block with constant mtime, mode and
owner. So the same SRC gives byte-identical shards whatever --workers; worker processes write shards independently,
each to a temporary name then renamed (a crash never leaves half a shard under its final name); and a rerun keeps
the shards that are there with their planned size and writes only the others. A rerun on a complete pack of the
same SRC says so and does nothing (it only lists SRC, no stat of every file: a file replaced by another of a
different size goes unnoticed then); a damaged shard (wrong size) is rewritten. One pack at a time per DST.

Functions:
- `pack(src, dst, shard_size=None, workers=None, log=print) -> dict`: what the command does; returns a summary.
- `parse_size("500MB") -> int`: 1000-based units (B, KB, MB, GB, TB), 1024-based ones (KiB, MiB, GiB, TiB).

The reader that training uses (`PackedSplit`, `is_packed`, `PackError`, `ShardReadError`) is
dlojz_lib/data/shards.py: this file is the writer, dlojz_lib/pack/source.py lists SRC, dlojz_lib/pack/plan.py lays
out the shards, and dlojz_pack.py is the command line.
"""

import hashlib
import io
import json
import multiprocessing
import os
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from dlojz_lib.data.shards import FORMAT, FORMAT_VERSION, MANIFEST, PackError, pack_files, read_manifest
from dlojz_lib.durable import NO_ROOM, atomic_write, fsync_folder
from dlojz_lib.pack.plan import SHUFFLE_SEED, padded, plan_split
from dlojz_lib.pack.source import SPLITS, class_names_of, list_source, listing_digest, stat_sizes

DEFAULT_SHARD_SIZE = 10**9
PROGRESS_EVERY = 5.0  # seconds between progress lines

# Tar headers: constants, so that the same source gives the same bytes (webdataset's TarWriter stamps the time).
MTIME = 946684800  # 2000-01-01 UTC (0 makes some tools warn of an implausibly old time stamp)
MODE = 0o644
OWNER = "dlojz"

_TEMP_RE = re.compile(r"^\.(dlojz_pack\.json|(train|val)-(index\.npy|\d{6}\.tar))\..*\.tmp$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text):
    """'1GB' -> 10**9, '64KB' -> 64000, '1GiB' -> 2**30, '12345' -> 12345 bytes."""
    match = _SIZE_RE.match(str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    size = int(float(match.group(1)) * unit) if unit else 0
    if size < 1:
        raise PackError(f"--shard-size {text!r}: not a size; give e.g. 1GB, 500MB or 64KB")
    return size


# ---------------------------------------------------------------------------------------------------------------
# Small file helpers
def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_json(path, obj):
    atomic_write(path, lambda f: f.write((json.dumps(obj, indent=1) + "\n").encode()))


# ---------------------------------------------------------------------------------------------------------------
# Writing
def _read_source(path):
    with open(path, "rb") as f:
        return f.read()


def _tarinfo(name, size):
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, MTIME, MODE
    info.uid = info.gid = 0
    info.uname = info.gname = OWNER
    return info


def _write_shard(dst, shard):
    """Write one shard under a temporary name, check it against the plan, rename it. Returns (name, bytes, images)."""
    final = os.path.join(dst, shard["name"])
    fd, tmp = tempfile.mkstemp(dir=dst, prefix=f".{shard['name']}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            # ustar: a name that does not fit one header is an error here, never an extra header that would
            # shift the planned offsets.
            tar = tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT)
            for path, key, ext, target, size, offset in shard["members"]:
                try:
                    data = _read_source(path)
                except OSError as err:
                    raise PackError(
                        f"SRC file {path}: unreadable ({err.strerror or err}); fix or remove it, then rerun"
                    ) from None
                if len(data) != size:
                    raise PackError(
                        f"SRC file {path}: {len(data)} bytes now, {size} when the pack was planned "
                        "(SRC changed during the pack); rerun"
                    )
                for member_ext, payload in sorted(
                    [(ext, data), ("cls", str(target).encode("ascii"))], key=lambda m: m[0]
                ):
                    tar.addfile(_tarinfo(f"{key}.{member_ext}", len(payload)), io.BytesIO(payload))
                    if member_ext == ext and f.tell() - padded(size) != offset:
                        raise RuntimeError(f"{final}: {key} at {f.tell() - padded(size)}, planned at {offset}")
            tar.close()
            if f.tell() != shard["size"]:
                raise RuntimeError(f"{final}: {f.tell()} bytes written, {shard['size']} planned")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        _unlink(tmp)
        raise
    return shard["name"], shard["size"], len(shard["members"])


def _pool_task(args):
    return _write_shard(*args)


def _ignore_sigint():
    # Ctrl-C goes to the whole process group: the parent stops the pool, the workers must not die mid-message.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _write_shards(dst, todo, workers):
    """Yield (name, bytes, images) as shards are finished, in-process for one worker, else by a process pool."""
    if workers <= 1 or len(todo) <= 1:
        for shard in todo:
            yield _write_shard(str(dst), shard)
        return
    # Not "fork": a fork of a process with threads (torch's, a caller's) can copy a held lock into the worker,
    # which then never starts and never exits. forkserver's workers come from a clean single-threaded server.
    start = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    pool = multiprocessing.get_context(start).Pool(min(workers, len(todo)), initializer=_ignore_sigint)
    try:
        yield from pool.imap_unordered(_pool_task, [(str(dst), shard) for shard in todo], chunksize=1)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _remove_temps(dst):
    for name in os.listdir(dst):
        if _TEMP_RE.match(name):
            _unlink(os.path.join(dst, name))


def _index_whole(path, samples):
    """Whether the index at `path` reads as the reader reads it, with `samples` rows."""
    try:
        return len(np.load(path, mmap_mode="r", allow_pickle=False)) == samples
    except (OSError, ValueError):
        return False


def _damaged(dst, names, sizes):
    """Shards missing or not of their planned size."""
    out = []
    for name, size in zip(names, sizes):
        try:
            if os.stat(os.path.join(dst, name)).st_size == size:
                continue
        except FileNotFoundError:
            pass
        out.append(name)
    return out


def _inspect_dst(dst, src, src_dirs):
    """The manifest of a pack of `src` in `dst`, or None for a new or empty folder; refuse anything else."""
    if any(dst.resolve().is_relative_to(d) for d in src_dirs):
        raise PackError(f"DST {dst}: inside SRC's train/ or val/ (it would become a class); give a folder outside")
    if dst.exists() and not dst.is_dir():
        raise PackError(f"DST {dst}: not a folder; give a new or empty folder")
    names = sorted(n for n in os.listdir(dst) if not _TEMP_RE.match(n)) if dst.exists() else []
    if not names:
        return None
    if MANIFEST not in names:
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise PackError(
            f"DST {dst}: holds other files ({names[0]}{more}) and is not a dlojz pack; give a new or empty folder"
        )
    manifest = read_manifest(dst, "give another DST, or remove this one")
    if manifest.get("source") != str(src):
        raise PackError(
            f"DST {dst}: is a pack of {manifest.get('source')}, not of SRC {src}; give another DST, or remove this one"
        )
    strangers = sorted(set(names) - pack_files(manifest))
    if strangers:
        raise PackError(
            f"DST {dst}: holds files that are not part of the pack ({strangers[0]}"
            f"{f' and {len(strangers) - 1} more' if len(strangers) > 1 else ''}); move them away or "
            "give another DST"
        )
    return manifest


def _counts(counts):
    return ", ".join(f"{split} {n:,}" for split, n in counts.items())


def default_workers():
    try:
        return min(8, len(os.sched_getaffinity(0)))  # the CPUs Slurm gave this job
    except AttributeError:
        return min(8, os.cpu_count() or 1)


def _complete_pack(dst, src_abs, manifest, listing, counts, requested, log):
    """DST already holds a complete pack: PackError if it is of another SRC or shard size; its summary if every
    shard is whole (nothing to do); None if some must be written again."""
    old_counts = {s: manifest["splits"][s]["samples"] for s in SPLITS}
    if manifest.get("listing_sha256") != listing:
        raise PackError(
            f"DST {dst}: a complete pack of SRC {src_abs} as it was ({_counts(old_counts)} images); "
            f"SRC has changed since ({_counts(counts)}): remove DST, or give another, to pack it "
            "again"
        )
    if requested is not None and requested != manifest["shard_size"]:
        raise PackError(
            f"DST {dst}: a complete pack of SRC in shards of {manifest['shard_size']} bytes, not "
            f"{requested}: remove DST, or give another, to pack it again"
        )
    damaged = [
        n for s in SPLITS for n in _damaged(dst, manifest["splits"][s]["shards"], manifest["splits"][s]["shard_sizes"])
    ]
    damaged += [  # an index that dlojz.py cannot read is damage too (dlojz.py then says to repack)
        manifest["splits"][s]["index"]
        for s in SPLITS
        if not _index_whole(dst / manifest["splits"][s]["index"], manifest["splits"][s]["samples"])
    ]
    if not damaged:
        log(f"dlojz_pack: {dst} is already a complete pack of {src_abs}: nothing to do")
        return dict(
            dst=str(dst),
            already_complete=True,
            written=0,
            kept=sum(len(manifest["splits"][s]["shards"]) for s in SPLITS),
            samples=old_counts,
            bytes_written=0,
        )
    log(f"dlojz_pack: {dst}: {len(damaged)} file(s) missing or damaged ({damaged[0]}...): writing them again")
    return None


def _new_manifest(src_abs, layout, classes, class_names, shard_size, listing, sizes_digest, counts, plans, old):
    """The manifest of the pack about to be written, "in progress" (an interrupted one's creation time kept)."""
    return dict(
        format=FORMAT,
        version=FORMAT_VERSION,
        state="in progress",
        source=str(src_abs),
        layout=layout,
        classes=list(classes),
        class_names=class_names,
        shard_size=shard_size,
        shuffle_seed=SHUFFLE_SEED,
        listing_sha256=listing,
        sizes_sha256=sizes_digest,
        created=(old or {}).get("created") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        splits={
            split: dict(
                samples=counts[split],
                index=f"{split}-index.npy",
                shards=[s["name"] for s in shards],
                shard_sizes=[s["size"] for s in shards],
                shard_samples=[len(s["members"]) for s in shards],
            )
            for split, (_, shards) in plans.items()
        },
    )


class OutOfRoom(OSError):
    """A full disk (or quota) under DST, said with the disk's free space and the bytes still to write."""

    def __str__(self):
        return self.strerror


def out_of_room(err, dst, still_to_write):
    """`err` (a write's OSError) as an OutOfRoom naming DST's disk, its free space and what is left to write, where
    it is a full disk or quota; else `err` itself."""
    if err.errno not in NO_ROOM:
        return err
    try:
        free = f"{shutil.disk_usage(dst).free / 2**20:,.0f} MiB free"
    except OSError:
        free = "its free space unknown"
    return OutOfRoom(
        err.errno,
        f"DST {dst}: no room on its disk ({free}, about {still_to_write / 2**20:,.0f} MiB of shards still to write): "
        "free some space there, or give a DST on another disk",
    )


def _write_with_progress(dst, todo, n_shards, kept, workers, log):
    """Write the shards `todo` with `workers` processes, a progress line every few seconds; the bytes written. A
    full disk is an OutOfRoom that says how much is left to write."""
    t0, last, written_bytes, done_images = time.monotonic(), time.monotonic(), 0, 0
    images_todo = sum(len(s["members"]) for s in todo)
    results = _write_shards(dst, todo, workers)
    try:
        for k, (name, nbytes, images) in enumerate(results, 1):
            written_bytes += nbytes
            done_images += images
            now = time.monotonic()
            if k == len(todo) or now - last >= PROGRESS_EVERY:
                last = now
                log(
                    f"dlojz_pack: {kept + k}/{n_shards} shards ({name}), {done_images:,}/{images_todo:,} images "
                    f"this run, {written_bytes / 1e6 / max(now - t0, 1e-9):,.1f} MB/s"
                )
    except OSError as err:  # (a worker's write, raised here as its shard is waited for)
        raise out_of_room(err, dst, sum(s["size"] for s in todo) - written_bytes) from None
    finally:
        results.close()  # stops the pool's other shards at once if one failed
        _remove_temps(dst)
    return written_bytes


def _checked_options(shard_size, workers):
    """(bytes per shard or None, worker processes), or a PackError naming the flag."""
    requested = (
        None if shard_size is None else (parse_size(shard_size) if isinstance(shard_size, str) else int(shard_size))
    )
    if requested is not None and requested < 1:
        raise PackError(f"--shard-size {shard_size}: not a size; give e.g. 1GB, 500MB or 64KB")
    workers = default_workers() if workers is None else workers
    if not isinstance(workers, int) or workers < 1:
        raise PackError(f"--workers {workers}: give 1 or more processes")
    return requested, workers


def _ready_dst(dst, src_abs, manifest, digests, log):
    """DST created and writable, with no temporary file left by a killed run; an interrupted pack of a source that
    has changed since (its (listing, sizes) digests differ) removed, its manifest forgotten (None returned)."""
    if manifest is not None and (manifest.get("listing_sha256"), manifest.get("sizes_sha256")) != digests:
        if manifest.get("state") == "complete":  # in use, maybe: not ours to delete
            raise PackError(
                f"DST {dst}: a complete pack of SRC {src_abs} as it was; files of SRC have changed size "
                "since: remove DST, or give another, to pack it again"
            )
        log(f"dlojz_pack: SRC changed since the interrupted pack in {dst} began: starting again")
        for name in pack_files(manifest):
            _unlink(dst / name)
        manifest = None
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PackError(f"DST {dst}: cannot create it ({err.strerror or err}); give a folder you can write") from None
    if not os.access(dst, os.W_OK | os.X_OK):
        raise PackError(f"DST {dst}: not writable; give a folder you can write")
    _remove_temps(dst)  # left by a killed run
    return manifest


def warn_of_empty_files(paths, sizes, log):
    """One warning naming the 0-byte files among `paths` (a copy cut short), which a run cannot decode."""
    if empty := [path for path, size in zip(paths, sizes) if size == 0]:
        shown = ", ".join(map(str, empty[:3])) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
        log(f"dlojz_pack: WARNING: {len(empty)} empty image file(s) (0 bytes), packed as they are, which a run cannot "
            f"decode: {shown}; replace or remove them and pack again")  # fmt: skip


def pack(src, dst, shard_size=None, workers=None, log=print):
    """Pack SRC into DST (see the module's docstring). `shard_size`: bytes or a string such as '1GB'; None for 1 GB,
    or the size of the interrupted pack being finished. Returns a summary dict."""
    t_start = time.monotonic()
    requested, workers = _checked_options(shard_size, workers)
    src, dst = Path(src), Path(dst)
    (layout, classes, samples), src_abs = list_source(src), src.resolve()
    manifest = _inspect_dst(dst, src_abs, [(src_abs / s).resolve() for s in SPLITS])
    listing = listing_digest(src, classes, samples)
    counts = {split: len(samples[split]) for split in SPLITS}
    class_names = class_names_of(src, classes, layout)

    if manifest is not None and manifest.get("state") == "complete":
        finished = _complete_pack(dst, src_abs, manifest, listing, counts, requested, log)
        if finished is not None:
            return dict(finished, seconds=time.monotonic() - t_start)

    if manifest is not None and requested is not None and requested != manifest["shard_size"]:
        raise PackError(
            f"DST {dst}: an interrupted pack in shards of {manifest['shard_size']} bytes: rerun with "
            f"--shard-size {manifest['shard_size']} (or without it) to finish it, or remove DST"
        )
    shard_size = requested or (manifest or {}).get("shard_size") or DEFAULT_SHARD_SIZE

    # The plan, from every file's size
    all_paths = [path for split in SPLITS for path, _ in samples[split]]
    all_sizes = stat_sizes(all_paths)
    sizes = {"train": all_sizes[: counts["train"]], "val": all_sizes[counts["train"] :]}
    warn_of_empty_files(all_paths, all_sizes, log)
    sizes_digest = hashlib.sha256(np.asarray(all_sizes, dtype="<u8").tobytes()).hexdigest()
    plans = {split: plan_split(src, split, classes, samples[split], sizes[split], shard_size) for split in SPLITS}

    manifest = _ready_dst(dst, src_abs, manifest, (listing, sizes_digest), log)

    manifest = _new_manifest(
        src_abs, layout, classes, class_names, shard_size, listing, sizes_digest, counts, plans, manifest
    )
    _write_json(dst / MANIFEST, manifest)  # first: a DST holding pack files always says whose they are
    for split, (index, _) in plans.items():
        atomic_write(dst / f"{split}-index.npy", lambda f, index=index: np.save(f, index, allow_pickle=False))

    shards = [s for split in SPLITS for s in plans[split][1]]
    damaged = set(_damaged(dst, [s["name"] for s in shards], [s["size"] for s in shards]))
    todo = [s for s in shards if s["name"] in damaged]
    kept = len(shards) - len(todo)
    total_bytes = sum(s["size"] for s in shards)
    log(
        f"dlojz_pack: {src_abs} ({layout} layout, {len(classes)} classes): "
        + "; ".join(f"{split} {counts[split]:,} images in {len(plans[split][1])} shards" for split in SPLITS)
        + f"; {total_bytes / 1e6:,.1f} MB"
    )
    if kept:
        log(f"dlojz_pack: finishing the pack in {dst}: {kept} shards already there, {len(todo)} to write")
    log(f"dlojz_pack: writing {len(todo)} shards into {dst} with {min(workers, max(1, len(todo)))} process(es)")

    written_bytes = _write_with_progress(dst, todo, len(shards), kept, workers, log)

    missing = _damaged(dst, [s["name"] for s in shards], [s["size"] for s in shards])
    if missing:
        raise PackError(
            f"DST {dst}/{missing[0]}: missing or of the wrong size after packing (another process "
            "writing into DST?); rerun"
        )
    fsync_folder(dst)  # the shards' renames reach the disk before the manifest says "complete"
    manifest.update(state="complete", completed=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    _write_json(dst / MANIFEST, manifest)
    seconds = time.monotonic() - t_start
    log(
        f"dlojz_pack: done: {dst} holds {len(shards)} shards, {sum(counts.values()):,} images, "
        f"{total_bytes / 1e6:,.1f} MB ({written_bytes / 1e6:,.1f} MB written in {seconds:.1f} s)"
    )
    return dict(
        dst=str(dst),
        already_complete=False,
        written=len(todo),
        kept=kept,
        samples=counts,
        bytes_written=written_bytes,
        seconds=seconds,
    )
