"""Pipeline parallelism's pieces (dlojz_lib/parallelism/pipeline.py): the layers of each known family compose to the model, the
stages' state dicts to the model's; on 2 and 4 gloo processes every schedule trains to one process's weights; the
lab (bench/pipeline_bubble.py) measures a bubble that shrinks as the micro-batches grow, as its formula says."""

import copy
import traceback

import pytest
import torch
import torchvision

from dlojz_lib.checks import UserError
from dlojz_lib.model import families
from dlojz_lib.model.build import BuiltModel
from dlojz_lib.model.zoo import create_model
from dlojz_lib.parallelism.bubble import Paused, expected_bubble
from dlojz_lib.parallelism.pipeline import (
    PipelineCut,
    Stage,
    bounds_at,
    build_pipeline,
    layer_seconds,
    layer_sizes,
    pipeline_eval,
    pipeline_layers,
    pipeline_step,
    stage_bounds,
    stage_copy,
)

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero-bubble", 2)]  # (schedule, stages per rank)


def small_model(arch):
    if arch == "toy-family":  # a model known by the row a test adds (dlojz_lib/model/families.py)
        from test_families import toy_with_its_row

        return toy_with_its_row()
    torch.manual_seed(0)
    if arch == "torchvision-vit":  # torchvision's ViT at 32 px: 16 patches, 3 blocks
        return torchvision.models.VisionTransformer(32, 8, 3, 2, 32, 64, num_classes=3)
    size = 64 if "coatnet" in arch or "maxvit" in arch else 32
    return create_model(arch, 3, False, size)


@pytest.mark.parametrize(
    "arch", ["timm:test_vit", "resnet18", "torchvision-vit", "timm:coatnet_pico_rw_224", "timm:maxvit_pico_rw_256"]
)
def test_the_stages_compose_to_the_model(arch):
    """Three stages balanced by parameters, each from a copy that holds only its own weights, run one after the
    other: the model's output to the last bit, and their state dicts, disjoint, are the model's."""
    model = small_model(arch).eval()
    image = torch.randn(2, 3, *(64, 64) if "coatnet" in arch or "maxvit" in arch else (32, 32))
    expected = model(image)
    layers = pipeline_layers(model, arch)
    bounds = stage_bounds(layer_sizes(model, layers), 3)
    x, keys = image, []
    for first, last in bounds:
        copied = stage_copy(model, layers, first, last)  # the others' weights on the meta device, pruned by Stage
        assert {p.device.type for p in copied.parameters()} == {"cpu", "meta"}
        stage = Stage(copied, pipeline_layers(copied, arch), first, last).eval()
        assert {p.device.type for p in stage.parameters()} == {"cpu"}  # its own, copied
        x = stage(x)
        keys.append(set(stage.state_dict()))
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    assert sum(len(k) for k in keys) == len(set().union(*keys)) == len(model.state_dict())
    assert set().union(*keys) == set(model.state_dict())


def test_a_stage_recomputes_its_layers_in_the_backward_to_the_same_gradients():
    """Stage(recompute=True) (--grad-checkpointing under --pp): the same output and gradients, from a forward that
    keeps a few tensors for the backward (each layer's input) instead of every activation."""
    model = small_model("timm:test_vit")
    image = torch.randn(4, 3, 32, 32)
    grads, saved = [], []
    for recompute in (False, True):
        copied = copy.deepcopy(model)
        stage = Stage(copied, pipeline_layers(copied, "timm:test_vit"), 0, 8, recompute)
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(1) or t, lambda t: t):
            loss = stage(image).square().sum()
        loss.backward()
        saved.append(len(count))
        grads.append({name: p.grad for name, p in stage.named_parameters()})
    assert saved[1] < saved[0] / 4, saved  # the activations dropped after the forward
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name])
    from dlojz_lib.torch_internals import (
        held_after_forward,
    )  # --activation-checkpointing selective, and --ac-every 2, under --pp

    held = {}
    for recompute, every in ((False, 1), ("selective", 1), ("selective", 2), ("full", 2)):
        copied = copy.deepcopy(model)
        stage = Stage(copied, pipeline_layers(copied, "timm:test_vit"), 0, 8, recompute, every=every)
        held[recompute, every] = held_after_forward(stage, image)
        stage(image).square().sum().backward()
        for name, parameter in stage.named_parameters():
            torch.testing.assert_close(parameter.grad, grads[0][name], msg=f"{recompute}, every {every}: {name}")
    assert held["selective", 1] < held["selective", 2] < held[False, 1], held
    assert held["full", 2] < held[False, 1], held


def test_each_stage_draws_its_own_random_numbers_and_its_peers_the_same():
    """Ranks are seeded alike: without a seed per stage, stage 1's stochastic-depth masks would repeat stage 0's.
    Two stages of the same layers (as two ranks run them, each from the run's seed): other masks on stage 1, the
    same on a stage's peer (a tensor peer, another replica), another at each numbered forward, none in eval mode, the
    process's generator left as it was, and a stage sought to a step draws what it drew there."""
    from timm.layers import DropPath

    def stage(index):
        model = torch.nn.Sequential(torch.nn.Identity(), DropPath(0.5), DropPath(0.5), torch.nn.Identity())
        return Stage(model, pipeline_layers(model), 1, 3, seed=7, index=index)

    def masks(stage, numbers=(0,)):
        torch.manual_seed(7)  # each rank's generator, as the run seeds it
        before = torch.get_rng_state()
        drawn = []
        for number in numbers:  # the micro-batches' forwards, as the schedule numbers them (number_forwards)
            stage.seek(number)
            drawn.append(stage(torch.ones(64, 1)).flatten())
        assert torch.equal(torch.get_rng_state(), before)  # the data's and the schedule's draws unchanged
        return drawn

    first, peer, second = masks(stage(0), (0, 1)), masks(stage(0), (0, 1)), masks(stage(1), (0, 1))
    assert torch.equal(first[0], peer[0]) and torch.equal(first[1], peer[1])  # peers alike
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[0], first[1])
    resumed = stage(0)
    assert torch.equal(masks(resumed, (1,))[0], first[1])
    again = stage(0)  # a forward the schedule does not number (shape inference) draws as the next, and counts none
    assert torch.equal(masks(again, (1,))[0], first[1]) and again.calls == 1
    evaluated = stage(0).eval()
    assert torch.equal(masks(evaluated)[0], torch.ones(64))


@pytest.mark.parametrize("recompute", [True, "selective"])
def test_a_stage_s_recomputation_counts_each_micro_batch_once_in_batch_norm(recompute):
    """--activation-checkpointing under --pp on a BatchNorm model: the stage's recomputation in the backward leaves
    the running statistics and the batch count as the forward left them, as a stage that keeps its activations."""
    model = small_model("resnet18")
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    states = []
    for mode in (False, recompute):
        copied = copy.deepcopy(model)
        stage = Stage(copied, pipeline_layers(copied, "resnet18"), 0, 4, mode)
        for _ in range(2):
            stage(images).square().sum().backward()
        states.append({name: buffer.clone() for name, buffer in stage.named_buffers()})
    assert states[0]["bn1.num_batches_tracked"] == 2
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("arch", ["resnet18", "timm:test_vit"])
def test_timing_the_layers_changes_no_state(arch):
    """--pp-split time's timing forwards (training mode, as the run trains) leave the model's buffers (BatchNorm's
    statistics and counts: a fine-tuned model's published ones) and the random generators (drop-path) as they were."""
    from dlojz_lib.parallelism.pipeline import time_layers

    torch.manual_seed(0)
    model = create_model(arch, 3, False, 32, 0.3 if "vit" in arch else None)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    sample = torch.randn(4, 3, 32, 32) + 3
    rng = torch.get_rng_state()
    time_layers(model, arch, sample, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


def draws_on_rank(rank, world, store_path, results):
    """One of 2 ranks: a drop-path ViT through the schedule (4 micro-batches a step), 2 steps, a validation, 2
    steps; then a second pipeline sought to step 2 (a resumed run), a validation, 2 steps: the draw numbers each
    micro-batch's forward seeds from."""
    import torch.distributed as dist

    from dlojz_lib.parallelism import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    drawn = []
    seeded = pipeline.stage_seed
    pipeline.stage_seed = lambda seed, index, number: drawn.append(number) or seeded(seed, index, number)
    try:
        found = []
        for resumed in (False, True):
            torch.manual_seed(0)
            model = create_model("timm:test_vit", 3, False, 32, 0.3)
            cut = PipelineCut(world, "1f1b", 4, seed=3)
            runner, stages, loss = build_pipeline(BuiltModel.of(model, "timm:test_vit"), cut, rank, torch.device("cpu"))
            loss.criterion = torch.nn.functional.cross_entropy
            data = torch.Generator().manual_seed(1)
            for step in range(2, 4) if resumed else range(4):
                if resumed and step == 2:
                    stages[0].seek(2 * 4)
                if step == 2:  # a validation between two steps: torch infers the shapes again after it
                    stages[0].eval()
                    pipeline_eval(runner, rank, world, torch.randn(8, 3, 32, 32), 8)
                    stages[0].train()
                images, labels = torch.randn(8, 3, 32, 32, generator=data), torch.randint(0, 3, (8,), generator=data)
                del drawn[:]
                pipeline_step(runner, rank, world, images, labels)
                found.append((resumed, step, list(drawn)))
        results.put((rank, found))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_a_stage_draws_by_step_and_micro_batch_whatever_validations_ran(tmp_path):
    """The schedule runs a training forward of its own to infer shapes after every eval -> train switch: a stage
    counting forwards drew one number ahead after a validation, and a run resumed past one drew otherwise than the
    uninterrupted run. Each micro-batch's forward draws by (step, micro-batch): 4 a step, the same resumed."""
    from conftest import spawn_ranks

    for rank, found in spawn_ranks(draws_on_rank, 2, tmp_path):
        scheduled = {}
        for resumed, step, drawn in found:
            assert drawn[-4:] == [4 * step + k for k in range(4)], (rank, resumed, step, drawn)
            scheduled[resumed, step] = drawn[-4:]
        assert scheduled[True, 2] == scheduled[False, 2] and scheduled[True, 3] == scheduled[False, 3]


def test_the_cut_balances_the_largest_stage():
    """The largest stage is the smallest possible: a heavy layer alone, the light ones together; each stage at least
    one layer; balanced by measured time, a slow layer alone; more stages than layers, or a model without a split,
    is one line."""
    assert stage_bounds([1, 1, 1, 1, 10, 1], 3) == [(0, 4), (4, 5), (5, 6)]
    assert stage_bounds([5, 5, 5, 5], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_bounds([1, 2, 3], 1) == [(0, 3)]
    with pytest.raises(UserError, match=r"--pp 5: the model has 4 layers \(stem, blocks, head\)"):
        stage_bounds([1, 1, 1, 1], 5)
    with pytest.raises(UserError, match="--pp: --arch mine has no pipeline split here: timm's ViT"):
        pipeline_layers(torch.nn.Linear(2, 2), "mine")
    assert bounds_at([4], 8, 2) == [(0, 4), (4, 8)]
    # the slow layer alone unless the first two layers' measured times exceed it: 20 ms of a loaded machine's
    # oversleep over their 2 x 2 ms, not the 2 ms a 3 ms layer left (seen once in a clean-clone run)
    slow_last = torch.nn.Sequential(*(Paused(4, seconds) for seconds in (1e-3, 1e-3, 1e-3, 12e-3)))
    layers = pipeline_layers(slow_last)
    assert stage_bounds(layer_sizes(slow_last, layers), 2) == [(0, 2), (2, 4)]  # the same parameters each
    assert stage_bounds(layer_seconds(slow_last, layers, torch.randn(2, 4)), 2) == [(0, 3), (3, 4)]  # its time
    for cuts in ([4], [5, 3], [0, 4], [4, 8]):
        with pytest.raises(UserError, match="--pp-split .*: 2 increasing layer indices between 1 and 7"):
            bounds_at(cuts, 8, 3)
    assert expected_bubble(4, 4) == pytest.approx(3 / 7) and expected_bubble(1, 8) == 0
    assert expected_bubble(4, 4, stages_per_rank=2) == pytest.approx(3 / 11)


def train_on_rank(rank, world, store_path, results, cases):
    """One rank: for each (arch, schedule, stages per rank, tensor-parallel size), two SGD steps with momentum
    through the pipeline (8 images in 4 micro-batches) against one process accumulating the same micro-batches;
    then a forward-only pass of 8 images and of 3 (a validation's last batch, padded) against the model in eval
    mode. With a tensor-parallel size t, the ranks are a (pipe, tensor) mesh: world / t stages, each split over t
    ranks by dlojz's tensor-parallel plan (3-D without its data dimension)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dlojz_lib.parallelism.tensor import fused_state_dict, parallelize

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        loss_fn = torch.nn.functional.cross_entropy
        for arch, schedule, per_rank, tp in cases:
            model = small_model(arch)
            reference, family = copy.deepcopy(model), families.family_of(model)
            pipe, group = rank, None
            if tp > 1:
                mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("pipe", "tensor"))
                pipe, group = mesh["pipe"].get_local_rank(), mesh["pipe"].get_group()
            cut = PipelineCut(world // tp, schedule, 4, per_rank)
            runner, stages, loss = build_pipeline(BuiltModel.of(model, arch), cut, pipe, torch.device("cpu"), group)
            loss.criterion = loss_fn
            for stage in stages if tp > 1 else ():
                parallelize(stage, mesh["tensor"], arch, family=family)  # (a stage is of no family: the model's)
                assert any(isinstance(p, DTensor) for p in stage.parameters()), f"{arch}: no block split"
            optimizer = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.1, momentum=0.9)
            expected = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
            data = torch.Generator().manual_seed(1)
            for _ in range(2):
                images, labels = torch.randn(8, 3, 32, 32, generator=data), torch.randint(0, 3, (8,), generator=data)
                optimizer.zero_grad()
                _, losses = pipeline_step(runner, pipe, world // tp, images, labels)
                optimizer.step()
                expected.zero_grad()
                mean_loss = 0.0
                for micro_images, micro_labels in zip(images.chunk(4), labels.chunk(4)):
                    share = loss_fn(reference(micro_images), micro_labels) / 4
                    share.backward()
                    mean_loss += share.item()
                expected.step()
                if pipe == world // tp - 1:  # the micro-batches' shares of the loss sum to the batch's mean
                    assert len(losses) == 4 and abs(sum(loss.item() for loss in losses) - mean_loss) < 1e-5, losses
            whole = reference.state_dict()
            for stage in stages:
                state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in stage.state_dict().items()}
                for key, value in fused_state_dict(state).items():  # (q, k and v held apart under --tp)
                    torch.testing.assert_close(value, whole[key], rtol=1e-4, atol=1e-5, msg=f"{schedule}: {key}")
            for stage in stages:
                stage.eval()
            reference.eval()
            for count in (8, 3):  # a last, smaller batch too; the same images on every rank
                images = torch.randn(count, 3, 32, 32, generator=data)
                logits = pipeline_eval(runner, pipe, world // tp, images, 8)
                if pipe == world // tp - 1:
                    torch.testing.assert_close(logits, reference(images), rtol=1e-4, atol=1e-5)
                else:
                    assert logits is None
            results.put((rank, arch, f"{schedule} tp {tp}", [stage.names for stage in stages]))
        dist.barrier()  # every rank's last sends received before the group goes
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc(), None))


def gathers_on_rank(rank, world, store_path, results):
    """One of 2 ranks, the data dimension of a one-stage pipeline whose stage FSDP shards over both: the collectives
    of a step of 4 micro-batches (after a first one), the blocks resharded after their forward as --pp's default
    sets it, and as --fsdp-reshard-after-forward forces it."""
    import torch.distributed as dist
    from conftest import counting_mode
    from torch.distributed.device_mesh import init_device_mesh

    from dlojz_lib.parallelism.fsdp import shard_model
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data", "pipe"))
        for forced in ([], ["--fsdp-reshard-after-forward"]):
            argv = ["--device", "cpu", "--fsdp", "--pp", "2", *forced]
            reshard = resolve_config(get_args_parser().parse_args(argv)).fsdp_reshard_after_forward
            units = []

            def shard(stage):
                units.append(shard_model(stage, reshard, None, torch.device("cpu"), mesh["data"]) + 1)  # and the root

            model = BuiltModel.of(small_model("timm:test_vit"), "timm:test_vit")
            cut = PipelineCut(1, "1f1b", 4, wrap=shard)
            runner, _, loss = build_pipeline(model, cut, 0, torch.device("cpu"), mesh["pipe"].get_group())
            loss.criterion = torch.nn.functional.cross_entropy
            images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 3, (8,))
            pipeline_step(runner, 0, 1, images, labels)
            with counting_mode() as counted:
                pipeline_step(runner, 0, 1, images, labels)
            results.put((rank, bool(forced), units[0], dict(counted.counts)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_under_pp_fsdp_gathers_each_unit_once_a_step(tmp_path):
    """--pp's default keeps a stage's blocks gathered from their forward to their backward: one all-gather per FSDP
    unit a step, where resharding (--fsdp-reshard-after-forward, forced) gathers each block again for every
    micro-batch (M forwards and the backward: 4 + 1 here); one reduce-scatter per unit either way."""
    from conftest import spawn_ranks

    found = {
        (rank, forced): (units, counts) for rank, forced, units, counts in spawn_ranks(gathers_on_rank, 2, tmp_path)
    }
    units, default = found[(0, False)]
    assert units == 7 and default == {"all_gather": units, "reduce_scatter": units}, default  # 6 blocks and the root
    _, forced = found[(0, True)]
    assert forced == {"all_gather": 6 * (4 + 1) + 1, "reduce_scatter": units}, forced
    assert found[(1, False)][1] == default


def cut_on_rank(rank, world, store_path, results):
    """One of 4 ranks, 2 data replicas x 2 stages: --pp-split time on a toy whose slow layer is the last on replica
    0 and the first on replica 1 (each replica's own times would cut it [(0, 3), (3, 4)] and [(0, 1), (1, 4)])."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "pipe"))
        replica = mesh["data"].get_local_rank()
        pauses = (1e-3, 1e-3, 1e-3, 10e-3) if replica == 0 else (10e-3, 1e-3, 1e-3, 1e-3)
        toy = torch.nn.Sequential(*(Paused(4, seconds) for seconds in pauses))
        pipe = mesh["pipe"].get_local_rank()
        cut = PipelineCut(2, "1f1b", 2, split="time", sample=torch.randn(2, 4))
        _, stages, _ = build_pipeline(
            BuiltModel.of(toy, "toy"), cut, pipe, torch.device("cpu"), mesh["pipe"].get_group()
        )
        results.put((rank, stages[0].names))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_a_cut_by_time_is_the_same_on_every_data_replica(tmp_path):
    """The layers' times are summed over the world, not one pipeline: replica 1's stages hold the layers replica 0's
    do, whatever each replica measured (else their sends and receives would never meet: a hang)."""
    from conftest import spawn_ranks

    names = dict(spawn_ranks(cut_on_rank, 4, tmp_path))
    assert names[0] == names[2] and names[1] == names[3], names  # ranks 0, 1: replica 0's stages; 2, 3: replica 1's
    assert names[0] + names[1] == ["0", "1", "2", "3"], names


def spawn(world, cases, tmp_path):
    from conftest import spawn_ranks

    found = spawn_ranks(train_on_rank, world, tmp_path, cases)
    errors = [f"rank {r}: {text}" for r, kind, text, _ in found if kind == "error"]
    assert not errors, "\n".join(errors)
    return found


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    cases = [("timm:test_vit", schedule, per_rank, 1) for schedule, per_rank in SCHEDULES]
    cases.append(("resnet18", "1f1b", 1, 1))
    return spawn(2, cases, tmp_path_factory.mktemp("pp2"))


@pytest.mark.multirank
def test_every_schedule_trains_to_the_weights_of_one_process(two_ranks):
    """2 ranks, a ViT (no BatchNorm) under each schedule and a ResNet (BatchNorm on each micro-batch, as one process
    accumulating them) under 1F1B: after two SGD steps with momentum each stage's weights and buffers are one
    process's (float32 sums in another order: 1e-5), and the pipeline's eval-mode logits, of a full batch and of a
    smaller last one, are the model's. The interleaved schedules hold 2 stages a rank (0 and 2, 1 and 3)."""
    trained = {(rank, arch, schedule): names for rank, arch, schedule, names in two_ranks}
    assert len(trained) == 2 * (len(SCHEDULES) + 1)
    assert trained[(0, "timm:test_vit", "gpipe tp 1")] == [["stem", "blocks.0", "blocks.1"]]
    assert len(trained[(1, "timm:test_vit", "interleaved tp 1")]) == 2


@pytest.mark.multirank
def test_four_ranks_train_to_the_weights_of_one_process_in_4_stages_and_in_2_of_2_ranks(tmp_path):
    """4 ranks: 1F1B over 4 stages (stem, blocks, head of a ViT), then over 2 stages each split over 2 ranks by the
    tensor-parallel plan (a (pipe, tensor) mesh): both reach one process's weights, and their eval logits its; so
    does a toy model whose family is the one row tests/model/test_families.py adds, under PP 2 x TP 2, and
    torchvision's ViT, whose blocks (nn.MultiheadAttention) its row's own plan splits."""
    cases = [("timm:test_vit", "1f1b", 1, 1), ("timm:test_vit", "1f1b", 1, 2), ("toy-family", "1f1b", 1, 2),
             ("torchvision-vit", "1f1b", 1, 2)]  # fmt: skip
    found = spawn(4, cases, tmp_path)
    names = {(rank, arch, schedule): stages for rank, arch, schedule, stages in found}
    assert sorted(rank for rank, _, _ in names) == [rank for rank in range(4) for _ in cases]
    vit = names[(1, "timm:test_vit", "1f1b tp 2")]
    assert vit == names[(0, "timm:test_vit", "1f1b tp 2")] == [["stem", "blocks.0", "blocks.1"]]  # one stage
    toy = names[(0, "toy-family", "1f1b tp 2")], names[(3, "toy-family", "1f1b tp 2")]
    assert toy == ([["stem", "mixers.0"]], [["mixers.1", "mixers.2", "mixers.3", "head"]]), toy  # cut by parameters


@pytest.mark.multirank
def test_the_pipeline_lab_prints_the_bubble_beside_its_formula(tmp_path):
    """bench/pipeline_bubble.py on 2 CPU ranks with the paused toy: a row per schedule and micro-batch count, the
    formula's bubble beside a measured idle share, and images per second that no schedule can beat: each rank's
    layers pause 3 ms an image (forward 1, backward 2) over 4 of the 8 layers, and a pause never ends early, so a
    step takes at least 16 x 12 ms / (1 - the formula's bubble) however loaded the machine is. How near the
    measured bubble comes to the formula is the lab's to show (a share of wall-clock time), not this test's."""
    import subprocess

    from conftest import ROOT, clean_env, read_json, script_python

    table = tmp_path / "rows.json"
    proc = subprocess.run(  # (the ranks: forks of the tests' preloaded server, as torchrun starts them)
        [*script_python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "bench" / "pipeline_bubble.py"), "--arch", "toy", "--schedules", "gpipe,interleaved",
         "--microbatches", "2,8", "-b", "16", "--steps", "2", "--json", str(table)],
        capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(row["schedule"], row["microbatches"]): row for row in read_json(table)}
    assert set(rows) == {("gpipe", 2), ("gpipe", 8), ("interleaved", 2), ("interleaved", 8)}
    assert rows[("gpipe", 2)]["bubble_expected"] == pytest.approx(1 / 3)
    assert (
        rows[("interleaved", 8)]["bubble_expected"] == pytest.approx(1 / 17) and rows[("interleaved", 8)]["stages"] == 4
    )
    for row in rows.values():
        assert 0 <= row["bubble_mean"] <= row["bubble_max"] < 1, row
        fastest = (1 - row["bubble_expected"]) / (4 * 3e-3)  # images a second with no overhead at all
        assert 0 < row["images_per_s"] <= fastest * (1 + 1e-3), (row, fastest)
    assert "schedule      stages  micro  bubble max" in proc.stdout
    for row in rows.values():
        assert f"{row['bubble_expected']:.3f}" in proc.stdout


def test_the_day_4_table_s_pipeline_rows_hold_the_stages_bytes(tmp_path):
    """bench/parallel_memory.py's PP rows: on 2 GPUs (one pipeline of 2 stages) each GPU holds the largest real
    Stage's parameters, to the byte, and sends one way for 4 micro-batches of 4 images (the first stage its output,
    the last its input's gradient); on 4 GPUs FSDP halves the stage; the first stage's activations under 1F1B are
    below FSDP's whole model's."""
    from conftest import read_json
    from test_tensor_parallel import parallel_memory

    table = tmp_path / "table.json"
    argv = ["--arch", "timm:test_vit", "--image-size", "32", "--num-classes", "3", "--gpus", "2,4", "--pp", "2",
            "--pp-microbatches", "4", "--optimizer", "sgd", "-b", "8", "--json", str(table)]  # fmt: skip
    assert parallel_memory().main(argv) == 0
    rows = {(row["gpus"], row["layout"]): row for row in read_json(table)}
    model = create_model("timm:test_vit", 3, False, 32)
    layers = pipeline_layers(model)
    bounds = stage_bounds(layer_sizes(model, layers), 2)
    sizes, x = [], torch.randn(1, 3, 32, 32)
    for first, last in bounds:
        copied = copy.deepcopy(model)
        stage = Stage(copied, pipeline_layers(copied), first, last)
        sizes.append(sum(p.numel() for p in stage.parameters()))
        x = stage(x) if first == 0 else x  # the first stage's output: what it sends on
    pipeline = rows[(2, "PP 2 x FSDP 1")]
    assert pipeline["parameter_bytes"] == 4 * max(sizes) and pipeline["parameters"] == sum(sizes)
    assert pipeline["sent_bytes_per_step"] == 4 * 4 * x.numel() * 2  # 4 micro-batches of 4, bf16
    assert rows[(4, "PP 2 x FSDP 2")]["parameter_bytes"] <= pipeline["parameter_bytes"] // 2 + 4 * 1024
    assert pipeline["activation_bytes"] < rows[(2, "FSDP")]["activation_bytes"]
    assert pipeline["bubble"] == pytest.approx(1 / 5)


# ---------------------------------------------------------------------------------------------- dlojz.py --pp


STEPS = 2  # the steps of the runs below: half the 4 of an epoch of the tiny images in batches of 16


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The same training (global batch 16 of half the images, 2 steps: the last incomplete batch dropped, as --pp
    does) as one process, as a pipeline of 2 ranks under 1F1B (4 micro-batches, cut by parameters), under GPipe (2
    micro-batches, cut at layer 4), on 4 ranks as 2 pipelines x 2 data replicas of 8 images, the gradients' global norm clipped to 0.1
    (below a fresh ViT's; cut by the layers' times, summed over the world), beside one process clipping too, and as
    PP 2 x TP 2 on 4 ranks (also cut after the stem: a stage without a block). A ResNet-18's pipeline (BatchNorm:
    one process accumulating 4 batches of 4) is a cell of tests/parallelism/test_family_matrix.py. One process also
    trains the whole epoch (4 steps), the weights a run stopped mid-epoch and resumed ends on."""
    from conftest import run_dlojz, show
    from test_fsdp import BASE

    out = tmp_path_factory.mktemp("pp")
    common = [*BASE, "--data-root", tiny_data, "--num-workers", "0"]  # 4 ranks on 2 cores: no CPU for a worker
    proc = run_dlojz(*common, "-b", "16", "--drop-last", "--output-dir", out / "single-epoch")
    assert proc.returncode == 0, show(proc)
    common += ["--train-subset", str(STEPS / 4)]
    for name, ranks, flags in (
        ("single", 1, ["-b", "16", "--drop-last"]),
        ("1f1b", 2, ["-b", "16", "--fsdp", "--pp", "2"]),
        ("gpipe", 2, ["-b", "16", "--fsdp", "--pp", "2", "--pp-schedule", "gpipe", "--pp-microbatches", "2",
                      "--pp-split", "4"]),
        ("single-clip", 1, ["-b", "16", "--drop-last", "--clip-grad-norm", "0.1"]),
        ("pp-data-clip", 4, ["-b", "8", "--fsdp", "--pp", "2", "--pp-microbatches", "2", "--clip-grad-norm", "0.1",
                             "--pp-split", "time"]),
        ("pp-tp", 4, ["-b", "16", "--fsdp", "--pp", "2", "--tp", "2"]),
        ("pp-tp-stem", 4, ["-b", "16", "--fsdp", "--pp", "2", "--tp", "2", "--pp-split", "1"]),
        ("interleaved", 2, ["-b", "16", "--fsdp", "--pp", "2", "--pp-schedule", "interleaved"]),
    ):  # fmt: skip
        proc = run_dlojz(
            *common, *flags, "--output-dir", out / name, "--metrics-json", out / f"{name}.json", ranks=ranks
        )
        assert proc.returncode == 0, show(proc)
        (out / f"{name}.log").write_text(proc.stdout)
    return out


@pytest.mark.parametrize(
    "name, reference",
    [("1f1b", "single"), ("gpipe", "single"), ("interleaved", "single"), ("pp-data-clip", "single-clip"),
     ("pp-tp", "single"), ("pp-tp-stem", "single")],
)  # fmt: skip
@pytest.mark.multirank
def test_pp_trains_to_the_weights_of_one_process(runs, name, reference):
    """`dlojz.py --fsdp --pp 2` under either schedule, and with 2 data replicas, reaches one process's weights after
    2 SGD steps (float32 sums in another order); its checkpoint (each stage's shards) consolidates into an ordinary
    model's, key for key; the loss and accuracy the log prints are the last stage's; validation sees each of the 15
    images once, with one process's figures."""
    from conftest import read_json
    from test_fsdp import assert_same_weights, checkpoint

    consolidated, one = checkpoint(runs / name), checkpoint(runs / reference)
    assert_same_weights(consolidated["model"], one["model"], atol=1e-5)
    # the stages' optimizer states, saved parameter by parameter, are one process's momentum buffers, in its groups
    momentum = [{i: s["momentum_buffer"] for i, s in c["optimizer"]["state"].items()} for c in (consolidated, one)]
    assert momentum[0].keys() == momentum[1].keys() and len(momentum[0]) == len(consolidated["model"])
    assert all(torch.allclose(momentum[0][i], momentum[1][i], atol=1e-5) for i in momentum[0])
    settings = [[{k: g[k] for k in ("params", "lr", "momentum", "weight_decay")} for g in c["optimizer"]["param_groups"]]
                for c in (consolidated, one)]  # fmt: skip
    assert settings[0] == settings[1]
    metrics, single = read_json(runs / f"{name}.json"), read_json(runs / f"{reference}.json")
    assert (metrics["steps"], metrics["global_batch_size"], metrics["val_images"]) == (STEPS, 16, 15)
    assert metrics["train_loss"] == pytest.approx(single["train_loss"], rel=1e-4)
    assert metrics["val_accuracy"] == single["val_accuracy"]
    assert metrics["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4)
    log = (runs / f"{name}.log").read_text()
    stages = {
        "1f1b": "stem to blocks.1 (133,056 parameters); blocks.2 to head (167,235 parameters)",
        "gpipe": "stem to blocks.2 (",
        "pp-data-clip": "parameters), the same cut on each of 2 data replicas; each sharded by FSDP (",
        "pp-tp": "each split over 2 ranks by the tensor-parallel plan and sharded by FSDP (2 blocks) over 1 data",
        "interleaved": "stem (49,600 parameters) and blocks.2 to blocks.3 (83,456 parameters); blocks.0 to blocks.1",
        # a stage without a transformer block (the stem alone) stays whole on both ranks of its tensor group
        "pp-tp-stem": "stages: stem (49,600 parameters, no block: replicated over the tensor group); blocks.0 to head",
    }
    assert stages[name] in next(line for line in log.splitlines() if line.startswith("pipeline: ")), log
    schedule = {"1f1b": "schedule 1f1b, 4 micro-batches of 4", "gpipe": "schedule gpipe, 2 micro-batches of 8",
                "pp-tp": "schedule 1f1b, 4 micro-batches of 4", "pp-tp-stem": "schedule 1f1b, 4 micro-batches of 4",
                "interleaved": "4 stages, 2 a rank, schedule interleaved, 4 micro-batches of 4"}  # fmt: skip
    assert schedule.get(name, "schedule 1f1b, 2 micro-batches of 4") in log


@pytest.mark.multirank
def test_pp_evaluates_its_own_and_an_ordinary_checkpoint_as_one_process(runs, tiny_data, tmp_path):
    """--eval-only through the pipeline: its own sharded checkpoint and one process's ordinary one (each stage taking
    its layers' weights) give one process's validation, and --predictions the same classes image by image."""
    import csv

    from conftest import read_json, run_dlojz, show
    from test_fsdp import BASE

    def predicted(path):
        with open(path, newline="") as file:
            return [(row["image"], row["predicted_class"]) for row in csv.DictReader(file)]

    import dlojz_lib.checkpoint as ckpt

    single = read_json(runs / "single.json")
    ordinary = ckpt.newest_checkpoint(runs / "single")
    own = next(path for path in ckpt.list_checkpoints(runs / "1f1b") if path.suffix == ".dcp")
    common = [*BASE, "--data-root", tiny_data, "--num-workers", "0", "-b", "16", "--eval-only"]
    first = run_dlojz(*common, "--resume", ordinary, "--output-dir", tmp_path / "one",
                      "--predictions", tmp_path / "one.csv")  # fmt: skip
    assert first.returncode == 0, show(first)
    for name, source in (("own", own), ("ordinary", ordinary)):
        proc = run_dlojz(*common, "--fsdp", "--pp", "2", "--resume", source, "--output-dir", tmp_path / name,
                         "--metrics-json", tmp_path / f"{name}.json", "--predictions", tmp_path / f"{name}.csv",
                         ranks=2)  # fmt: skip
        assert proc.returncode == 0, show(proc)
        metrics = read_json(tmp_path / f"{name}.json")
        assert metrics["val_images"] == 15 and metrics["val_accuracy"] == single["val_accuracy"]
        assert metrics["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4)
        assert predicted(tmp_path / f"{name}.csv") == predicted(tmp_path / "one.csv")


@pytest.mark.multirank
def test_pp_clips_the_global_norm_across_stages(runs):
    """--clip-grad-norm under --pp: each stage's norm, the squares summed over the pipeline: one process's clip (the
    clip changed the run)."""
    from test_fsdp import weights

    clipped, unclipped = weights(runs / "pp-data-clip"), weights(runs / "single")
    assert any(not torch.allclose(clipped[k], unclipped[k], atol=1e-4) for k in clipped)


@pytest.mark.multirank
def test_the_day_4_table_s_pp_x_tp_row_holds_what_a_3d_run_measures(runs, tmp_path):
    """bench/parallel_memory.py's PP 2 x TP 2 row: each GPU's parameters, to the byte, those a 3-D run of dlojz.py
    measured on its largest rank; its activations below PP 2's alone (the blocks' split), its sends above the
    stages' alone (TP's all-reduces)."""
    from conftest import read_json
    from test_tensor_parallel import parallel_memory

    table = tmp_path / "table.json"
    argv = ["--arch", "timm:test_vit", "--image-size", "32", "--num-classes", "3", "--gpus", "2,4", "--pp", "2",
            "--tp", "2", "--pp-microbatches", "4", "--optimizer", "sgd", "-b", "8", "--json", str(table)]  # fmt: skip
    assert parallel_memory().main(argv) == 0
    rows = {(row["gpus"], row["layout"]): row for row in read_json(table)}
    three_d, measured = rows[(4, "PP 2 x TP 2 x FSDP 1")], read_json(runs / "pp-tp.json")
    assert three_d["parameter_bytes"] == measured["parameter_bytes_per_rank"]
    assert three_d["optimizer_bytes"] == measured["optimizer_bytes_per_rank"]
    assert measured["parallel"] == "pp" and measured["pipeline_size"] == 2 and measured["tensor_parallel_size"] == 2
    assert three_d["activation_bytes"] < rows[(4, "PP 2 x FSDP 2")]["activation_bytes"]
    assert three_d["sent_bytes_per_step"] > rows[(2, "PP 2 x FSDP 1")]["sent_bytes_per_step"]  # the stages' sends


@pytest.mark.multirank
def test_a_pp_run_stopped_mid_epoch_resumes_to_the_same_weights(runs, tiny_data, tmp_path):
    """Saved by a pipeline of 2 ranks after a step or two (each stage's shards in one DCP folder), resumed by the same
    layout: the epoch goes on after the images already trained on, and the run ends on one process's weights."""
    from conftest import run_dlojz, show
    from test_fsdp import BASE, assert_same_weights, stopped_mid_epoch, weights

    out = tmp_path / "run"
    common = [*BASE, "--data-root", tiny_data, "--num-workers", "0", "-b", "16", "--fsdp", "--pp", "2"]
    stopped_mid_epoch(common, out, steps=4)
    proc = run_dlojz(*common, "--output-dir", out, "--resume", "auto", ranks=2)
    assert proc.returncode == 0, show(proc)
    assert_same_weights(weights(out), weights(runs / "single-epoch"), atol=1e-5)


@pytest.mark.parametrize(
    "flags, ranks, fragments",
    [
        (["--pp", "2"], 1, ["--pp 2 runs with --fsdp over the data dimension", "add --fsdp"]),
        (["--pp", "2", "--fsdp", "--pp-microbatches", "1"], 1, ["--pp-microbatches 1: at least --pp 2"]),
        (["--pp", "2", "--fsdp", "--pp-microbatches", "3"], 1, ["--pp-microbatches 3 must divide -b 8"]),
        (
            ["--pp", "2", "--fsdp", "--grad-acc", "2"],
            1,
            ["the schedule already accumulates", "--pp-microbatches 2 x M"],
        ),
        (["--pp", "2", "--fsdp", "--pp-split", "2,3"], 1, ["--pp-split 2,3: params, time, or 1 layer indices"]),
        (["--pp-microbatches", "4"], 1, ["set how --pp N cuts the model: add --pp N"]),
        (["--pp", "2", "--fsdp", "--pp-stages-per-rank", "2"], 1, ["--pp-schedule 1f1b holds one; add --pp-schedule"]),
        (["--pp", "2", "--fsdp", "--pp-schedule", "zero-bubble"], 1, ["after FSDP has reduced them"]),
        (["--pp", "2", "--fsdp", "--pp-schedule", "interleaved", "--pp-split", "3"], 1, ["3 layer indices"]),
        (
            ["--pp", "2", "--fsdp", "--pp-schedule", "interleaved", "--pp-microbatches", "5", "-b", "10"],
            1,
            ["--pp-microbatches 5: --pp-schedule interleaved over --pp 2 runs them in 2 rounds", "(e.g. 2)"],
        ),
        (["--pp", "2", "--fsdp", "--no-drop-last"], 1, ["--pp 2 with --no-drop-last"]),
        (  # gloo's "Received data size doesn't match" at the first step of a new resolution (NCCL: undefined)
            ["--pp", "2", "--fsdp", "--min-res", "32", "--max-res", "48", "--end-ramp", "1"],
            1,
            ["--pp 2 with --min-res: the stages send activations of the shape", "drop one of them"],
        ),
        (["--pp", "2", "--fsdp", "--tp", "2", "--sequence-parallel"], 1, ["--pp 2 with --sequence-parallel"]),
        (["--pp", "2", "--fsdp", "--tp", "2"], 2, ["--pp 2 x --tp 2 = 4: this job has 2 rank(s), not a multiple of 4"]),
        (["--pp", "3", "--fsdp", "--pp-microbatches", "4"], 4, ["--pp 3: this job has 4 rank(s), not a multiple of 3"]),
        (["--pp", "2", "--fsdp", "--pp-split", "9"], 2, ["--pp-split", "9"]),
        # the ranks named first: -b 8 in --pp 3's default 6 micro-batches was blamed on --pp-microbatches
        (["--pp", "3", "--fsdp"], 2, ["--pp 3: this job has 2 rank(s), not a multiple of 3"]),
        (  # micro-batches of 1 image: BatchNorm's "Expected more than 1 value per channel" inside the schedule
            ["--pp", "2", "--fsdp", "--arch", "resnet18", "-b", "4"],
            2,
            ["-b 4 in --pp-microbatches 4: micro-batches of 1 image", "give -b 8 or more, or --pp-microbatches 2"],
        ),
        (
            ["--pp", "2", "--fsdp", "--pp-schedule", "interleaved", "--pp-stages-per-rank", "5"],
            2,
            ["--pp 2 x --pp-stages-per-rank 5 = 10 stages: the model has 8 layers"],
        ),
        (
            ["--pp", "2", "--fsdp", "--arch", "timm:test_resnet"],
            2,
            ["--arch timm:test_resnet has no pipeline split here"],
        ),
    ],
)
@pytest.mark.multirank
def test_what_pp_cannot_do_is_one_line(flags, ranks, fragments, tiny_data, tmp_path):
    from conftest import run_dlojz
    from test_dlojz import assert_one_line_error
    from test_fsdp import BASE

    proc = run_dlojz(*BASE, "--data-root", tiny_data, "--num-workers", "0", "-b", "8", *flags,
                     "--output-dir", tmp_path / "run", ranks=ranks)  # fmt: skip
    assert_one_line_error(proc, *fragments)


@pytest.mark.multirank
def test_the_lab_sweeps_schedules_and_prints_each_run_s_bubble(tiny_data, tmp_path):
    """`dlojz_lab.py sweep --nproc-per-node 2` over the schedules (under bfloat16 autocast, layers recomputed): each
    run's two ranks started as torchrun starts them, each run's chronometer line gives every stage's compute and idle
    time per step and the bubble beside its formula, and `compare` tabulates both beside the img/s."""
    import csv
    import json

    import preloaded
    from conftest import clean_env, show
    from test_fsdp import BASE
    from test_lab import lab

    # --python: each run's torchrun served by the tests' preloaded server (tests/preloaded_client.py): two forks
    # given torchrun's variables, not torchrun and two new interpreters
    (tmp_path / "py").mkdir()
    python = preloaded.python_executable(tmp_path / "py", clean_env())

    grid = ["--grid", "pp-schedule=gpipe,1f1b,interleaved"]
    flags = [*BASE, "--data-root", tiny_data, "--num-workers", "0", "-b", "16", "--fsdp", "--pp", "2", "--test",
             "--test-nsteps", "4", "--pp-microbatches", "8", "--amp", "--amp-dtype", "bfloat16",
             "--grad-checkpointing"]  # fmt: skip
    proc = lab("sweep", "--name", "pp", "--nproc-per-node", "2", "--python", python, *grid, "--", *flags, cwd=tmp_path)
    assert proc.returncode == 0, show(proc)
    calls = (tmp_path / "py" / "python.calls").read_text().splitlines()
    assert len(calls) == 3 and all(
        c.startswith("-u -m torch.distributed.run --standalone --nproc-per-node 2 ") for c in calls
    )
    proc = lab("compare", "runs/pp", cwd=tmp_path)
    assert proc.returncode == 0, show(proc)
    assert "bubble %" in proc.stdout and "formula %" in proc.stdout, proc.stdout
    with open(tmp_path / "runs" / "pp" / "compare.csv", newline="") as file:
        rows = {row["pp-schedule"]: row for row in csv.DictReader(file)}
    for schedule, stages, who, formula in (
        ("gpipe", 2, "stage", "0.11 by (N - 1) / (M + N - 1)"),
        ("1f1b", 2, "stage", "0.11 by (N - 1) / (M + N - 1)"),
        ("interleaved", 4, "rank", "0.06 by (N - 1) / (V M + N - 1)"),  # 2 stages a rank: timed together
    ):
        run = tmp_path / "runs" / "pp" / f"pp-schedule={schedule}"
        metrics = json.loads((run / "metrics.json").read_text())
        pipeline = metrics["pipeline"]
        assert metrics["compute_dtype"] == "bfloat16" and metrics["train_loss"] > 0  # finite: JSON has no NaN
        assert pipeline["schedule"] == schedule
        assert pipeline["expected_bubble"] == pytest.approx(1 / (1 + 8 * stages // 2))
        assert [stage["stage"] for stage in pipeline["stages"]] == [1, 2]
        assert all(0 < s["compute_s"] <= s["step_s"] * 1.05 for s in pipeline["stages"]), pipeline
        assert float(rows[schedule]["bubble"]) == pytest.approx(pipeline["bubble"])
        assert float(rows[schedule]["img_s"]) > 0
        log = (run / "log.txt").read_text()
        assert (
            f">>> pipeline ({schedule}, {stages} stages on 2 ranks, 8 micro-batches; medians of 3 steps): {who} 1 "
            in log
        )
        assert "; each layer recomputed in the backward (--grad-checkpointing)" in log
        assert formula in log and "Training on 1 nodes and 2 processes (TorchElastic)" in log


@pytest.mark.parametrize("backend", ["pytorch", "dali"])
def test_a_later_stage_reads_no_image(tiny_data, tmp_path, monkeypatch, backend):
    """--pp: the first stage's rank loads the images (through DALI too); a later stage's loads placeholders for the
    same sample keys (nothing read from disk: every file made unreadable, its batches still come; no DALI pipeline
    built), their shapes the same batch sizes, and its labels are the first stage's, broadcast at each batch
    (FirstStageLabels). Under DALI the validation images that are not whole files (one cut short, one empty) are
    found once, by the first rank, and left out on every stage: both count the same images (a later stage sizing
    its placeholders from the whole set would wait for batches the first never sends)."""
    import shutil
    from types import SimpleNamespace

    from dlojz_lib.data.loaders import FirstStageLabels, Placeholders, build_data, build_loaders
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    root = shutil.copytree(tiny_data, tmp_path / "data")
    cut, empty = sorted((root / "val").rglob("*.JPEG"))[:2]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    empty.write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    argv = ["--device", "cpu", "--fsdp", "--pp", "2", "--data-root", str(root), "-b", "4", "--num-workers", "0"]
    cfg = resolve_config(get_args_parser().parse_args([*argv, "--data-backend", backend]))
    device = torch.device("cpu")
    sent, counted = [], {}

    def all_gather(obj):  # the first rank's object reaches the other
        sent.append(obj)
        return [sent[0], obj]

    for pipe_rank in (0, 1):
        mesh = {"pipe": SimpleNamespace(get_local_rank=lambda rank=pipe_rank: rank, get_group=lambda: None)}
        ranks = SimpleNamespace(
            mesh=mesh, data_size=1, data_rank=0, device=device, is_main=pipe_rank == 0, enabled=True,
            all_gather=all_gather,
        )  # fmt: skip
        train_set, val_set, _ = build_data(cfg, ranks, lambda line: None)
        with monkeypatch.context() as patched:
            if pipe_rank == 1:
                patched.setattr("builtins.open", lambda *a, **k: pytest.fail("a later stage opened a file"))
            loaders = build_loaders(cfg, train_set, val_set, 3, ranks, lambda line: None)
        counted[pipe_rank] = loaders.n_val_images
        assert isinstance(loaders.train_batches, FirstStageLabels) and isinstance(loaders.val_batches, FirstStageLabels)
        assert isinstance(getattr(loaders.train, "dataset", None), Placeholders) is (pipe_rank == 1)
        assert (type(loaders.train).__name__ == "DaliBatches") is (backend == "dali" and pipe_rank == 0)
        if pipe_rank == 1:
            monkeypatch.setattr("builtins.open", lambda *a, **k: pytest.fail("a later stage opened a file"))
            loaders.start_epoch(0, 0)
            sizes = [images.shape[0] for images, _ in loaders.train]
            assert sizes == [4] * (len(train_set) // 4) and loaders.n_val_images == len(val_set)
    files = len(list((root / "val").rglob("*.JPEG")))
    assert counted[0] == counted[1] == files - 2 * (backend == "dali"), counted
