"""The training loop never waits for the device between its log points.

On a GPU, reading a tensor's value on the host (`.item()`, `bool(t)`, `.tolist()`, `float(t)`) waits for every
queued kernel: one such read per step stalls the GPU. Here, on the CPU, every read is recorded with the training
position at which it happened: outside log points there must be none (tests/test_gpu.py proves the same on CUDA
with torch.cuda.set_sync_debug_mode("error")).
"""

import contextlib

import pytest
import torch

import dlojz
from test_flag_effects import loop_for

READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def recorded_host_reads(state):
    """Record (micro-batches done, read) for every host read of a tensor's value while the `with` lasts."""
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def recorder(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            reads.append((state.batch, name))
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, recorder(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def reads_during_epoch(loop, monkeypatch):
    """Host reads before the last micro-batch of one epoch, with log points and console lines moved out of reach."""
    monkeypatch.setattr(dlojz, "LOG_EVERY", 10**6)
    loop["progress"].line_every = 10**6
    n_batches = loop["loaders"].n_train_batches
    with recorded_host_reads(loop["state"]) as reads:
        dlojz.train_one_epoch(**loop)
    assert any(done == n_batches for done, _ in reads), "the epoch's end reads its totals: the recorder works"
    return [(done, name) for done, name in reads if done < n_batches]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_float16_steps_with_the_grad_scaler_do_not_read_the_device(optimizer, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    loop = loop_for("--amp", "--amp-dtype", "float16", "--optimizer", optimizer, "--model-ema", n_batches=6)
    assert loop["opt"].scaler.is_enabled()
    assert loop["opt"].optimizer.defaults["fused"], "fused step: GradScaler passes it the scale and inf flag as tensors"
    assert dlojz.train_one_epoch.__name__  # the loop itself, not a copy of it
    assert reads_during_epoch(loop, monkeypatch) == []


def test_the_recorder_sees_the_read_of_an_unfused_step(monkeypatch, tmp_path):
    """Without the fused step, GradScaler reads the inf flag on the host at every optimizer step."""
    monkeypatch.chdir(tmp_path)
    build = dlojz.optim.build_optimizer
    monkeypatch.setattr(dlojz.optim, "build_optimizer", lambda *a, **k: build(*a, **{**k, "fused": False}))
    loop = loop_for("--amp", "--amp-dtype", "float16", "--optimizer", "sgd", n_batches=6)
    assert not loop["opt"].optimizer.defaults.get("fused")
    reads = reads_during_epoch(loop, monkeypatch)
    assert {done for done, _ in reads} == set(range(6))  # one read per step, each in its own step


def test_model_ema_update_does_not_read_the_device(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    loop = loop_for("--model-ema", "--no-amp", n_batches=2)
    model = loop["model"]
    with recorded_host_reads(loop["state"]) as reads:
        for _ in range(3):
            model.ema.update_parameters(model.module)
    assert reads == [] and model.ema.updates == 3 and int(model.ema.n_averaged) == 3
