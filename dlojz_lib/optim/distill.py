"""Knowledge distillation (`--teacher`): a trained model's logits join the training loss, as in Hinton et al. 2015
and timm's train.py.

    loss = (1 - alpha) x criterion(student, labels) + alpha x T^2 x KL(softmax(teacher / T) || softmax(student / T))

(T^2 keeps the distillation term's gradients at the scale of the labels' as T grows.) The teacher is any dlojz
checkpoint (or a run's folder), or torchvision's or timm's published DEFAULT weights from the offline cache, as
`--pretrained` reads them; it runs in eval mode without gradients, under the run's autocast and memory format, on
each rank's own batch (replicated, never sharded: it is not trained), and is not part of the model: not in the
optimizer, not in checkpoints, not in the EMA.

- `load_teacher(cfg, num_classes, device, log)`: the `Teacher` (a callable: images -> logits), one line when its
  classes are not the data set's.
- `DistillationLoss(criterion, alpha, temperature)`: `loss(student_logits, targets, teacher_logits)`.
"""

import torch
import torch.nn.functional as F

from dlojz_lib.checks import fail


class Teacher:
    """A frozen model whose logits the loss reads: eval mode, no gradients, on the run's device and memory format."""

    def __init__(self, module, device, channels_last):
        module = module.to(device).eval()
        if channels_last:
            module = module.to(memory_format=torch.channels_last)
        for param in module.parameters():
            param.requires_grad_(False)
        self.module = module

    @torch.no_grad()
    def __call__(self, images):
        return self.module(images)


def teacher_source(spec):
    """(checkpoint, arch, weights) for load_for_inference: a path that exists is a checkpoint (or a run's folder),
    anything else a model name with its published DEFAULT weights."""
    from pathlib import Path

    if Path(spec).exists():
        return spec, None, None
    return None, spec, "DEFAULT"


def load_teacher(cfg, num_classes, device, log):
    from dlojz_lib.inference import load_for_inference

    checkpoint, arch, weights = teacher_source(cfg.teacher)
    model = load_for_inference(checkpoint, arch, weights)
    if len(model.classes) != num_classes:
        fail(
            f"--teacher {cfg.teacher}: it predicts {len(model.classes)} classes, the data set has {num_classes}: give "
            "a teacher trained on these classes"
        )
    teacher = Teacher(model.module, device, cfg.channels_last)
    log(
        f"--teacher: {model.source}; loss = {1 - cfg.distill_alpha:g} x the labels' + {cfg.distill_alpha:g} x "
        f"T^2 KL(teacher || student) at T = {cfg.distill_temperature:g}"
    )
    return teacher


class DistillationLoss(torch.nn.Module):
    def __init__(self, criterion, alpha, temperature):
        super().__init__()
        self.criterion, self.alpha, self.temperature = criterion, alpha, temperature

    def forward(self, outputs, targets, teacher_logits):
        t = self.temperature
        distillation = F.kl_div(
            F.log_softmax(outputs.float() / t, dim=1),
            F.log_softmax(teacher_logits.float() / t, dim=1),
            reduction="batchmean",
            log_target=True,
        )
        loss = self.alpha * t * t * distillation
        if self.alpha < 1:
            loss = loss + (1 - self.alpha) * self.criterion(outputs, targets)
        return loss
