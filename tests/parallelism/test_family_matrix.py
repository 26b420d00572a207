"""Every model family of day 4 under every layout it can take, against one process on the same data: the parameters
and the buffers (BatchNorm's running statistics and batch counts) of a consolidated checkpoint, each layout with
activation checkpointing (a recomputation is a forward the training loop does not own: it must count no batch).
Families: timm's ViT, timm's CoAtNet (BatchNorm in its convolutional blocks, attention in the others),
torchvision's ResNet (BatchNorm throughout); layouts: --fsdp over 2 data ranks, --fsdp --tp 2, --fsdp --pp 2 and
3-D (--pp 2 --tp 2) on 4 ranks. A cell a family cannot run is refused in one line, and the refusal is its test;
CoAtNet's --tp and 3-D cells and the ViT's --tp cell are left to other tests (LEFT).

BatchNorm normalises over the images a forward sees: a pipeline's 4 micro-batches of 4 are one process's -b 4
--grad-acc 4 (each forward a micro-batch), buffers included; FSDP's 2 ranks normalise over their own 8 images each
(the sampler deals them out in turns: no one process groups them so, and --fsdp refuses --sync-bn), so a
BatchNorm family's --fsdp cell is held to the same layout without recomputation, buffers included. A ViT's sums are
the same in any grouping, within the suite's tolerance.

Across the seams: a pipeline run with drop-path resumed from the middle of its second epoch (a validation behind
it) ends where the uninterrupted run ends; a pipeline's LAMB checkpoint (LAMB clips the global norm itself)
consolidates to one process's weights and optimizer.
--compile: the ViT's --fsdp run compiled is one process's (tests/parallelism/test_fsdp.py); here a ResNet's blocks,
one forward at several shapes, compile each at its own (a pipeline cell compiled would take a minute on the CPU)."""

import pytest
from conftest import read_json, run_dlojz, show
from test_dlojz import assert_one_line_error
from test_fsdp import BASE, assert_same_weights, checkpoint

import dlojz_lib.checkpoint as ckpt

FAMILIES = {  # a row of the family table (dlojz_lib/model/families.py): the --arch of its cells, the sizes it trains at
    "vit": ["--arch", "timm:test_vit"],
    "coatnet": ["--arch", "timm:coatnet_pico_rw_224", "--image-size", "64", "--val-resize-size", "72",
                "--val-crop-size", "64"],
    "resnet": ["--arch", "resnet18"],
}  # fmt: skip
# the table's rows other tests cover, and where (their layouts against one process, or for a row no --arch names,
# the pipeline's cut and draws)
ELSEWHERE = {
    "torchvision's ViT": "tests/parallelism/test_tensor_parallel.py (--fsdp --tp 2), test_pipeline.py (PP 2 x TP 2)",
    "an nn.Sequential (each child a layer)": "tests/parallelism/test_pipeline.py (its cut, the stages' draws)",
}
AC = ["--activation-checkpointing", "full"]
# layout: (ranks, its flags, the run a BatchNorm family's equals: "b16" (one process, -b 16), "micro" (one process,
# -b 4 --grad-acc 4) or "plain" (the same layout without activation checkpointing))
LAYOUTS = {
    "fsdp": (2, ["-b", "8", "--fsdp", *AC], "plain"),
    "tp": (2, ["-b", "16", "--fsdp", "--tp", "2", *AC], "b16"),
    "pp": (2, ["-b", "16", "--fsdp", "--pp", "2", *AC], "micro"),
    "3d": (4, ["-b", "16", "--fsdp", "--pp", "2", "--tp", "2", *AC], "micro"),
}
REFERENCES = {"b16": (1, ["-b", "16"]), "micro": (1, ["-b", "4", "--grad-acc", "4"]),
              "plain": (2, ["-b", "8", "--fsdp"])}  # fmt: skip
STEPS = 2  # an epoch of each cell: 2 steps of 16 images
# the batches BatchNorm counts in the steps (a rank's, under --fsdp)
COUNTED = {"b16": STEPS, "plain": STEPS, "micro": 4 * STEPS}
LEFT = {("coatnet", "tp"), ("coatnet", "3d"), ("vit", "tp")}
# cells a family cannot run: the line that says so
REFUSED = {
    ("resnet", "tp"): "--arch resnet18 has no tensor-parallel plan here",
    ("resnet", "3d"): "--arch resnet18 has no tensor-parallel plan here",
}
# Left to other tests, for the suite's time: CoAtNet's --tp plan against one process (test_tensor_parallel.py's, its
# relative position bias included; its BatchNorm blocks stay whole under --tp, as in its --fsdp cell), its 3-D
# cell (a minute on 4 CPU ranks at 64 px: its --pp cell and the ViT's 3-D cell stand for it), and the ViT's --tp
# cell: test_tensor_parallel.py's "tp" run, under --activation-checkpointing selective, against one process
CELLS = [(family, layout) for family in FAMILIES for layout in LAYOUTS if (family, layout) not in LEFT]


def family_of_cells(flags) -> str:
    """The family table's row of the model a cell's flags train (built on the meta device)."""
    import torch

    from dlojz_lib.model.families import family_of
    from dlojz_lib.model.zoo import create_model

    size = int(flags[flags.index("--image-size") + 1]) if "--image-size" in flags else 32
    with torch.device("meta"):
        return family_of(create_model(flags[flags.index("--arch") + 1], 3, False, size)).name


def test_the_matrix_has_cells_for_every_family_of_the_table():
    """The matrix's families are the family table's rows: each of its models is of the row it stands for, one a row,
    and every row of the table has its cells here or names the tests that cover it (a family added to the table
    without either fails here)."""
    from dlojz_lib.model.families import FAMILIES as TABLE

    rows = [family_of_cells(flags) for flags in FAMILIES.values()]
    assert len(set(rows)) == len(rows), rows
    assert set(rows).isdisjoint(ELSEWHERE) and set(rows) | set(ELSEWHERE) == {row.name for row in TABLE}


def common(tiny_data):
    # 4 ranks on 2 cores: no CPU for a DataLoader worker; 2 steps of 16 images (33, 11 a class: the last dropped)
    return [*BASE, "--data-root", tiny_data, "--num-workers", "0", "--drop-last", "--train-subset", "11"]


@pytest.fixture(scope="module")
def references(tiny_data, tmp_path_factory):
    """Each family's reference runs as its layouts need them (a ViT's grouping of images needs none but one)."""
    out = tmp_path_factory.mktemp("one")
    for family, flags in FAMILIES.items():
        for name, (ranks, reference) in REFERENCES.items():
            if (family == "vit") != (name == "b16"):  # (-b 16 is the reference of the ViT's cells alone here)
                continue
            folder = out / f"{family}-{name}"
            proc = run_dlojz(*common(tiny_data), *flags, *reference, "--output-dir", folder,
                             "--metrics-json", folder.with_suffix(".json"), ranks=ranks)  # fmt: skip
            assert proc.returncode == 0, show(proc)
    return out


@pytest.mark.parametrize("family, layout", CELLS, ids=[f"{f}-{lay}" for f, lay in CELLS])
@pytest.mark.multirank
def test_a_family_under_a_layout_trains_to_one_process_s_parameters_and_buffers(
    references, tiny_data, tmp_path, family, layout
):
    ranks, flags, reference = LAYOUTS[layout]
    out = tmp_path / "run"
    proc = run_dlojz(*common(tiny_data), *FAMILIES[family], *flags, "--output-dir", out,
                     "--metrics-json", tmp_path / "run.json", ranks=ranks)  # fmt: skip
    if (family, layout) in REFUSED:
        assert_one_line_error(proc, REFUSED[family, layout])
        return
    assert proc.returncode == 0, show(proc)
    one = references / f"{family}-{'b16' if family == 'vit' else reference}"
    state, expected = checkpoint(out)["model"], checkpoint(one)["model"]
    counts = [key for key in expected if key.endswith("num_batches_tracked")]
    assert bool(counts) == (family != "vit")
    for key in counts:  # exactly: a recomputation that counted its batch doubled them
        assert state[key] == COUNTED[reference], (key, state[key])
    assert_same_weights(state, expected, atol=1e-5)
    metrics, single = read_json(tmp_path / "run.json"), read_json(one.with_suffix(".json"))
    assert metrics["steps"] == single["steps"] == STEPS and metrics["val_images"] == 15
    assert metrics["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4)


@pytest.mark.multirank
def test_a_pipeline_with_drop_path_resumed_after_a_validation_draws_what_it_would_have(tiny_data, tmp_path):
    """--drop-path under --pp: 2 epochs uninterrupted, and resumed from step 3 (epoch 2, a validation behind it,
    after which torch's schedule infers its shapes again with a forward of its own): the same weights, to float
    sums' order (a draw one forward off moved them by 1e-3)."""
    flags = [*common(tiny_data), *FAMILIES["vit"], "-b", "16", "--fsdp", "--pp", "2", "--drop-path", "0.3",
             "--epochs", "2"]  # fmt: skip
    whole = tmp_path / "whole"
    proc = run_dlojz(*flags, "--output-dir", whole, "--checkpoint-every", "1e-9", "--keep-checkpoints", "0", ranks=2)
    assert proc.returncode == 0, show(proc)
    source = next(path for path in ckpt.list_checkpoints(whole) if ckpt.load(path)["global_step"] == STEPS + 1)
    resumed = tmp_path / "resumed"
    proc = run_dlojz(*flags, "--output-dir", resumed, "--resume", source, ranks=2)
    assert proc.returncode == 0, show(proc)
    assert f"global step {STEPS + 1})" in proc.stdout, proc.stdout
    state, expected = checkpoint(resumed), checkpoint(whole)
    assert state["global_step"] == expected["global_step"] == 2 * STEPS
    assert_same_weights(state["model"], expected["model"], atol=1e-6)


@pytest.mark.multirank
def test_a_pipeline_s_lamb_checkpoint_consolidates_to_one_process_s_optimizer(tiny_data, tmp_path):
    """--optimizer lamb under --pp: LAMB's own clip of the global gradient norm is the model's across the stages
    (a stage's own norm trained other weights), and dlojz_fsdp.py consolidate of its checkpoint (the groups' tensor
    step among the settings saved parameter by parameter) gives one process's weights, step and moments."""
    flags = [*common(tiny_data), *FAMILIES["vit"], "-b", "16", "--optimizer", "lamb", "--lr", "0.01"]
    for name, ranks, layout in (("one", 1, []), ("pp", 2, ["--fsdp", "--pp", "2"])):
        proc = run_dlojz(*flags, *layout, "--output-dir", tmp_path / name, ranks=ranks)
        assert proc.returncode == 0, show(proc)
    assert "the optimizer's own clip of the global gradient norm (1) is the model's" in proc.stdout, proc.stdout
    state, expected = checkpoint(tmp_path / "pp"), checkpoint(tmp_path / "one")
    assert_same_weights(state["model"], expected["model"], atol=1e-5)
    groups = [[g["step"] for g in c["optimizer"]["param_groups"]] for c in (state, expected)]
    assert groups[0] == groups[1] and all(step == STEPS for step in groups[0])
    moments = [{i: s["exp_avg_sq"] for i, s in c["optimizer"]["state"].items()} for c in (state, expected)]
    assert moments[0].keys() == moments[1].keys() and moments[0]
    assert_same_weights(moments[0], moments[1], atol=1e-7)


def compiled_blocks_on_rank(rank, world, store_path, results):
    """One rank: a ResNet's first two stages (blocks of 64 and 128 channels, one forward), each block compiled, then
    sharded by FSDP as --fsdp and --pp shard them; a forward and backward against the same stages eager."""
    import copy

    import torch
    import torch.distributed as dist

    from dlojz_lib.model.zoo import create_model
    from dlojz_lib.parallelism.fsdp import shard_model
    from dlojz_lib.parallelism.layout import compile_blocks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = create_model("resnet18", 3, False, 32)
        eager = torch.nn.Sequential(model.layer1, model.layer2)
        stages = copy.deepcopy(eager)
        blocks = [*stages[0], *stages[1]]
        line = compile_blocks(blocks, None)
        shard_model(stages, False, None, torch.device("cpu"), units=blocks)
        x = torch.randn(4, 64, 8, 8)
        expected, found = eager(x), stages(x)
        expected.square().sum().backward()
        found.square().sum().backward()
        gaps = [
            (q.grad.full_tensor() - p.grad).abs().max().item() for p, q in zip(eager.parameters(), stages.parameters())
        ]
        results.put((line, (found - expected).abs().max().item(), max(gaps)))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_a_cnn_s_blocks_compile_one_graph_a_shape_forward_and_backward(tmp_path):
    """--compile under --fsdp, --tp and --pp compiles each block, then FSDP shards it: a ResNet's blocks share one
    forward at several shapes, whose second shape made torch compile a graph with symbolic shapes whose backward
    inductor failed on (InductorError). Compiled and sharded, a ResNet's first two stages give the eager output and
    gradients."""
    from conftest import spawn_ranks

    [(line, output_gap, gradient_gap)] = spawn_ranks(compiled_blocks_on_rank, 1, tmp_path)
    assert "each of 4 blocks" in line
    assert output_gap < 1e-4 and gradient_gap < 1e-3, (output_gap, gradient_gap)
