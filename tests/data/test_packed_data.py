"""dlojz.py on packed shards (dlojz_pack.py): a --data-root holding shards is found by its manifest and read by
index, so that everything that works on folders works unchanged: the same samples at the same indices, the same
training, exact validation on 1 and 2 ranks, exact mid-epoch resume, a corrupt sample or a truncated shard skipped
with a warning naming shard and key."""

import shutil
import signal

import conftest
import pytest
import torch
from conftest import clean_env, read_json, run_dlojz, show
from test_resume import RUN, final_weights, start, wait_for_line

TINY = [*conftest.TINY, "--num-workers", "1"]  # with SMALL's DataLoader worker: the shards are read in a worker


def pack(src, dst, shard_size="60KB"):
    from dlojz_lib.pack.writer import pack as pack_tree

    pack_tree(src, dst, shard_size=shard_size, workers=1, log=lambda *a, **k: None)
    return dst


@pytest.fixture(scope="module")
def packed(tiny_data, tmp_path_factory):
    """The tiny data set (72 train, 15 val images) in 5 train shards and 1 val shard."""
    return pack(tiny_data, tmp_path_factory.mktemp("packed") / "tiny")


def datasets(root, seed=3):
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.transforms import TrainTransform, ValTransform

    return build_datasets(root, TrainTransform(16), ValTransform(18, 16), seed=seed)


def test_shards_give_the_folder_samples_at_the_same_indices(tiny_data, packed):
    folder_train, folder_val, folder_classes, _ = datasets(tiny_data)
    train, val, classes, layout = datasets(packed)
    assert layout.startswith("packed shards: 5 train + 1 val") and classes == folder_classes
    assert len(train) == len(folder_train) == 72 and len(val) == len(folder_val) == 15
    for i in range(len(train)):  # the same augmentation of the same image: pixels equal, whatever the storage
        (a, ta), (b, tb) = folder_train[(2, i)], train[(2, i)]
        assert ta == tb and torch.equal(a, b), i
    for i in range(len(val)):
        (a, ta), (b, tb) = folder_val[(0, i)], val[(0, i)]
        assert ta == tb and torch.equal(a, b), i


def test_images_the_region_decoder_leaves_to_pil_read_the_same_from_shards(tiny_data, tmp_path):
    from PIL import Image

    src = shutil.copytree(tiny_data, tmp_path / "src")
    picture = Image.open(next((src / "train" / "disc").iterdir())).convert("RGB")
    picture.save(src / "train" / "disc" / "zz_png.png")  # not a JPEG
    picture.convert("CMYK").save(src / "train" / "disc" / "zz_cmyk.jpg")  # a JPEG libjpeg's RGB output refuses
    folder_train = datasets(src)[0]
    train = datasets(pack(src, tmp_path / "packed"))[0]
    names = [p for p, _ in folder_train.samples]
    for name in ("zz_png.png", "zz_cmyk.jpg"):
        i = next(k for k, p in enumerate(names) if p.endswith(name))
        assert torch.equal(folder_train[(1, i)][0], train[(1, i)][0]), name


@pytest.fixture(scope="module")
def trained_on_shards(packed, tmp_path_factory):
    """One epoch on the packed tiny data set: (output folder, metrics, console output)."""
    out = tmp_path_factory.mktemp("shards-run")
    proc = run_dlojz(
        *TINY, "--epochs", "1", "--data-root", packed, "--output-dir", out / "run", "--metrics-json", out / "m.json"
    )
    assert proc.returncode == 0, show(proc)
    return out / "run", read_json(out / "m.json"), proc.stdout


def test_training_on_shards_equals_training_on_folders(tiny_data, packed, trained_on_shards, tmp_path):
    proc = run_dlojz(
        *TINY,
        "--epochs",
        "1",
        "--data-root",
        tiny_data,
        "--output-dir",
        tmp_path / "folder",
        "--metrics-json",
        tmp_path / "folder.json",
    )
    assert proc.returncode == 0, show(proc)
    shards_out, shards_metrics, shards_log = trained_on_shards
    assert f"data: {packed} (packed shards: 5 train + 1 val webdataset tar files" in shards_log
    folder_metrics = read_json(tmp_path / "folder.json")
    for key in ("train_loss", "val_loss", "val_accuracy", "val_images", "steps"):
        assert folder_metrics[key] == shards_metrics[key], key
    shards_weights = final_weights(shards_out)["model"]
    for key, value in final_weights(tmp_path / "folder")["model"].items():
        assert torch.equal(value, shards_weights[key]), key


@pytest.mark.multirank
def test_one_and_two_ranks_validate_the_same_images_on_shards(packed, trained_on_shards, tmp_path):
    run = trained_on_shards[0]
    checkpoint = run / (run / "latest").read_text().strip()
    metrics = {}
    for ranks in (1, 2):
        proc = run_dlojz(
            *TINY,
            "--data-root",
            packed,
            "--val-batch-size",
            "4",
            "--eval-only",
            "--resume",
            checkpoint,
            "--output-dir",
            tmp_path / "eval",
            "--metrics-json",
            tmp_path / f"{ranks}.json",
            ranks=ranks,
        )
        assert proc.returncode == 0, show(proc)
        metrics[ranks] = read_json(tmp_path / f"{ranks}.json")
    assert metrics[2]["world_size"] == 2
    assert metrics[1]["val_images"] == metrics[2]["val_images"] == 15  # 15 images on 2 ranks: none padded
    assert metrics[1]["val_accuracy"] == metrics[2]["val_accuracy"]
    assert metrics[1]["val_loss"] == pytest.approx(metrics[2]["val_loss"], rel=1e-5)


def test_mid_epoch_resume_on_shards_gives_the_same_weights(tmp_path_factory, tmp_path):
    from dlojz_lib.data.embedded import make_embedded_dataset

    src = make_embedded_dataset(
        tmp_path_factory.mktemp("data") / "resume", n_classes=3, train_per_class=80, val_per_class=4, size=(64, 56)
    )
    shards = pack(src, tmp_path / "packed", shard_size="200KB")
    straight = tmp_path / "straight"
    proc = run_dlojz(*RUN, "--data-root", shards, "--output-dir", straight)
    assert proc.returncode == 0, show(proc)
    interrupted = tmp_path / "interrupted"
    proc = start([*RUN, "--data-root", shards, "--output-dir", interrupted], clean_env())
    early = wait_for_line(proc, "Epoch 1/2, Step")
    proc.send_signal(signal.SIGUSR1)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "saving a checkpoint at epoch 1" in early + rest, early + rest
    assert final_weights(interrupted)["global_step"] < 15  # stopped mid-epoch
    proc = run_dlojz(*RUN, "--data-root", shards, "--output-dir", interrupted, "--resume", "auto")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, show(proc)
    a, b = final_weights(straight), final_weights(interrupted)
    assert a["global_step"] == b["global_step"] == 30
    for key, value in a["model"].items():
        assert torch.allclose(value.float(), b["model"][key].float(), rtol=1e-5, atol=1e-6), key


def copy_pack(packed, tmp_path):
    return shutil.copytree(packed, tmp_path / "copy")


def test_a_corrupt_sample_is_named_and_skipped(packed, tmp_path, capfd):
    copy = copy_pack(packed, tmp_path)
    train = datasets(copy)[0]
    victim = 5
    row = train.shards._row(train.samples[victim][0])
    shard = copy / train.shards.shards[int(row["shard"])]
    with open(shard, "r+b") as file:  # the JPEG's bytes turned to garbage, the shard's size unchanged
        file.seek(int(row["offset"]))
        file.write(b"\x00" * int(row["size"]))
    image, target = train[(0, victim)]
    assert (image.shape, target) == ((3, 16, 16), train.samples[victim + 1][1])  # the next sample instead
    err = capfd.readouterr().err
    assert f"WARNING: skipping unreadable image {shard}:{row['key'].decode()}" in err, err


def test_a_truncated_shard_loses_its_samples_with_one_warning(packed, tmp_path, capfd):
    copy = copy_pack(packed, tmp_path)
    train = datasets(copy)[0]
    shard = copy / train.shards.shards[1]
    lost = [i for i, (row, _) in enumerate(train.samples) if train.shards._row(row)["shard"] == 1]
    with open(shard, "r+b") as file:
        file.truncate(shard.stat().st_size // 2)
    capfd.readouterr()
    cut = datasets(copy)[0]
    err = capfd.readouterr().err
    assert err.count(f"WARNING: shard {shard} is cut short") == 1, err
    assert 0 < len(train) - len(cut) <= len(lost), (len(train), len(cut), len(lost))  # only that shard's tail
    for i in range(len(cut)):  # what is left reads without a warning
        cut[(0, i)]
    assert "skipping" not in capfd.readouterr().err
    shard.unlink()
    assert len(datasets(copy)[0]) == len(train) - len(lost)  # a missing shard: all its samples
    assert f"WARNING: shard {shard} is missing: {len(lost)} of its samples" in capfd.readouterr().err


def test_loader_only_reads_shards(packed, tmp_path):
    proc = run_dlojz(
        *TINY, "--data-root", packed, "--loader-only", "--test-nsteps", "5", "--metrics-json", tmp_path / "m.json"
    )
    assert proc.returncode == 0, show(proc)
    metrics = read_json(tmp_path / "m.json")
    assert metrics["loader_batches"] == 5 and metrics["loader_images_per_second"] > 0, metrics
