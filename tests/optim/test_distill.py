"""--teacher: the distillation loss (alpha 1 at temperature T is T^2 x the KL to the teacher), a student trained
from a teacher checkpoint on 2 ranks with --grad-acc (the teacher out of the optimizer and the checkpoints), the
chronometer's teacher phase, and the one-line errors."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, read_json, run_dlojz, show

from dlojz_lib.optim.distill import DistillationLoss

RUN = [*TINY, "--arch", "resnet18", "--epochs", "1"]


def test_the_loss_is_the_kl_to_the_teacher_at_alpha_1_and_the_labels_at_alpha_0():
    torch.manual_seed(0)
    student, teacher, labels = torch.randn(6, 5), torch.randn(6, 5), torch.randint(0, 5, (6,))
    ce = torch.nn.CrossEntropyLoss()
    t = 3.0
    p, log_q = F.softmax(teacher / t, dim=1), F.log_softmax(student / t, dim=1)
    kl = (p * (p.log() - log_q)).sum(1).mean()  # by hand: KL(teacher || student), per image, averaged
    assert DistillationLoss(ce, 1.0, t)(student, labels, teacher).item() == pytest.approx(t * t * kl.item(), rel=1e-5)
    assert DistillationLoss(ce, 0.0, t)(student, labels, teacher).item() == pytest.approx(ce(student, labels).item())
    mixed = DistillationLoss(ce, 0.3, t)(student, labels, teacher).item()
    assert mixed == pytest.approx(0.7 * ce(student, labels).item() + 0.3 * t * t * kl.item(), rel=1e-5)
    # the student learns towards the teacher: the gradient of the alpha-1 loss is T x (q - p) / batch
    student.requires_grad_(True)
    DistillationLoss(ce, 1.0, t)(student, labels, teacher).backward()
    torch.testing.assert_close(student.grad, t * (F.softmax(student / t, 1) - p).detach() / 6)


@pytest.fixture
def teacher(trained_run):
    return trained_run


@pytest.mark.multirank
def test_a_student_distils_on_two_ranks_and_the_teacher_stays_out_of_its_checkpoint(teacher, tiny_data, tmp_path):
    import torchvision

    import dlojz_lib.checkpoint as ckpt

    flags = [*RUN, "--data-root", tiny_data, "--teacher", teacher, "--distill-alpha", "0.7"]
    proc = run_dlojz(*flags, "--grad-acc", "2", "--output-dir", tmp_path / "student", ranks=2)
    assert proc.returncode == 0, show(proc)
    assert "--teacher: " in proc.stdout and "loss = 0.3 x the labels' + 0.7 x T^2 KL" in proc.stdout
    saved, _ = ckpt.load_latest(tmp_path / "student")
    student = torchvision.models.resnet18(num_classes=3)
    assert saved["model"].keys() == student.state_dict().keys()  # the teacher's weights are not saved
    assert len(saved["optimizer"]["state"]) == len(list(student.parameters()))  # nor optimised
    proc = run_dlojz(*flags, "--test", "--test-nsteps", "4", "--metrics-json", tmp_path / "m.json")
    assert proc.returncode == 0, show(proc)
    assert "=>>> Teacher's forward median" in proc.stdout, show(proc)
    assert read_json(tmp_path / "m.json")["chrono"]["teacher_median_s"] > 0


def test_a_teacher_of_other_classes_is_one_line(teacher, tiny_data, tmp_path, run_inline):
    import torchvision

    import dlojz_lib.checkpoint as ckpt

    saved, _ = ckpt.load_latest(teacher)
    saved.update(model=torchvision.models.resnet18(num_classes=4).state_dict(), num_classes=4, classes=list("abcd"))
    ckpt.write(saved, tmp_path / "ckpt_e0001_s000000009.pt")
    proc = run_inline(
        *RUN, "--data-root", tiny_data, "--teacher", tmp_path / "ckpt_e0001_s000000009.pt", "--output-dir",
        tmp_path / "run",
    )  # fmt: skip
    assert proc.returncode == 2 and "it predicts 4 classes, the data set has 3" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--distill-alpha", "0.9"], "--distill-alpha set the distillation from a teacher: add --teacher"),
        (["--distill-temperature", "4"], "--distill-temperature set the distillation"),
        (["--distill-alpha", "1.5"], "--distill-alpha"),
        (["--teacher", "no_such_model"], "--teacher no_such_model: no such checkpoint, and as a model name"),
    ],
)
def test_distillation_flags_without_a_teacher_or_out_of_range_are_one_line(run_inline, flags, message):
    proc = run_inline(*TINY, *flags)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_a_teacher_by_name_takes_its_cached_weights_and_its_classes_are_checked(
    tiny_data, tmp_path, run_inline, monkeypatch
):
    import torchvision

    from dlojz_lib.model.pretrained import torchvision_weights, torchvision_weights_path

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    proc = run_inline(*RUN, "--data-root", tiny_data, "--teacher", "resnet18", "--output-dir", tmp_path / "a")
    assert proc.returncode == 2 and "--teacher resnet18: no such checkpoint, and as a model name" in proc.stderr
    assert "not in torch hub's cache" in proc.stderr, proc.stderr  # checked before the run, as --pretrained
    path = torchvision_weights_path(torchvision_weights("resnet18", "DEFAULT"))
    path.parent.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), path)
    proc = run_inline(*RUN, "--data-root", tiny_data, "--teacher", "resnet18", "--output-dir", tmp_path / "b")
    assert proc.returncode == 2 and "it predicts 1000 classes, the data set has 3" in proc.stderr, proc.stderr
