"""What only a CUDA GPU can prove: dlojz's CUDA paths, run as a user runs them, on one GPU (two for the last tests).

- precision: float16 autocast with a live GradScaler (ResNet-50), bfloat16 without one, both reported in the metrics;
- `--channels-last`: weights, the batch the model gets and the convolutions' outputs are NHWC on the GPU;
- the CUDA prefetcher (side stream, pinned memory, `--non-blocking` or not) hands out the very batches a CPU
  normalisation gives;
- the chronometer: its phases wait for the compute stream (and only for it), add up to the step and agree with the
  wall clock; NVML's energy per image;
- `--compile` trains on CUDA, in the default mode, with CUDA graphs (`--compile-mode reduce-overhead`) and autotuned;
- no host-device synchronisation in steady-state training steps: a whole epoch of dlojz's own `train_one_epoch`
  under `torch.cuda.set_sync_debug_mode("error")` (fused SGD/AdamW under the float16 GradScaler, bfloat16, EMA,
  gradient clipping and accumulation, BlurPool, CUDA graphs; synthetic batches, and images through the DataLoader
  and the prefetcher), the only wait being the log point the test leaves at its end; validation (TTA, BlurPool)
  waits only for its totals;
- gradient accumulation under torch.compile, and the CUDA-graph modes' one-line refusal of it;
- fused steps after an overflowed first step (GPU memory is reused, not zeroed);
- with 2 GPUs or more: NCCL validation equal to 1 GPU's on an odd number of images, a `--sync-bn` run, an LR sweep
  that ends on both ranks at once, gradient accumulation under DDP, NVML under a remapped CUDA_VISIBLE_DEVICES.

Skipped, with the reason, where no CUDA GPU is visible (this project's CI machine). On a GPU node, one command:
    python -m pytest tests -m gpu -v          # these tests alone: a few minutes on one H100
    bash bench/gpu_acceptance.sh [PYTHON]     # checks, these tests, then ResNet-50 throughput against the anchors
"""

import math
import time

import pytest
import torch
from conftest import read_json, run_dlojz, show
from in_process import synthetic_loop, synthetic_run

import dlojz
import dlojz_lib.optim.optimizers
from dlojz_lib.data.loaders import SYNTHETIC_CLASSES, synthetic_loaders

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU visible: the GPU acceptance tests run on a GPU node (bench/gpu_acceptance.sh)",
    ),
]

two_gpus = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs on this node"
)

# Small enough for a few seconds per run on one GPU; the ResNet-50 tests raise the image size.
CUDA = [
    "--device",
    "cuda",
    "--no-wandb",
    "--image-size",
    "64",
    "-b",
    "32",
    "--val-batch-size",
    "32",
    "--val-resize-size",
    "73",
    "--val-crop-size",
    "64",
]
TORCHRUN2 = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir is made under ./runs


def loop_for(*flags, n_batches=3):
    """The arguments of dlojz.train_one_epoch for these flags on CUDA (synthetic batches on the device)."""
    return synthetic_loop([*CUDA, *map(str, flags)], n_batches=n_batches)


def run_epoch_seen(loop):
    """One epoch of dlojz's loop; returns (EpochResult, conv1's outputs, the batches the model got)."""
    conv_outputs, inputs = [], []
    module = loop["model"].module
    handles = [
        module.conv1.register_forward_hook(lambda m, args, out: conv_outputs.append(out.detach())),
        module.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach())),
    ]
    try:
        result = dlojz.train_one_epoch(**loop)
    finally:
        for handle in handles:
            handle.remove()
    return result, conv_outputs, inputs


def skip_without_bfloat16():
    """Asked in the test, not at collection: asking starts CUDA in the pytest process, which a run of the other
    tests alone (the DataLoader workers they fork) has no reason to do."""
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(
            "this GPU has no native bfloat16 (compute capability < 8.0): dlojz refuses --amp-dtype bfloat16 there"
        )


def is_power_of_two(x):
    return x is not None and math.isfinite(x) and x > 0 and math.log2(x).is_integer()


# ---------------------------------------------------------------- precision
def test_float16_with_the_grad_scaler_on_resnet50():
    loop = loop_for("--arch", "resnet50", "--image-size", "128", "--amp", "--amp-dtype", "float16")
    result, conv_outputs, _ = run_epoch_seen(loop)
    assert len(conv_outputs) == 3 and {out.dtype for out in conv_outputs} == {torch.float16}
    assert math.isfinite(result.train_loss)
    assert next(loop["model"].module.parameters()).dtype == torch.float32  # float32 master weights
    scaler = loop["training"].scaler
    assert scaler.is_enabled() and is_power_of_two(scaler.get_scale()), scaler.get_scale()
    assert loop["training"].optimizer.defaults.get("fused"), (
        "SGD's fused step: the scaler hands it tensors, no host read"
    )


def test_bfloat16_needs_no_scaler():
    skip_without_bfloat16()
    loop = loop_for("--arch", "resnet50", "--image-size", "128", "--amp", "--amp-dtype", "bfloat16")
    result, conv_outputs, _ = run_epoch_seen(loop)
    assert {out.dtype for out in conv_outputs} == {torch.bfloat16}
    assert math.isfinite(result.train_loss)
    assert not loop["training"].scaler.is_enabled()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_precision_is_reported_in_the_metrics(dtype, tmp_path):
    if dtype == "bfloat16":
        skip_without_bfloat16()
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *CUDA,
        "--arch",
        "resnet50",
        "--synthetic",
        "--test",
        "--test-nsteps",
        "20",
        "--amp",
        "--amp-dtype",
        dtype,
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path / "run",
    )
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["compute_dtype"] == dtype and m["steps"] == 20 and math.isfinite(m["train_loss"])
    if dtype == "float16":
        assert is_power_of_two(m["grad_scaler_scale"]), m["grad_scaler_scale"]
    else:
        assert m["grad_scaler_scale"] is None


# ---------------------------------------------------------------- memory format
@pytest.mark.parametrize("flag, expected", [("--channels-last", True), ("--no-channels-last", False)])
def test_channels_last_on_cuda(flag, expected):
    loop = loop_for("--arch", "resnet18", "--amp", flag)
    _, conv_outputs, inputs = run_epoch_seen(loop)
    nhwc = torch.channels_last
    assert loop["model"].module.conv1.weight.is_contiguous(memory_format=nhwc) is expected
    assert inputs[0].is_cuda and inputs[0].is_contiguous(memory_format=nhwc) is expected
    assert inputs[0].is_contiguous() is not expected
    assert conv_outputs[0].is_contiguous(memory_format=nhwc) is expected  # cuDNN ran the NHWC kernels


# ---------------------------------------------------------------- the CUDA prefetcher
def test_the_prefetcher_gives_the_same_batches_on_its_stream(tmp_path):
    """Validation batches built by dlojz (DataLoader workers, pinned memory, DevicePrefetcher's copy stream,
    normalisation on the GPU) with --non-blocking, --no-non-blocking and --channels-last: the same images and labels,
    on the GPU, equal to the same uint8 batches normalised on the CPU, even when the compute stream reads each one
    late."""
    from dlojz_lib.data.embedded import make_embedded_dataset
    from dlojz_lib.data.prefetch import DeviceNormalize, DevicePrefetcher
    from dlojz_lib.dist import Distribution
    from dlojz_lib.log import Console
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    root = make_embedded_dataset(tmp_path / "d", n_classes=3, train_per_class=16, val_per_class=4, size=(48, 40))
    got, reference = {}, None
    for name, flags in (
        ("non-blocking", ["--non-blocking"]),
        ("blocking", ["--no-non-blocking"]),
        ("channels-last", ["--non-blocking", "--channels-last"]),
    ):
        cfg = resolve_config(
            get_args_parser().parse_args(
                [
                    "--device",
                    "cuda",
                    "--arch",
                    "resnet18",
                    "--data-root",
                    str(root),
                    "--image-size",
                    "32",
                    "--val-resize-size",
                    "36",
                    "--val-crop-size",
                    "32",
                    "--val-batch-size",
                    "5",
                    "-b",
                    "16",  # (the GPU profile's 128 is more than the 48 training images)
                    "--num-workers",
                    "1",
                    "--output-dir",
                    str(tmp_path / "run"),
                    *flags,
                ]
            )
        )
        assert cfg.non_blocking is (name != "blocking") and cfg.pin_memory
        ranks = Distribution(1, 0, 0, torch.device(cfg.torch_device))
        log = Console(False)
        train_set, val_set, classes = dlojz.build_data(cfg, ranks, log)
        loaders = dlojz.build_loaders(cfg, train_set, val_set, len(classes), ranks, log)
        try:
            prefetcher = loaders.val_batches
            assert isinstance(prefetcher, DevicePrefetcher) and prefetcher.non_blocking is cfg.non_blocking
            batches = []
            for images, labels in prefetcher:
                assert images.is_cuda and labels.is_cuda and images.dtype == torch.float32
                assert images.is_contiguous(memory_format=torch.channels_last) is cfg.channels_last
                # The compute stream reads the batch late (a kernel queued first keeps it busy), while the
                # prefetcher copies the next one: a missing stream wait or a buffer reused too early shows here.
                torch.cuda._sleep(20_000_000)
                batches.append((images.clone(), labels.clone()))
            got[name] = [(images.cpu(), labels.cpu()) for images, labels in batches]
            if reference is None:  # the loader's uint8 batches, normalised on the CPU
                normalize = DeviceNormalize(torch.device("cpu"))
                reference = [(normalize(images), labels) for images, labels in prefetcher.loader]
        finally:
            loaders.close()
    assert [len(images) for images, _ in reference] == [5, 5, 2]  # 12 validation images
    for name, batches in got.items():
        assert len(batches) == len(reference), name
        for (images, labels), (ref_images, ref_labels) in zip(batches, reference):
            assert torch.equal(labels, ref_labels), name
            torch.testing.assert_close(images, ref_images, rtol=0, atol=1e-5, msg=name)
    for (a, la), (b, lb) in zip(got["non-blocking"], got["blocking"]):
        assert torch.equal(a, b) and torch.equal(la, lb)


# ---------------------------------------------------------------- the chronometer
def gpu_sleep_seconds(cycles):
    """How long torch.cuda._sleep(cycles) keeps the GPU busy, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def test_the_chronometer_waits_for_the_compute_stream_and_only_for_it():
    """Kernels the host only queues (torch.cuda._sleep) are charged to the phase that queued them; a kernel on a
    side stream (the prefetcher's copy of the next batch) is charged to none."""
    from dlojz_lib.observers.chrono import Chronometer

    device = torch.device("cuda", torch.cuda.current_device())
    calibration = 10_000_000
    gpu_sleep_seconds(calibration)  # first launch
    cycles = int(calibration * 0.02 / gpu_sleep_seconds(calibration))  # about 20 ms on this GPU's clock
    sleep_s = gpu_sleep_seconds(cycles)
    chrono = Chronometer(enabled=True, device=device, warmup_steps=1, nvml=None)
    side = torch.cuda.Stream(device)
    chrono.start()
    for _ in range(6):
        chrono.dataload()
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
        chrono.dataload()
        chrono.forward()
        torch.cuda._sleep(cycles)
        chrono.forward()
        chrono.backward()
        torch.cuda._sleep(2 * cycles)
        chrono.backward()
        side.synchronize()
    s = chrono.summary({"images_per_step": 1})
    assert s["forward_median_s"] == pytest.approx(sleep_s, rel=0.3), (s, sleep_s)
    assert s["backward_median_s"] == pytest.approx(2 * sleep_s, rel=0.3), (s, sleep_s)
    assert s["load_median_s"] < 0.25 * sleep_s, (s, sleep_s)


@pytest.fixture(scope="module")
def resnet50_test_metrics(tmp_path_factory):
    """The metrics of one `--synthetic --test` ResNet-50 run at 224 px, batch 64, AMP (chronometer on)."""
    out = tmp_path_factory.mktemp("resnet50_test")
    proc = run_dlojz(
        *CUDA,
        "--arch",
        "resnet50",
        "--image-size",
        "224",
        "-b",
        "64",
        "--val-batch-size",
        "64",
        "--val-resize-size",
        "256",
        "--val-crop-size",
        "224",
        "--amp",
        "--synthetic",
        "--test",
        "--test-nsteps",
        "40",
        "--test-unsync-steps",  # every step timed by the chronometer: its phases against the run's clock below
        "0",
        "--metrics-json",
        out / "m.json",
        "--output-dir",
        out / "run",
    )
    assert proc.returncode == 0, show(proc)
    return read_json(out / "m.json")


def test_the_chronometer_phases_add_up_to_the_step(resnet50_test_metrics):
    m = resnet50_test_metrics
    chrono = m["chrono"]
    assert chrono["steps"] == 40 and chrono["measured_steps"] == 35 and chrono["warmup_excluded"]
    assert chrono["forward_median_s"] + chrono["backward_median_s"] == pytest.approx(
        chrono["step_median_s"], rel=0.15
    ), chrono
    assert 0 < chrono["forward_median_s"] < chrono["step_median_s"]
    assert m["images_per_second"] > 0 and chrono["throughput_img_s"] > 0
    # Against the untimed clock: the run's images/s is timed between the synchronised log points after steps 10
    # and 40 (wall clock, warm-up left out); the phases of steps 11 to 40 lie inside that window, one after the
    # other, and must fill it but for the loop's bookkeeping and NVML's readings between them.
    trace = read_json(chrono["trace_path"])
    phases_s = sum((load or 0.0) + step for load, step in zip(trace["load_s"][10:40], trace["step_s"][10:40]))
    wall_s = 30 * m["global_batch_size"] / m["images_per_second"]
    assert 0.8 * wall_s < phases_s < 1.02 * wall_s, (phases_s, wall_s, chrono)
    from dlojz_lib.model.zoo import peak_flops

    if peak_flops(torch.cuda.get_device_name(), "float16"):  # V100/A100/H100/H200: the MFU is reported
        assert 0 < chrono["mfu"] < 1, chrono


def test_nvml_reads_the_energy_per_image(resnet50_test_metrics):
    try:
        import pynvml
    except ImportError:
        pytest.skip("pynvml (nvidia-ml-py) is not installed: dlojz leaves the energy figures out")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        pytest.skip(f"NVML does not start here ({err}): dlojz leaves the energy figures out")
    from dlojz_lib.observers.chrono import nvml_handle_for

    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(nvml_handle_for(pynvml, torch.device("cuda", 0)))
    except pynvml.NVMLError as err:
        pytest.skip(f"this GPU has no energy counter ({err}): dlojz leaves the energy figures out")
    chrono = resnet50_test_metrics["chrono"]
    assert chrono.get("peak_power_w", 0) > 0, chrono
    # ResNet-50 training: a fraction of a joule per image on an A100/H100; 20 J would be a unit error (mJ).
    assert 0 < chrono.get("energy_per_image_j", 0) < 20, chrono


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("mode", [None, "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_runs_on_cuda(tmp_path, mode):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *CUDA,
        "--arch",
        "resnet18",
        "--synthetic",
        "--test",
        "--test-nsteps",
        "10",
        *(["--compile"] if mode is None else ["--compile-mode", mode]),
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path / "run",
        timeout=800,
    )
    assert proc.returncode == 0, show(proc)
    assert f"torch.compile: mode {mode or 'default'}" in proc.stdout, show(proc)
    m = read_json(metrics)
    assert m["steps"] == 10 and math.isfinite(m["train_loss"])
    # the compilation is in the time to the first step, not in the step statistics
    assert m["chrono"]["time_to_first_step_s"] > 5 * m["chrono"]["step_median_s"], m["chrono"]


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"])
def test_gradient_accumulation_compiles_on_cuda(tmp_path, mode):
    """Accumulated micro-batches under torch.compile (without CUDA graphs, which refuse --grad-acc)."""
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *CUDA, "--arch", "resnet18", "--synthetic", "--test", "--test-nsteps", "6", "--grad-acc", "2", "--amp",
        *(["--compile"] if mode is None else ["--compile-mode", mode]), "--metrics-json", metrics,
        "--output-dir", tmp_path / "run", timeout=800,
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["steps"] == 6 and math.isfinite(m["train_loss"])


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_refuse_gradient_accumulation_in_one_line(tmp_path, mode):
    proc = run_dlojz(*CUDA, "--synthetic", "--test", "--grad-acc", "2", "--compile-mode", mode)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, show(proc)
    assert "--grad-acc 2 accumulates" in proc.stderr


# ---------------------------------------------------------------- no host-device synchronisation per step
SYNC_FREE = [
    pytest.param(["--optimizer", "sgd", "--amp-dtype", "float16"], id="sgd-float16"),
    pytest.param(["--optimizer", "adamw", "--amp-dtype", "float16"], id="adamw-float16"),
    pytest.param(["--optimizer", "sgd", "--amp-dtype", "bfloat16"], id="sgd-bfloat16"),
    pytest.param(["--optimizer", "sgd", "--amp-dtype", "float16", "--model-ema"], id="sgd-float16-ema"),
    pytest.param(["--optimizer", "adamw", "--amp-dtype", "bfloat16", "--model-ema"], id="adamw-bfloat16-ema"),
    pytest.param(
        ["--optimizer", "sgd", "--amp-dtype", "float16", "--clip-grad-norm", "1.0", "--channels-last"],
        id="sgd-float16-clip-channels-last",
    ),
    pytest.param(
        ["--optimizer", "sgd", "--amp-dtype", "float16", "--channels-last", "--compile-mode", "reduce-overhead"],
        id="sgd-float16-cuda-graphs",
    ),
    pytest.param(["--optimizer", "sgd", "--amp-dtype", "bfloat16", "--blurpool"], id="sgd-bfloat16-blurpool"),
    pytest.param(["--optimizer", "sgd", "--amp-dtype", "float16", "--grad-acc", "3"], id="sgd-float16-grad-acc"),
    pytest.param(
        ["--optimizer", "lamb", "--amp-dtype", "float16"],
        id="lamb-float16",
        marks=pytest.mark.xfail(
            strict=False,
            raises=RuntimeError,
            reason="timm's LAMB has no fused step: the float16 GradScaler reads its overflow flag on the host at every "
            "optimizer step (dlojz says so at start-up; --amp-dtype bfloat16 or sgd/adamw avoid it)",
        ),
    ),
]


@pytest.mark.parametrize("flags", SYNC_FREE)
def test_training_steps_never_wait_for_the_gpu(flags, monkeypatch):
    """torch.cuda.set_sync_debug_mode("error") raises at any host-device synchronisation. A first epoch warms up
    (cuDNN autotuning, optimizer state, the scaler's first scale, EMA's first copy; its log points wait on purpose);
    the second, dlojz's train_one_epoch itself, runs in that mode from its start to its one deliberate wait, the
    log point of its last step (the others moved out of reach), which the test lets through."""
    if "bfloat16" in flags:
        skip_without_bfloat16()
    loop = synthetic_loop([*CUDA, "--arch", "resnet18", "--epochs", "2", "--amp", *flags], n_batches=9)
    steps = 9 // loop["training"].grad_acc
    result = epoch_without_waits(loop, monkeypatch)
    assert loop["state"].global_step == 2 * steps and math.isfinite(result.train_loss)
    if "--model-ema" in flags:
        assert loop["model"].ema.updates == 2 * steps


def epoch_without_waits(loop, monkeypatch):
    """A warm-up epoch, then a second one under torch.cuda.set_sync_debug_mode("error") up to the log point of its
    last step (the others moved out of reach), which is let through; returns the second epoch's EpochResult."""
    dlojz.train_one_epoch(**loop)
    state, n_batches = loop["state"], loop["loaders"].n_train_batches
    assert state.batch == n_batches
    state.epoch, state.batch = 1, 0  # as main() does between epochs
    monkeypatch.setattr(dlojz, "LOG_EVERY", 10**6)
    loop["progress"].line_every = 10**6
    log_points = []
    agree_on_stop = dlojz.agree_on_stop

    def log_point(*args):  # the ranks' agreement reads the device: the epoch's deliberate wait
        torch.cuda.set_sync_debug_mode(0)
        log_points.append(state.batch)
        return agree_on_stop(*args)

    monkeypatch.setattr(dlojz, "agree_on_stop", log_point)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):  # the mode is on: a host read fails
            torch.ones((), device="cuda").item()
        result = dlojz.train_one_epoch(**loop)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert log_points == [n_batches], "one wait, at the last step's log point"
    return result


def test_an_epoch_through_the_dataloader_and_prefetcher_never_waits_for_the_gpu(tmp_path, monkeypatch):
    """The same on images: DataLoader workers, pinned memory, the prefetcher's copy stream, normalisation on the GPU,
    MixUp, float16 with the GradScaler, BlurPool."""
    from test_host_sync import loop_on_data

    from dlojz_lib.data.embedded import make_embedded_dataset

    root = make_embedded_dataset(tmp_path / "d", n_classes=3, train_per_class=32, val_per_class=4, size=(48, 40))
    loop = loop_on_data(
        root, "--device", "cuda", "--epochs", "2", "--amp", "--amp-dtype", "float16", "--mixup-alpha", "0.2",
        "--blurpool", "-b", "8", "--pin-memory", "--non-blocking", "--drop-last",
    )  # fmt: skip
    assert type(loop["loaders"].train_batches).__name__ == "DevicePrefetcher"
    result = epoch_without_waits(loop, monkeypatch)
    assert loop["state"].global_step == 2 * loop["loaders"].n_train_batches and math.isfinite(result.train_loss)


@pytest.mark.parametrize("flags", [["--tta-flip"], ["--blurpool", "--channels-last"]])
def test_validation_batches_never_wait_for_the_gpu(flags):
    """evaluate() waits once, for its totals after the last batch."""
    cfg, loop = synthetic_run([*CUDA, "--arch", "resnet18", "--amp", *flags], n_batches=3)
    ranks = loop["ranks"]
    loaders = synthetic_loaders(cfg, SYNTHETIC_CLASSES, ranks, 32, 4 * cfg.val_batch_size)
    dlojz.evaluate(loop["model"].module, loaders, loop["training"], ranks, tta_flip=cfg.tta_flip)  # warm-up
    totals = []
    plain_cpu = torch.Tensor.cpu

    def read_totals(tensor, *args, **kwargs):  # the one deliberate wait: the totals and confusion counts, copied
        if tensor.is_cuda:
            torch.cuda.set_sync_debug_mode(0)
            totals.append(tensor.shape)
        return plain_cpu(tensor, *args, **kwargs)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.Tensor.cpu = read_totals
        result = dlojz.evaluate(loop["model"].module, loaders, loop["training"], ranks, tta_flip=cfg.tta_flip)
    finally:
        torch.Tensor.cpu = plain_cpu
        torch.cuda.set_sync_debug_mode(0)
    # 4 totals, then the confusion counts of the model's 1000 outputs
    assert totals == [torch.Size([4 + SYNTHETIC_CLASSES**2])] and result["val_images"] == 4 * cfg.val_batch_size


# ---------------------------------------------------------------- fused steps after an overflow
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_fused_step_skips_overflowed_steps_on_cuda(name, monkeypatch):
    """The fused step (on the GPU, the scaler's inf flag read by the kernel) ends with the weights of the unfused
    one when the first step overflows, even when the GPU memory it allocates holds garbage (NaN-filled here)."""
    from test_optim import GOOD_LR, grad_scaler_steps, tiny_classifier

    results = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = tiny_classifier().cuda()
        optimizer = dlojz_lib.optim.optimizers.build_optimizer(
            name, model.parameters(), GOOD_LR[name], 0.9, 1e-4, fused=fused
        )
        assert bool(optimizer.defaults.get("fused")) is fused
        empty_like = torch.empty_like
        monkeypatch.setattr(torch, "empty_like", lambda t, **kw: empty_like(t, **kw).fill_(float("nan")))
        results[fused] = grad_scaler_steps(optimizer, model, overflow_at=(0, 2), device="cuda")
        monkeypatch.undo()
    atol = 1e-5 if name == "sgd" else 0.3 * GOOD_LR[name]  # Adam's normalised step amplifies rounding near 0
    for unfused, fused in zip(results[False], results[True]):
        assert torch.isfinite(fused).all()
        torch.testing.assert_close(fused, unfused, rtol=0, atol=atol)


# ---------------------------------------------------------------- two GPUs and more
TINY = [
    "--device",
    "cuda",
    "--arch",
    "resnet18",
    "--image-size",
    "32",
    "--val-resize-size",
    "36",
    "--val-crop-size",
    "32",
    "--num-workers",
    "1",
    "--no-wandb",
]


@two_gpus
@pytest.mark.multirank
def test_nccl_validation_on_two_gpus_equals_one(tmp_path, tiny_data):
    """A checkpoint trained on one GPU, validated with --eval-only on 1 and on 2 GPUs (NCCL): 15 images, 8 + 7 on
    two ranks, every image counted once. float32 (no AMP, no TF32): the logits differ by rounding at most."""
    train = tmp_path / "train"
    proc = run_dlojz(*TINY, "--data-root", tiny_data, "-b", "8", "--epochs", "1", "--output-dir", train)
    assert proc.returncode == 0, show(proc)
    assert (train / "latest").is_file()
    results = []
    for launcher in (None, TORCHRUN2):
        metrics = tmp_path / f"eval{len(results)}.json"
        proc = run_dlojz(
            *TINY,
            "--data-root",
            tiny_data,
            "--val-batch-size",
            "4",
            "--no-amp",
            "--no-tf32",
            "--eval-only",
            "--resume",
            "auto",
            "--output-dir",
            train,
            "--metrics-json",
            metrics,
            launcher=launcher,
        )
        assert proc.returncode == 0, show(proc)
        results.append(read_json(metrics))
    one, two = results
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["val_images"] == two["val_images"] == 15
    assert one["val_accuracy"] == two["val_accuracy"] and one["val_top5_accuracy"] == two["val_top5_accuracy"]
    assert one["val_loss"] == pytest.approx(two["val_loss"], rel=1e-4)


@two_gpus
@pytest.mark.multirank
def test_sync_bn_test_run_on_two_gpus_reports(tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *CUDA,
        "--arch",
        "resnet18",
        "--synthetic",
        "--test",
        "--test-nsteps",
        "10",
        "--sync-bn",
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path / "run",
        launcher=TORCHRUN2,
    )
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["world_size"] == 2 and m["global_batch_size"] == 64 and m["steps"] == 10
    assert m["chrono"]["steps"] == 10 and math.isfinite(m["train_loss"])
    assert "SyncBatchNorm waits for the GPU once per BatchNorm layer" in proc.stdout, show(proc)


@two_gpus
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.multirank
def test_an_lr_sweep_on_two_gpus_ends_on_both_at_once(tmp_path, dtype):
    """Pushed to lr 10, one rank's float16 loss turns non-finite before the other's: both stop at the same step
    (the averaged loss), the job ends in seconds, not at --dist-timeout."""
    if dtype == "bfloat16":
        skip_without_bfloat16()
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *CUDA, "--arch", "resnet18", "--synthetic", "--epochs", "2", "--findlr", "--lr", "10", "--amp",
        "--amp-dtype", dtype, "--dist-timeout", "120", "--metrics-json", metrics, "--output-dir", tmp_path / "run",
        launcher=TORCHRUN2, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    assert read_json(metrics)["findlr_suggested_lr"] > 0
    assert (tmp_path / "run" / "findlr.csv").exists()


@two_gpus
@pytest.mark.multirank
def test_tensor_parallel_copies_stay_equal_on_two_gpus(tmp_path):
    """--tp 2 on two GPUs (NCCL, cuDNN autotuning, float16 autocast gathers): the copies of the weights the group
    holds whole are compared at every step (--check-replicas 1) and stay equal: their gradients are averaged."""
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *CUDA, "--arch", "timm:test_vit", "--image-size", "32", "--synthetic", "--test", "--test-nsteps", "10",
        "--fsdp", "--tp", "2", "--check-replicas", "1", "--amp", "--amp-dtype", "bfloat16", "--metrics-json", metrics,
        "--output-dir", tmp_path / "run", launcher=TORCHRUN2, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    assert "their copies compared every 1 steps" in proc.stdout and "hold different copies" not in proc.stdout
    assert read_json(metrics)["steps"] == 10


@two_gpus
@pytest.mark.multirank
def test_gradient_accumulation_under_ddp_on_two_gpus(tmp_path):
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *CUDA, "--arch", "resnet18", "--synthetic", "--test", "--test-nsteps", "6", "--grad-acc", "2", "--amp",
        "--compile-mode", "max-autotune-no-cudagraphs", "--metrics-json", metrics, "--output-dir", tmp_path / "run",
        launcher=TORCHRUN2, timeout=800,
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["world_size"] == 2 and m["steps"] == 6 and math.isfinite(m["train_loss"])


@two_gpus
def test_nvml_reads_the_gpu_cuda_visible_devices_names(tmp_path):
    """NVML numbers every GPU of the node; torch only those CUDA_VISIBLE_DEVICES shows: cuda:0 of a task bound to
    the node's last GPU is that GPU for NVML too (its UUID)."""
    pytest.importorskip("pynvml", reason="pynvml (nvidia-ml-py) is not installed")
    import subprocess
    import sys

    from conftest import ROOT, clean_env

    last = torch.cuda.device_count() - 1
    code = (
        "import pynvml, torch; from dlojz_lib.observers.chrono import nvml_handle_for; pynvml.nvmlInit(); "
        "uuid = pynvml.nvmlDeviceGetUUID(nvml_handle_for(pynvml, torch.device('cuda', 0))); "
        "print(uuid.decode() if isinstance(uuid, bytes) else uuid)"
    )
    seen = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(CUDA_VISIBLE_DEVICES=str(last)), cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert seen.returncode == 0, seen.stderr[-2000:]
    assert seen.stdout.strip() == f"GPU-{torch.cuda.get_device_properties(last).uuid}"


# ---------------------------------------------------------------- --data-backend dali on the GPU
def test_dali_decodes_on_the_gpu_into_the_loop(tmp_path):
    pytest.importorskip("nvidia.dali", reason="DALI is not installed on this node (pip install nvidia-dali-cuda130)")
    from dlojz_lib.data.embedded import make_embedded_dataset

    data = make_embedded_dataset(tmp_path / "data", n_classes=3, train_per_class=40, val_per_class=7, size=(96, 80))
    proc = run_dlojz(
        *CUDA,
        "--data-root",
        data,
        "--data-backend",
        "dali",
        "--channels-last",
        "--epochs",
        "2",
        "--metrics-json",
        tmp_path / "m.json",
        "--output-dir",
        tmp_path / "run",
    )
    assert proc.returncode == 0, show(proc)
    assert "DALI: decoding on the GPU (" in proc.stdout and "DALI training pipeline: " in proc.stdout, show(proc)
    metrics = read_json(tmp_path / "m.json")
    assert metrics["val_images"] == 21 and metrics["steps"] == 2 * 4, metrics  # 120 images, -b 32: 4 steps


def test_dali_batches_are_on_the_gpu_in_channels_last(tmp_path):
    """float16 channels-last batches made by DALI on the current stream: shared, not copied, and no host wait (the
    pipeline's run returns before a long kernel queued on that stream ends)."""
    pytest.importorskip("nvidia.dali", reason="DALI is not installed on this node (pip install nvidia-dali-cuda130)")
    from dlojz_lib.data.dali import DaliBatches, DaliSettings, train_pipeline
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.embedded import make_embedded_dataset
    from dlojz_lib.data.samplers import EpochSampler

    data = make_embedded_dataset(tmp_path / "data", n_classes=3, train_per_class=16, val_per_class=2, size=(96, 80))
    train, _, _, _ = build_datasets(data, None, None)
    device = torch.device("cuda", 0)
    batches = DaliBatches(
        train,
        EpochSampler(train, 1, 0),
        16,
        lambda s: train_pipeline(s, 16, 64, 0, DaliSettings(2, half=True, pad_channels=True), 1),
        device,
    )
    iterator = iter(batches)
    images, labels = next(iterator)
    assert images.device == labels.device == device and images.dtype == torch.float16
    assert images.shape == (16, 4, 64, 64) and images.is_contiguous(memory_format=torch.channels_last)
    assert images[:, 3].abs().max().item() == 0
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued on the current stream
    started = time.perf_counter()
    next(iterator)
    assert time.perf_counter() - started < 0.5  # the batch is ordered after the sleep, not waited for
    torch.cuda.synchronize()


def test_dali_batches_dropped_while_a_kernel_reads_them_keep_their_pixels(tmp_path):
    """Each batch is read by a kernel queued behind ~0.2 s of GPU sleep, and the loop drops its reference at once
    (as a training loop does) and asks for the next: the sums the kernels compute equal those of the same batches
    waited for one by one (the same seed: the same crops). Without the lifetime guard DALI may reuse a dropped
    batch's buffer before the kernel has read it."""
    pytest.importorskip("nvidia.dali", reason="DALI is not installed on this node (pip install nvidia-dali-cuda130)")
    from dlojz_lib.data.dali import DaliBatches, DaliSettings, train_pipeline
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.embedded import make_embedded_dataset
    from dlojz_lib.data.samplers import EpochSampler

    data = make_embedded_dataset(tmp_path / "data", n_classes=4, train_per_class=32, val_per_class=2, size=(96, 80))
    train, _, _, _ = build_datasets(data, None, None)
    device = torch.device("cuda", 0)

    def sums(wait):
        batches = DaliBatches(
            train,
            EpochSampler(train, 1, 0),
            16,
            lambda s: train_pipeline(s, 16, 64, 0, DaliSettings(2, prefetch=2), 7),
            device,
        )
        found = []
        for images, _ in batches:
            if not wait:
                torch.cuda._sleep(400_000_000)  # the reading kernel waits behind it, the host does not
            found.append(images.float().sum((1, 2, 3)))
            del images  # the loop's reference gone at once
            if wait:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return torch.stack(found).cpu(), batches

    waited, _ = sums(wait=True)
    racing, batches = sums(wait=False)
    assert waited.shape == (8, 16)
    torch.testing.assert_close(racing, waited, rtol=0, atol=0)
    assert batches.lifetimes is not None and len(batches.lifetimes.held) <= 8


# ---------------------------------------------------------------- --fsdp on the GPU
VIT = ["--arch", "timm:test_vit", "--optimizer", "adamw", "--lr", "0.002"]


def fsdp_epoch_seen():
    from torch.distributed.tensor import DTensor

    loop = loop_for(*VIT, "--fsdp")
    seen = []
    qkv = loop["model"].module.blocks[0].attn.qkv
    qkv.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, out.dtype)))
    result = dlojz.train_one_epoch(**loop)
    return (
        sorted(set(seen), key=str),
        isinstance(qkv.weight, DTensor),
        qkv.weight.dtype,
        qkv.weight.is_cuda,
        result.train_loss,
        loop["training"].scaler.is_enabled(),
    )


def test_fsdp_gathers_bfloat16_parameters_and_keeps_float32_shards_on_cuda():
    """One GPU (a group of one rank, NCCL, in a spawned interpreter: no process group may live in pytest's, which
    forks later): the blocks compute with bfloat16 copies of their parameters; the shards the optimizer updates
    stay float32 on the GPU; no GradScaler."""
    skip_without_bfloat16()
    from test_fsdp import in_fresh_process

    seen, sharded, dtype, on_gpu, loss, scaler = in_fresh_process(fsdp_epoch_seen)
    assert seen == [(torch.bfloat16, torch.bfloat16)], seen
    assert sharded and dtype == torch.float32 and on_gpu
    assert math.isfinite(loss) and not scaler


def test_fsdp_checkpoints_and_resumes_on_cuda(tmp_path, tiny_data):
    skip_without_bfloat16()
    flags = [*CUDA, *VIT, "--data-root", tiny_data, "--fsdp", "-b", "8", "--output-dir", tmp_path / "run"]
    proc = run_dlojz(*flags, "--epochs", "1")
    assert proc.returncode == 0, show(proc)
    proc = run_dlojz(*flags, "--epochs", "2", "--resume", "auto", "--metrics-json", tmp_path / "m.json")
    assert proc.returncode == 0, show(proc)
    assert "resumed from" in proc.stdout and ".dcp" in proc.stdout, show(proc)
    metrics = read_json(tmp_path / "m.json")
    assert metrics["parallel"] == "fsdp" and metrics["compute_dtype"] == "bfloat16" and metrics["steps"] == 2 * 9
    assert (tmp_path / "run" / "ckpt_e0002_s000000018.dcp").is_dir()


def test_fsdp_compiles_on_cuda(tmp_path):
    skip_without_bfloat16()
    proc = run_dlojz(
        *CUDA,
        *VIT,
        "--synthetic",
        "--test",
        "--test-nsteps",
        "10",
        "--fsdp",
        "--compile",
        "--metrics-json",
        tmp_path / "m.json",
        "--output-dir",
        tmp_path / "run",
        timeout=800,
    )
    assert proc.returncode == 0, show(proc)
    m = read_json(tmp_path / "m.json")
    assert m["steps"] == 10 and math.isfinite(m["train_loss"]) and m["parallel"] == "fsdp"


@two_gpus
@pytest.mark.multirank
def test_fsdp_on_two_gpus_trains_to_the_weights_of_ddp(tmp_path, tiny_data):
    """NCCL: FSDP's reduce-scatter and DDP's all-reduce give the same weights (float32: --no-amp --no-tf32)."""
    out = {}
    for name, flags in (("ddp", []), ("fsdp", ["--fsdp"])):
        out[name] = tmp_path / name
        proc = run_dlojz(
            *TINY,
            *VIT,
            "--data-root",
            tiny_data,
            "-b",
            "8",
            "--epochs",
            "1",
            "--no-amp",
            "--no-tf32",
            "--output-dir",
            out[name],
            *flags,
            launcher=TORCHRUN2,
        )
        assert proc.returncode == 0, show(proc)
    import dlojz_lib.checkpoint as ckpt
    from dlojz_fsdp import consolidate

    sharded = ckpt.load_latest(out["fsdp"])[1]
    fsdp = torch.load(consolidate(sharded, tmp_path / "fsdp.pt"), weights_only=True)["model"]
    ddp = ckpt.load_latest(out["ddp"])[0]["model"]
    for key in ddp:
        assert torch.allclose(fsdp[key].float(), ddp[key].float().cpu(), atol=1e-5), key
