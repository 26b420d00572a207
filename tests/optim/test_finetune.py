"""Fine-tuning controls: --layer-decay's learning rate per block, --freeze-backbone-epochs' head alone then every
layer (and a fine-tuning stopped mid-way that resumes to the uninterrupted run's weights), --drop-path's stochastic
depth where the model has it."""

import contextlib
import dataclasses

import conftest
import pytest
import torch
import torchvision

from dlojz_lib.checks import UserError
from dlojz_lib.dist import Distribution
from dlojz_lib.model.build import build_model
from dlojz_lib.optim.training import build_training
from dlojz_lib.parallelism.layout import lay_out
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import get_args_parser

CPU = Distribution(1, 0, 0, torch.device("cpu"))
# torchvision's resnet18: the tests name its layers.
TINY = [*conftest.TINY, "--arch", "resnet18"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir (./runs/...) is made and checked writable


def config(*flags):
    return resolve_config(get_args_parser().parse_args(["--device", "cpu", *map(str, flags)]))


def lr_of_each_parameter(*flags, arch="resnet18", num_classes=3):
    cfg = config("--arch", arch, "--lr", "0.1", *flags)
    model = lay_out(build_model(cfg, num_classes, CPU, lambda line: None), cfg, CPU, lambda line: None)
    lines = []
    training = build_training(cfg, model, 10, num_classes, CPU, lines.append)
    names = {id(param): name for name, param in model.module.named_parameters()}
    lrs = {names[id(param)]: group["lr"] for group in training.optimizer.param_groups for param in group["params"]}
    return lrs, lines, training


def test_layer_decay_scales_each_block_s_learning_rate_from_the_head_down():
    lrs, lines, training = lr_of_each_parameter("--layer-decay", "0.5", "--lr-scheduler", "constant")
    # resnet18's layers: conv1, bn1, 8 blocks (layer1.0 ... layer4.1, a downsample with its block), fc: 11.
    assert lrs["fc.weight"] == lrs["fc.bias"] == pytest.approx(0.1)
    assert lrs["layer4.1.conv2.weight"] == pytest.approx(0.1 * 0.5)
    assert lrs["layer4.0.downsample.0.weight"] == lrs["layer4.0.conv1.weight"] == pytest.approx(0.1 * 0.5**2)
    assert lrs["layer1.0.conv1.weight"] == pytest.approx(0.1 * 0.5**8)
    assert lrs["conv1.weight"] == pytest.approx(0.1 * 0.5**10)
    assert training.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # the head first: the logged lr is its
    assert any(line.startswith("layer decay 0.5: 11 layers, learning rates from lr x 0.000977") for line in lines)
    plain, _, _ = lr_of_each_parameter("--lr-scheduler", "constant")
    assert set(plain.values()) == {0.1}


def test_layer_decay_follows_every_schedule_and_timm_s_grouping():
    onecycle, _, training = lr_of_each_parameter("--layer-decay", "0.5")  # OneCycle: max_lr per group
    for _ in range(5):
        training.optimizer.step()
        training.scheduler.step()
    lrs = [group["lr"] / group["lr_scale"] for group in training.optimizer.param_groups]
    assert max(lrs) == pytest.approx(min(lrs)) and len(lrs) > 2  # each group at its scale of the same cycle
    timm_lrs, _, _ = lr_of_each_parameter("--layer-decay", "0.5", "--lr-scheduler", "constant", arch="timm:resnet10t")
    assert timm_lrs["fc.weight"] == pytest.approx(0.1) and timm_lrs["conv1.0.weight"] < 0.1 * 0.5**3


def test_drop_path_reaches_the_model_s_stochastic_depth():
    cfg = config("--arch", "convnext_tiny", "--drop-path", "0.3")
    module = build_model(cfg, 3, CPU, lambda line: None).module
    rates = [m.p for m in module.modules() if isinstance(m, torchvision.ops.StochasticDepth)]
    assert rates and max(rates) == pytest.approx(0.3)  # torchvision's default for convnext_tiny is 0.1
    cfg = config("--arch", "timm:resnet10t", "--drop-path", "0.2", "--image-size", "32")
    module = build_model(cfg, 3, CPU, lambda line: None).module
    import timm.layers

    rates = [m.drop_prob for m in module.modules() if isinstance(m, timm.layers.DropPath)]
    assert rates and max(rates) == pytest.approx(0.2)  # rising with depth to the rate, as in both libraries
    swin = build_model(config("--arch", "swin_t", "--drop-path", "0.3"), 3, CPU, lambda line: None).module
    rates = [m.p for m in swin.modules() if isinstance(m, torchvision.ops.StochasticDepth)]
    assert max(rates) == pytest.approx(0.3) and min(rates) == 0.0  # its builder's own rule, scaled (default 0.2)
    with pytest.raises(UserError, match=r"^--drop-path: torchvision's resnet18 has no stochastic depth"):
        config("--arch", "resnet18", "--drop-path", "0.1")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--freeze-backbone-epochs", "1", "-e", "2"], r"would keep random weights fixed: give the weights"),
        (["--freeze-backbone-epochs", "2", "-e", "2", "--initial-checkpoint", "w.pt"], r"must end before --epochs 2"),
        (["--freeze-backbone-epochs", "1", "-e", "2", "--initial-checkpoint", "w.pt", "--findlr"], r"--findlr sweeps"),
        (["--linear-probe"], r"--linear-probe trains a head on a frozen backbone: give the backbone's weights"),
        (["--linear-probe", "--initial-checkpoint", "w.pt", "--layer-decay", "0.8"], r"drop --layer-decay"),
        (["--linear-probe", "--initial-checkpoint", "w.pt", "--freeze-backbone-epochs", "1", "-e", "3"], r"drop --fre"),
    ],
)
def test_fine_tuning_flags_refuse_in_one_line(flags, message, tmp_path):
    torch.save({}, tmp_path / "w.pt")
    with pytest.raises(UserError, match=message):
        config(*flags)


@pytest.mark.parametrize("flag, value", [("--layer-decay", "0"), ("--layer-decay", "1.5"), ("--drop-path", "1.5")])
def test_fine_tuning_values_out_of_bounds_are_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as stopped:
        get_args_parser().parse_args([flag, value])
    assert stopped.value.code == 2 and flag in capsys.readouterr().err


def parameters_only(state, module):
    return {name: state[name] for name, _ in module.named_parameters()}


def test_the_head_learns_alone_then_every_layer_and_a_stopped_fine_tuning_resumes_exactly(
    tiny_data, tmp_path, run_inline
):
    """3 epochs of 9 steps, the first frozen: the backbone is the file's until step 9, then learns; a run resumed
    from a checkpoint in the frozen epoch ends with the uninterrupted run's weights."""
    torch.manual_seed(0)
    names = torchvision.models.resnet18(num_classes=3)
    torch.save(names.state_dict(), tmp_path / "start.pth")
    start = parameters_only(names.state_dict(), names)
    common = [*TINY, "--data-root", tiny_data, "-e", "2", "--initial-checkpoint", tmp_path / "start.pth"]
    common += ["--freeze-backbone-epochs", "1", "--layer-decay", "0.8", "--lr-scheduler", "cosine"]
    common += ["--keep-checkpoints", "0"]
    out = tmp_path / "straight"
    proc = run_inline(*common, "--output-dir", out, "--checkpoint-every", "1e-9")
    assert proc.returncode == 0, proc.stderr
    assert "the head (fc) learns alone for 1 epochs, then every layer" in proc.stdout

    def at(path):
        return parameters_only(torch.load(path, weights_only=True)["model"], names)

    frozen_end = at(out / "ckpt_e0001_s000000009.pt")  # epoch 1's end
    for name, value in start.items():
        assert torch.equal(frozen_end[name], value) != name.startswith("fc."), name
    first_unfrozen = at(out / "ckpt_e0001_s000000010.pt")  # one step later, every layer has learnt
    assert not torch.equal(first_unfrozen["conv1.weight"], start["conv1.weight"])
    final = at(out / (out / "latest").read_text().strip())
    assert not torch.equal(final["conv1.weight"], start["conv1.weight"])
    assert not torch.equal(final["layer4.1.bn2.weight"], frozen_end["layer4.1.bn2.weight"])

    resumed_out = tmp_path / "resumed"
    proc = run_inline(*common, "--output-dir", resumed_out, "--resume", out / "ckpt_e0000_s000000004.pt")
    assert proc.returncode == 0, proc.stderr
    assert "(epoch 1, step 4/9, global step 4)" in proc.stdout
    resumed = at(resumed_out / (resumed_out / "latest").read_text().strip())
    for name, value in final.items():
        assert torch.allclose(value, resumed[name], rtol=1e-5, atol=1e-6), name
    assert proc.stdout.index("initial weights: not read, the run resumes") < proc.stdout.index("resumed from")
    assert "freshly initialised" not in proc.stdout  # (the checkpoint's head, not a new one)

    # The start file gone since, or not given again: the fine-tuning resumes all the same (its checkpoint's weights).
    (tmp_path / "start.pth").unlink()
    without = [arg for arg in common if arg not in ("--initial-checkpoint", tmp_path / "start.pth")]
    for name, flags in (("gone", common), ("not-given", without)):
        proc = run_inline(*flags, "--output-dir", tmp_path / name, "--resume", out / "ckpt_e0001_s000000013.pt")
        assert proc.returncode == 0, (name, proc.stderr)
        assert "the head (fc) learns alone for 1 epochs" in proc.stdout


@pytest.mark.multirank
def test_a_fine_tuning_sharded_by_fsdp_on_two_ranks_keeps_the_backbone_then_trains_it(tiny_data, tmp_path):
    """--initial-checkpoint is loaded before FSDP shards the model; the frozen epoch drops the sharded gradients of
    every block but the head's, and --layer-decay's groups are made of the sharded parameters."""
    import timm
    from conftest import run_dlojz, show
    from test_fsdp import BASE, weights

    torch.manual_seed(3)
    whole = timm.create_model("test_vit", num_classes=1000, img_size=32)
    torch.save(whole.state_dict(), tmp_path / "vit.pth")
    start = parameters_only(whole.state_dict(), whole)
    out = tmp_path / "run"
    proc = run_dlojz(
        *BASE, "--data-root", tiny_data, "-b", "8", "--fsdp", "--epochs", "2", "--initial-checkpoint",
        tmp_path / "vit.pth", "--freeze-backbone-epochs", "1", "--layer-decay", "0.8", "--keep-checkpoints", "0",
        "--output-dir", out, ranks=2,
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    assert "new, freshly initialised for 3 classes: head.bias, head.weight" in proc.stdout
    frozen_end = weights(out / "ckpt_e0001_s000000005.dcp")
    final = weights(out / "ckpt_e0002_s000000010.dcp")
    for name, value in start.items():
        if name.startswith("head."):
            assert not torch.equal(frozen_end[name], final[name]), name
        else:
            assert torch.equal(frozen_end[name], value) and not torch.equal(final[name], value), name


def test_frozen_layers_are_out_of_the_clip_s_norm_and_the_float16_scaler_s_overflow_check(tmp_path):
    """One optimizer step of the real loop, the backbone frozen, --clip-grad-norm: the head moves as plain SGD
    moves it with its own gradients clipped to its own norm (the backbone's gradients, made large, count for
    nothing), and an inf in a frozen gradient under float16 neither skips the step nor lowers the loss scale."""
    from in_process import synthetic_loop

    import dlojz
    from dlojz_lib.data.loaders import SYNTHETIC_CLASSES

    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(num_classes=SYNTHETIC_CLASSES).state_dict(), tmp_path / "w.pth")
    flags = ["--device", "cpu", "--arch", "resnet18", "--image-size", "16", "-b", "4", "--optimizer", "sgd"]
    flags += ["--lr", "0.5", "--mom", "0", "--wd", "0", "--lr-scheduler", "constant"]
    flags += ["-e", "2", "--freeze-backbone-epochs", "1", "--initial-checkpoint", str(tmp_path / "w.pth")]

    def one_step(backbone_gradient, *more):
        """The loop's one step, the backbone's gradients set to `backbone_gradient` after the backward; returns
        (the loop, the head's parameters, their values before, their gradients as the backward left them)."""
        loop = synthetic_loop([*flags, *more], n_batches=1)
        if loop["training"].scaler.is_enabled():  # a scale at which the head's own float16 gradients do not overflow
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
            loop["training"] = dataclasses.replace(loop["training"], scaler=scaler)
        module, hooks = loop["model"].module, loop["hooks"]
        head = [module.fc.weight, module.fc.bias]
        before, grads = [param.detach().clone() for param in head], []
        phase = hooks.phase

        @contextlib.contextmanager
        def phase_after_the_backward(name):
            if name == "optimizer_step":
                for name, param in module.named_parameters():
                    if not name.startswith("fc."):
                        param.grad.fill_(backbone_gradient)
                grads.extend(param.grad.clone() for param in head)
            with phase(name):
                yield

        hooks.phase = phase_after_the_backward
        dlojz.train_one_epoch(**loop)
        return loop, head, before, grads

    loop, head, before, grads = one_step(1e3, "--no-amp", "--clip-grad-norm", "0.01")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    scale = min(1.0, 0.01 / (float(norm) + 1e-6))  # clip_grad_norm_'s factor, on the head alone
    for param, start, grad in zip(head, before, grads):
        torch.testing.assert_close(param.detach(), start - 0.5 * scale * grad)
    assert torch.equal(loop["model"].module.conv1.weight, torch.load(tmp_path / "w.pth")["conv1.weight"])

    loop, head, before, _ = one_step(float("inf"), "--amp", "--amp-dtype", "float16")  # (the scaler unscales)
    scaler = loop["training"].scaler
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**8  # not halved: no overflow counted
    assert not torch.equal(head[0].detach(), before[0])  # and the head stepped


def test_a_linear_probe_trains_the_head_alone_on_the_frozen_backbone(tiny_data, tmp_path, run_inline):
    """--linear-probe: 2 epochs, then every backbone weight and BatchNorm buffer is the file's, the head has learnt,
    and the backbone ran in eval mode (its running statistics untouched, though the batches differ from them)."""
    torch.manual_seed(0)
    start = torchvision.models.resnet18(num_classes=3)
    torch.save(start.state_dict(), tmp_path / "start.pth")
    flags = [*TINY, "--data-root", tiny_data, "-e", "2", "--initial-checkpoint", tmp_path / "start.pth"]
    proc = run_inline(*flags, "--linear-probe", "--output-dir", tmp_path / "probe", "--keep-checkpoints", "1")
    assert proc.returncode == 0, proc.stderr
    assert "--linear-probe: only the head (fc, 1,539 of 11,178,051 parameters) trains" in proc.stdout
    out = tmp_path / "probe"
    final = torch.load(out / (out / "latest").read_text().strip(), weights_only=True)["model"]
    for name, value in start.state_dict().items():
        assert torch.equal(final[name], value) != name.startswith("fc."), name  # buffers too: running_mean, ...


def test_a_linear_probe_keeps_the_backbone_in_eval_mode_and_computes_no_backbone_gradient():
    from dlojz_lib.model.zoo import linear_probe

    model = torchvision.models.resnet18(num_classes=3)
    assert linear_probe(model, "fc") == (1539, 11178051)
    model.train()
    assert model.training and model.fc.training and not model.layer1[0].bn1.training and not model.bn1.training
    images = torch.randn(4, 3, 32, 32, requires_grad=False)
    loss = model(images).sum()
    assert loss.grad_fn is not None and all(p.grad is None for p in model.parameters())
    loss.backward()
    assert model.fc.weight.grad is not None and model.conv1.weight.grad is None
    model.eval()
    assert not model.training and not model.fc.training
    import copy

    twin = copy.deepcopy(model)  # (EMA's copy) keeps the class
    twin.train()
    assert not twin.layer4[1].bn2.training and twin.fc.training
