"""The training loop and validation never make the host wait for the device between their log points.

On a GPU the host waits for every queued kernel when it reads a tensor's value (`item`, `bool`, `float`, `tolist`,
a copy to the CPU), when an op's output size depends on the values (`nonzero`, boolean-mask indexing,
`masked_select`, `unique`, `repeat_interleave` without `output_size`), when a comparison is answered on the host
(`equal`, `is_nonzero`), and when a tensor is made from Python data on the device (a blocking copy from pageable
memory). Here, on the CPU, `SyncAudit` (a TorchDispatchMode, with `HostTensors`, a TorchFunctionMode that tells the
tensors kept on the host on purpose and sees host copies and tensors made on the device) records each such
operation with the dlojz code that asked for it, while one epoch of the real loop runs for every flag that
touches the step or the model: outside log points it must record nothing but the exceptions listed in EXCEPTIONS,
each with its reason. tests/test_gpu.py proves the same on CUDA with torch.cuda.set_sync_debug_mode("error").
"""

import contextlib
import os
import sys

import preloaded
import pytest
import torch
import torch.multiprocessing as mp
from conftest import ROOT
from in_process import synthetic_run
from test_flag_effects import BASE, loop_for, run_for
from test_float8 import MLP_VIT
from test_preemption import as_rank_of_two
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import dlojz
import dlojz_lib.log
import dlojz_lib.optim.optimizers
import dlojz_lib.optim.training
from dlojz_lib.data.loaders import SYNTHETIC_CLASSES, synthetic_loaders
from dlojz_lib.resume import TrainState

aten = torch.ops.aten

# Operations that make a CUDA stream's host wait when they read a tensor on the device.
SYNCHRONISING = {
    aten._local_scalar_dense: "reads a value on the host (item, bool, float, int)",
    aten.nonzero: "nonzero: its size depends on the values",
    aten.argwhere: "argwhere: its size depends on the values",
    aten.masked_select: "masked_select: its size depends on the values",
    aten._unique: "unique: its size depends on the values",
    aten._unique2: "unique: its size depends on the values",
    aten.unique_dim: "unique: its size depends on the values",
    aten.unique_consecutive: "unique_consecutive: its size depends on the values",
    aten.unique_dim_consecutive: "unique_consecutive: its size depends on the values",
    aten.equal: "equal: answered on the host",
    aten.is_nonzero: "is_nonzero: answered on the host",
}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
LIFTED = "a tensor made from Python data on the device (a blocking host-to-device copy on CUDA)"
COPIED_IN = "a host value copied into a device tensor (t[i] = x, t.copy_(host): a blocking copy on CUDA)"
# Functions whose CPU kernels check their input's values on the host where their CUDA kernels do not (one_hot's
# class range: a device-side assert on CUDA): the reads inside them are the CPU's, not a GPU wait.
CPU_ONLY_CHECKS = {"one_hot"}
HOST_COPIES = {"tolist", "numpy", "cpu"}  # not dispatched as copies when the tensor is on the CPU already
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.linspace,
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
}  # fmt: skip

# Known waits, by the function that asks, with the reason they are kept.
EXCEPTIONS = {
    "dlojz_lib/observers/hooks.py:optimizer_step_done": "--findlr reads every step's loss: the range test needs it",
    "grad_scaler.py:<genexpr>": "an optimizer without a fused step under the float16 GradScaler reads the "
    "overflow flag at every step (timm's LAMB, LARS, Lion): said at start-up, --amp-dtype bfloat16 avoids it",
}


def synchronising(func, args, kwargs):
    """Why `func(*args, **kwargs)` would make the host wait for a CUDA stream reading its device inputs, or None."""
    packet = func.overloadpacket
    if packet in SYNCHRONISING:
        return SYNCHRONISING[packet]
    if packet in INDEXING and len(args) > 1:
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return f"{packet.__name__} with a boolean mask: its size depends on the values"
    if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int:
        if kwargs.get("output_size") is None:
            return "repeat_interleave without output_size: its size depends on the values"
    return None


# Frames that pass an operation on without asking for it: dispatch, and torch's decorators.
MACHINERY = (
    "torch/utils/_python_dispatch",
    "torch/_ops",
    "torch/overrides",
    "torch/_tensor.py",
    "torch/_dynamo/eval_frame",
    "torch/_compile.py",
    "torch/utils/_contextlib",
)


def asker():
    """Where the operation was asked: the innermost frame outside this audit and torch's dispatch machinery, as
    'file:function': a product file's path from the project's root (dlojz_lib/observers/hooks.py), another file's name
    (grad_scaler.py when torch asks on its own)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        machinery = MACHINERY
        own = path == __file__ and frame.f_code.co_name in ("record", "__torch_function__", "__torch_dispatch__")
        if not own and not any(part in path for part in machinery):
            product = path.startswith(str(ROOT) + os.sep) and not path.startswith(str(ROOT / "tests") + os.sep)
            return f"{os.path.relpath(path, ROOT) if product else os.path.basename(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def explicit_device(args, kwargs):
    """The device a call names (its `device` keyword, or a device or device string among `to`'s arguments)."""
    if "device" in kwargs:
        return kwargs["device"]
    return next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)


class HostTensors(TorchFunctionMode):
    """Which tensors live on the host on purpose, on a GPU too: made without a device (torch.tensor(x),
    torch.full(...)) or with device "cpu", and what is computed from them alone. A wait on such a tensor (the
    StopPoll's gloo flag, MixUp's sampled ratio) waits for nothing; every other tensor (the model's, the batch,
    anything made with device=...) is the device's. Records host copies of device tensors, and device tensors made
    from Python data."""

    def __init__(self, audit):
        super().__init__()
        self.audit, self.host = audit, WeakIdKeyDictionary()
        self.making_host_tensor = False
        self.in_factory = False
        self.in_cpu_only_check = False

    def is_host(self, tensors):
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(t in self.host for t in tensors)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in FACTORIES:
            device = kwargs.get("device")
            on_host = device is None or device == "cpu"
            if func in (torch.tensor, torch.as_tensor) and not on_host:
                self.audit.record(LIFTED)
            self.making_host_tensor, self.in_factory = on_host, True
            try:
                out = func(*args, **kwargs)
            finally:
                self.making_host_tensor = self.in_factory = False
            if on_host:
                self.mark(out)
            return out
        if name in HOST_COPIES and args and isinstance(args[0], torch.Tensor) and args[0] not in self.host:
            self.audit.record(f"{name}(): a copy to the host")
        if name in CPU_ONLY_CHECKS:
            self.in_cpu_only_check = True
            try:
                return func(*args, **kwargs)
            finally:
                self.in_cpu_only_check = False
        out = func(*args, **kwargs)
        if name in ("to", "cuda"):
            device = explicit_device(args, kwargs)
            if device is not None and device != "cpu" and isinstance(out, torch.Tensor):
                self.host.pop(out, None)  # moved to the device
        elif name in HOST_COPIES and isinstance(out, torch.Tensor):
            self.mark(out)
        return out

    def adopt(self, obj, depth=6):
        """Mark the tensors `obj` holds (its attributes, lists, modules' children) as the host's: made on the
        host before the audit started, and kept there (MixUp's Beta distribution)."""
        if isinstance(obj, torch.Tensor):
            self.host[obj] = True
        elif depth and isinstance(obj, (list, tuple)):
            for item in obj:
                self.adopt(item, depth - 1)
        elif depth and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                self.adopt(value, depth - 1)
            if isinstance(obj, torch.nn.Module):
                for child in obj.children():
                    self.adopt(child, depth - 1)

    def mark(self, out):
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.host[t] = True


class SyncAudit(TorchDispatchMode):
    """Records (position, asker, why) for every operation that would make the host wait for a CUDA stream;
    `position()` says where the loop is when it happens."""

    def __init__(self, position):
        super().__init__()
        self.position, self.records = position, []
        self.host_tensors = HostTensors(self)

    def record(self, why):
        self.records.append((self.position(), asker(), why))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = self.host_tensors.is_host(tensors)
        if func.overloadpacket is aten.lift_fresh:
            # Python data made a tensor on the host: by torch.tensor(x) (recorded above when a device is named), or
            # by an assignment t[i] = x, whose copy_ into the device tensor is recorded next
            on_host = self.host_tensors.making_host_tensor or not self.host_tensors.in_factory
        elif func.overloadpacket is aten.copy_ and not self.host_tensors.is_host(args[:1]):
            if self.host_tensors.is_host(args[1:2]):
                self.record(COPIED_IN)
        elif self.host_tensors.in_cpu_only_check:
            pass
        elif not on_host and (why := synchronising(func, args, kwargs)) is not None:
            self.record(why)
        out = func(*args, **kwargs)
        if on_host:
            self.host_tensors.mark(out)
        return out

    @contextlib.contextmanager
    def recording(self):
        with self.host_tensors, self:
            yield self.records


def unexpected(records):
    return [record for record in records if record[1] not in EXCEPTIONS]


LOG_EVERY = 2  # the training audit keeps log points every 2 optimizer steps: what they read is their purpose


def audit_epoch(loop, monkeypatch, checkpoints=None):
    """Train one epoch of `loop` under the audit; return (records outside log points, records at them). A log point
    lasts from the ranks' agreement to the next forward; the epoch's end (its totals) counts as one."""
    monkeypatch.setattr(dlojz, "LOG_EVERY", LOG_EVERY)
    loop["progress"].line_every = 10**6
    state, n_batches = loop["state"], loop["loaders"].n_train_batches
    in_log_point = [False]
    agree_on_stop = dlojz.agree_on_stop

    def log_point(*args):
        in_log_point[0] = True
        return agree_on_stop(*args)

    monkeypatch.setattr(dlojz, "agree_on_stop", log_point)
    forward = loop["model"].net.register_forward_pre_hook(lambda *args: in_log_point.__setitem__(0, False))
    audit = SyncAudit(lambda: "log point" if in_log_point[0] or state.batch >= n_batches else state.batch)
    audit.host_tensors.adopt(loop["training"].mix)  # torchvision's MixUp and CutMix sample their ratio on the host
    try:
        with audit.recording() as records:
            dlojz.train_one_epoch(**loop, checkpoints=checkpoints)
    finally:
        forward.remove()
    outside = [record for record in records if record[0] != "log point"]
    at_log_points = [record for record in records if record[0] == "log point"]
    assert any(asker == "dlojz.py:epoch_result" for _, asker, _ in at_log_points), "the audit sees the epoch's end"
    # a log point reads the agreed values once; a host value copied into a device tensor there is one wait more
    assert [record for record in at_log_points if record[2] == COPIED_IN] == []
    return outside, at_log_points


# A tiny ViT where float16 runs: the waits under audit are the step's (scaler, optimizer, EMA), whatever the model,
# and on the CPU a float16 convolution's backward takes seconds a step (resnet18: 2 s at 16 px; this ViT: 0.03 s).
FLOAT16_MODEL = ["--arch", "timm:test_vit"]

# Each flag that touches the step or the model, grouped so that every one runs under the audit (a wait any of them
# adds fails its group); the timm optimizers run alone, as their steps differ.
TRAINING_FLAGS = [
    pytest.param(
        [
            "--amp",
            "--amp-dtype",
            "float16",
            "--model-ema",
            "--clip-grad-norm",
            "1.0",
            "--label-smoothing",
            "0.1",
            "--model-ema-steps",
            "2",
            "--model-ema-warmup",
            *FLOAT16_MODEL,
        ],
        id="float16-ema-clip-smoothing",
    ),
    pytest.param(
        ["--amp", "--amp-dtype", "bfloat16", "--blurpool", "--grad-acc", "2", "--nesterov"],
        id="bfloat16-blurpool-grad-acc",
    ),
    pytest.param(
        [
            "--no-amp",
            "--mixup-alpha",
            "0.2",
            "--cutmix-alpha",
            "1.0",
            "--lr-scheduler",
            "cosine",
            "--warmup-epochs",
            "1",
            "--epochs",
            "2",
            "--bce-loss",
            "--warmup-start-factor",
            "0.1",
            "--min-lr",
            "1e-4",
        ],
        id="float32-mixup-cutmix-cosine-bce",
    ),  # fmt: skip
    pytest.param(["--optimizer", "adamw", "--amp", "--amp-dtype", "float16", *FLOAT16_MODEL], id="adamw-float16"),
    pytest.param(["--optimizer", "lamb", "--amp", "--amp-dtype", "bfloat16"], id="lamb-bfloat16"),
    pytest.param(["--optimizer", "rmsprop", "--amp", "--amp-dtype", "bfloat16"], id="rmsprop-bfloat16"),
    pytest.param(["--optimizer", "lars", "--amp", "--amp-dtype", "bfloat16"], id="lars-bfloat16"),
    pytest.param(["--optimizer", "lion", "--amp", "--amp-dtype", "bfloat16"], id="lion-bfloat16"),
    pytest.param(["--findlr"], id="findlr"),
    # torchao's float8 linears (tests/model/test_float8.py's narrow ViT, registered there: each block's fc1 over
    # tensorwise's sizes; rowwise's take none of them): their scales computed on the device
    pytest.param(["--arch", MLP_VIT, "--float8", "tensorwise"], id="float8-tensorwise"),
    pytest.param(
        ["--arch", MLP_VIT, "--float8", "tensorwise", "--amp", "--amp-dtype", "bfloat16"],
        id="float8-tensorwise-bfloat16",
    ),
]


@pytest.mark.parametrize("flags", TRAINING_FLAGS)
def test_a_training_epoch_waits_for_the_device_only_at_log_points(flags, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    loop = loop_for(*flags, n_batches=4 * (2 if "--grad-acc" in flags else 1))
    if "--float8" in flags:  # (the audited step runs torchao's linears)
        assert any(type(m).__name__ == "Float8Linear" for m in loop["model"].module.modules())
    outside, at_log_points = audit_epoch(loop, monkeypatch)
    assert unexpected(outside) == []
    if "--findlr" in flags:  # the warned exception is seen at every step
        assert {
            position for position, asker, _ in outside if asker == "dlojz_lib/observers/hooks.py:optimizer_step_done"
        } >= {
            1,
            3,
        }


def loop_on_data(data_root, *flags):
    """train_one_epoch's arguments as main() builds them, on the images of `data_root` through the DataLoader
    (one worker: the batches reach this process as they do in a run)."""
    return run_on_data(data_root, *flags)[1]


def run_on_data(data_root, *flags):
    """(Config, loop_on_data's loop): for a test that also reads the flags."""
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    argv = [*BASE, "--data-root", str(data_root), "--num-workers", "1", "--no-wandb", *flags]
    cfg = resolve_config(get_args_parser().parse_args(argv))
    ranks, cfg = dlojz.setup_distributed(cfg)
    log = dlojz.Console(ranks.is_main)
    train_set, val_set, classes = dlojz.build_data(cfg, ranks, log)
    model = dlojz.lay_out(dlojz.build_model(cfg, len(classes), ranks, log), cfg, ranks, log)
    loaders = dlojz.build_loaders(cfg, train_set, val_set, len(classes), ranks, log)
    training = dlojz.build_training(cfg, model, loaders.n_train_batches, len(classes), ranks, log)
    progress = dlojz.Progress(
        log, dlojz_lib.log.NoWandb(), ranks.device, cfg.epochs, loaders.n_train_batches, cfg.grad_acc, cfg.batch_size
    )
    hooks = dlojz.LoopHooks(dlojz.Chronometer(enabled=False, device=ranks.device))
    stop = dlojz.StopPoll(dlojz.StopSignal(), ranks)
    test_steps = cfg.test_nsteps if cfg.test else None
    return cfg, dict(model=model, training=training, loaders=loaders, state=TrainState(), ranks=ranks, hooks=hooks,
                     progress=progress, stop=stop, test_steps=test_steps, output_dir=cfg.output_dir)  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(
            ["--amp", "--amp-dtype", "float16", *FLOAT16_MODEL, "--mixup-alpha", "0.2", "-b", "8"], id="float16-mixup"
        ),
        pytest.param(
            ["--min-res", "24", "--max-res", "32", "--end-ramp", "1", "--epochs", "2", "-b", "8"], id="progressive"
        ),
    ],
)
def test_an_epoch_on_images_through_the_dataloader_waits_only_at_log_points(flags, tiny_data, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg, loop = run_on_data(tiny_data, *flags)
    outside, _ = audit_epoch(loop, monkeypatch)
    assert loop["state"].batch == loop["loaders"].n_train_batches >= 9  # 72 images, 8 a batch
    assert unexpected(outside) == []
    loaders = loop["loaders"]
    validation = audit_validation(loop["model"], loaders, loop["training"], loop["ranks"], cfg.tta_flip)
    assert unexpected(validation) == []


def test_the_float16_scaler_of_an_unfused_optimizer_is_the_listed_exception(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    loop = loop_for("--optimizer", "lamb", "--amp", "--amp-dtype", "float16", *FLOAT16_MODEL, n_batches=4)
    outside, _ = audit_epoch(loop, monkeypatch)
    assert {asker for _, asker, _ in outside} == {"grad_scaler.py:<genexpr>"}
    assert {position for position, _, _ in outside} >= {1, 2, 3}


def test_the_audit_sees_the_read_of_an_unfused_sgd_step(monkeypatch, tmp_path):
    """Without the fused step, GradScaler reads the inf flag on the host at every optimizer step."""
    monkeypatch.chdir(tmp_path)
    build = dlojz_lib.optim.optimizers.build_optimizer
    monkeypatch.setattr(dlojz_lib.optim.training, "build_optimizer", lambda *a, **k: build(*a, **{**k, "fused": False}))
    loop = loop_for("--amp", "--amp-dtype", "float16", "--optimizer", "sgd", *FLOAT16_MODEL, n_batches=4)
    assert not loop["training"].optimizer.defaults.get("fused")
    outside, _ = audit_epoch(loop, monkeypatch)
    assert {asker for _, asker, _ in outside} == {"grad_scaler.py:<genexpr>"}


def test_checkpoints_every_few_minutes_wait_only_at_log_points(monkeypatch, tmp_path):
    from dlojz_lib.resume import make_saver, periodic_checkpoints

    monkeypatch.chdir(tmp_path)
    cfg, loop = run_for("--checkpoint-every", "0.0001", "--output-dir", tmp_path / "run", n_batches=4)
    saver = make_saver(cfg, loop["model"], loop["training"], loop["ranks"])
    checkpoints = periodic_checkpoints(cfg, saver, 0.0, loop["loaders"].n_train_batches, None, lambda line: None)
    outside, _ = audit_epoch(loop, monkeypatch, checkpoints)
    saver.wait()
    assert unexpected(outside) == []
    assert list((tmp_path / "run").glob("*.pt")), "the periodic checkpoints were written"


def test_the_audit_catches_a_tensor_made_from_python_data_in_the_step(monkeypatch, tmp_path):
    """The BlurPool kernel as it was once made, from a Python list at every forward: on CUDA a blocking copy."""
    import dlojz_lib.model.zoo

    def blur_from_python_data(x, kernel, stride):
        kernel = torch.tensor([1.0, 2.0, 1.0], device=x.device, dtype=x.dtype)
        kernel = (kernel[:, None] * kernel[None, :] / 16).expand(x.shape[1], 1, 3, 3)
        return torch.nn.functional.conv2d(x, kernel, stride=stride, padding=1, groups=x.shape[1])

    monkeypatch.setattr(dlojz_lib.model.zoo, "blur", blur_from_python_data)
    monkeypatch.chdir(tmp_path)
    outside, _ = audit_epoch(loop_for("--blurpool", n_batches=4), monkeypatch)
    assert {(asker, why) for _, asker, why in unexpected(outside)} == {
        ("test_host_sync.py:blur_from_python_data", LIFTED)
    }


@pytest.mark.parametrize(
    "code, why",
    [
        (lambda t: t.sum().item(), "reads a value"),
        (lambda t: t[t > 0], "boolean mask"),
        (lambda t: torch.unique(t), "unique"),
        (lambda t: t.nonzero(), "nonzero"),
        (lambda t: torch.repeat_interleave(t.long().abs()), "repeat_interleave"),
        (lambda t: t.tolist(), "tolist()"),
        (lambda t: torch.equal(t, t), "equal"),
        (lambda t: t.__setitem__(1, 0.5), "copied into a device tensor"),
        (lambda t: t.copy_(torch.ones(5)), "copied into a device tensor"),
    ],
)
def test_the_audit_sees_each_kind_of_wait(code, why):
    on_device = torch.arange(-2.0, 3.0)  # made before the audit, as the model and the batch are: the device's
    audit = SyncAudit(lambda: 0)
    with audit.recording() as records:
        code(on_device)
    assert any(why in record[2] for record in records), records
    audit = SyncAudit(lambda: 0)
    with audit.recording() as records:  # what does not wait: device-side ops, sizes known in advance
        torch.where(on_device > 0, on_device, 0.0).sum()
        torch.repeat_interleave(on_device, 2)
        torch.full((), 3.0, device=on_device.device)
        on_device.select(0, 1).fill_(0.5)  # the value is the kernel's argument
    assert records == []


def test_tensors_kept_on_the_host_are_not_waits():
    audit = SyncAudit(lambda: 0)
    with audit.recording() as records:
        flag = torch.full((1,), 1.0)  # the StopPoll's gloo flag
        assert bool(flag.numpy()[0])
        ratio = torch.distributions.Beta(torch.tensor([0.2]), torch.tensor([0.2])).sample()
        assert 0 <= float(ratio) <= 1  # MixUp's ratio, sampled on the host
        assert records == []
        torch.tensor([1.0, 2.0], device=flag.device)  # a device named: on CUDA a blocking copy
        flag.to(torch.device("cpu")).item()
    assert [why for _, _, why in records] == [LIFTED, SYNCHRONISING[aten._local_scalar_dense]]


def audit_validation(model, loaders, training, ranks, tta_flip):
    """Validate under the audit; return the records made before the last forward (the final totals excluded)."""
    forwards = [0]
    hook = model.module.register_forward_pre_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))
    try:
        with SyncAudit(lambda: forwards[0]).recording() as records:
            dlojz.evaluate(model.module, loaders, training, ranks, tta_flip=tta_flip)
    finally:
        hook.remove()
    assert forwards[0] >= 3 * (2 if tta_flip else 1)
    assert records, "the audit sees the final totals"
    return [record for record in records if record[0] < forwards[0]]


@pytest.mark.parametrize("flags", [["--tta-flip"], ["--blurpool", "--amp", "--amp-dtype", "bfloat16"]])
def test_validation_waits_for_the_device_only_at_its_end(flags, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg, loop = run_for(*flags)
    ranks = loop["ranks"]
    loaders = synthetic_loaders(cfg, SYNTHETIC_CLASSES, ranks, 8, 3 * cfg.val_batch_size)
    assert unexpected(audit_validation(loop["model"], loaders, loop["training"], ranks, cfg.tta_flip)) == []


def audited_ranks(rank, port, out_dir, results):
    """Two DDP ranks on gloo, the step's flags together: an epoch and a validation under the audit."""
    as_rank_of_two(rank, port, out_dir)
    import torch.distributed as dist

    flags = ["--amp", "--amp-dtype", "float16", "--grad-acc", "2", "--model-ema", "--clip-grad-norm", "1.0"]
    # (BlurPool, a ResNet's, is audited in one process above: DDP adds nothing to it)
    cfg, loop = synthetic_run([*BASE, *flags, *FLOAT16_MODEL, "--tta-flip", "--mixup-alpha", "0.2"], n_batches=4)
    from dlojz_lib.observers.watchdog import Watchdog

    # the ranks' forward seconds compared at each log point, as --straggler-factor's default does in a run
    loop["stop"].watchdog = Watchdog(loop["ranks"], 0, None, straggler_factor=1.5)
    monkeypatch = pytest.MonkeyPatch()
    try:
        outside, _ = audit_epoch(loop, monkeypatch)
        ranks = loop["ranks"]
        loaders = synthetic_loaders(cfg, SYNTHETIC_CLASSES, ranks, 8, 3 * 2 * cfg.val_batch_size)
        validation = audit_validation(loop["model"], loaders, loop["training"], ranks, True)
        results[rank] = (unexpected(outside), unexpected(validation), loop["model"].parallel)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_two_ddp_ranks_wait_for_the_device_only_at_log_points(tmp_path):
    port = preloaded.free_port()
    # forkserver: the ranks fork from a server that imported dlojz once (preloaded), not two fresh interpreters
    results = mp.get_context("forkserver").Manager().dict()
    mp.start_processes(audited_ranks, (port, str(tmp_path), results), nprocs=2, join=True, start_method="forkserver")
    assert dict(results) == {0: ([], [], "ddp"), 1: ([], [], "ddp")}


def test_model_ema_update_does_not_read_the_device(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    loop = loop_for("--model-ema", "--no-amp", n_batches=2)
    model = loop["model"]
    with SyncAudit(lambda: 0).recording() as records:
        for _ in range(3):
            model.ema.update_parameters(model.module)
    assert records == [] and model.ema.updates == 3 and int(model.ema.n_averaged) == 3


def test_a_log_point_sends_the_ranks_forward_seconds_without_a_copy_from_the_host(monkeypatch):
    """The log point's vector (stop, checkpoint, NaN step, then each rank's forward seconds when stragglers are
    compared) is made and filled on the device: its one wait is the read of the agreed values (tolist)."""
    import types

    import dlojz_lib.dist
    from dlojz_lib.dist import Distribution, StopSignal, agree_on_stop
    from dlojz_lib.observers.watchdog import Watchdog

    monkeypatch.setattr(dlojz_lib.dist.dist, "all_reduce", lambda tensor, op=None: None)  # the one rank of two here
    ranks = Distribution(2, 1, 1, torch.device("cpu"))
    watchdog = Watchdog(ranks, 0, None, straggler_factor=2.0)
    assert watchdog.compares
    stop = types.SimpleNamespace(stop_signal=StopSignal(), watchdog=watchdog)
    first_nonfinite = torch.full((), -1.0, dtype=torch.float64)
    audit = SyncAudit(lambda: "log point")
    with audit.recording() as records:  # (what audit_epoch asserts at every log point, with the stragglers compared)
        assert agree_on_stop(stop, first_nonfinite, ranks)[:3] == (False, -1.0, False)
    assert [why for _, _, why in records] == ["tolist(): a copy to the host"]
