"""Validation results per class, from the confusion matrix that `evaluate` sums on the device and all-reduces once
(rows: the true class, columns: the predicted one): precision, recall and F1 of each class, balanced accuracy (the
mean recall) and macro-F1 (the mean F1), both over the classes the validation set has. On an imbalanced set they
show what top-1 hides: a model that never predicts a rare class keeps a high top-1 and loses that class's recall.
"""

import torch


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
