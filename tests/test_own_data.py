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

    from dlojz_lib.optim import balanced_class_weights

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

    from dlojz_lib.config import resolve_config
    from dlojz_lib.dist import Distribution
    from dlojz_lib.flags import get_args_parser
    from dlojz_lib.optim import build_training
    from dlojz_lib.parallel import build_model

    cpu = Distribution(1, 0, 0, torch.device("cpu"))
    for flags, expected in (([], None), (["--class-weights", "balanced"], [50 / 66, 50 / 66, 50 / 18])):
        cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", *flags]))
        training = build_training(cfg, build_model(cfg, 3, cpu, print), 10, 3, cpu, print, [22, 22, 6])
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
