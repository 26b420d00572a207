"""--global-batch and --lr-scaling: a run (a recipe) keeps its published images a step on any number of ranks, with
each rank's batch and --grad-acc chosen at start-up and said in one block; where the ranks cannot make it, the
nearest is taken and --lr follows the rule."""

import dataclasses
import math
import re

import pytest
from conftest import ROOT, TINY, read_json, run_dlojz

from dlojz_lib.checks import UserError
from dlojz_lib.global_batch import fit_global_batch, fit_to_ranks, split_global_batch
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import get_args_parser

FITTED = [p for p in sorted((ROOT / "recipes").glob("*.toml")) if re.search(r"^global-batch = ", p.read_text(), re.M)]


def resolve(*flags):
    return resolve_config(get_args_parser().parse_args(["--device", "cpu", *map(str, flags)]))


def fitted(cfg, world_size):
    lines = []
    return fit_to_ranks(cfg, world_size, lines.append), "\n".join(lines)


def test_every_recipe_with_a_published_batch_says_it():
    names = {p.name for p in FITTED}
    assert {"torchvision_vit_b_16.toml", "torchvision_resnet50_v2.toml", "timm_rsb_a1_resnet50.toml"} <= names
    assert "race_rn50_16ep.toml" in names and "mlperf_rn50_lars.toml" in names and len(names) == 12


@pytest.mark.parametrize("gpus", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("path", FITTED, ids=lambda p: p.name)
def test_a_recipe_trains_with_its_published_batch_lr_and_ema_on_any_number_of_gpus(path, gpus):
    """1 GPU, 1, 2, 4 and 8 nodes of 4: the published global batch, the file's lr, a per-GPU batch within the
    file's, and torchvision's EMA decay for the published images a step (what its 8 GPUs gave)."""
    from dlojz_lib.model.zoo import ema_decay

    cfg = resolve("--config", path)
    run, block = fitted(cfg, gpus)
    assert gpus * run.batch_size * run.grad_acc == cfg.global_batch, block
    assert run.batch_size <= cfg.batch_size and run.lr == cfg.lr and run.min_lr == cfg.min_lr
    assert f"= {cfg.global_batch} images a step, as given" in block and "as given (the global batch it is for)" in block
    if cfg.model_ema_adjust:
        published = 1 - (1 - cfg.model_ema_decay) * cfg.global_batch * cfg.model_ema_steps / cfg.epochs
        assert ema_decay(run.section("memory"), run.section("training"), gpus) == pytest.approx(published, abs=1e-12)
        header = float(re.search(r"on these images a step: ([0-9.]+)\.", path.read_text()).group(1))
        assert header == pytest.approx(published, abs=1e-6)  # the header's figure is the one the run uses
    # the header's split for this allocation is the one the run takes
    if gpus in (1, 4, 8, 32):
        acc = f" x --grad-acc {run.grad_acc}" if run.grad_acc > 1 else ""
        assert f"{gpus} x {run.batch_size}{acc}" in path.read_text()


@pytest.mark.parametrize(
    "world, most, split",
    [(1, 512, (512, 8)), (4, 512, (512, 2)), (8, 512, (512, 1)), (32, 512, (128, 1)), (4, 300, (256, 4))],
)
def test_the_split_is_the_fewest_micro_batches_that_fit(world, most, split):
    assert split_global_batch(4096, world, most) == split


@pytest.mark.parametrize("rule, factor", [("linear", 4095 / 4096), ("sqrt", math.sqrt(4095 / 4096)), ("none", 1.0)])
def test_a_global_batch_the_ranks_cannot_make_is_the_nearest_with_the_lr_by_the_rule(rule, factor):
    cfg = resolve("--global-batch", 4096, "-b", 512, "--lr", 0.003, "--lr-scheduler", "cosine", "--min-lr", 1e-5,
                  "--lr-scaling", rule)  # fmt: skip
    run, block = fitted(cfg, 3)
    assert (run.batch_size, run.grad_acc) == (455, 3)  # 3 x 455 x 3 = 4,095 images
    assert run.lr == pytest.approx(0.003 * factor, rel=1e-12) and run.min_lr == pytest.approx(1e-5 * factor)
    assert (
        "3 x 455 images x --grad-acc 3 = 4095 images a step, the nearest to 4096 (not a multiple of 3 ranks)" in block
    )
    assert "--batch-size 512 -> 455 per rank" in block and "--grad-acc 1 -> 3" in block
    if rule != "none":
        assert f"--lr 0.003 -> {run.lr:g} (--lr-scaling {rule}" in block


def test_the_rule_is_linear_unless_given():
    run, _ = fitted(resolve("--global-batch", 64, "-b", 64, "--lr", 0.1), 3)  # 3 x 21 = 63
    assert (run.batch_size, run.grad_acc, run.lr) == (21, 1, pytest.approx(0.1 * 63 / 64))


def test_a_cuda_graph_mode_compiles_without_graphs_when_the_fit_accumulates():
    cfg = dataclasses.replace(resolve("--global-batch", 64, "-b", 16), compile=True, compile_mode="reduce-overhead")
    run, block = fitted(cfg, 2)
    assert (run.grad_acc, run.compile_mode) == (2, "default") and "--compile-mode reduce-overhead -> default" in block
    run, _ = fitted(cfg, 4)  # 4 x 16: no accumulation, the graphs stay
    assert (run.grad_acc, run.compile_mode) == (1, "reduce-overhead")


def test_the_bad_combinations_are_one_line():
    with pytest.raises(UserError, match="--lr-scaling says how --lr follows --global-batch: add --global-batch"):
        resolve("--lr-scaling", "sqrt")
    with pytest.raises(
        UserError, match="--global-batch chooses --grad-acc from the ranks the job has: drop --grad-acc 2"
    ):
        resolve("--global-batch", 64, "--grad-acc", 2)
    with pytest.raises(UserError, match="this job has 8 ranks, more than the images of a step"):
        fit_global_batch(resolve("--global-batch", 4), 8, print)


def test_no_global_batch_drops_a_recipe_s_batch_and_its_lr_rule(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('global-batch = 4096\nlr-scaling = "sqrt"\nbatch-size = 64\n')
    cfg = resolve("--config", path)
    assert (cfg.global_batch, cfg.lr_scaling) == (4096, "sqrt")
    cfg = resolve("--config", path, "--no-global-batch")
    assert (cfg.global_batch, cfg.lr_scaling, cfg.batch_size) == (None, None, 64)
    assert fitted(cfg, 4)[0] == cfg  # no global batch: the run as given


@pytest.mark.parametrize("ranks, batch, grad_acc", [(1, 8, 2), (2, 8, 1)])
@pytest.mark.multirank
def test_a_run_keeps_the_global_batch_on_one_and_two_ranks(tiny_data, tmp_path, ranks, batch, grad_acc):
    """The same command on 1 and 2 ranks: 16 images a step on both (one rank accumulates two micro-batches of 8),
    the block said once."""
    metrics = tmp_path / "m.json"
    proc = run_dlojz(*TINY, "--data-root", tiny_data, "--global-batch", 16, "--test", "--test-nsteps", 2,
                     "--output-dir", tmp_path / "run", "--metrics-json", metrics, ranks=ranks)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = read_json(metrics)
    assert (result["global_batch_size"], result["world_size"], result["steps"]) == (16, ranks, 2)
    acc = f" x --grad-acc {grad_acc}" if grad_acc > 1 else " x --grad-acc 1"
    assert f"{ranks} x {batch} images{acc} = 16 images a step, as given" in proc.stdout
    assert proc.stdout.count("--global-batch 16: fitted to") == 1


@pytest.mark.parametrize("target, replicas, per_rank", [(64, 2, 32), (64, 1, 64), (60, 2, 32)])
def test_under_pp_the_global_batch_is_one_step_of_the_schedule_without_grad_acc(target, replicas, per_rank):
    """--pp accumulates its micro-batches in the schedule, and refuses --grad-acc: --global-batch fits -b (a
    multiple of --pp-microbatches, the nearest where the replicas cannot make it exactly) with --grad-acc 1."""
    cfg = resolve("--global-batch", target, "-b", 8, "--fsdp", "--pp", 2, "--lr", 0.1)
    run, block = fitted(cfg, replicas)
    assert (run.batch_size, run.grad_acc) == (per_rank, 1), block
    assert run.batch_size % cfg.pp_microbatches == 0
    assert f"{replicas} x {per_rank} images x --grad-acc 1 = {replicas * per_rank} images a step" in block
    assert "each step's batch in --pp-microbatches 4, which accumulate in place of --grad-acc" in block
    if replicas * per_rank != target:
        assert "30 images per rank do not split into --pp-microbatches 4" in block and run.lr != cfg.lr
