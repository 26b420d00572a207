"""Validation results per class, from the confusion matrix that `evaluate` sums on the device and all-reduces once
(rows: the true class, columns: the predicted one): precision, recall and F1 of each class, balanced accuracy (the
mean recall) and macro-F1 (the mean F1), both over the classes the validation set has. On an imbalanced set they
show what top-1 hides: a model that never predicts a rare class keeps a high top-1 and loses that class's recall.
"""

import contextlib
import io
from pathlib import Path

import torch
import torch.distributed as dist

from dlojz_lib.durable import atomic_write


def per_class(confusion: torch.Tensor) -> dict:
    """{"precision", "recall", "f1", "support"}: one float tensor of each per class, from a [C, C] matrix of counts.
    A class never predicted has precision 0, a class absent from validation recall 0 (scikit-learn's
    zero_division=0)."""
    confusion = confusion.double()
    hits = confusion.diagonal()
    support, predicted = confusion.sum(dim=1), confusion.sum(dim=0)
    recall = torch.where(support > 0, hits / support.clamp(min=1), torch.zeros_like(hits))
    precision = torch.where(predicted > 0, hits / predicted.clamp(min=1), torch.zeros_like(hits))
    both = precision + recall
    f1 = torch.where(both > 0, 2 * precision * recall / both.clamp(min=1e-300), torch.zeros_like(hits))
    return dict(precision=precision, recall=recall, f1=f1, support=support)


def summary(confusion: torch.Tensor) -> dict:
    """Balanced accuracy and macro-F1 over the classes present in validation (0 when none is)."""
    scores = per_class(confusion)
    present = scores["support"] > 0
    if not present.any():
        return dict(val_balanced_accuracy=0.0, val_macro_f1=0.0)
    return dict(
        val_balanced_accuracy=scores["recall"][present].mean().item(),
        val_macro_f1=scores["f1"][present].mean().item(),
    )


PER_CLASS_CSV = "per_class.csv"
CONFUSION_PNG = "confusion.png"
LABELLED_UP_TO = 100  # classes named on the plot's axes; beyond, per_class.csv names each class's worst confusion


@contextlib.contextmanager
def durable_csv(path):
    """A csv.writer whose rows reach `path` whole at the end, through a temporary name (a full disk leaves the
    previous file, or none)."""
    import csv

    text = io.StringIO(newline="")
    yield csv.writer(text)
    atomic_write(path, lambda file: file.write(text.getvalue().encode()))


def write_per_class(confusion: torch.Tensor, classes, folder) -> list:
    """--eval-only's results per class in `folder`: per_class.csv (one row a class: images, precision, recall, F1,
    and the class it is most often mistaken for, with how many) and confusion.png (rows: true class, columns:
    predicted, each row as fractions of its images). Returns the paths written."""

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    scores = per_class(confusion)
    mistakes = confusion.double().clone()
    mistakes.fill_diagonal_(-1)  # the largest off-diagonal count of each row
    worst_count, worst = mistakes.max(dim=1)
    with durable_csv(folder / PER_CLASS_CSV) as writer:
        writer.writerow(["class", "images", "precision", "recall", "f1", "most_mistaken_for", "times"])
        for index, name in enumerate(classes):
            mistaken = worst_count[index] > 0
            writer.writerow(
                [
                    name,
                    int(scores["support"][index]),
                    f"{scores['precision'][index]:.4f}",
                    f"{scores['recall'][index]:.4f}",
                    f"{scores['f1'][index]:.4f}",
                    classes[worst[index]] if mistaken else "",
                    int(worst_count[index]) if mistaken else 0,
                ]
            )
    plot_confusion(confusion, classes, folder / CONFUSION_PNG)
    return [folder / PER_CLASS_CSV, folder / CONFUSION_PNG]


def plot_confusion(confusion: torch.Tensor, classes, path) -> None:
    from matplotlib.figure import Figure  # object API with the Agg canvas: no display, no global backend state

    counts = confusion.double()
    fractions = (counts / counts.sum(dim=1, keepdim=True).clamp(min=1)).numpy()
    n = len(classes)
    side = min(4 + 0.18 * n, 24)
    figure = Figure(figsize=(side, side))
    axes = figure.add_subplot()
    image = axes.imshow(fractions, cmap="Blues", vmin=0, vmax=1)
    figure.colorbar(image, ax=axes, fraction=0.046, label="share of the true class's images")
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    if n <= LABELLED_UP_TO:
        size = 8 if n <= 30 else 5
        axes.set_xticks(range(n), classes, rotation=90, fontsize=size)
        axes.set_yticks(range(n), classes, fontsize=size)
        axes.set_title("confusion matrix (rows sum to 1)")
    else:
        axes.set_title(f"confusion matrix of {n} classes (rows sum to 1); each class's worst mix-up: {PER_CLASS_CSV}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def write_predictions(path, predictions, classes, name_of) -> None:
    """--predictions: one CSV row per image: its file (`name_of(index)`), true and predicted class, and the top-5
    classes with their probabilities (softmax of the logits evaluated, flip-averaged with --tta-flip). The true
    class of an image that could not be read is empty."""

    index, labels, top5, probabilities = predictions
    k = top5.shape[1]
    header = ["image", "true_class", "predicted_class"]
    header += [column for rank in range(1, k + 1) for column in (f"class_{rank}", f"probability_{rank}")]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with durable_csv(path) as writer:
        writer.writerow(header)
        for i, label, top, probability in zip(index.tolist(), labels.tolist(), top5.tolist(), probabilities.tolist()):
            row = [name_of(i), classes[label] if label >= 0 else "", classes[top[0]]]
            row += [value for c, p in zip(top, probability) for value in (classes[c], f"{p:.6f}")]
            writer.writerow(row)


def gather_predictions(predictions, ranks):
    """evaluate()'s predictions of every rank on rank 0's CPU, in the data set's order: (image index, label,
    top-5 classes, their probabilities). ShardSampler gives rank r the images r, r + W, r + 2W..., in order."""
    labels, top5, probabilities = (torch.cat(parts).cpu() for parts in zip(*predictions))
    index = torch.arange(len(labels)) * ranks.data_size + ranks.data_rank
    mine = (index, labels, top5, probabilities)
    if not ranks.enabled:
        return mine
    every = [None] * ranks.data_size  # (--tp: a tensor-parallel group's ranks predicted the same images)
    dist.all_gather_object(every, mine, group=ranks.data_group)  # once, at --eval-only's end: no cost
    index, labels, top5, probabilities = (torch.cat(parts) for parts in zip(*every))
    order = index.argsort()
    return index[order], labels[order], top5[order], probabilities[order]
