"""Tests of dlojz_pack: an image tree packed into webdataset tar shards reads back as the folder does (same sample,
same bytes, same class at every index), the shards are plain tars, packing is deterministic (workers, reruns), an
interrupted pack is finished without rewriting what was done, a damaged shard is named, bad input is one line.

Small trees only (tens of 32x24 JPEGs): the whole file takes a few seconds on 2 cores, most of it two CLI
subprocesses (importing torch) run side by side.

Modules: dlojz_lib/pack/ (dlojz_lib/pack/source.py: the tree read, dlojz_lib/pack/plan.py: byte-identical
shards whatever the writers, the writer).
"""

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from conftest import importtime, script_python  # noqa: E402

import dlojz_lib.pack.writer  # noqa: E402
from dlojz_lib.checks import DataError  # noqa: E402
from dlojz_lib.data.embedded import make_embedded_dataset  # noqa: E402
from dlojz_lib.data.layout import IMG_EXTENSIONS  # noqa: E402
from dlojz_lib.data.shards import (  # noqa: E402
    MANIFEST,
    PackedSplit,
    PackError,
    ShardReadError,
    intact_rows,
    is_packed,
)
from dlojz_lib.pack.writer import pack  # noqa: E402
from dlojz_pack import main  # noqa: E402

SHARD_SIZE = "20KB"  # 3 samples of these tiny JPEGs per shard (a tar is padded to 10 KiB records): 12 train shards
# webdataset's split of a member name into sample key and field (webdataset.tariterators.base_plus_ext)
WEBDATASET_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
WNIDS = {"disc": "n01440764", "square": "n01443537", "triangle": "n01484850"}


def quiet(*_):
    pass


def image_folder(root, split):
    """What dlojz's build_datasets reads: torchvision's ImageFolder with dlojz's extensions."""
    return torchvision.datasets.ImageFolder(
        str(Path(root) / split), is_valid_file=lambda p: p.lower().endswith(IMG_EXTENSIONS)
    )


def shard_files(root):
    return sorted(p.name for p in Path(root).iterdir() if p.name.endswith(".tar"))


def file_bytes(root):
    """{name: bytes} of the shards and indexes (the manifest holds dates)."""
    return {p.name: p.read_bytes() for p in sorted(Path(root).iterdir()) if p.suffix in (".tar", ".npy")}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """ImageFolder tree with the awkward cases: a PNG with the stem of a JPEG beside it (same key), dots in a name,
    a nested folder, a file that is not an image (ImageFolder and the pack leave it out)."""
    root = make_embedded_dataset(
        tmp_path_factory.mktemp("pack") / "src", n_classes=3, train_per_class=10, val_per_class=3, size=(32, 24)
    )
    train = root / "train"
    Image.new("RGB", (20, 16), (10, 200, 30)).save(train / "disc" / "disc_0003.png")
    shutil.copy(train / "square" / "square_0001.JPEG", train / "square" / "holiday.2019.v2.jpeg")
    (train / "triangle" / "sub").mkdir()
    shutil.copy(train / "triangle" / "triangle_0002.JPEG", train / "triangle" / "sub" / "x.JPEG")
    (train / "disc" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def imagenet_src(tmp_path_factory):
    """torchvision's ImageNet layout: WordNet-id folders, ImageNet's file names, a meta.bin naming 2 of the 3 ids."""
    embedded = make_embedded_dataset(
        tmp_path_factory.mktemp("pack") / "embedded", n_classes=3, train_per_class=4, val_per_class=2, size=(32, 24)
    )
    root = tmp_path_factory.mktemp("pack") / "imagenet"
    n_val = 0
    for name, wnid in WNIDS.items():
        for split in ("train", "val"):
            (root / split / wnid).mkdir(parents=True)
            for k, f in enumerate(sorted((embedded / split / name).iterdir())):
                n_val += split == "val"
                target = f"{wnid}_{k}.JPEG" if split == "train" else f"ILSVRC2012_val_{n_val:08d}.JPEG"
                shutil.copy(f, root / split / wnid / target)
    names = {"n01440764": ("tench", "Tinca tinca"), "n01443537": ("goldfish", "Carassius auratus")}
    torch.save((names, sorted(WNIDS.values()) * 2), root / "meta.bin")
    return root


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory):
    """SRC packed in shards of 20KB by one process, uninterrupted: what every other pack must equal byte for byte."""
    dst = tmp_path_factory.mktemp("pack") / "reference"
    pack(src, dst, shard_size=SHARD_SIZE, workers=1, log=quiet)
    return dst


# ---------------------------------------------------------------------------------------------------------------
# Reading back


def test_pack_reads_back_as_the_image_folder(src, reference):
    manifest = json.loads((reference / MANIFEST).read_text())
    assert manifest["state"] == "complete" and manifest["layout"] == "imagefolder"
    assert manifest["source"] == str(src.resolve())
    for split in ("train", "val"):
        folder, packed = image_folder(src, split), PackedSplit(reference, split)
        assert len(packed) == len(folder.samples) and packed.targets == folder.targets
        assert packed.classes == folder.classes == ["disc", "square", "triangle"]
        assert packed.class_names == packed.classes  # no meta.bin: the folder names
        for i, (path, target) in enumerate(folder.samples):
            assert packed.read_bytes(i) == Path(path).read_bytes(), f"{split} sample {i} ({path})"
        keys = [packed.key(i) for i in range(len(packed))]
        assert len(set(keys)) == len(keys) and not any("." in k or "/" in k for k in keys)
        assert packed.location(0) == f"{packed.shard_path(0)}:{keys[0]}"
        # Train shards hold a shuffled order (sequential readers see mixed classes); val the folder's order.
        placement = sorted(range(len(packed)), key=lambda i: (packed.shard_path(i).name, packed.rows()[i]["offset"]))
        if split == "train":
            assert placement != list(range(len(packed)))
            assert len({packed.targets[i] for i in placement[:6]}) > 1
        else:
            assert placement == list(range(len(packed)))
    train = image_folder(src, "train")
    keys = {
        Path(path).relative_to(src / "train").as_posix(): PackedSplit(reference, "train").key(i)
        for i, (path, _) in enumerate(train.samples)
    }
    assert "disc/notes.txt" not in keys and len(keys) == 33
    assert keys["disc/disc_0003.JPEG"] == "disc_0003" and keys["disc/disc_0003.png"] == "disc_0003_1"
    assert keys["square/holiday.2019.v2.jpeg"] == "square_holiday_2019_v2"
    assert keys["triangle/sub/x.JPEG"] == "triangle_sub_x"


def test_imagenet_layout_keeps_meta_bin_names_and_imagenet_keys(imagenet_src, tmp_path):
    dst = tmp_path / "packed"
    summary = pack(imagenet_src, dst, shard_size=SHARD_SIZE, workers=1, log=quiet)
    assert summary["samples"] == {"train": 12, "val": 6} and is_packed(dst)
    for split in ("train", "val"):
        folder, packed = image_folder(imagenet_src, split), PackedSplit(dst, split)
        assert packed.classes == folder.classes == sorted(WNIDS.values())
        assert packed.class_names == ["tench", "goldfish", "n01484850"]  # as build_datasets names them
        assert packed.targets == folder.targets
        for i, (path, _) in enumerate(folder.samples):
            assert packed.read_bytes(i) == Path(path).read_bytes()
    assert PackedSplit(dst, "train").key(0) == "n01440764_0"
    assert PackedSplit(dst, "val").key(0) == "n01440764_ILSVRC2012_val_00000001"
    assert json.loads((dst / MANIFEST).read_text())["layout"] == "imagenet"


# ---------------------------------------------------------------------------------------------------------------
# The shards


def test_shards_are_standard_tars_in_webdataset_format(src, reference):
    seen = {}
    for split in ("train", "val"):
        packed = PackedSplit(reference, split)
        source = {
            packed.key(i): (Path(path), target) for i, (path, target) in enumerate(image_folder(src, split).samples)
        }
        for name in packed.shards:
            with tarfile.open(reference / name) as tar:
                members = tar.getmembers()
                assert all(m.isreg() for m in members)
                # Two consecutive members per sample, grouped by webdataset's key rule: KEY.cls and KEY.<ext>.
                groups = [members[k : k + 2] for k in range(0, len(members), 2)]
                for group in groups:
                    (key_a, ext_a), (key_b, ext_b) = (WEBDATASET_KEY.match(m.name).groups() for m in group)
                    assert key_a == key_b and "cls" in (ext_a, ext_b), [m.name for m in group]
                    key = key_a
                    path, target = source[key]
                    for m in group:
                        data = tar.extractfile(m).read()
                        if m.name.endswith(".cls"):
                            assert data == str(target).encode("ascii")
                        else:
                            assert data == path.read_bytes(), f"{name}: {m.name} differs from {path}"
                            expected = path.suffix.lower().lstrip(".").replace("jpeg", "jpg")
                            assert m.name == f"{key}.{expected}"
                    seen[(split, key)] = name
                # Constant headers: the same source gives the same bytes.
                assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {
                    (members[0].mtime, 0, 0, members[0].uname, members[0].gname, members[0].mode)
                }
        assert sum(1 for s, _ in seen if s == split) == len(packed)  # every sample in exactly one shard
    assert any(name.endswith(".png") for name in tarfile.open(reference / seen[("train", "disc_0003_1")]).getnames())
    if shutil.which("tar"):  # GNU tar lists and extracts them too
        name = seen[("train", "square_holiday_2019_v2")]
        listing = subprocess.run(["tar", "-tf", str(reference / name)], capture_output=True, text=True, check=True)
        assert listing.stdout.split() == tarfile.open(reference / name).getnames()
        extracted = subprocess.run(
            ["tar", "-xOf", str(reference / name), "square_holiday_2019_v2.jpg"], capture_output=True, check=True
        ).stdout
        assert extracted == (src / "train" / "square" / "holiday.2019.v2.jpeg").read_bytes()


def test_several_shards_are_the_same_bytes_whatever_the_workers_and_the_clock(src, reference, tmp_path, monkeypatch):
    manifest = json.loads((reference / MANIFEST).read_text())
    sizes = manifest["splits"]["train"]["shard_sizes"] + manifest["splits"]["val"]["shard_sizes"]
    counts = manifest["splits"]["train"]["shard_samples"] + manifest["splits"]["val"]["shard_samples"]
    assert len(manifest["splits"]["train"]["shards"]) >= 5 and len(manifest["splits"]["val"]["shards"]) >= 2
    assert all(size <= 20_000 or count == 1 for size, count in zip(sizes, counts))
    assert sizes == [(reference / n).stat().st_size for n in shard_files(reference)]
    # Two processes, an hour later, from a copy of SRC elsewhere: the same bytes (headers carry no time or path).
    copy = tmp_path / "elsewhere"
    shutil.copytree(src, copy)
    clock = time.time
    monkeypatch.setattr(time, "time", lambda: clock() + 3600)
    lines = []
    summary = pack(copy, tmp_path / "two", shard_size=SHARD_SIZE, workers=2, log=lines.append)
    assert summary["written"] == len(sizes) and summary["kept"] == 0
    assert file_bytes(tmp_path / "two") == file_bytes(reference)
    progress = [line for line in lines if "MB/s" in line]
    assert progress and re.search(rf"{len(sizes)}/{len(sizes)} shards .*, 42/42 images", progress[-1])


# ---------------------------------------------------------------------------------------------------------------
# Interrupted, damaged


def test_an_interrupted_pack_is_finished_without_rewriting_the_finished_shards(src, reference, tmp_path, monkeypatch):
    dst = tmp_path / "interrupted"
    manifest = json.loads((reference / MANIFEST).read_text())
    # Ctrl-C while the 4th shard is being written, after its first sample.
    stop_at = sum(manifest["splits"]["train"]["shard_samples"][:3]) + 2
    calls = []
    read = dlojz_lib.pack.writer._read_source

    def interrupted(path):
        calls.append(path)
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return read(path)

    monkeypatch.setattr(dlojz_lib.pack.writer, "_read_source", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pack(src, dst, shard_size=SHARD_SIZE, workers=1, log=quiet)
    monkeypatch.undo()
    finished = ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    # No half shard under a final name, no temporary file left, the manifest says "in progress".
    assert shard_files(dst) == finished and not [p for p in dst.iterdir() if p.name.startswith(".")]
    assert json.loads((dst / MANIFEST).read_text())["state"] == "in progress"
    assert is_packed(dst)
    with pytest.raises(PackError, match="not finished"):
        PackedSplit(dst, "train")
    # A killed run leaves its temporary file: the next run removes it.
    (dst / ".train-000003.tar.k1ll3d.tmp").write_bytes(b"half a shard")
    before = {}
    for name in finished:
        os.utime(dst / name, ns=(1_000_000_000, 1_000_000_000))
        before[name] = (dst / name).stat().st_ino
    summary = pack(src, dst, workers=2, log=quiet)  # the interrupted pack's shard size is kept
    assert summary["kept"] == 3 and summary["written"] == len(shard_files(reference)) - 3
    for name in finished:
        st = (dst / name).stat()
        assert (st.st_ino, st.st_mtime_ns) == (before[name], 1_000_000_000), f"{name} was written again"
    assert file_bytes(dst) == file_bytes(reference)
    assert not [p for p in dst.iterdir() if p.name.startswith(".")]
    assert json.loads((dst / MANIFEST).read_text())["state"] == "complete"
    assert_whole(dst)
    # Once complete, a rerun says so and writes nothing.
    lines = []
    again = pack(src, dst, workers=2, log=lines.append)
    assert again["already_complete"] and again["written"] == 0 and "nothing to do" in lines[-1]
    assert all((dst / name).stat().st_mtime_ns == 1_000_000_000 for name in finished)


def test_a_rerun_on_a_complete_pack_whose_index_is_gone_writes_it_again(src, reference, tmp_path):
    """dlojz.py says to repack a pack whose index is missing: the repack must not call it complete."""
    dst = tmp_path / "no-index"
    shutil.copytree(reference, dst)
    (dst / "val-index.npy").unlink()
    with pytest.raises(PackError, match="val-index.npy: unreadable index"):
        PackedSplit(dst, "val")
    lines = []
    summary = pack(src, dst, workers=1, log=lines.append)
    assert not summary["already_complete"] and "val-index.npy" in lines[0], lines
    assert file_bytes(dst) == file_bytes(reference)
    assert_whole(dst)


def assert_whole(dst):
    """Every sample of both splits whole in its shard, as dlojz.py's start-up check reads them."""
    for split in ("train", "val"):
        packed = PackedSplit(dst, split)
        assert intact_rows(packed) == (list(range(len(packed))), []), split


def test_a_truncated_shard_is_named_with_the_sample(src, reference, tmp_path):
    dst = tmp_path / "damaged"
    shutil.copytree(reference, dst)
    packed = PackedSplit(dst, "train")
    in_shard = sorted(
        (int(packed.rows()[i]["offset"]), i)
        for i in range(len(packed))
        if packed.shard_path(i).name == "train-000001.tar"
    )
    (_, first), (last_offset, last) = in_shard[0], in_shard[-1]
    shard = dst / "train-000001.tar"
    with open(shard, "r+b") as f:
        f.truncate(last_offset + 100)  # the last sample cut in the middle
    assert packed.read_bytes(first) == Path(image_folder(src, "train").samples[first][0]).read_bytes()
    with pytest.raises(ShardReadError, match=rf"{re.escape(str(shard))}: sample {packed.key(last)} is cut short"):
        packed.read_bytes(last)
    try:
        packed.read_bytes(last)
    except ShardReadError as err:  # skipped like an unreadable image file, reported like bad data
        assert isinstance(err, OSError) and isinstance(err, DataError) and "\n" not in str(err)
    rows, warnings = intact_rows(packed)  # the start-up check: the shard's samples after the cut left out
    assert first in rows and last not in rows and len(warnings) == 1, warnings
    assert f"shard {shard} is cut short ({last_offset + 100} of " in warnings[0] and "dlojz_pack.py" in warnings[0]
    (dst / "val-000001.tar").unlink()
    _, warnings = intact_rows(PackedSplit(dst, "val"))
    assert len(warnings) == 1 and "val-000001.tar is missing" in warnings[0], warnings
    # A rerun of the pack writes the damaged shards again.
    summary = pack(src, dst, workers=1, log=quiet)
    assert summary["written"] == 2 and file_bytes(dst) == file_bytes(reference)
    assert_whole(dst)


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def test_cli_refuses_a_foreign_dst_and_a_non_data_src_in_one_line(src, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    not_data = tmp_path / "photos"
    not_data.mkdir()
    shutil.copy(src / "val" / "disc" / "disc_0000.JPEG", not_data / "photo.jpg")
    # The message names the argument, the path and the culprit.
    cases = {
        "foreign DST": ([str(src), str(foreign)], [f"DST {foreign}", "notes.txt"]),
        "not a data tree": ([str(not_data), str(tmp_path / "out")], [f"SRC {not_data}", "train/"]),
    }
    # Side by side: the foreign DST's process imports torch to list its (valid) SRC first.
    procs = {
        name: subprocess.Popen(
            [*script_python(), str(ROOT / "dlojz_pack.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for name, (args, _) in cases.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        lines = err.splitlines()
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}\n{err}"
        assert len(lines) == 1 and lines[0].startswith("dlojz_pack.py: error: ") and "Traceback" not in err, err
        for needle in cases[name][1]:
            assert needle in lines[0], f"{name}: {lines[0]}"
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]  # left as it was
    assert not (tmp_path / "out").exists()


def test_a_source_that_is_not_a_data_tree_is_refused_before_torch_is_imported(tmp_path):
    """The pack writer's checks, its atomic writes (dlojz_lib.durable) and the data's layout (dlojz_lib.data.layout)
    need no torch: a wrong SRC is one line at once, not after torch's seconds of import."""
    (tmp_path / "photos").mkdir()
    command = [sys.executable, "-X", "importtime", str(ROOT / "dlojz_pack.py"), "photos", "out"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines, imported = importtime(result.stderr)
    assert result.returncode == 2 and lines == [lines[0]] and "SRC photos: not a data tree" in lines[0], lines
    assert "dlojz_lib.durable" in imported and "dlojz_lib.data.layout" in imported and "torch" not in imported
    assert not (tmp_path / "out").exists()


def test_bad_inputs_are_one_line_errors(src, imagenet_src, reference, tmp_path, capsys):
    def run(*args):
        status = main([str(a) for a in args])
        err = capsys.readouterr().err
        assert status == 2 and len(err.splitlines()) == 1 and err.startswith("dlojz_pack.py: error: "), err
        return err

    before = {p.name: p.stat().st_mtime_ns for p in reference.iterdir()}
    assert "--shard-size '12XB': not a size" in run(src, tmp_path / "a", "--shard-size", "12XB")
    assert "argument --workers: must be >= 1 (got 0)" in run(src, tmp_path / "a", "--workers", "0")
    assert f"is a pack of {src.resolve()}, not of SRC {imagenet_src.resolve()}" in run(imagenet_src, reference)
    assert "a complete pack of SRC in shards of 20000 bytes, not 1000000" in run(src, reference, "--shard-size", "1MB")
    (tmp_path / "notes.txt").write_text("mine")
    assert f"SRC {tmp_path}/notes.txt: a file, not a folder; give the folder" in run(
        tmp_path / "notes.txt", tmp_path / "a"
    )
    assert f"SRC {tmp_path}/nowhere: no such folder; give the folder" in run(tmp_path / "nowhere", tmp_path / "a")
    assert {p.name: p.stat().st_mtime_ns for p in reference.iterdir()} == before
    # Something else next to a pack.
    small = tmp_path / "small"
    shutil.copytree(imagenet_src, small)
    pack(small, tmp_path / "p", shard_size=SHARD_SIZE, workers=1, log=quiet)
    (tmp_path / "p" / "extra.txt").write_text("x")
    assert "not part of the pack (extra.txt)" in run(small, tmp_path / "p")
    (tmp_path / "p" / "extra.txt").unlink()
    # A complete pack of SRC as it was: SRC has changed since.
    shutil.copy(small / "val" / "n01440764" / "ILSVRC2012_val_00000001.JPEG", small / "val" / "n01440764" / "new.JPEG")
    assert "SRC has changed since" in run(small, tmp_path / "p")
    with pytest.raises(PackError, match="not a dlojz pack"):
        PackedSplit(small, "train")
    assert not is_packed(small)


# ---------------------------------------------------------------------------------------------------------------
# DataLoader workers


class BytesOf(torch.utils.data.Dataset):
    def __init__(self, split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitem__(self, i):
        data = self.split.read_bytes(i)
        # which process read it, with descriptors opened by which process, how many open
        return dict(index=i, data=data, pid=os.getpid(), owner=self.split._files.pid, open=len(self.split._files))


def test_the_reader_survives_pickling_and_dataloader_workers(src, reference):
    split = PackedSplit(reference, "train", max_open=2)
    sources = [Path(path).read_bytes() for path, _ in image_folder(src, "train").samples]
    assert split.read_bytes(5) == sources[5] and split._files  # descriptors open in this process
    blob = pickle.dumps(split)
    assert len(blob) < 4000, "the index or the descriptors were pickled"
    clone = pickle.loads(blob)
    assert not clone._files and [clone.read_bytes(i) for i in range(len(clone))] == sources
    assert clone.targets == split.targets and len(clone._files) <= 2
    loader = torch.utils.data.DataLoader(
        BytesOf(split), batch_size=4, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    got = {}
    for batch in loader:
        for i, data, pid, owner, n_open in zip(
            batch["index"].tolist(),
            batch["data"],
            batch["pid"].tolist(),
            batch["owner"].tolist(),
            batch["open"].tolist(),
        ):
            assert pid != os.getpid() and owner == pid, "a worker read through descriptors it did not open"
            assert n_open <= 2
            got[i] = data
    assert [got[i] for i in range(len(sources))] == sources
    assert split.read_bytes(7) == sources[7] and split._files.pid == os.getpid()  # the parent's own still work


def test_an_empty_image_file_is_named_in_one_warning(tmp_path):
    """A 0-byte JPEG (a copy cut short) is packed as it is, which a run cannot decode: one warning line names it
    and says what to do; a pack without one has no warning."""
    root = make_embedded_dataset(tmp_path / "src", n_classes=2, train_per_class=2, val_per_class=1, size=(16, 12))
    said = []
    pack(root, tmp_path / "clean", log=said.append)
    assert not [line for line in said if "WARNING" in line], said
    empty = root / "train" / sorted(p.name for p in (root / "train").iterdir())[0] / "cut_short.JPEG"
    empty.write_bytes(b"")
    said = []
    pack(root, tmp_path / "packed", log=said.append)
    warnings = [line for line in said if "WARNING" in line]
    assert len(warnings) == 1 and str(empty) in warnings[0] and "1 empty image file(s) (0 bytes)" in warnings[0]
    assert "replace or remove them and pack again" in warnings[0], warnings


def test_a_full_disk_names_the_disk_and_the_room_still_needed(tmp_path, monkeypatch, capsys):
    """No room left under DST (ENOSPC from a shard's write): one line naming DST's disk, its free space and the MiB
    still to write, exit 1, the finished shards kept."""
    import errno

    import dlojz_pack

    root = make_embedded_dataset(tmp_path / "src", n_classes=2, train_per_class=2, val_per_class=1, size=(16, 12))

    def full(dst, shard):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dlojz_lib.pack.writer, "_write_shard", full)
    assert dlojz_pack.main([str(root), str(tmp_path / "packed"), "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"DST {tmp_path / 'packed'}: no room on its disk (" in err, err
    assert "MiB free, about 0 MiB of shards still to write): free some space there" in err, err
    assert "rerun the same command to finish (finished shards are kept)" in err
