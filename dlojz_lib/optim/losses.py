"""The losses a run trains with beside torch's cross-entropy (--bce-loss's binary cross-entropy, --class-weights
balanced) and the batch accuracy against class indices or soft labels (MixUp/CutMix), kept on the device.
"""

from __future__ import annotations

import torch
from torch import nn


class BinaryCrossEntropy(nn.Module):
    """--bce-loss: timm's BinaryCrossEntropy (one sigmoid per class, as "ResNet strikes back" trains), whose
    smoothing applies to class indices; MixUp/CutMix's soft labels are smoothed here as timm's Mixup smooths its
    targets (mixing smoothed one-hots is smoothing the mix: target x (1 - s) + s / classes)."""

    def __init__(self, smoothing: float, target_threshold: float | None, weight: torch.Tensor | None):
        super().__init__()
        from timm.loss import BinaryCrossEntropy as TimmBinaryCrossEntropy

        self.smoothing = smoothing
        self.loss = TimmBinaryCrossEntropy(smoothing=smoothing, target_threshold=target_threshold, weight=weight)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.shape == logits.shape and self.smoothing:
            targets = targets * (1.0 - self.smoothing) + self.smoothing / logits.shape[-1]
        return self.loss(logits, targets)


def balanced_class_weights(class_counts) -> torch.Tensor:
    """--class-weights balanced: images / (classes x images of the class), as scikit-learn's "balanced" (a class
    with no training image gets 0: it has nothing to weigh)."""
    counts = torch.tensor(class_counts, dtype=torch.float64)
    weights = counts.sum() / (len(class_counts) * counts.clamp(min=1))
    return torch.where(counts > 0, weights, torch.zeros_like(weights)).float()


def soft_target_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of the batch whose predicted class (argmax of ``outputs``) matches the target class.

    ``targets`` holds class indices (shape ``[N]``) or soft labels (shape ``[N, C]``, from MixUp/CutMix or label
    smoothing), whose target class is their argmax. Returns a 0-dim float tensor on the outputs' device, so no
    GPU synchronisation happens until the caller reads it.
    """
    predicted = outputs.detach().argmax(dim=1)
    labels = targets.argmax(dim=1) if targets.ndim == outputs.ndim else targets
    return (predicted == labels).float().mean()
