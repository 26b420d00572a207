"""What only a CUDA GPU can prove: the precision paths, channels-last, the prefetcher's streams, the chronometer's
synchronised phases, NVML energy, --compile, training steps that never wait for the GPU, and (2+ GPUs) NCCL.

Skipped, with the reason, where no CUDA GPU is visible (this project's CI). On a GPU node, one command:
    python -m pytest tests -m gpu -v          # these tests, a few minutes on one H100
    bash bench/gpu_acceptance.sh [PYTHON]     # these tests, then the throughput table against the anchors
"""
import math

import pytest
import torch

import dlojz
from conftest import SMALL, clean_env, read_json, run_dlojz, show
from test_optim import GOOD_LR, grad_scaler_steps, tiny_classifier

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA GPU visible: the GPU tests run on a GPU node (bench/gpu_acceptance.sh)")]

CUDA = ["--device", "cuda", "--image-size", "64", "-b", "16", "--val-batch-size", "16", "--no-wandb"]
TORCHRUN2 = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir is made under ./runs


def loop_for(*flags, n_batches=3):
    return dlojz.synthetic_loop([*CUDA, *map(str, flags)], n_batches=n_batches)


def run_epoch_seen(loop):
    """One epoch; the conv1 output dtypes and the batches the model got."""
    dtypes, inputs = [], []
    module = loop["model"].module
    handles = [module.conv1.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype)),
               module.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))]
    try:
        result = dlojz.train_one_epoch(**loop)
    finally:
        for handle in handles:
            handle.remove()
    return result, dtypes, inputs


def test_float16_with_the_grad_scaler_on_resnet50():
    loop = loop_for("--arch", "resnet50", "--amp", "--amp-dtype", "float16")
    result, dtypes, _ = run_epoch_seen(loop)
    assert set(dtypes) == {torch.float16} and math.isfinite(result.train_loss)
    scaler = loop["opt"].scaler
    assert scaler.is_enabled() and math.log2(scaler.get_scale()).is_integer()
    assert loop["opt"].optimizer.defaults["fused"]


def test_bfloat16_needs_no_scaler():
    loop = loop_for("--arch", "resnet50", "--amp", "--amp-dtype", "bfloat16")
    result, dtypes, _ = run_epoch_seen(loop)
    assert set(dtypes) == {torch.bfloat16} and math.isfinite(result.train_loss)
    assert not loop["opt"].scaler.is_enabled()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_precision_reported_in_the_metrics(dtype, tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(*CUDA, "--arch", "resnet18", "--synthetic", "--test", "--test-nsteps", "12", "--amp",
                     "--amp-dtype", dtype, "--metrics-json", metrics, "--output-dir", tmp_path / "run")
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["compute_dtype"] == dtype
    assert (m["grad_scaler_scale"] is not None) is (dtype == "float16")


def test_channels_last_on_cuda():
    loop = loop_for("--arch", "resnet18", "--channels-last")
    _, _, inputs = run_epoch_seen(loop)
    assert loop["model"].module.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert inputs[0].is_cuda and inputs[0].is_contiguous(memory_format=torch.channels_last)
    assert not inputs[0].is_contiguous()


def test_the_prefetcher_gives_the_same_batches_on_its_stream(tmp_path):
    from dlojz_config import get_args_parser, resolve_config
    from dlojz_data import make_embedded_dataset
    from dlojz_dist import Distribution
    from dlojz_log import Console
    root = make_embedded_dataset(tmp_path / "d", n_classes=3, train_per_class=16, val_per_class=4, size=(48, 40))
    batches = {}
    for flag in ("--non-blocking", "--no-non-blocking"):
        cfg = resolve_config(get_args_parser().parse_args(
            [*SMALL[2:], "--device", "cuda", "--data-root", str(root), "--val-batch-size", "5", "--num-workers", "1",
             flag, "--output-dir", str(tmp_path / "run")]))
        ranks = Distribution(1, 0, 0, torch.device(cfg.torch_device))
        log = Console(False)
        train_set, val_set, classes = dlojz.build_data(cfg, ranks, log)
        loaders = dlojz.build_loaders(cfg, train_set, val_set, len(classes), ranks, log)
        got = [(images.cpu(), labels.cpu(), images.is_cuda) for images, labels in loaders.val_batches]
        batches[flag] = got
        for loader in dlojz.LOADERS:
            dlojz.close_loader(loader)
        dlojz.LOADERS.clear()
    fast, plain = batches["--non-blocking"], batches["--no-non-blocking"]
    assert len(fast) == len(plain) == 3 and all(on_gpu for _, _, on_gpu in fast)
    for (a, la, _), (b, lb, _) in zip(fast, plain):
        assert torch.equal(a, b) and torch.equal(la, lb)


def chrono_metrics(tmp_path, *flags):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(*CUDA, "--synthetic", "--test", "--test-nsteps", "30", "--metrics-json", metrics,
                     "--output-dir", tmp_path / "run", *flags)
    assert proc.returncode == 0, show(proc)
    return read_json(metrics)


def test_the_chronometer_phases_add_up_to_the_step(tmp_path):
    chrono = chrono_metrics(tmp_path, "--arch", "resnet50", "--image-size", "128", "-b", "64", "--amp")["chrono"]
    total = chrono["forward_median_s"] + chrono["backward_median_s"]
    assert total == pytest.approx(chrono["step_median_s"], rel=0.15), chrono
    assert chrono["throughput_img_s"] > 0 and 0 < chrono["mfu"] < 1


def test_nvml_reads_the_energy_per_image(tmp_path):
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py not installed: no energy figures")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        pytest.skip(f"NVML does not start here: {err}")
    chrono = chrono_metrics(tmp_path, "--arch", "resnet50", "--image-size", "128", "-b", "64", "--amp")["chrono"]
    assert chrono.get("energy_per_image_j", 0) > 0, chrono


def test_compile_runs_on_cuda(tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(*CUDA, "--arch", "resnet18", "--synthetic", "--test", "--test-nsteps", "10", "--compile",
                     "--metrics-json", metrics, "--output-dir", tmp_path / "run", timeout=900)
    assert proc.returncode == 0, show(proc)
    assert read_json(metrics)["steps"] == 10


@pytest.mark.parametrize("flags", [
    ["--optimizer", "sgd", "--amp", "--amp-dtype", "float16"],
    ["--optimizer", "adamw", "--amp", "--amp-dtype", "float16"],
    ["--optimizer", "sgd", "--amp", "--amp-dtype", "bfloat16", "--model-ema"],
    ["--optimizer", "sgd", "--amp", "--amp-dtype", "float16", "--clip-grad-norm", "1.0", "--channels-last"],
], ids=["sgd-float16", "adamw-float16", "sgd-bfloat16-ema", "sgd-float16-clip"])
def test_training_steps_never_wait_for_the_gpu(flags, monkeypatch):
    """torch.cuda.set_sync_debug_mode("error") raises on any host-device synchronisation: on from the end of the
    first micro-batch (cuDNN autotuning, the scaler's first scale) to the end of the last (whose totals the host
    reads on purpose), log points moved out of reach."""
    loop = loop_for("--arch", "resnet18", *flags, n_batches=8)
    monkeypatch.setattr(dlojz, "LOG_EVERY", 10 ** 6)
    loop["progress"].line_every = 10 ** 6
    hooks, state = loop["hooks"], loop["state"]
    step_done = hooks.step_done

    def checked_step_done():
        step_done()
        torch.cuda.set_sync_debug_mode("error" if state.batch < 8 else 0)
    hooks.step_done = checked_step_done
    try:
        result = dlojz.train_one_epoch(**loop)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert loop["state"].global_step == 8 and math.isfinite(result.train_loss)


def test_timm_lamb_waits_for_the_gpu_with_float16():
    """What the start-up line says: an optimizer without a fused step makes the GradScaler read its overflow flag
    on the host at every step (bfloat16 needs no scaler)."""
    loop = loop_for("--arch", "resnet18", "--optimizer", "lamb", "--amp", "--amp-dtype", "float16", n_batches=2)
    opt, model = loop["opt"], loop["model"].module
    images, labels = next(iter(loop["loaders"].train_batches))
    for step in range(2):
        with opt.autocast():
            loss = opt.criterion(model(images), labels)
        opt.scaler.scale(loss).backward()
        torch.cuda.set_sync_debug_mode("error" if step == 1 else 0)
        try:
            if step == 1:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    opt.scaler.step(opt.optimizer)
            else:
                opt.scaler.step(opt.optimizer)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        opt.scaler.update()
        opt.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_fused_step_skips_overflowed_steps_on_cuda(name, monkeypatch):
    """The fused step's momentum buffers after an overflowed first step, with reused GPU memory (NaN-filled here):
    the same weights as the unfused step."""
    results = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = tiny_classifier().cuda()
        optimizer = dlojz.optim.build_optimizer(name, model.parameters(), GOOD_LR[name], 0.9, 1e-4, fused=fused)
        empty_like = torch.empty_like
        monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
        results[fused] = grad_scaler_steps(optimizer, model, overflow_at=(0, 2), device="cuda")
        monkeypatch.undo()
    atol = 1e-5 if name == "sgd" else 0.3 * GOOD_LR[name]
    for unfused, fused in zip(results[False], results[True]):
        assert torch.isfinite(fused).all()
        torch.testing.assert_close(fused, unfused, rtol=0, atol=atol)


# ---------------------------------------------------------------- two GPUs and more
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs on this node")


@two_gpus
def test_nccl_validation_on_two_gpus_equals_one(tmp_path, tiny_data):
    common = [*SMALL[2:], "--device", "cuda", "--data-root", tiny_data, "--no-wandb", "--val-batch-size", "4"]
    proc = run_dlojz(*common, "-b", "8", "--epochs", "1", "--output-dir", tmp_path / "train")
    assert proc.returncode == 0, show(proc)
    results = []
    for launcher in (None, TORCHRUN2):
        metrics = tmp_path / f"eval{len(results)}.json"
        proc = run_dlojz(*common, "--eval-only", "--resume", "auto", "--output-dir", tmp_path / "train",
                         "--metrics-json", metrics, launcher=launcher)
        assert proc.returncode == 0, show(proc)
        results.append(read_json(metrics))
    one, two = results
    assert (one["world_size"], two["world_size"]) == (1, 2) and one["val_images"] == two["val_images"] == 15
    assert one["val_accuracy"] == two["val_accuracy"] and one["val_top5_accuracy"] == two["val_top5_accuracy"]
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-4)


@two_gpus
def test_sync_bn_test_run_on_two_gpus_reports(tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(*CUDA, "--arch", "resnet18", "--synthetic", "--test", "--test-nsteps", "10", "--sync-bn",
                     "--metrics-json", metrics, "--output-dir", tmp_path / "run", launcher=TORCHRUN2,
                     env=clean_env())
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["world_size"] == 2 and m["chrono"]["steps"] >= 10
