"""dlojz_predict.py: a folder of images through a trained model, as --eval-only sees them (the same probabilities,
flip TTA, EMA weights), top-k, AMP, unreadable files skipped and counted, and the one-line errors."""

import csv
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TRAINED_RUN, run_dlojz, show

import dlojz_predict


@pytest.fixture(scope="module")
def trained(trained_run, tiny_data, tmp_path_factory):
    """A run of one epoch (with an EMA), and --eval-only's predictions of its weights and of its EMA's."""
    out = tmp_path_factory.mktemp("predict")
    shutil.copytree(trained_run, out / "run")  # --eval-only writes its per-class files in the run's folder
    evaluated = {}
    for name, flags in (("raw", []), ("ema", ["--eval-ema"]), ("tta", ["--tta-flip"])):
        csv_path = out / f"{name}.csv"
        proc = run_dlojz(
            *TRAINED_RUN, "--data-root", tiny_data, "--output-dir", out / "run", "--eval-only", "--resume", "auto",
            "--predictions", csv_path, *flags,
        )  # fmt: skip
        assert proc.returncode == 0, show(proc)
        evaluated[name] = rows_of(csv_path)
    return out / "run", evaluated


def rows_of(path):
    with open(path, newline="") as file:
        return {row["image"]: row for row in csv.DictReader(file)}


def predicted(tmp_path, capsys, *args):
    out = tmp_path / "p.csv"
    status = dlojz_predict.main([*map(str, args), "-o", str(out), "--num-workers", "0"])
    captured = capsys.readouterr()
    return status, (rows_of(out) if status == 0 else None), captured


def probabilities(row, k=3):
    return [(row[f"class_{r}"], float(row[f"probability_{r}"])) for r in range(1, k + 1)]


@pytest.mark.parametrize("name, flags", [("raw", []), ("ema", ["--ema"]), ("tta", ["--tta-flip"])])
def test_predictions_are_eval_only_s(trained, tiny_data, tmp_path, capsys, name, flags):
    run, evaluated = trained
    status, rows, captured = predicted(tmp_path, capsys, run, tiny_data / "val", *flags)
    assert status == 0, captured.err
    assert "3 classes named by the checkpoint, validation's preprocessing (resize 18, crop 16" in captured.out
    assert "15 images (one batch: no rate past the first, on cpu, 0 decoding workers)" in captured.out  # (-b 64)
    assert rows.keys() == evaluated[name].keys() and len(rows) == 15
    for image, row in rows.items():
        expected = evaluated[name][image]
        assert row["predicted_class"] == expected["predicted_class"], image
        for (c, p), (d, q) in zip(probabilities(row), probabilities(expected)):
            assert c == d and p == pytest.approx(q, abs=2e-6), image
    others = [evaluated[other] for other in evaluated if other != name]
    assert all(  # the flag was not ignored: another setting's probabilities differ
        any(probabilities(rows[i]) != probabilities(other[i]) for i in rows) for other in others
    )


def test_top_k_amp_and_unreadable_files(trained, tiny_data, tmp_path, capsys):
    run, evaluated = trained
    folder = shutil.copytree(tiny_data / "val", tmp_path / "images")
    (folder / "nested").mkdir()
    shutil.copy(next((tiny_data / "val").rglob("*.JPEG")), folder / "nested" / "copy.jpg")
    (folder / "broken.jpg").write_bytes(b"not an image")
    (folder / "notes.txt").write_text("not an image file name: left out")
    status, rows, captured = predicted(tmp_path, capsys, run, folder, "--top-k", "2", "--amp")
    assert status == 0, captured.err
    assert len(rows) == 16 and str(folder / "nested" / "copy.jpg") in rows  # found in a sub-folder
    assert "WARNING: skipping unreadable image" in captured.err and str(folder / "broken.jpg") in captured.err
    assert "1 unreadable file(s) skipped" in captured.out
    row = next(iter(rows.values()))
    assert "class_2" in row and "class_3" not in row
    # bfloat16 autocast: close to the float32 probabilities, not the same numbers
    gaps = []
    for path, row in rows.items():
        relative = Path(path).relative_to(folder)
        if relative.parts[0] != "nested":
            expected = evaluated["raw"][str(tiny_data / "val" / relative)]
            gaps.append(abs(float(row["probability_1"]) - float(expected["probability_1"])))
    assert 0 < max(gaps) < 0.05, gaps


def test_a_checkpoint_without_class_names_takes_its_data_folders(trained, tiny_data, tmp_path, capsys):
    import dlojz_lib.checkpoint as ckpt

    run, _ = trained
    saved, _ = ckpt.load_latest(run)
    del saved["classes"]
    ckpt.write(saved, tmp_path / "ckpt_e0001_s000000009.pt")
    status, rows, captured = predicted(tmp_path, capsys, tmp_path / "ckpt_e0001_s000000009.pt", tiny_data / "val")
    assert status == 0 and f"named by the folders of {tiny_data / 'train'}" in captured.out, captured


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda p: torch.save({"weights": 1}, p / "w.pt"), ["{p}/w.pt", "{val}"], "not written by dlojz"),
        (lambda p: (p / "empty").mkdir(), ["{run}", "{p}/empty"], "no images in"),
        (lambda p: None, ["{run}", "{p}/missing"], "no such file or folder"),
        (lambda p: os.mkfifo(p / "pipe"), ["{run}", "{p}/pipe"], "not an image file nor a folder (a named pipe"),
        (
            lambda p: (p / "a").symlink_to(p / "b") or (p / "b").symlink_to(p / "a"),
            ["{run}", "{p}/a"],
            "a symbolic link that leads round in a loop",
        ),
        (
            lambda p: (p / "dangling").symlink_to(p / "gone.jpg"),
            ["{run}", "{p}/dangling"],
            "which does not exist: give an image file or a folder",
        ),
        (lambda p: None, [], "name the model"),
        (lambda p: None, ["{run}"], "give the images"),
        (lambda p: None, ["--arch", "resnet18", "--pretrained", "DEFAULT"], "give the images"),
        (lambda p: None, ["{p}", "--pretrained", "DEFAULT"], "name the model"),
        (  # both weights: the checkpoint was read as an image and dropped
            lambda p: None,
            ["--arch", "resnet18", "--pretrained", "DEFAULT", "{run}/ckpt_e0001_s000000009.pt", "{val}"],
            "ckpt_e0001_s000000009.pt is a checkpoint and --pretrained gives weights too: give one of them",
        ),
    ],
)
def test_bad_input_is_one_line(trained, tiny_data, tmp_path, capsys, make, args, message):
    run, _ = trained
    make(tmp_path)
    args = [a.format(p=tmp_path, run=run, val=tiny_data / "val") for a in args]
    status = dlojz_predict.main([*args, "-o", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and message in err, err


def test_published_weights_from_the_cache_predict_with_their_class_names(tiny_data, tmp_path, capsys, monkeypatch):
    """--arch NAME --pretrained DEFAULT: the weights from torch hub's cache, torchvision's preprocessing and ImageNet's
    class names (a file of random weights stands for the published one: nothing is downloaded)."""
    import torchvision

    from dlojz_lib.model.pretrained import torchvision_weights, torchvision_weights_path

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    weights = torchvision_weights("resnet18", "DEFAULT")
    path = torchvision_weights_path(weights)
    path.parent.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), path)
    args = ["--arch", "resnet18", "--pretrained", "DEFAULT", tiny_data / "val", "--top-k", "2"]
    status, rows, captured = predicted(tmp_path, capsys, *args)
    assert status == 0, captured.err
    assert f"--arch resnet18 --pretrained DEFAULT ({path}): 1000 classes, the published preprocessing" in captured.out
    assert len(rows) == 15 and all(row["class_1"] in weights.meta["categories"] for row in rows.values())


def test_an_averaged_checkpoint_predicts_as_its_weights_do(trained, tiny_data, tmp_path, capsys):
    """dlojz_avg.py's file (the mean of the checkpoints given: here one and its copy) is read as any checkpoint."""
    import dlojz_avg
    import dlojz_lib.checkpoint as ckpt

    run, evaluated = trained
    newest = ckpt.list_checkpoints(run)[-1]
    copy = tmp_path / "copy" / newest.name  # (the same file twice is refused: each counts once in the mean)
    copy.parent.mkdir()
    for source in (newest, ckpt.checksum_path(newest)):
        shutil.copy(source, copy.parent)
    assert dlojz_avg.main([str(newest), str(copy), "-o", str(tmp_path / "averaged.pt")]) == 0
    status, rows, captured = predicted(tmp_path, capsys, tmp_path / "averaged.pt", tiny_data / "val")
    assert status == 0, captured.err
    for image, row in rows.items():
        for (c, p), (d, q) in zip(probabilities(row), probabilities(evaluated["raw"][image])):
            assert c == d and p == pytest.approx(q, abs=2e-6), image


def test_ema_of_a_run_without_one_names_the_flag_given(trained_run, tiny_data, tmp_path, monkeypatch, capsys):
    """dlojz_predict.py's flag is --ema (dlojz.py's is --eval-ema): the refusal names the one the user typed."""
    import dlojz_lib.checkpoint as ckpt

    path = sorted(trained_run.glob("ckpt_e*.pt"))[-1]
    saved = ckpt.load(path)
    monkeypatch.setattr(ckpt, "load", lambda given: dict(saved, ema=None))  # a run without --model-ema
    status = dlojz_predict.main([str(path), str(tiny_data / "val"), "--ema", "-o", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "--ema: " in err and "has no EMA weights (its run had no --model-ema): leave --ema out" in err, err
    assert "--eval-ema" not in err and not (tmp_path / "p.csv").exists()
