"""The GPU start-up checks, reached on the CPU with a faked CUDA: which GPU a rank takes, a torch without kernels
for the GPU, a driver too old for the wheel's CUDA, emulated bfloat16; FLOPs and activation bytes of a SyncBN model."""

import sys
import types

import pytest
import torch
import torchvision
from conftest import spawn_ranks

import dlojz_lib.settings.config
from dlojz_lib.checks import UserError
from dlojz_lib.model.zoo import saved_activation_bytes, train_flops_per_image
from dlojz_lib.settings.config import check_autocast, local_device


@pytest.fixture
def fake_cuda(monkeypatch):
    """A node whose task sees `count` GPUs of compute capability `capability`, torch built for `archs`."""

    def make(count=1, capability=(9, 0), archs=("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(archs))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla V100-SXM2-32GB")

    return make


@pytest.mark.parametrize("visible, local_rank, expected", [(4, 3, "cuda:3"), (1, 3, "cuda:0"), (2, 3, "cuda:1")])
def test_each_rank_takes_a_gpu_it_sees(fake_cuda, visible, local_rank, expected):
    # 4 visible: the node's GPUs, one per local rank; 1 visible: Slurm bound one GPU to each task (--gpus-per-task)
    fake_cuda(count=visible)
    assert local_device("auto", local_rank) == expected


def test_a_gpu_the_wheel_has_no_kernels_for_is_one_line(fake_cuda):
    fake_cuda(capability=(7, 0))  # V100 with the CUDA 13 wheel (sm_75 and newer)
    with pytest.raises(UserError) as err:
        local_device("cuda", 0)
    message = str(err.value)
    assert "no kernels for Tesla V100-SXM2-32GB (sm_70" in message and "cu126" in message and "module load" in message


def test_ptx_for_an_older_arch_runs_on_a_newer_gpu(fake_cuda):
    fake_cuda(capability=(10, 3), archs=("sm_80", "compute_90"))
    assert local_device("cuda", 0) == "cuda:0"


WHEEL = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")  # torch 2.14.1's CUDA 13 wheel


@pytest.mark.parametrize(
    "capability, archs, runs",
    [
        ((7, 0), WHEEL, False),  # V100
        ((7, 5), WHEEL, True),  # T4
        ((8, 0), WHEEL, True),  # A100
        ((8, 6), WHEEL, True),  # A40
        ((8, 9), WHEEL, True),  # L4, L40S: sm_86's kernels
        ((9, 0), WHEEL, True),  # H100
        ((10, 0), WHEEL, True),  # B200
        ((10, 3), WHEEL, True),  # B300: sm_100's kernels
        ((12, 0), WHEEL, True),  # RTX PRO 6000
        ((12, 1), WHEEL, True),  # DGX Spark: sm_120's kernels
        ((9, 0), ("sm_80", "sm_90a"), True),  # a site build with arch-specific kernels
        ((10, 0), ("sm_90a", "sm_100a"), True),
        ((10, 3), ("sm_90a", "sm_100a"), False),  # sm_100a runs on 10.0 only
        ((10, 3), ("sm_90", "sm_100f"), True),  # a family build: 10.x from 10.0 on
        ((12, 1), ("sm_120f",), True),
        ((9, 0), ("sm_86",), False),  # cubins do not cross a major version
        ((9, 0), ("compute_80",), True),  # PTX-only: compiled at load time for newer GPUs
        ((8, 0), ("compute_90",), False),
        ((9, 0), ("sm_80", "weird_arch"), False),  # an unreadable name is no kernel
        ((9, 0), ("weird_arch",), True),  # nothing readable: torch's own check decides
    ],
)
def test_which_gpus_the_kernels_run_on(fake_cuda, capability, archs, runs):
    fake_cuda(capability=capability, archs=archs)
    if runs:
        assert local_device("cuda", 0) == "cuda:0"
    else:
        with pytest.raises(UserError, match=rf"no kernels for .* \(sm_{capability[0]}{capability[1]}; built for"):
            local_device("cuda", 0)


def test_a_driver_too_old_for_the_wheel_is_named(monkeypatch):
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlSystemGetCudaDriverVersion=lambda: 12040, nvmlSystemGetDriverVersion=lambda: "550.54"
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as err:
        local_device("cuda", 0)
    assert "driver 550.54 supports CUDA up to 12.4, this torch needs CUDA 13.0" in str(err.value)
    monkeypatch.setattr(nvml, "nvmlSystemGetCudaDriverVersion", lambda: 13000)
    assert dlojz_lib.settings.config.driver_too_old() is None


def test_emulated_bfloat16_is_refused(monkeypatch):
    calls = []

    def is_bf16_supported(including_emulation=True):
        calls.append(including_emulation)
        return including_emulation  # a V100: only by emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla V100-SXM2-32GB")
    with pytest.raises(UserError, match=r"^--amp-dtype bfloat16: Tesla V100-SXM2-32GB has no bfloat16 support"):
        check_autocast(torch.device("cuda", 0), torch.bfloat16)
    assert calls == [False]


def syncbn_report_figures(rank, world_size, store, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(torchvision.models.resnet18(num_classes=10))
        figures = (
            train_flops_per_image(synced, 32),
            saved_activation_bytes(synced, 32, False, False, "resnet18"),
            any(isinstance(m, torch.nn.SyncBatchNorm) for m in synced.modules()),
        )
        results.put((rank, figures))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_flops_and_activation_bytes_of_a_syncbn_model_in_a_process_group(tmp_path):
    """--test --sync-bn on 2 ranks: the report's FLOP count and activation estimate run with the process group up
    (a SyncBatchNorm in training mode would reach for the other rank, and refuse CPU/meta tensors)."""
    results = dict(spawn_ranks(syncbn_report_figures, 2, tmp_path))
    plain = torchvision.models.resnet18(num_classes=10)
    expected = (train_flops_per_image(plain, 32), saved_activation_bytes(plain, 32, False, False, "resnet18"), True)
    assert results[0] == results[1] == expected  # and the model itself keeps its SyncBatchNorm layers


@pytest.mark.parametrize(
    "dtype, channels_last, backend",
    [
        (torch.float16, True, "Cudnn"),
        (torch.float16, False, "Cudnn"),
        (torch.float32, True, "Cudnn"),
        (torch.bfloat16, True, "Native"),
        (torch.bfloat16, False, "Native"),
    ],
)
def test_batch_norm_gives_float16_to_cudnn_and_bfloat16_to_torch_s_own_kernels(dtype, channels_last, backend):
    """The rule dlojz's dtype advice rests on, asked of this torch on fake CUDA tensors (no GPU): a batch norm's
    input as autocast leaves it (the convolution's dtype; weights and statistics float32). A torch that changes the
    rule fails here: then float16's default, the ablation's rows and dlojz_lib.model.zoo's warning are to be revisited."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, 64, 14, 14, device="cuda", dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        weight, bias, mean, var = (torch.empty(64, device="cuda") for _ in range(4))
        chosen = torch._C._select_batch_norm_backend(x, weight, bias, mean, var, True, 1e-5)
    assert chosen.name == backend


def test_a_batch_norm_model_in_eager_bfloat16_on_a_gpu_is_warned_of_the_cost():
    from dlojz_lib.model.zoo import batch_norm_on_native_kernels

    resnet, vit = torchvision.models.resnet18(), torchvision.models.vit_b_16(image_size=32, num_classes=3)
    assert batch_norm_on_native_kernels(resnet, "cuda", "bfloat16", compiled=False)
    assert not batch_norm_on_native_kernels(resnet, "cuda", "bfloat16", compiled=True)  # Inductor's own batch norm
    assert not batch_norm_on_native_kernels(resnet, "cuda", "float16", compiled=False)
    assert not batch_norm_on_native_kernels(resnet, "cpu", "bfloat16", compiled=False)
    assert not batch_norm_on_native_kernels(vit, "cuda", "bfloat16", compiled=False)  # LayerNorm only
