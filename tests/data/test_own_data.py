"""Your own data set: --val-split of one folder of classes (stratified, disjoint from training, the same in every
run, kept in the output folder and reused by a resumed run and --eval-only)."""

import shutil

import pytest
from conftest import SMALL

from dlojz_lib.data.datasets import DataError, build_datasets

TINY = [*SMALL, "--image-size", "16", "--val-resize-size", "18", "--val-crop-size", "16", "-b", "8"]
TINY += ["--no-wandb", "--num-workers", "0"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run without --output-dir writes in ./runs


def split(root, spec, saved=None):
    return build_datasets(root, None, None, val_split=spec, saved_split=saved)


def per_class(dataset):
    counts = {}
    for _, target in dataset.samples:
        counts[target] = counts.get(target, 0) + 1
    return counts


def test_the_split_is_stratified_disjoint_and_the_same_every_time(tiny_data):
    train, val, classes, layout = split(tiny_data / "train", 0.25)  # 3 classes of 24 images
    assert layout == "folder of classes, split" and len(classes) == 3
    assert per_class(val) == {0: 6, 1: 6, 2: 6} and per_class(train) == {0: 18, 1: 18, 2: 18}
    assert not {path for path, _ in train.samples} & {path for path, _ in val.samples}
    again_train, again_val, _, _ = split(tiny_data / "train", 0.25)
    assert again_val.samples == val.samples and again_train.samples == train.samples
    _, by_count, _, _ = split(tiny_data / "train", 2)  # F >= 1: images per class
    assert per_class(by_count) == {0: 2, 1: 2, 2: 2}
    assert any(line.startswith("--val-split 0.25: 18 of 72 images of") for line in train.notes)


def test_a_data_set_with_its_own_val_is_not_split_and_a_folder_of_classes_alone_says_how(tiny_data):
    with pytest.raises(DataError, match=r"^--val-split 0.1: data root .* has its own val/: leave --val-split out"):
        split(tiny_data, 0.1)
    with pytest.raises(DataError, match=r"no train/<class>/ folders; .*a single folder of classes: add --val-split"):
        build_datasets(tiny_data / "train", None, None)


def test_a_run_keeps_its_split_and_eval_only_validates_on_it(tiny_data, tmp_path, run_inline):
    folder = tmp_path / "classes"
    shutil.copytree(tiny_data / "train", folder)
    out = tmp_path / "run"
    proc = run_inline(*TINY, "--data-root", folder, "--val-split", "0.25", "-e", "1", "--output-dir", out)
    assert proc.returncode == 0, proc.stderr
    assert "--val-split 0.25: 18 of 72 images of" in proc.stdout and "(18 images)" in proc.stdout, proc.stdout
    listed = (out / "val_split.txt").read_text().splitlines()
    assert len(listed) == 18 and all((folder / name).is_file() for name in listed)
    # A new image in the folder trains; the validation images stay those of the run's list.
    first = sorted((folder / listed[0].split("/")[0]).iterdir())[0]
    shutil.copy(first, first.with_name("added_later.jpg"))
    checkpoint = sorted(out.glob("ckpt_e*.pt"))[-1]
    # Even asked for another fraction: a checkpoint validates on images it never trained on.
    evaluated = tmp_path / "evaluated"
    proc = run_inline(
        *TINY, "--data-root", folder, "--val-split", "0.5", "--eval-only", "--resume", checkpoint,
        "--output-dir", evaluated,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        f"--val-split 0.5: the split of {out / 'val_split.txt'}, 18 validation images; every other image trains"
        in proc.stdout
    )
    assert "(18 images, " in proc.stdout, proc.stdout  # the list's 18, not a new split with the added image
    # The results per class of --eval-only: one row a class, summing to the images validated, and the plot.
    import csv

    from PIL import Image

    with open(evaluated / "per_class.csv") as file:
        rows = list(csv.DictReader(file))
    assert [row["class"] for row in rows] == sorted(p.name for p in folder.iterdir())
    assert sum(int(row["images"]) for row in rows) == 18
    assert all(0 <= float(row["recall"]) <= 1 for row in rows)
    assert Image.open(evaluated / "confusion.png").size[0] > 300


def test_balanced_class_weights_are_inverse_to_each_class_s_share():
    import torch

    from dlojz_lib.optim.losses import balanced_class_weights

    assert torch.allclose(balanced_class_weights([30, 10]), torch.tensor([40 / 60, 40 / 20]))
    assert balanced_class_weights([5, 0, 5])[1] == 0  # no image: nothing to weigh


def test_class_weights_balanced_weighs_the_training_loss_of_an_imbalanced_folder(tiny_data, tmp_path, run_inline):
    import torch

    folder = tmp_path / "classes"
    shutil.copytree(tiny_data / "train", folder)
    rare = sorted(folder.iterdir())[2]
    for path in sorted(rare.iterdir())[8:]:  # 8 images of the third class, 24 of the others
        path.unlink()
    common = [*TINY, "--data-root", folder, "--val-split", "2", "-e", "1", "--test", "--test-nsteps", "1"]
    proc = run_inline(*common, "--class-weights", "balanced", "--output-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert f"classes: 3, training images per class from 6 ({rare.name}) to 22 " in proc.stdout, proc.stdout
    assert "--class-weights balanced: the training loss weighs each class by 0.758 (the largest) to 2.78" in proc.stdout

    from dlojz_lib.dist import Distribution
    from dlojz_lib.model.build import build_model
    from dlojz_lib.optim.training import build_training
    from dlojz_lib.parallelism.layout import lay_out
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    cpu = Distribution(1, 0, 0, torch.device("cpu"))
    for flags, expected in (([], None), (["--class-weights", "balanced"], [50 / 66, 50 / 66, 50 / 18])):
        cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", *flags]))
        training = build_training(
            cfg, lay_out(build_model(cfg, 3, cpu, print), cfg, cpu, print), 10, 3, cpu, print, [22, 22, 6]
        )
        weight = training.criterion.weight
        assert weight is None if expected is None else torch.allclose(weight, torch.tensor(expected))


def test_balanced_accuracy_and_macro_f1_equal_a_direct_computation_from_the_predictions():
    """evaluate()'s confusion matrix, summed on the device, against the predictions written out and counted in
    Python; one unreadable image (label -100) counts nowhere."""
    import torch
    from test_race import FixedLogits, batches_of
    from test_race import evaluate as evaluate_batches

    torch.manual_seed(1)
    net, batches = FixedLogits(4), batches_of(n_batches=4, size=8, num_classes=4)
    batches[1][1][3] = -100
    metrics = evaluate_batches(net, batches)
    with torch.no_grad():
        predicted = torch.cat([net(images).argmax(dim=1) for images, _ in batches]).tolist()
    truth = torch.cat([labels for _, labels in batches]).tolist()
    pairs = [(t, p) for t, p in zip(truth, predicted) if t >= 0]
    recalls, f1s = [], []
    for c in range(4):
        tp = sum(1 for t, p in pairs if t == c and p == c)
        support, called = sum(1 for t, _ in pairs if t == c), sum(1 for _, p in pairs if p == c)
        if support == 0:
            continue
        recall, precision = tp / support, (tp / called if called else 0.0)
        recalls.append(recall)
        f1s.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    assert metrics["val_images"] == 31
    assert metrics["val_balanced_accuracy"] == pytest.approx(sum(recalls) / len(recalls))
    assert metrics["val_macro_f1"] == pytest.approx(sum(f1s) / len(f1s))
    assert metrics["val_balanced_accuracy"] != pytest.approx(metrics["val_accuracy"])  # the labels are not balanced


def test_per_class_results_of_many_classes_name_each_class_s_worst_mix_up(tmp_path):
    import csv

    import torch

    from dlojz_lib.metrics import write_per_class

    classes = [f"c{i:03d}" for i in range(120)]  # past the plot's labelled axes
    confusion = torch.eye(120, dtype=torch.int64) * 5
    confusion[7, 42] = 3  # c007 is taken for c042 three times
    csv_path, png_path = write_per_class(confusion, classes, tmp_path)
    rows = {row["class"]: row for row in csv.DictReader(open(csv_path))}
    assert (rows["c007"]["most_mistaken_for"], rows["c007"]["times"], rows["c007"]["recall"]) == ("c042", "3", "0.6250")
    assert rows["c008"]["most_mistaken_for"] == "" and rows["c042"]["precision"] == "0.6250"
    assert png_path.stat().st_size > 0


def test_eval_ema_validates_the_checkpoint_s_ema_weights(tiny_data, tmp_path, run_inline):
    """--eval-only --eval-ema gives the figures the training run's last validation gave its EMA; without it, its
    model's. A checkpoint without EMA weights, or --eval-ema without --eval-only, is one line."""
    import json

    out = tmp_path / "run"
    common = [*TINY, "--data-root", tiny_data]
    trained = run_inline(
        *common, "-e", "1", "--model-ema", "--model-ema-decay", "0.5", "--output-dir", out,
        "--metrics-json", tmp_path / "trained.json",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    trained = json.loads((tmp_path / "trained.json").read_text())
    assert trained["ema_val_loss"] != trained["val_loss"]
    for flags, prefix in (([], ""), (["--eval-ema"], "ema_")):
        metrics = tmp_path / f"eval{prefix}.json"
        proc = run_inline(
            *common, "--eval-only", "--resume", "auto", "--output-dir", out, "--metrics-json", metrics, *flags
        )
        assert proc.returncode == 0, proc.stderr
        evaluated = json.loads(metrics.read_text())
        assert evaluated["val_accuracy"] == trained[f"{prefix}val_accuracy"]
        assert evaluated["val_loss"] == pytest.approx(trained[f"{prefix}val_loss"], rel=1e-5)
        assert evaluated["eval_ema"] == bool(flags)
    plain = tmp_path / "plain"
    assert run_inline(*common, "-e", "1", "--output-dir", plain).returncode == 0
    proc = run_inline(*common, "--eval-only", "--eval-ema", "--resume", "auto", "--output-dir", plain)
    assert proc.returncode == 2 and "has no EMA weights (its run had no --model-ema)" in proc.stderr
    proc = run_inline(*common, "--eval-ema", "--output-dir", plain)
    assert proc.returncode == 2 and "--eval-ema goes with --eval-only --resume CHECKPOINT" in proc.stderr


class Targets:
    def __init__(self, targets):
        self.targets = targets

    def __len__(self):
        return len(self.targets)


def test_the_balanced_sampler_draws_every_class_equally_the_same_on_every_rank_and_after_a_resume():
    from dlojz_lib.data.samplers import BalancedEpochSampler

    data = Targets([0] * 40 + [1] * 12 + [2] * 3 + [3] * 5)  # 60 images, shuffled classes don't matter
    one = BalancedEpochSampler(data, 1, 0, seed=7)
    one.set_epoch(3)
    drawn = [i for _, i in one]
    assert len(drawn) == 60  # as many draws as images: the same steps per epoch
    per_class = per_class_of([data.targets[i] for i in drawn])
    assert sorted(per_class.values()) == [15, 15, 15, 15]
    times = per_class_of(drawn)  # a class's images as evenly repeated as its quota allows: 3 images, 5 times each
    assert {times[i] for i in range(52, 55)} == {5} and {times[i] for i in range(55, 60)} == {3}
    assert sorted(times[i] for i in range(40, 52)) == [1] * 9 + [2] * 3  # 12 images for 15 draws
    assert len([i for i in range(40) if i in times]) == 15 and {times[i] for i in range(40) if i in times} == {1}
    # Two ranks deal out the one rank's order: every second draw each.
    ranks = [BalancedEpochSampler(data, 2, r, seed=7) for r in (0, 1)]
    for sampler in ranks:
        sampler.set_epoch(3)
    assert [i for _, i in ranks[0]] == drawn[0::2] and [i for _, i in ranks[1]] == drawn[1::2]
    # Resumed after 10 images of the epoch: the same order goes on; another epoch draws another order.
    one.skip = 10
    assert [i for _, i in one] == drawn[10:]
    one.skip = 0
    one.set_epoch(4)
    assert [i for _, i in one] != drawn


def per_class_of(values):
    counts = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def test_balanced_sampler_reaches_the_training_loader_and_refuses_class_weights(tiny_data, tmp_path, run_inline):
    folder = tmp_path / "classes"
    shutil.copytree(tiny_data / "train", folder)
    rare = sorted(folder.iterdir())[2]
    for path in sorted(rare.iterdir())[6:]:  # 6 images of the third class, 24 of the others
        path.unlink()
    common = [*TINY, "--data-root", folder, "--val-split", "2", "-e", "1", "--test", "--test-nsteps", "1"]
    proc = run_inline(*common, "--balanced-sampler", "--output-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert (
        f"--balanced-sampler: 48 draws an epoch, about 16 of each of 3 classes (the rarest, {rare.name}, 4 images: "
        "each 4 times;" in proc.stdout
    ), proc.stdout
    proc = run_inline(*common, "--balanced-sampler", "--class-weights", "balanced")
    assert proc.returncode == 2 and "both would favour the rare classes twice: give one of them" in proc.stderr


@pytest.mark.multirank
def test_two_ranks_split_as_one_and_draw_balanced_epochs(tiny_data, tmp_path):
    """--val-split on 2 ranks lists the images one process chooses, and both validate them once between them;
    --balanced-sampler's epoch trains on both."""
    import json
    import os

    from conftest import run_dlojz, show

    folder = tmp_path / "classes"
    shutil.copytree(tiny_data / "train", folder)
    for path in sorted(sorted(folder.iterdir())[1].iterdir())[10:]:  # 10 images of the second class
        path.unlink()
    out, metrics = tmp_path / "run", tmp_path / "metrics.json"
    proc = run_dlojz(
        *TINY, "--data-root", folder, "--val-split", "0.25", "--balanced-sampler", "-e", "1", "--output-dir", out,
        "--metrics-json", metrics, ranks=2,
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    _, val, _, _ = split(folder, 0.25)
    expected = [os.path.relpath(path, folder) for path, _ in val.samples]
    assert (out / "val_split.txt").read_text().splitlines() == expected
    result = json.loads(metrics.read_text())
    assert result["world_size"] == 2 and result["val_images"] == len(expected) == 14
    assert proc.stdout.count("--balanced-sampler: 44 draws an epoch, about 15 of each of 3 classes") == 1, show(proc)


def test_a_class_of_one_image_is_said_to_be_never_validated(tiny_data, tmp_path):
    folder = tmp_path / "classes"
    shutil.copytree(tiny_data / "train", folder)
    lonely = folder / "lonely"
    lonely.mkdir()
    shutil.copy(next((folder / sorted(p.name for p in folder.iterdir() if p.is_dir())[0]).iterdir()), lonely / "a.jpg")
    train, val, classes, _ = split(folder, 0.25)
    line = next(line for line in train.notes if line.startswith("--val-split 0.25:"))
    assert line.endswith("; 1 class of one image (lonely) only trains, never validated: add images, or give a "
                         "validation folder")  # fmt: skip
    assert classes.index("lonely") not in per_class(val)


def test_a_folder_in_place_of_the_run_s_split_list_is_one_line(tiny_data, tmp_path, run_inline):
    folder = tmp_path / "classes"
    shutil.copytree(tiny_data / "train", folder)
    out = tmp_path / "run"
    (out / "val_split.txt").mkdir(parents=True)
    proc = run_inline(*TINY, "--data-root", folder, "--val-split", "0.25", "-e", "1", "--output-dir", out)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        f"--val-split: {out / 'val_split.txt'} is not the run's list of validation images (a folder?)"
        in (proc.stderr.strip().splitlines()[-1])
    )
