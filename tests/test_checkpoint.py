"""Checkpoints: atomic writes, `latest` pointer, keep-last-K, refusal of truncated or foreign files."""

import pytest
import torch

import dlojz_lib.checkpoint as ckpt


class Payload:  # an arbitrary pickled object: refused by weights_only loading
    pass


def state(value):
    return {"model": {"w": torch.full((4,), float(value))}, "epoch": value}


def test_save_load_latest_and_keep_last_k(tmp_path):
    for step in range(1, 6):
        ckpt.save(state(step), tmp_path, ckpt.checkpoint_name(step, step * 10), keep=3)
    kept = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert kept == [ckpt.checkpoint_name(s, s * 10) for s in (3, 4, 5)]
    loaded, path = ckpt.load_latest(tmp_path)
    assert path.name == ckpt.checkpoint_name(5, 50) and loaded["epoch"] == 5
    assert torch.equal(loaded["model"]["w"], torch.full((4,), 5.0))


def test_crash_mid_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    first = ckpt.save(state(1), tmp_path, ckpt.checkpoint_name(1, 10))
    before = first.read_bytes()
    real_save = torch.save

    def crash_after_partial_write(obj, f):
        real_save(obj, f)
        f.truncate(100)  # half a file on disk...
        raise KeyboardInterrupt("killed mid-write")  # ...and the process dies

    monkeypatch.setattr(torch, "save", crash_after_partial_write)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(state(2), tmp_path, ckpt.checkpoint_name(2, 20))
    monkeypatch.undo()
    assert first.read_bytes() == before
    # no temp file left behind, nor the new checkpoint's checksum file
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, f"{first.name}.sha256", "latest"]
    loaded, path = ckpt.load_latest(tmp_path)
    assert path == first and loaded["epoch"] == 1


def test_truncated_latest_falls_back_to_previous(tmp_path, capsys):
    ckpt.save(state(1), tmp_path, ckpt.checkpoint_name(1, 10))
    newest = ckpt.save(state(2), tmp_path, ckpt.checkpoint_name(2, 20))
    newest.write_bytes(newest.read_bytes()[:200])  # e.g. a disk that filled up outside dlojz
    loaded, path = ckpt.load_latest(tmp_path)
    assert loaded["epoch"] == 1 and path.name == ckpt.checkpoint_name(1, 10)
    assert f"checkpoint {newest}: its SHA-256 differs" in capsys.readouterr().err


def test_foreign_and_malicious_files_are_refused(tmp_path):
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ckpt.CheckpointError, match="not written by dlojz"):
        ckpt.load(foreign)

    pickled = tmp_path / "pickled.pt"
    torch.save({ckpt.FORMAT_KEY: ckpt.FORMAT_VERSION, "obj": Payload()}, pickled)
    with pytest.raises(ckpt.CheckpointError, match="holds objects other than tensors .* never unpickles"):
        ckpt.load(pickled)
    text = tmp_path / "notes.pt"
    text.write_text("hello")  # (torch's own reason: KeyError 'h')
    with pytest.raises(ckpt.CheckpointError, match="notes.pt is not a PyTorch file"):
        ckpt.load(text)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(foreign.read_bytes()[:300])  # (torch's own reason: OSError errno 22)
    with pytest.raises(ckpt.CheckpointError, match="cut.pt is truncated or damaged"):
        ckpt.load(cut)


def test_load_latest_in_empty_dir(tmp_path):
    assert ckpt.load_latest(tmp_path) == (None, None)


def test_a_flipped_byte_is_refused_and_the_previous_checkpoint_used(tmp_path, capsys):
    older = ckpt.save(state(1), tmp_path, ckpt.checkpoint_name(1, 10))
    newest = ckpt.save(state(2), tmp_path, ckpt.checkpoint_name(2, 20))
    data = bytearray(newest.read_bytes())
    at = data.find(torch.full((4,), 2.0).numpy().tobytes())  # inside the weights: the file still unpickles
    assert at > 0
    data[at + 1] ^= 0x01
    newest.write_bytes(bytes(data))
    assert torch.load(newest, weights_only=True)["epoch"] == 2  # torch alone does not notice
    with pytest.raises(ckpt.CheckpointError, match=r"its SHA-256 differs from the one recorded in .*\.sha256"):
        ckpt.load(newest)
    loaded, path = ckpt.load_latest(tmp_path)
    assert path == older and loaded["epoch"] == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trying the previous checkpoint" in err


def test_the_checksum_file_is_sha256sum_format_and_required_for_new_checkpoints(tmp_path):
    import hashlib

    path = ckpt.save(state(1), tmp_path, ckpt.checkpoint_name(1, 10))
    digest, name = ckpt.checksum_path(path).read_text().split()
    assert name == path.name and digest == hashlib.sha256(path.read_bytes()).hexdigest()
    ckpt.checksum_path(path).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"checksum file .*\.sha256 is missing"):
        ckpt.load(path)
    # A checkpoint of the format before checksums (1) loads without one.
    old = tmp_path / ckpt.checkpoint_name(0, 5)
    torch.save(dict(state(0), **{ckpt.FORMAT_KEY: 1}), old)
    assert ckpt.load(old)["epoch"] == 0


def test_pruning_removes_the_checksum_files_too(tmp_path):
    for step in range(1, 4):
        ckpt.save(state(step), tmp_path, ckpt.checkpoint_name(step, step), keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ckpt.checkpoint_name(3, 3),
        ckpt.checkpoint_name(3, 3) + ".sha256",
        "latest",
    ]


def test_a_full_disk_keeps_the_previous_checkpoint_and_training_goes_on(tmp_path, monkeypatch, capsys):
    import errno

    weights = torch.nn.Linear(2, 2)
    saver = ckpt.CheckpointSaver(tmp_path, 3, torch.device("cpu"), {}, model=weights)
    first = saver.save(dict(epoch=1, batch=0, global_step=10))
    real_save = torch.save

    def disk_full(obj, f):  # what torch.save raises when the disk fills: its zip writer's error, from the OSError
        real_save(obj, f)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 962176 vs 962072") from err

    monkeypatch.setattr(torch, "save", disk_full)
    assert saver.save(dict(epoch=2, batch=0, global_step=20)) is None  # no exception: the run goes on
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"checkpoint {tmp_path / ckpt.checkpoint_name(2, 20)} not written (No space left on device)" in err
    assert f"{first.name} stays the latest" in err
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, f"{first.name}.sha256", "latest"]
    assert ckpt.load_latest(tmp_path)[1] == first
    # Any other failure is a bug, not the file system's: raised.
    monkeypatch.setattr(torch, "save", lambda obj, f: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        saver.save(dict(epoch=3, batch=0, global_step=30))


def test_a_background_save_returns_before_the_write_and_writes_the_state_of_its_step(tmp_path, monkeypatch):
    import threading

    weights = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.constant_(weights.weight, 1.0)
    saver = ckpt.CheckpointSaver(tmp_path, 3, torch.device("cpu"), {}, background=True, model=weights)
    release, real_save = threading.Event(), ckpt.save

    def slow_save(*args, **kwargs):
        assert release.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save", slow_save)
    path = saver.save(dict(epoch=1, batch=5, global_step=5))
    assert not path.exists() and saver._writer.is_alive()  # save() returned while the file is being written
    with torch.no_grad():
        weights.weight.fill_(2.0)  # training goes on meanwhile
    release.set()
    saver.wait()
    assert torch.equal(ckpt.load(path)["model"]["weight"], torch.ones(1, 3))  # the step's weights, not later ones
    # A failure in the background thread reaches the run at its next save or wait.
    monkeypatch.setattr(ckpt, "save", lambda *a, **k: 1 / 0)
    saver.save(dict(epoch=1, batch=6, global_step=6))
    with pytest.raises(ZeroDivisionError):
        saver.wait()
