"""Checkpoints: atomic writes, `latest` pointer, keep-last-K, refusal of truncated or foreign files."""

import pytest
import torch

import dlojz_checkpoint as ckpt


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
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, "latest"]  # no temp file left behind
    loaded, path = ckpt.load_latest(tmp_path)
    assert path == first and loaded["epoch"] == 1


def test_truncated_latest_falls_back_to_previous(tmp_path, capsys):
    ckpt.save(state(1), tmp_path, ckpt.checkpoint_name(1, 10))
    newest = ckpt.save(state(2), tmp_path, ckpt.checkpoint_name(2, 20))
    newest.write_bytes(newest.read_bytes()[:200])  # e.g. a disk that filled up outside dlojz
    loaded, path = ckpt.load_latest(tmp_path)
    assert loaded["epoch"] == 1 and path.name == ckpt.checkpoint_name(1, 10)
    assert f"checkpoint {newest} is unreadable or truncated" in capsys.readouterr().err


def test_foreign_and_malicious_files_are_refused(tmp_path):
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ckpt.CheckpointError, match="not written by dlojz"):
        ckpt.load(foreign)

    pickled = tmp_path / "pickled.pt"
    torch.save({ckpt.FORMAT_KEY: ckpt.FORMAT_VERSION, "obj": Payload()}, pickled)
    with pytest.raises(ckpt.CheckpointError, match="unreadable"):
        ckpt.load(pickled)
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(ckpt.CheckpointError, match="unreadable"):
        ckpt.load(text)


def test_load_latest_in_empty_dir(tmp_path):
    assert ckpt.load_latest(tmp_path) == (None, None)
