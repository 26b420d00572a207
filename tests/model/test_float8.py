"""--float8 (dlojz_lib/model/float8.py): which linears it converts (a family's blocks', sizes multiples of 16 and
above torchao's thresholds, never the stem or the head), and where it is refused in one line (the CPU, a GPU below
compute capability 8.9, torchao missing). torchao is not installed here: its conversion and emulation are not run
by the suite (docs/fsdp.md says so)."""

import pytest
import torch

from dlojz_lib.checks import UserError
from dlojz_lib.model.families import family_of
from dlojz_lib.model.float8 import float8_linears
from dlojz_lib.model.zoo import create_model


def meta_model(arch):
    with torch.device("meta"):
        return create_model(arch, 1000, False, 224)


@pytest.mark.parametrize(
    "arch, recipe, converted",
    [
        # ViT-B/16 (768 wide, MLP 3072): under tensorwise scaling its fc2 (3072 -> 768) alone is large enough
        ("timm:vit_base_patch16_224", "tensorwise", {"mlp.fc2"}),
        ("timm:vit_base_patch16_224", "rowwise", set()),
        # ViT-H/14 (1280 wide, MLP 5120): every projection of a block under tensorwise, fc2 alone under rowwise
        ("timm:vit_huge_patch14_224", "tensorwise", {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}),
        ("timm:vit_huge_patch14_224", "rowwise", {"mlp.fc2"}),
        ("resnet50", "tensorwise", set()),  # a ResNet's blocks have no linear; its fc, the head, stays
    ],
)
def test_float8_converts_the_blocks_linears_large_enough_to_pay(arch, recipe, converted):
    model = meta_model(arch)
    family = family_of(model)
    chosen = float8_linears(model, family, recipe)
    blocks = len(family.blocks(model))
    assert {path.split(".", 2)[2] for path in chosen} == converted, chosen
    assert len(chosen) == blocks * len(converted)  # every block alike
    assert not any(path.startswith(("head", "fc", "patch_embed")) for path in chosen)


def test_float8_linears_of_a_model_of_no_family_are_none():
    assert float8_linears(torch.nn.Linear(4096, 4096), None, "tensorwise") == []


def test_float8_is_refused_where_it_cannot_run(monkeypatch):
    """On a GPU below compute capability 8.9 (an A100: 8.0) and without torchao, one line each, before any work."""
    import importlib.util

    from dlojz_lib.settings.config import check_float8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"A100-SXM4-80GB \(compute capability 8.0\) has no float8 matrix products"):
        check_float8("tensorwise", "cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None)
    with pytest.raises(UserError, match="float8 training is torchao's, which is not installed here"):
        check_float8("rowwise", "cuda:0")


def test_fsdp_s_float8_scales_run_after_each_step_under_tensorwise_scaling_only():
    """Under --fsdp with tensorwise scaling FSDP gathers float8 weights: the run's model calls torchao's scale
    computation after each optimizer step (Model.after_step); rowwise, or without --fsdp, nothing."""
    from dlojz_lib.parallelism.layout import float8_scales

    module = torch.nn.Linear(2, 2)
    assert float8_scales(None, True, module) is None and float8_scales("rowwise", True, module) is None
    assert float8_scales("tensorwise", False, module) is None
    after_step = float8_scales("tensorwise", True, module)
    assert after_step.func.__name__ == "scales_for_fsdp" and after_step.args == (module,)
