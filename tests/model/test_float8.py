"""--float8 (dlojz_lib/model/float8.py): which linears it converts (a family's blocks', sizes multiples of 16 and
above torchao's thresholds, held to torchao's own filter; never the stem or the head), their conversion by torchao
(installed with the project), a run that trains in float8 on the CPU (a check of the numerics: near bfloat16's loss,
not equal to it), a micro-batch whose rows torchao pads, checkpoints of plain weights, and where it is refused in
one line (a GPU below compute capability 8.9, torchao missing). The FSDP float8 all-gather over 2 ranks:
tests/parallelism/test_fsdp.py."""

import pytest
import timm
import torch
from in_process import synthetic_run

import dlojz
from dlojz_lib.checks import UserError
from dlojz_lib.model.families import family_of
from dlojz_lib.model.float8 import RECIPES, float8_linears, too_small
from dlojz_lib.model.zoo import create_model

# The smallest published timm ViT with block linears tensorwise float8 converts (14 of them, 22 M parameters): the
# runs in other processes, which cannot see a model registered here, at a quarter of ViT-B/16's checkpoint bytes
SMALL_VIT = "timm:vit_little_patch16_reg1_gap_256"
WIDE_VIT = "timm:dlojz_wide_vit"  # (registered below: a ViT whose block linears float8 converts, small enough here)
MLP_VIT = "timm:dlojz_mlp_vit"  # (registered below: a narrow ViT whose fc1 alone float8 converts, under tensorwise)


def two_block_vit(kwargs, width, heads, mlp_ratio):
    """timm's VisionTransformer of 2 blocks, 16-px patches, with create_model's `kwargs` (less timm's own, for
    published weights)."""
    from timm.models.vision_transformer import VisionTransformer

    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    return VisionTransformer(patch_size=16, embed_dim=width, depth=2, num_heads=heads, mlp_ratio=mlp_ratio, **kwargs)


@timm.models.register_model
def dlojz_wide_vit(pretrained=False, **kwargs):
    """Two blocks 1088 wide with a 4352-wide MLP: under tensorwise every block linear is above torchao's sizes,
    under rowwise fc1 alone (its qkv, proj and fc2 are below them)."""
    return two_block_vit(kwargs, 1088, 8, 4.0)


@timm.models.register_model
def dlojz_mlp_vit(pretrained=False, **kwargs):
    """Two blocks 64 wide with a 1040-wide MLP: under tensorwise each fc1 (1040 outputs, over torchao's 1024) is
    converted and no other linear is; 50 times fewer weights than dlojz_wide_vit, for the runs on several ranks."""
    return two_block_vit(kwargs, 64, 2, 1040 / 64)


def meta_model(arch, image_size=224):
    with torch.device("meta"):
        return create_model(arch, 1000, False, image_size)


def test_the_recipes_and_sizes_are_torchao_s():
    """The recipes --float8 offers are torchao's, and the linears float8_linears converts (too_small) are those
    torchao's auto filter converts, over a grid of sizes either side of its thresholds."""
    from torchao.float8 import Float8LinearRecipeName
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    from dlojz_lib.settings.flags import get_args_parser

    assert set(RECIPES) == {recipe.value for recipe in Float8LinearRecipeName}
    choices = next(a.choices for a in get_args_parser()._actions if "--float8" in a.option_strings)
    assert tuple(choices) == RECIPES
    sizes = (512, 1024, 1040, 2048, 2064, 4096, 4112, 8192)
    for recipe in ("tensorwise", "rowwise"):
        keeps = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for out_features in sizes:
            for in_features in sizes:
                layer = torch.nn.Linear(in_features, out_features, device="meta")
                assert keeps(layer, "blocks.0.x") is not too_small(recipe, out_features, in_features), (
                    recipe,
                    out_features,
                    in_features,
                )


def test_the_pinned_torchao_is_the_one_the_refusal_names():
    from pathlib import Path

    from dlojz_lib.settings.config import TORCHAO_VERSION

    requirements = (Path(__file__).resolve().parents[2] / "requirements.txt").read_text()
    assert f"torchao=={TORCHAO_VERSION}\n" in requirements


@pytest.mark.parametrize(
    "arch, recipe, converted",
    [
        # ViT-B/16 (768 wide, MLP 3072): under tensorwise its qkv (768 -> 2304) and fc1 (768 -> 3072)
        ("timm:vit_base_patch16_224", "tensorwise", {"attn.qkv", "mlp.fc1"}),
        ("timm:vit_base_patch16_224", "rowwise", set()),
        # ViT-H/14 (1280 wide, MLP 5120): every projection of a block under tensorwise, fc1 alone under rowwise
        ("timm:vit_huge_patch14_224", "tensorwise", {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}),
        ("timm:vit_huge_patch14_224", "rowwise", {"mlp.fc1"}),
        ("timm:vit_huge_patch14_224", "rowwise_with_gw_hp", {"mlp.fc1"}),
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


def test_the_converted_linears_are_torchao_s_float8_linears_and_no_other():
    """ViT-H/14 under tensorwise (on the meta device): each linear float8_linears lists is torchao's Float8Linear,
    every other linear (the head) torch's own."""
    from torchao.float8.float8_linear import Float8Linear

    from dlojz_lib.model.float8 import convert

    model = meta_model("timm:vit_huge_patch14_224")
    chosen = float8_linears(model, family_of(model), "tensorwise")
    convert(model, chosen, "tensorwise", fsdp=False)
    linears = {path: type(m) for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {path for path, kind in linears.items() if kind is Float8Linear} == set(chosen)
    assert {kind for path, kind in linears.items() if path not in chosen} == {torch.nn.Linear}


def test_float8_linears_of_a_model_of_no_family_are_none():
    assert float8_linears(torch.nn.Linear(4096, 4096), None, "tensorwise") == []


def test_a_model_whose_linears_are_all_too_small_says_none_is_converted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    synthetic_run(["--device", "cpu", "--arch", "timm:test_vit", "--image-size", "32", "--float8", "tensorwise"], 2)
    assert "--float8 tensorwise: no linear converted: none of timm:test_vit's block linears" in capsys.readouterr().out


def losses(tmp_path, monkeypatch, *flags, steps=3):
    """The training loss of each of `steps` SGD steps of the wide ViT on the same synthetic batches, with `flags`
    (--amp: in bfloat16 autocast); and the run's model."""
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    argv = [
        "--device",
        "cpu",
        "--arch",
        WIDE_VIT,
        "--image-size",
        "32",
        "-b",
        "4",
        "--lr",
        "0.05",
        "-e",
        str(steps),
        *flags,
    ]
    _, loop = synthetic_run(argv, n_batches=1)
    found = []
    for epoch in range(steps):
        loop["state"].epoch, loop["state"].batch = epoch, 0
        found.append(dlojz.train_one_epoch(**loop).train_loss)
    return found, loop["model"].module


@pytest.mark.parametrize(
    "recipe, converted, precision",
    [("tensorwise", 8, "--amp"), ("rowwise", 2, "--amp"), ("rowwise_with_gw_hp", 2, "--no-amp")],
)
def test_float8_trains_near_bfloat16_and_not_as_bfloat16(recipe, converted, precision, tmp_path, monkeypatch, capsys):
    """3 steps of the wide ViT on the CPU with --float8 RECIPE: its linears are torchao's, the start-up lines say
    which and that float8 on a CPU checks the numerics, and each step's loss is within 2 % of the run's without
    float8 (bfloat16 autocast; float32 for rowwise_with_gw_hp, which autocast cannot take) on the same batches from
    the same weights, but not equal to it (float8's products really ran)."""
    from torchao.float8.float8_linear import Float8Linear

    from dlojz_lib.torch_internals import cpu_float8_takes_row_scales

    # (torch 2.11): refused in one line, before any work
    if recipe != "tensorwise" and not cpu_float8_takes_row_scales():
        tmp_path.joinpath("refused").mkdir()
        monkeypatch.chdir(tmp_path / "refused")
        with pytest.raises(UserError, match=rf"--float8 {recipe} on the CPU: this torch .* has no CPU float8"):
            synthetic_run(["--device", "cpu", "--arch", WIDE_VIT, "--image-size", "32", "--float8", recipe], 1)
        return
    plain, _ = losses(tmp_path / "plain", monkeypatch, precision)
    capsys.readouterr()
    in_float8, module = losses(tmp_path / "f8", monkeypatch, precision, "--float8", recipe)
    said = capsys.readouterr().out
    assert f"--float8 {recipe}: {converted} linears in float8" in said, said
    assert "on the CPU float8 checks the numerics" in said
    assert "rows a micro-batch, not a multiple of 16: torchao pads" in said or recipe == "rowwise_with_gw_hp", said
    assert sum(isinstance(m, Float8Linear) for m in module.modules()) == converted
    assert in_float8 != plain, (in_float8, plain)
    for mine, theirs in zip(in_float8, plain):
        assert abs(mine - theirs) <= 0.02 * abs(theirs), (in_float8, plain)


def test_float8_compiled_trains_as_eager_float8(tmp_path, monkeypatch, capsys):
    """--float8 tensorwise with --compile: torch.compile traces torchao's float8 casts and products, and 2 steps'
    losses are eager float8's within 0.1 % (inductor fuses the casts: last bits differ); the loss of the first
    step, before any update, to 1e-5."""
    if torch.torch_version.TorchVersion(torch.__version__) < "2.14":  # refused on the CPU, before any work
        tmp_path.joinpath("refused").mkdir()
        monkeypatch.chdir(tmp_path / "refused")
        with pytest.raises(UserError, match="--float8 tensorwise --compile on the CPU: this torch"):
            synthetic_run(["--device", "cpu", "--arch", WIDE_VIT, "--float8", "tensorwise", "--compile"], 1)
        return
    eager, _ = losses(tmp_path / "eager", monkeypatch, "--no-amp", "--float8", "tensorwise", steps=2)
    compiled, module = losses(
        tmp_path / "compiled", monkeypatch, "--no-amp", "--float8", "tensorwise", "--compile", steps=2
    )
    assert "torch.compile: mode default" in capsys.readouterr().out
    assert abs(compiled[0] - eager[0]) <= 1e-5 * abs(eager[0]), (compiled, eager)
    assert abs(compiled[1] - eager[1]) <= 1e-3 * abs(eager[1]), (compiled, eager)


def test_a_float8_run_s_checkpoint_holds_plain_weights_that_load_without_float8(tiny_data, tmp_path, run_inline):
    """A --float8 run's checkpoint has the keys and dtypes of the same run without --float8 (no torchao tensor in
    it); a run without --float8 resumes it, and a run with --float8 resumes the plain run's. The runs are dlojz's
    command in this process, which sees the narrow ViT registered here (each fc1 converted)."""
    import dlojz_lib.checkpoint as ckpt

    common = ["--device", "cpu", "--data-root", tiny_data, "--arch", MLP_VIT, "--image-size", "32"]
    common += ["-b", "8", "--train-subset", "16", "-e", "1", "--no-wandb", "--num-workers", "0"]
    saved = {}
    for name, flags in (("float8", ["--float8", "tensorwise"]), ("plain", [])):
        result = run_inline(*common, *flags, "--output-dir", tmp_path / name)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert ("--float8 tensorwise: 2 linears in float8" in result.stdout) == bool(flags), result.stdout
        path = ckpt.newest_checkpoint(tmp_path / name)
        saved[name] = torch.load(path, map_location="cpu", weights_only=True)["model"]
    assert {k: (v.dtype, v.shape) for k, v in saved["float8"].items()} == {
        k: (v.dtype, v.shape) for k, v in saved["plain"].items()
    }
    assert all(type(v) is torch.Tensor for v in saved["float8"].values())
    for name, flags in (("float8", []), ("plain", ["--float8", "tensorwise"])):  # each resumed the other way
        resumed = run_inline(*common, *flags, "-e", "2", "--resume", "auto", "--output-dir", tmp_path / name)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        assert "Epoch 2/2" in resumed.stdout and ("2 linears in float8" in resumed.stdout) == bool(flags)


@pytest.mark.multirank
def test_an_fsdp_float8_run_consolidates_and_predicts_without_torchao(tiny_data, tmp_path):
    """A 2-rank --fsdp --float8 tensorwise run's sharded checkpoint (its weights torchao's float8 all-gather tensors
    while it trains) consolidates into plain tensors, which dlojz_predict.py reads where torchao cannot be imported."""
    import subprocess
    import sys

    from conftest import ROOT, clean_env, run_dlojz

    import dlojz_fsdp
    import dlojz_lib.checkpoint as ckpt

    common = ["--device", "cpu", "--data-root", tiny_data, "--arch", SMALL_VIT, "--image-size", "32"]
    common += ["-b", "8", "--train-subset", "16", "-e", "1", "--no-wandb", "--num-workers", "0"]
    run = tmp_path / "run"
    result = run_dlojz(*common, "--fsdp", "--float8", "tensorwise", "--output-dir", run, ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--float8 tensorwise: 14 linears in float8" in result.stdout
    sharded = ckpt.newest_checkpoint(run)
    whole = tmp_path / "whole.pt"
    assert dlojz_fsdp.main(["consolidate", str(sharded), str(whole)]) == 0  # (the command's own main, here)
    weights = torch.load(whole, map_location="cpu", weights_only=True)["model"]
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in weights.values())
    blocked = tmp_path / "no_torchao" / "torchao"  # a torchao that cannot be imported
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('torchao is not installed here')\n")
    env = clean_env(PYTHONPATH=blocked.parent)
    predicted = subprocess.run(
        [sys.executable, str(ROOT / "dlojz_predict.py"), str(whole), str(tiny_data / "val"), "-o",
         str(tmp_path / "predictions.csv"), "--device", "cpu", "--num-workers", "0"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert predicted.returncode == 0, predicted.stdout + predicted.stderr[-3000:]
    assert len((tmp_path / "predictions.csv").read_text().splitlines()) == 1 + 15  # a header, the 15 images


def test_float8_is_refused_where_it_cannot_run(monkeypatch):
    """On a GPU below compute capability 8.9 (an A100: 8.0) and without torchao, one line each, before any work;
    the CPU runs it (a check)."""
    import importlib.util

    from dlojz_lib.settings.config import check_float8

    check_float8("tensorwise", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"A100-SXM4-80GB \(compute capability 8.0\) has no float8 matrix products"):
        check_float8("tensorwise", "cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8("rowwise", "cuda:0", amp=True)
    with pytest.raises(UserError, match="--float8 rowwise_with_gw_hp: .* autocast leaves in two dtypes"):
        check_float8("rowwise_with_gw_hp", "cuda:0", amp=True)
    check_float8("rowwise_with_gw_hp", "cuda:0", amp=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None)
    with pytest.raises(UserError, match=r"torchao's, which is not installed here: pip install torchao==0\.18\.0"):
        check_float8("rowwise", "cpu")


def test_float8_on_the_cpu_is_refused_where_this_torch_cannot_run_it(monkeypatch):
    """On the CPU, a torch whose float8 product takes no row scales (2.11) refuses the row-wise recipes, and one
    older than 2.14 refuses --compile, each in one line naming its version; tensorwise runs on any; a GPU never
    asks either."""
    from dlojz_lib import torch_internals
    from dlojz_lib.settings import config

    version = torch.torch_version.TorchVersion(torch.__version__)
    assert torch_internals.cpu_float8_takes_row_scales() or version < "2.14"  # (True on 2.14.1, False on 2.11.0)
    assert not torch_internals.cpu_float8_takes_row_scales() or version >= "2.12"
    monkeypatch.setattr(torch_internals, "cpu_float8_takes_row_scales", lambda: False)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        with pytest.raises(UserError, match=rf"--float8 {recipe} on the CPU: this torch 2\.11\.0\+cu130 has no CPU"):
            config.check_float8(recipe, "cpu")
    config.check_float8("tensorwise", "cpu")
    with pytest.raises(UserError, match=r"--float8 tensorwise --compile on the CPU: this torch 2\.11\.0\+cu130's"):
        config.check_float8("tensorwise", "cpu", compiled=True)
    monkeypatch.setattr(torch, "__version__", "2.14.1")
    config.check_float8("tensorwise", "cpu", compiled=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    config.check_float8("rowwise", "cuda:0", amp=True, compiled=True)


def test_fsdp_s_float8_scales_run_after_each_step_under_tensorwise_scaling_only():
    """Under --fsdp with tensorwise scaling FSDP gathers float8 weights: the run's model calls torchao's scale
    computation after each optimizer step (Model.after_step); rowwise, or without --fsdp, nothing."""
    from dlojz_lib.parallelism.layout import float8_scales

    module = torch.nn.Linear(2, 2)
    assert float8_scales(None, True, module) is None and float8_scales("rowwise", True, module) is None
    assert float8_scales("tensorwise", False, module) is None
    after_step = float8_scales("tensorwise", True, module)
    assert after_step.func.__name__ == "scales_for_fsdp" and after_step.args == (module,)


def fsdp_float8_on_rank(rank, world, store_path, results, replicas):
    """One of 2 ranks: the narrow ViT (MLP_VIT) built and laid out as dlojz.py does with --fsdp --float8 tensorwise
    --no-amp (built on rank 0, filled from it), and one process's --float8 tensorwise run beside it; both take the
    same 8 images, 2 SGD steps, the float8 weights' scales precomputed after each (Model.after_step). What each step
    sends (kind, dtype, elements), and every weight gathered against one process's."""
    import traceback

    import torch.distributed as dist
    from conftest import counting_mode

    from dlojz_lib.dist import Distribution, model_parallel_mesh
    from dlojz_lib.model.build import build_model
    from dlojz_lib.parallelism.layout import lay_out
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        ranks = Distribution(world, rank, rank, torch.device("cpu"))
        model_parallel_mesh(ranks, 1, 1, replicas)
        common = ["--device", "cpu", "--arch", MLP_VIT, "--image-size", "32", "-b", "8", "--no-amp", "--float8"]
        models = []
        for flags in (["tensorwise", "--fsdp", "--fsdp-replicate", str(replicas)], ["tensorwise"]):
            cfg = resolve_config(get_args_parser().parse_args([*common, *flags]))
            torch.manual_seed(0)
            built = build_model(cfg, 10, ranks if "--fsdp" in flags else Distribution(1, 0, 0, ranks.device), print)
            models.append(lay_out(built, cfg, ranks, print) if "--fsdp" in flags else built.module)
        sharded, reference = models
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (sharded.module, reference)]
        data = torch.Generator().manual_seed(1)
        steps = []
        for _ in range(2):
            images, labels = torch.randn(8, 3, 32, 32, generator=data), torch.randint(0, 10, (8,), generator=data)
            for net, optimizer in zip((sharded.net, reference), optimizers):
                optimizer.zero_grad()
                with counting_mode() as counted:
                    torch.nn.functional.cross_entropy(net(images), labels).backward()
                optimizer.step()
                if net is sharded.net:
                    steps.append([(name, dtype, numel) for _, name, _, dtype, numel in counted.calls])
                    sharded.after_step()
        state = {key: value.full_tensor() for key, value in sharded.module.state_dict().items()}
        for key, expected in reference.state_dict().items():
            torch.testing.assert_close(state[key], expected, rtol=1e-4, atol=1e-5, msg=key)
        cfg = resolve_config(get_args_parser().parse_args([*common[:-1], "--fsdp", "--fsdp-replicate", str(replicas)]))
        torch.manual_seed(0)
        plain = lay_out(build_model(cfg, 10, ranks, print), cfg, ranks, print)  # the same FSDP without float8
        with counting_mode() as counted:
            torch.nn.functional.cross_entropy(plain.net(images), labels).backward()
        results.put((rank, [*steps, [(name, dtype, numel) for _, name, _, dtype, numel in counted.calls]]))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    dist.destroy_process_group()


@pytest.mark.multirank
@pytest.mark.parametrize("world, replicas", [(2, 1), (4, 2)], ids=["fsdp", "hsdp"])
def test_fsdp_gathers_float8_weights_with_scales_computed_once_a_step_and_trains_as_one_process(
    world, replicas, tmp_path
):
    """--fsdp --float8 tensorwise on 2 CPU ranks: each block's all-gather carries its float8 weights in one byte
    each (torchao's float8 all-gather: the block's bytes are its converted weights' elements plus 4 bytes each of the
    rest, float32's, under --no-amp: a quarter of float32's, half of bfloat16's); before the scales are precomputed each converted weight's forward and backward
    all-reduce its own amax, after it (Model.after_step, each optimizer step) none; and after 2 steps every weight
    is one process's --float8 tensorwise run's within float32 tolerance. The same under HSDP on 4 ranks (2 replicas
    of 2 shards: each block gathered within its replica)."""
    from conftest import spawn_ranks

    from dlojz_lib.model.float8 import float8_linears

    found = spawn_ranks(fsdp_float8_on_rank, world, tmp_path, replicas)
    failures = [steps for _, steps in found if isinstance(steps, str)]
    assert not failures, "\n".join(failures)
    assert len(found) == world
    model = meta_model(MLP_VIT, 32)
    converted = {f"{path}.weight" for path in float8_linears(model, family_of(model), "tensorwise")}
    assert converted == {"blocks.0.mlp.fc1.weight", "blocks.1.mlp.fc1.weight"}, converted
    expected = []  # each block's bytes gathered: float8 weights in 1 byte, the rest (norms, biases) in float32's 4
    for path, block in family_of(model).blocks(model):
        sizes = {f"{path}.{name}": p.numel() for name, p in block.named_parameters()}
        expected.append(sum(n if name in converted else 4 * n for name, n in sizes.items()))
    for _, (first, second, plain) in found:
        gathered = [n for kind, dtype, n in first if kind == "_allgather_base_" and dtype == "torch.uint8"]
        assert sorted(gathered) == sorted(expected * 2), (gathered, expected)  # forward and backward
        amaxes = [sent for sent in first if sent[0] == "all_reduce"]  # (DTensor's, one float32 each)
        assert len(amaxes) == 2 * len(converted) and {sent[1:] for sent in amaxes} == {("torch.float32", 1)}, first
        assert not [sent for sent in second if sent[0] == "all_reduce"], second  # (HSDP's gradients: allreduce_)
        assert [n for kind, dtype, n in second if dtype == "torch.uint8"] == [
            n for kind, dtype, n in first if dtype == "torch.uint8"
        ]

    # the planner's FSDP + float8 row (dlojz_lib/parallelism/plan.py) for this model on 2 ranks: the bytes a step
    # sends fewer than its FSDP row, as the runs counted them (each rank sends (n - 1) / n of what it gathers)
    if replicas > 1:
        return
    from dlojz_lib.parallelism.plan import GPUS, Allocation, LayoutTable, plan

    def sent(step):  # the bytes this rank sends in its all-gathers (float8's as uint8, the rest float32)
        gathered = sum(
            n * (1 if dtype == "torch.uint8" else 4) for kind, dtype, n in step if kind == "_allgather_base_"
        )
        return gathered * (world - 1) // world

    rows, _, _ = plan(
        LayoutTable(MLP_VIT, 32, 10, 8, gpus=(2,), amp_bytes=4), Allocation(1, **dict(GPUS["h100"], gpus_per_node=2))
    )
    rows = {row["layout"]: row for row in rows}
    predicted = rows["FSDP"]["sent_by_group"]["data"] - rows["FSDP + float8"]["sent_by_group"]["data"]
    measured = sent(plain) - sent(first)
    assert predicted == measured, (predicted, measured)
