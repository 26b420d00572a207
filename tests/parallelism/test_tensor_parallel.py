"""Tensor parallelism's plans (dlojz_lib/parallelism/tensor.py, each family's in dlojz_lib/model/tensor_plans.py) on 2
gloo processes: the parallelised tiny ViT, CoAtNet and MaxViT, and torchvision's ViT (a family whose blocks are not
timm's: nn.MultiheadAttention, split by its row's own plan), give the single-process model's outputs, gradients and
step, and their state dicts fused back are an ordinary model's."""

import traceback

import pytest
import torch

from dlojz_lib.checks import UserError
from dlojz_lib.model.tensor_plans import HeadShardedQKV, Pointwise
from dlojz_lib.model.zoo import create_model
from dlojz_lib.parallelism.tensor import WholeCopies, fused_state_dict, parallelize, token_sharded_weights

ARCH = "timm:test_vit"  # 6 blocks, 2 heads of 32, MLP 192 wide
# timm's CoAtNet and MaxViT at 64 px with heads in pairs (timm's test_coatnet and test_maxvit have odd counts):
TINY = {
    # 3 transformer blocks on NCHW maps (1x1 convolutions, qkv head by head, a relative position bias), 2 or 4 heads
    "coatnet": ("coatnet_pico_rw_224", dict(embed_dim=(16, 32, 64, 64), depths=(1, 1, 2, 1), stem_width=(8, 16),
                                            transformer_dim_head=16)),
    # 8 channels-last blocks on windows and grid cells, TensorFlow's [q; k; v] layout and bias, 2 or 4 heads
    "maxvit_tf": ("maxvit_tiny_tf_224", dict(embed_dim=(16, 32, 32, 32), depths=(1, 1, 1, 1), stem_width=16,
                                             transformer_dim_head=8)),
}  # fmt: skip
BLOCKS = {"vit": 6, "coatnet": 3, "maxvit_tf": 8, "torchvision_vit": 3}
SPLIT = {"vit": 10, "coatnet": 6, "maxvit_tf": 10, "torchvision_vit": 10}  # a block's split parameters: q, k, v (or
# qkv), fc1 or mlp.0 (and their biases), proj or out_proj and fc2 or mlp.3 (their biases replicated)


def tiny_model(kind, size):
    import timm
    import torchvision

    if kind == "vit":
        return create_model(ARCH, 3, False, size)
    if kind == "torchvision_vit":  # a family whose blocks are not timm's: nn.MultiheadAttention, torchvision's MLP
        return torchvision.models.VisionTransformer(size, 8, 3, 2, 32, 64, num_classes=3)
    name, layout = TINY[kind]
    return timm.create_model(name, img_size=size, num_classes=3, **layout)


def full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def compare(rank, world, kind, size, sequence_parallel):
    """One rank: the same model and batch as one process, parallelised over `world` ranks, two SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    reference, parallel = tiny_model(kind, size), tiny_model(kind, size)
    parallel.load_state_dict(reference.state_dict())  # a fused qkv read into the three parts below
    mesh = init_device_mesh("cpu", (world,))
    assert parallelize(parallel, mesh, kind, sequence_parallel) == BLOCKS[kind]
    whole = WholeCopies(parallel, mesh, summed=token_sharded_weights(parallel) if sequence_parallel else ())
    images, labels = torch.randn(4, 3, size, size), torch.tensor([0, 1, 2, 1])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (reference, parallel)]
    for model, optimizer in zip((reference, parallel), optimizers):
        for _ in range(2):  # two steps: the momentum's second use too
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            if model is parallel:  # as dlojz.py steps: the whole weights' gradients over the group first
                whole.average_gradients()
            optimizer.step()
        model.outputs = model(images).detach()
    torch.testing.assert_close(parallel.outputs, reference.outputs, rtol=1e-4, atol=1e-5)
    split = [p for p in parallel.parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()]
    assert all(p.to_local().numel() * world == p.numel() for p in split)
    assert len(split) == BLOCKS[kind] * SPLIT[kind]
    state = fused_state_dict({key: full(value) for key, value in parallel.state_dict().items()})
    expected = reference.state_dict()
    assert state.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(state[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


def count_collectives(world, kind, size, sequence_parallel, checkpointing="none"):
    """The collectives of one forward and one backward of the parallelised model, {pass: {kind: count}}, its blocks
    recomputed as --activation-checkpointing `checkpointing` says."""
    from conftest import counting_mode
    from torch.distributed.device_mesh import init_device_mesh

    from dlojz_lib.model.recompute import checkpoint_blocks

    torch.manual_seed(0)
    model = tiny_model(kind, size)
    mesh = init_device_mesh("cpu", (world,))
    parallelize(model, mesh, kind, sequence_parallel)
    if checkpointing != "none":
        checkpoint_blocks(list(model.blocks), checkpointing)  # (a ViT's blocks)
    whole = WholeCopies(model, mesh, summed=token_sharded_weights(model) if sequence_parallel else ())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with counting_mode() as forward:
        loss = model(torch.randn(4, 3, size, size)).sum()
    with counting_mode() as backward:
        loss.backward()
    with counting_mode() as step:  # the whole weights' one all-reduce, then a step that sends nothing
        whole.average_gradients()
        optimizer.step()
    return {"forward": dict(forward.counts), "backward": dict(backward.counts), "step": dict(step.counts)}


def megatron_s_collectives(kind, sequence_parallel):
    """What Megatron-LM's layout sends for the whole model: BLOCK_COLLECTIVES per block; with sequence parallelism
    the tokens gathered after the last block (and, backward, the first block's input gradient); CoAtNet's and
    MaxViT's relative position bias tables, their gradient gathered over the heads, one a block."""
    from dlojz_lib.parallelism.tensor import BLOCK_COLLECTIVES

    expected = {}
    for step, collectives in BLOCK_COLLECTIVES[sequence_parallel].items():
        expected[step] = {name: count * BLOCKS[kind] for name, count in collectives.items()}
        if sequence_parallel:
            expected[step]["all_gather"] += 1
    if kind in ("coatnet", "maxvit_tf"):
        expected["backward"]["all_gather"] = BLOCKS[kind]
    expected["step"] = {"all_reduce": 1}  # WholeCopies: every whole weight's gradient, the norms' under SP too
    return expected


def compare_on_rank(rank, world, store_path, failures, cases):
    """One rank of one process group for every case (a process start and torch's import once, not per case): each
    case's failure put in `failures` under the case."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    for case in cases:
        try:
            compare(rank, world, *case)
            counted = count_collectives(world, *case)
            assert counted == megatron_s_collectives(case[0], case[2]), counted
            if case[0] == "vit":  # the selective policy keeps the collectives' outputs: none sent again
                assert count_collectives(world, *case, "selective") == counted
        except BaseException:
            failures.put((case, f"rank {rank}: {traceback.format_exc()}"))
        dist.barrier()  # the next case starts together, whatever this one did on the other rank
    dist.destroy_process_group()


CASES = [
    ("vit", 32, False),
    ("vit", 48, True),
    ("coatnet", 64, False),
    ("maxvit_tf", 64, False),
    ("torchvision_vit", 32, False),
]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """Each case's failures on 2 ranks, {case: [lines]} (empty where it passed)."""
    from conftest import spawn_ranks

    found = spawn_ranks(compare_on_rank, 2, tmp_path_factory.mktemp("tp-cases"), CASES, timeout=400)
    return {case: [text for failed, text in found if tuple(failed) == case] for case in CASES}


@pytest.mark.parametrize("kind, size, sequence_parallel", CASES)
@pytest.mark.multirank
def test_the_parallel_model_trains_as_one_process(compared, kind, size, sequence_parallel):
    """2 ranks (half the heads each): after two SGD steps with momentum the outputs are the single process's
    (float32 sums in another order: 1e-5), and the fused state dict is an ordinary model's, key for key. With
    sequence parallelism (48 px: 9 patches and the class token, 5 tokens a rank) the norms' gradients come from each
    rank's tokens and are summed over the group: a norm left out of the plan would train on half of them. CoAtNet and
    MaxViT: each rank adds its heads' slice of the relative position bias, whose table gets every head's gradient (a
    table trained on one rank's heads would part from the single process's). And what it sends, counted per kind in
    one forward and one backward, is Megatron-LM's (BLOCK_COLLECTIVES a block, the table bench/parallel_memory.py
    sends by): 2 all-reduces each way a block (q, k and v summed before one), or with sequence parallelism 2
    all-gathers and 2 reduce-scatters each way; then the step's one all-reduce of the weights the group holds whole
    (WholeCopies), which with sequence parallelism sums the norms' gradients too (a replicated DTensor each sent an
    all-reduce of its own: 4 a block). The ViT's blocks under --activation-checkpointing selective send the same:
    the recomputation reuses the forward's collectives (recomputed: 5 all-reduces a block where Megatron sends 4)."""
    errors = compared[(kind, size, sequence_parallel)]
    assert not errors, "\n".join(errors)


def test_the_fused_qkv_loads_and_the_parts_fuse_back():
    """One process: HeadShardedQKV computes the fused projection's output, reads a fused state dict, and
    fused_state_dict gives it back."""
    torch.manual_seed(0)
    qkv = torch.nn.Linear(8, 24)
    split = HeadShardedQKV(qkv)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(split(x), qkv(x))
    other = HeadShardedQKV(torch.nn.Linear(8, 24))
    other.load_state_dict(qkv.state_dict())  # the fused keys
    torch.testing.assert_close(other(x), qkv(x))
    fused = fused_state_dict({f"attn.qkv.{k}": v for k, v in other.state_dict().items()})
    assert set(fused) == {"attn.qkv.weight", "attn.qkv.bias"}
    torch.testing.assert_close(fused["attn.qkv.weight"], qkv.weight)


def test_a_pointwise_convolution_is_a_linear_layer_with_its_weight():
    """Pointwise: a 1x1 convolution's output from an NCHW map (and a channels-last one), with the convolution's own
    parameters (its state dict's names and shapes); held apart by HeadShardedQKV, the same output."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 12, 1)
    layer = Pointwise(conv)
    assert {k: v.shape for k, v in layer.state_dict().items()} == {k: v.shape for k, v in conv.state_dict().items()}
    x = torch.randn(2, 8, 3, 5)
    for image in (x, x.contiguous(memory_format=torch.channels_last)):
        torch.testing.assert_close(layer(image), conv(image))
    torch.testing.assert_close(HeadShardedQKV(Pointwise(conv))(x), conv(x))
    with pytest.raises(ValueError):
        Pointwise(torch.nn.Conv2d(8, 12, 3))


@pytest.mark.parametrize(
    "arch, tp, fragment",
    [
        ("resnet18", 2, "--tp: --arch resnet18 has no tensor-parallel plan here: timm's ViT family"),
        (ARCH, 4, "--tp 4: timm:test_vit has 2 heads in a block; give a --tp that divides it"),
        ("timm:test_coatnet", 2, "--tp 2: timm:test_coatnet has 3 heads in a block; give a --tp that divides it"),
    ],
)
def test_a_model_the_plan_cannot_split_is_one_line(arch, tp, fragment):
    class Mesh:  # only its size is read before the plan is refused
        def size(self):
            return tp

    with pytest.raises(UserError) as err:
        parallelize(create_model(arch, 3, False, 32), Mesh(), arch)
    assert fragment in str(err.value)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The same training (global batch 16) as one process, as one tensor-parallel group of 2 ranks (one data
    replica: both ranks take the 16 images; its blocks recomputed by the selective policy), and 2-D on 4 ranks (2 groups of 2, 8 images each); then with 2
    accumulated micro-batches and the gradients' global norm clipped to 0.1 (always below a fresh ViT's)."""
    from conftest import run_dlojz, show
    from test_fsdp import BASE

    out = tmp_path_factory.mktemp("tp")
    common = [*BASE, "--data-root", tiny_data, "--num-workers", "0"]  # 4 ranks on 2 cores: no CPU for a worker
    for name, ranks, flags in (
        ("single", 1, ["-b", "16"]),
        ("tp", 2, ["-b", "16", "--fsdp", "--tp", "2", "--activation-checkpointing", "selective"]),  # (the family
        # matrix's ViT --tp cell: the collectives' outputs kept, a recomputation that equals the forward)
        ("tp-fsdp", 4, ["-b", "8", "--fsdp", "--tp", "2"]),
        ("single-clip", 1, ["-b", "8", "--grad-acc", "2", "--clip-grad-norm", "0.1"]),
        ("tp-clip", 2, ["-b", "8", "--grad-acc", "2", "--clip-grad-norm", "0.1", "--fsdp", "--tp", "2"]),
    ):
        proc = run_dlojz(
            *common, *flags, "--output-dir", out / name, "--metrics-json", out / f"{name}.json", ranks=ranks
        )
        assert proc.returncode == 0, show(proc)
        (out / f"{name}.log").write_text(proc.stdout)
    return out


@pytest.mark.parametrize("name", ["tp", "tp-fsdp"])
@pytest.mark.multirank
def test_tp_trains_to_the_weights_of_one_process(runs, name):
    """Tensor-parallel (and 2-D) training reaches one process's weights after 5 SGD steps (float32 sums in another
    order), its consolidated checkpoint is an ordinary model's, and the data dimension is the replicas': the global
    batch is 16, and validation sees each of the 15 images once."""
    from conftest import read_json
    from test_fsdp import assert_same_weights, weights

    assert_same_weights(weights(runs / name), weights(runs / "single"), atol=1e-5)
    metrics, single = read_json(runs / f"{name}.json"), read_json(runs / "single.json")
    assert (metrics["steps"], metrics["global_batch_size"], metrics["val_images"]) == (5, 16, 15)
    assert metrics["val_accuracy"] == single["val_accuracy"]
    assert metrics["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4)
    log = (runs / f"{name}.log").read_text()
    replicas = "1 data replica" if name == "tp" else "2 data replicas"
    assert (
        f"tensor parallelism: 6 blocks over groups of 2 ranks (q, k, v and fc1 column-wise, proj and fc2 row-wise), {replicas}"
        in log
    )
    assert f"Model state per rank (TP 2 x FSDP {1 if name == 'tp' else 2}: blocks split over groups of 2" in log
    assert metrics["parallel"] == "tp" and metrics["tensor_parallel_size"] == 2


@pytest.mark.multirank
def test_tp_clips_the_global_norm_over_both_meshes_and_accumulates(runs):
    """--clip-grad-norm under --tp: the split layers' gradients (2-D mesh) and the replicated ones' (data mesh)
    clipped by one global norm, with --grad-acc 2: the weights of one process doing the same."""
    from test_fsdp import assert_same_weights, weights

    clipped = weights(runs / "tp-clip")
    assert_same_weights(clipped, weights(runs / "single-clip"), atol=1e-5)
    unclipped = weights(runs / "single")
    assert any(not torch.allclose(clipped[k], unclipped[k], atol=1e-4) for k in clipped)  # the clip changed the run


@pytest.mark.parametrize(
    "flags, ranks, fragments",
    [
        (["--tp", "2"], 1, ["--tp 2 runs with --fsdp over the data dimension", "add --fsdp"]),
        (["--tp", "2", "--fsdp", "--loader-only"], 1, ["--tp 2 splits the model, which --loader-only does not build"]),
        (["--tp", "3", "--fsdp"], 2, ["--tp 3: this job has 2 rank(s), not a multiple of 3"]),
        (["--tp", "2", "--fsdp", "--amp", "--amp-dtype", "float16"], 1, ["--fsdp with --amp-dtype float16"]),
        (
            ["--tp", "2", "--fsdp", "--arch", "timm:test_resnet"],
            2,
            ["--arch timm:test_resnet has no tensor-parallel plan"],
        ),
    ],
)
@pytest.mark.multirank
def test_what_tp_cannot_do_is_one_line(flags, ranks, fragments, tiny_data, tmp_path):
    from conftest import run_dlojz
    from test_dlojz import assert_one_line_error
    from test_fsdp import BASE

    proc = run_dlojz(*BASE, "--data-root", tiny_data, "--num-workers", "0", "-b", "8", *flags,
                     "--output-dir", tmp_path / "run", ranks=ranks)  # fmt: skip
    assert_one_line_error(proc, *fragments)


@pytest.mark.multirank
def test_the_day_4_table_gives_the_bytes_a_run_measures(runs, tmp_path):
    """bench/parallel_memory.py's (dlojz_lib/parallelism/plan.py's rows) parameter, gradient and optimizer bytes per
    rank for TP 2 (2 ranks) and TP 2 x FSDP 2 (4 ranks) are what those runs measured (the metrics JSON's *_bytes_per_rank), to the byte; FSDP's and
    DDP's rows follow their rule (a half, a whole)."""
    from conftest import read_json

    bench = parallel_memory()
    table = tmp_path / "table.json"
    argv = ["--arch", ARCH, "--image-size", "32", "--num-classes", "3", "--gpus", "2,4", "--tp", "2", "--optimizer",
            "sgd", "-b", "8", "--json", str(table)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = {(row["gpus"], row["layout"]): row for row in read_json(table)}
    for name, key in (("tp", (2, "TP 2 x FSDP 1")), ("tp-fsdp", (4, "TP 2 x FSDP 2"))):
        measured, estimated = read_json(runs / f"{name}.json"), rows[key]
        for kind in ("parameter", "gradient", "optimizer"):
            assert measured[f"{kind}_bytes_per_rank"] == estimated[f"{kind}_bytes"], (name, kind)
    whole = rows[(2, "DDP")]["parameter_bytes"]
    assert whole == 4 * sum(p.numel() for p in create_model(ARCH, 3, False, 32).parameters())
    assert rows[(2, "FSDP")]["parameter_bytes"] <= whole // 2 + 4 * 1024  # each parameter's half, rounded up
    assert rows[(4, "TP 2 x FSDP 2")]["activation_bytes"] < rows[(4, "FSDP")]["activation_bytes"]
    assert bench.main([*argv, "--sequence-parallel"]) == 0  # the norms' and dropouts' activations split too
    split = {(row["gpus"], row["layout"]): row for row in read_json(table)}[(4, "TP 2 + SP x FSDP 2")]
    assert split["activation_bytes"] < rows[(4, "TP 2 x FSDP 2")]["activation_bytes"]
    assert split["sent_bytes_per_step"] == rows[(4, "TP 2 x FSDP 2")]["sent_bytes_per_step"]  # the same bytes sent


@pytest.mark.multirank
def test_a_tp_run_stopped_mid_epoch_resumes_in_2d_to_the_same_weights(runs, tiny_data, tmp_path):
    """Saved by one tensor-parallel group of 2 ranks after a step or two (sharded, the TP layout inside), resumed by
    4 ranks in 2-D (2 groups x 8 images): DCP reshards model and optimizer across the layouts, the epoch goes on
    after the images already trained on, and the run ends on one process's weights."""
    from conftest import run_dlojz, show
    from test_fsdp import BASE, assert_same_weights, stopped_mid_epoch, weights

    out = tmp_path / "run"
    common = [*BASE, "--data-root", tiny_data, "--num-workers", "0", "--fsdp", "--tp", "2"]
    stopped_mid_epoch([*common, "-b", "16"], out)
    proc = run_dlojz(*common, "-b", "8", "--output-dir", out, "--resume", "auto", ranks=4)
    assert proc.returncode == 0, show(proc)
    assert_same_weights(weights(out), weights(runs / "single"), atol=1e-5)


def test_checkpoint_names_map_between_the_fused_and_the_split_qkv():
    """An ordinary checkpoint's fused qkv splits into the parts a parallelised model holds (other keys as they are,
    a model without parts left fused); the names' difference is seen both ways, and not between equal layouts."""
    from dlojz_lib.parallelism.tensor import qkv_layouts_differ, split_state_dict

    reference = tiny_model("vit", 32)
    parallel = tiny_model("vit", 32)
    parallel.blocks[0].attn.qkv = HeadShardedQKV(parallel.blocks[0].attn.qkv)  # as the plan holds it
    fused, keys = reference.state_dict(), parallel.state_dict().keys()
    split = split_state_dict(fused, keys)
    assert split.keys() == keys
    q, k, v = (split[f"blocks.0.attn.qkv.{part}.weight"] for part in "qkv")
    assert torch.equal(torch.cat([q, k, v]), fused["blocks.0.attn.qkv.weight"])
    assert split_state_dict(fused, fused.keys()) == fused
    parallel.load_state_dict(split)
    torch.testing.assert_close(parallel(torch.ones(1, 3, 32, 32)), reference(torch.ones(1, 3, 32, 32)))
    assert qkv_layouts_differ(fused, keys) and qkv_layouts_differ(keys, fused)
    assert not qkv_layouts_differ(keys, keys) and not qkv_layouts_differ(fused, {**fused, "extra.weight": 0})


def test_torchvision_s_fused_in_proj_maps_to_the_split_attention_and_back():
    """torchvision's ViT row's state-dict adapter: the fused `in_proj_weight` and `in_proj_bias` of an ordinary
    checkpoint load into HeadSplitAttention's q, k and v (by the module's own hook, and split by name), the split
    model computes the same logits, and its state dict fuses back to the ordinary one, key for key."""
    from dlojz_lib.model.tensor_plans import HeadSplitAttention
    from dlojz_lib.parallelism.tensor import qkv_layouts_differ, split_state_dict

    torch.manual_seed(0)
    reference, parallel, other = (tiny_model("torchvision_vit", 32) for _ in range(3))
    for model in (parallel, other):
        for block in model.encoder.layers:
            block.self_attention = HeadSplitAttention(block.self_attention)
    fused, keys = reference.state_dict(), parallel.state_dict().keys()
    prefix = "encoder.layers.encoder_layer_0.self_attention"
    assert {f"{prefix}.{part}.{name}" for part in "qkv" for name in ("weight", "bias")} <= set(keys)
    split = split_state_dict(fused, keys)
    assert split.keys() == keys
    parallel.load_state_dict(split)
    other.load_state_dict(fused)  # (the fused names, split by HeadSplitAttention's load hook)
    images = torch.randn(2, 3, 32, 32)
    for model in (parallel, other):
        torch.testing.assert_close(model(images), reference(images), rtol=1e-5, atol=1e-6)
    back = fused_state_dict(parallel.state_dict())
    assert list(back) == list(fused) and all(torch.equal(back[key], fused[key]) for key in fused)
    assert qkv_layouts_differ(fused, keys) and not qkv_layouts_differ(keys, keys)


@pytest.mark.multirank
def test_a_consolidated_tp_2_checkpoint_evaluates_under_tp(runs, tiny_data, tmp_path):
    """The names differ between --tp 1 (timm's fused qkv) and --tp 2 (q, k and v apart): a consolidated --tp 2
    checkpoint (fused) evaluates under --fsdp --tp 2 to the run's own last validation. (Resumes between the two,
    and every other pair of layouts: test_resume_matrix.py.)"""
    from conftest import read_json, run_dlojz, show
    from test_fsdp import BASE, checkpoint

    import dlojz_lib.checkpoint as ckpt

    tensor = [*BASE, "--data-root", tiny_data, "--num-workers", "0", "--fsdp", "-b", "16", "--tp", "2"]
    sharded = ckpt.load_latest(runs / "tp")[1]
    checkpoint(sharded)  # consolidated beside it
    metrics = tmp_path / "eval.json"
    proc = run_dlojz(*tensor, "--eval-only", "--resume", sharded.with_suffix(".consolidated.pt"),
                     "--output-dir", tmp_path / "eval", "--metrics-json", metrics, ranks=2)  # fmt: skip
    assert proc.returncode == 0, show(proc)
    evaluated, trained = read_json(metrics), read_json(runs / "tp.json")
    assert evaluated["val_accuracy"] == trained["val_accuracy"] and evaluated["val_images"] == 15
    assert evaluated["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-5)


@pytest.mark.multirank
def test_tp_trains_under_bfloat16_autocast_with_recomputed_activations(tiny_data, tmp_path):
    """--amp (bfloat16: FSDP gathers in it) and --grad-checkpointing with --tp: a --test run whose loss is finite,
    the chronometer's report and the per-rank memory line written; under --prof, the profiler's line gives the time
    in tensor parallelism's collectives (gloo: the training thread's waits for DTensor's all-reduces)."""
    import math

    from conftest import read_json, run_dlojz, show
    from test_fsdp import BASE

    metrics = tmp_path / "m.json"
    proc = run_dlojz(*BASE, "--data-root", tiny_data, "--num-workers", "0", "-b", "8", "--fsdp", "--tp", "2", "--amp",
                     "--amp-dtype", "bfloat16", "--grad-checkpointing", "--test", "--test-nsteps", "3", "--prof",
                     "--prof-wait", "0", "--prof-active", "1", "--output-dir", tmp_path / "run",
                     "--metrics-json", metrics, ranks=2)  # fmt: skip
    assert proc.returncode == 0, show(proc)
    result = read_json(metrics)
    assert result["compute_dtype"] == "bfloat16" and result["steps"] == 3 and math.isfinite(result["train_loss"])
    assert result["chrono"]["steps"] == 3 and "Model state per rank (TP 2 x FSDP 1" in proc.stdout
    line = next(line for line in proc.stdout.splitlines() if line.startswith("profiler: "))
    assert "collectives per step on rank 0 (host time): " in line and "waits " in line and "all_reduce " in line


@pytest.mark.multirank
def test_sequence_parallel_trains_to_the_weights_of_one_process(tiny_data, tmp_path):
    """--tp 2 --sequence-parallel at 48 px (10 tokens, 5 a rank) against one process at 48 px: the same weights
    after the epoch; the start-up line says the tokens are split; --check-replicas 1 compares the copies of the
    replicated weights at every step and finds them equal."""
    from conftest import run_dlojz, show
    from test_fsdp import BASE, assert_same_weights, weights

    size = ["--image-size", "48", "--val-resize-size", "54", "--val-crop-size", "48"]
    common = [*BASE, *size, "--data-root", tiny_data, "--num-workers", "0", "-b", "16"]
    single = run_dlojz(*common, "--output-dir", tmp_path / "single")
    assert single.returncode == 0, show(single)
    proc = run_dlojz(*common, "--fsdp", "--tp", "2", "--sequence-parallel", "--check-replicas", "1",
                     "--output-dir", tmp_path / "sp", ranks=2)  # fmt: skip
    assert proc.returncode == 0, show(proc)
    assert "the tokens split between them: sequence parallelism" in proc.stdout
    # every step's check passed: the replicated weights' copies stayed equal (their gradients averaged)
    assert "the weights each group holds whole get its average gradient, their copies compared every 1 steps" in (
        proc.stdout
    )
    assert_same_weights(weights(tmp_path / "sp"), weights(tmp_path / "single"), atol=1e-5)


@pytest.mark.parametrize(
    "flags, ranks, fragment",
    [
        (["--sequence-parallel"], 1, "--sequence-parallel splits the tokens over a tensor-parallel group: add --tp N"),
        (["--check-replicas", "5"], 1, "--check-replicas compares the weights a tensor-parallel group holds whole"),
        (["--fsdp", "--tp", "2", "--sequence-parallel"], 2, "sees 5 tokens at this image size, which do not split"),
        (  # trained an epoch, then validation's collectives mismatched (and the advice was to resume)
            [
                "--fsdp",
                "--tp",
                "2",
                "--sequence-parallel",
                "--image-size",
                "48",
                "--val-resize-size",
                "73",
                "--val-crop-size",
                "64",
            ],
            2,
            "sees 17 tokens at validation's --val-crop-size 64, which do not split over 2 ranks",
        ),
    ],
)
@pytest.mark.multirank
def test_what_sequence_parallel_cannot_do_is_one_line(flags, ranks, fragment, tiny_data, tmp_path):
    from conftest import run_dlojz
    from test_dlojz import assert_one_line_error
    from test_fsdp import BASE

    proc = run_dlojz(*BASE, "--data-root", tiny_data, "--num-workers", "0", "-b", "8", *flags,
                     "--output-dir", tmp_path / "run", ranks=ranks)  # fmt: skip
    assert_one_line_error(proc, fragment)


@pytest.mark.parametrize(
    "kind, size, fragment",
    [
        ("coatnet", 64, "--sequence-parallel: coatnet's attention runs on windows or NCHW maps"),
        ("torchvision_vit", 32, "--sequence-parallel: torchvision_vit's blocks (torchvision's) have no sequence-par"),
    ],
)
def test_sequence_parallelism_on_windows_or_maps_is_one_line(kind, size, fragment):
    """--sequence-parallel splits a timm ViT's tokens; a CoAtNet's attention on NCHW maps, and a family whose plan
    does not split tokens (torchvision's ViT), are refused before any change."""

    class Mesh:
        def size(self):
            return 2

    model = tiny_model(kind, size)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(UserError) as err:
        parallelize(model, Mesh(), kind, sequence_parallel=True)
    assert fragment in str(err.value)
    assert model.state_dict().keys() == before.keys()  # no block split


def parallel_memory():
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("parallel_memory", ROOT / "bench" / "parallel_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_table_of_the_course_coatnet_7_has_its_tp_rows(tmp_path, capsys):
    """The course's CoAtNet-7 (timm:coatnet_7_224, 2.43 B parameters, on the meta device) has a TP 4 x FSDP 2 row on
    8 GPUs: its state a little above FSDP's over 8 (the MBConv blocks, stem and head sharded over 2 replicas only),
    its activations (the transformer blocks' estimate) and the bytes it sends below FSDP's."""
    from conftest import read_json

    table = tmp_path / "table.json"
    assert parallel_memory().main(["--arch", "timm:coatnet_7_224", "--gpus", "8", "--json", str(table)]) == 0
    rows = {row["layout"]: row for row in read_json(table)}
    assert set(rows) == {"DDP", "FSDP", "TP 4 x FSDP 2", "PP 4 x FSDP 2"}
    assert 2.40e9 < rows["DDP"]["parameters"] < 2.45e9
    tp, fsdp = rows["TP 4 x FSDP 2"], rows["FSDP"]
    assert fsdp["parameter_bytes"] < tp["parameter_bytes"] < 1.25 * fsdp["parameter_bytes"]  # the MBConv replicated
    assert tp["activation_bytes"] < fsdp["activation_bytes"] and tp["sent_bytes_per_step"] < fsdp["sent_bytes_per_step"]
    assert "no tensor-parallel plan" not in capsys.readouterr().out


def test_the_table_of_a_model_without_a_plan_has_ddp_and_fsdp_only(tmp_path, capsys):
    """A convolutional model (timm's test_resnet): DDP's and FSDP's state per GPU, no TP row, its activations as its
    meta model's forward saves them (DDP's with autocast's copy of the weights), and a line saying which models have a plan."""
    from conftest import read_json

    bench = parallel_memory()
    table = tmp_path / "table.json"
    assert bench.main(["--arch", "timm:test_resnet", "--image-size", "32", "--gpus", "2,4", "--json", str(table)]) == 0
    rows = read_json(table)
    assert [row["layout"] for row in rows] == ["DDP", "FSDP"] * 2
    assert rows[1]["activation_bytes"] == rows[3]["activation_bytes"] > 0  # FSDP's on 2 and 4 GPUs
    copies = 2 * rows[0]["parameters"]  # DDP's: autocast's bfloat16 copy of the weights too
    assert rows[0]["activation_bytes"] == rows[2]["activation_bytes"] == rows[1]["activation_bytes"] + copies
    assert rows[3]["parameter_bytes"] < rows[1]["parameter_bytes"] < rows[0]["parameter_bytes"]
    assert "timm:test_resnet has no tensor-parallel plan in dlojz" in capsys.readouterr().out


def whole_copies_on_rank(rank, world, store_path, results):
    """One of 2 ranks of a tensor group: a tiny ViT split by the plan, one backward; rank 1's gradient of the final
    norm nudged (as another kernel's rounding would); then the averaged step, the unaveraged one, and a copy
    changed on rank 1 under the check."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dlojz_lib.parallelism.tensor import WholeCopies, replicas_differ

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))

        def gather(obj):
            out = [None] * world
            dist.all_gather_object(out, obj)
            return out

        outcome = {}
        for averaged in (False, True):  # the averaged model last: its copies equal until changed below
            torch.manual_seed(0)
            model = tiny_model("vit", 32)
            parallelize(model, mesh, "vit")
            copies = WholeCopies(model, mesh, check_every=2, gather=gather)
            names = [name for name, _ in copies.named]
            torch.nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1])).backward()
            if rank == 1:
                model.norm.weight.grad += 1e-3
            if averaged:
                copies.average_gradients()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            outcome[averaged] = replicas_differ(copies.named, mesh)
        copies.check(1)  # not a checked step: no comparison
        with torch.no_grad():
            model.norm.weight[0] = float("nan")  # the same NaN on both ranks: copies alike, bit for bit
            model.head.weight[0, 0] = float("inf")
        copies.check(2)
        with torch.no_grad():
            model.head.bias[0] += rank  # rank 1's copy changed
        try:
            copies.check(4)
            raised = None
        except UserError as err:
            raised = str(err)
        results.put((rank, names, outcome, raised))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_the_weights_a_group_holds_whole_keep_one_value_and_a_drift_is_named(tmp_path):
    """The replicated weights (norms, embeddings, head, the row-wise layers' biases; not the split q, k, v, fc1,
    proj and fc2 weights): a gradient that differs on one rank leaves their copies apart unless averaged over the
    group; --check-replicas names the first copy that differs, on every rank, in one line, and takes copies
    that are alike bit for bit as alike, NaN included."""
    from conftest import spawn_ranks

    found = {rank: rest for rank, *rest in spawn_ranks(whole_copies_on_rank, 2, tmp_path)}
    names, outcome, raised = found[0]
    assert "norm.weight" in names and "head.bias" in names and "blocks.0.attn.proj.bias" in names
    assert not any(name.endswith(("qkv.q.weight", "fc1.weight", "attn.proj.weight", "fc2.weight")) for name in names)
    assert "patch_embed.proj.weight" in names  # the stem
    assert outcome[True] is None and outcome[False] == ("norm.weight", 0, 1)  # averaged: equal; else apart
    for rank in (0, 1):
        assert found[rank][2] == (
            "--check-replicas 2: at step 4 ranks 0 and 1 hold different copies of head.bias, which their tensor "
            "group holds whole: the run stops here; resume it from its last checkpoint (--resume auto: one copy of "
            "each weight was saved) and report the GPUs and torch version"
        )


def test_check_replicas_reaches_the_model_s_whole_copies():
    """--check-replicas N is the period of the comparison the run's WholeCopies makes; without --tp there is none."""
    from types import SimpleNamespace

    from dlojz_lib.parallelism.layout import whole_copies

    ranks = SimpleNamespace(mesh={"tensor": object()}, all_gather=None)
    off, on = (SimpleNamespace(tp=tp, check_replicas=every, sequence_parallel=False) for tp, every in ((1, 0), (2, 3)))
    copies = whole_copies(on, torch.nn.Linear(2, 2), ranks, None)
    assert copies.check_every == 3 and [name for name, _ in copies.named] == ["weight", "bias"]
    assert whole_copies(off, torch.nn.Linear(2, 2), ranks, None) is None


def test_a_resume_across_the_qkv_namings_finds_each_entry_s_source():
    """Each key of the run's state (a weight, an optimizer entry, a group setting) found in a checkpoint of the other
    naming: a part in the fused tensor (its third), a fused tensor in the three parts; a key found nowhere, None."""
    from dlojz_lib.parallelism.fsdp import saved_sources

    fused = {"model.b.attn.qkv.weight", "optimizer.state.b.attn.qkv.weight.exp_avg", "model.b.norm.weight"}
    assert saved_sources("model.b.attn.qkv.k.weight", fused) == ("part", ["model.b.attn.qkv.weight"], 1)
    assert saved_sources("optimizer.state.b.attn.qkv.v.weight.exp_avg", fused) == (
        "part", ["optimizer.state.b.attn.qkv.weight.exp_avg"], 2
    )  # fmt: skip
    assert saved_sources("model.b.norm.weight", fused) == ("same", ["model.b.norm.weight"], None)
    split = {f"model.b.attn.qkv.{p}.weight" for p in "qkv"} | {
        f"optimizer.param_groups.b.attn.qkv.{p}.weight.lr" for p in "qkv"
    }
    assert saved_sources("model.b.attn.qkv.weight", split) == (
        "fuse",
        [f"model.b.attn.qkv.{p}.weight" for p in "qkv"],
        None,
    )
    assert saved_sources("optimizer.param_groups.b.attn.qkv.weight.lr", split)[0] == "fuse"
    assert saved_sources("model.b.attn.proj.weight", split) is None


def laid_out_on_rank(rank, world, store_path, results):
    """One of 4 ranks, 2 data replicas x 2 tensor ranks: torchvision's ViT laid out as dlojz.py lays out
    `--fsdp --tp 2` (`lay_out`: its row's plan, then FSDP over the data dimension), two SGD steps with momentum on
    its replica's half of a batch of 8, against one process on the whole batch: every weight, fused back."""
    import torch.distributed as dist

    from dlojz_lib.dist import Distribution, model_parallel_mesh
    from dlojz_lib.model.build import BuiltModel
    from dlojz_lib.parallelism.fsdp import state_bytes
    from dlojz_lib.parallelism.layout import lay_out
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--fsdp", "--tp", "2", "-b", "4"]))
        ranks = Distribution(world, rank, rank, torch.device("cpu"))
        model_parallel_mesh(ranks, 1, 2)
        torch.manual_seed(0)
        reference = tiny_model("torchvision_vit", 32)
        built = BuiltModel.of(tiny_model("torchvision_vit", 32), "torchvision_vit")
        built.module.load_state_dict(reference.state_dict())
        said = []
        model = lay_out(built, cfg, ranks, said.append)
        split = [p for p in model.module.parameters() if p.placements[-1].is_shard() and p.device_mesh.ndim == 2]
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (reference, model.module)]
        data = torch.Generator().manual_seed(1)
        for _ in range(2):
            images, labels = torch.randn(8, 3, 32, 32, generator=data), torch.randint(0, 3, (8,), generator=data)
            mine = slice(4 * ranks.data_rank, 4 * ranks.data_rank + 4)
            for net, optimizer, (x, y) in zip(
                (reference, model.net), optimizers, ((images, labels), (images[mine], labels[mine]))
            ):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                if net is model.net:  # as dlojz.py steps: the whole weights' gradients over the tensor group first
                    model.whole_copies.average_gradients()
                optimizer.step()
        held = state_bytes(model.module, optimizers[1])
        state = fused_state_dict({key: full(value) for key, value in model.module.state_dict().items()})
        expected = reference.state_dict()
        assert state.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)
        results.put((rank, said, len(split), held))
    except BaseException:
        results.put((rank, traceback.format_exc(), None, None))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_a_family_whose_blocks_are_not_timm_s_trains_under_fsdp_and_tp_as_one_process(tmp_path):
    """torchvision's ViT (nn.MultiheadAttention and torchvision's MLP: no timm class) under `--fsdp --tp 2` on 4
    ranks reaches one process's weights, by its row's plan alone (q, k, v and mlp.0 column-wise, out_proj and
    mlp.3 row-wise: 10 tensors a block split over the tensor dimension, 3 blocks), and the run's line says that
    plan. The planner prices it by the same row: its TP 2 x FSDP 2 row holds the largest rank's parameter and
    optimizer bytes to the byte."""
    import torch
    from conftest import spawn_ranks

    from dlojz_lib.parallelism.plan import LayoutTable, layout_rows

    found = spawn_ranks(laid_out_on_rank, 4, tmp_path)
    failures = [said for _, said, split, _ in found if split is None]
    assert not failures, "\n".join(failures)
    for _, said, split, _ in found:
        assert split == 3 * 10, split
        assert any("(q, k, v and mlp.0 column-wise, out_proj and mlp.3 row-wise)" in line for line in said), said
    with torch.device("meta"):
        module = tiny_model("torchvision_vit", 32)
    table = LayoutTable("torchvision_vit", 32, 3, 4, gpus=(4,), tp=(2,), pp=(), optimizer="sgd")
    row = next(row for row in layout_rows(table, module)[0] if row["layout"] == "TP 2 x FSDP 2")
    for key in ("parameter_bytes", "optimizer_bytes"):
        assert row[key] == max(held[key] for *_, held in found), (key, row[key], [held for *_, held in found])
