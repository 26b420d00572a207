"""The layouts' bytes, computed on a model built on the meta device (no memory, no GPU: a 2.4 B-parameter model is
read in seconds): per GPU, the parameters, gradients, optimizer state and activations, and the bytes each GPU sends
per step, under DDP, FSDP, tensor parallelism with FSDP (2-D), pipeline parallelism with FSDP and all three (3-D).
`bench/parallel_memory.py` prints them as the course's day-4 table; what each figure is, is said there.

- `layout_rows(settings)`: the rows, `settings` the table's (`LayoutTable`: the model, its image size, the images a
  GPU takes, the world sizes, tensor and pipeline degrees, the optimizer...); returns (rows, parameters, planned).
- `plan(settings, allocation)`: `dlojz_lab.py plan`'s answer: every layout dlojz can run on an `Allocation` (nodes,
  GPUs a node, their memory, the roofline's FLOP/s and bandwidths), with activation checkpointing where a layout
  does not fit without it and float8 where the GPU has it, each estimated (`estimate`: whether it fits, the bytes
  sent inside and across nodes, a roofline step), the ones that fit first, fastest first; `pick_line`,
  `named_layout_line`: what it says.
- `choose_layout(args)`, `auto_layout(args, allocation)`: dlojz.py's `--layout auto`, the pick made the run's flags.
What a transformer block of the tensor plan keeps and sends: `dlojz_lib.parallelism.block_figures`; the bytes
and collectives a layout sends: `dlojz_lib.parallelism.sends`. The bytes
held and sent are a run's, to the byte, for 9 layouts (tests/parallelism/test_planner.py); the activations within
5 % of a CPU forward's in float32; the roofline's step is compared with runs by bench/plan_vs_runs.py.
"""

import dataclasses
import math

from dlojz_lib.checks import UserError, fail
from dlojz_lib.optim import OPTIMIZER_TABLE
from dlojz_lib.parallelism.block_figures import (
    CHECKPOINTING,
    attention_shapes,
    block_sent,
    blocks_activations,
    tensor_plan,
)
from dlojz_lib.parallelism.sends import (
    ddp_collectives,
    fsdp_bytes_sent,
    fsdp_collectives,
    fsdp_units,
    local_numel,
    stage_sends,
    tensor_collectives,
    whole_copies_bytes_sent,
)
from dlojz_lib.settings.layout import Layout


@dataclasses.dataclass(frozen=True)
class LayoutTable:
    """What the rows are computed for."""

    arch: str
    image_size: int = 224
    num_classes: int = 1000
    batch_size: int = 16  # images a GPU takes (a tensor-parallel group shares them; a pipeline takes b p)
    gpus: tuple = (8,)  # world sizes
    tp: tuple = (4,)  # tensor-parallel degrees
    pp: tuple = (4,)  # pipeline stage counts
    pp_microbatches: int | None = 8  # 1F1B's micro-batches a step (None: 2 p, dlojz.py's default)
    optimizer: str = "adamw"
    amp_bytes: int = 2  # bytes of the AMP dtype (what travels, the activations)
    sequence_parallel: bool = False
    checkpointing: str = "none"  # --activation-checkpointing: the activations a row counts (BLOCK_BYTES' modes)
    batch_per_copy: bool = False  # batch_size counts a model copy's images (a pipeline's too), as dlojz.py's -b


def placements(module):
    """(shape, tensor-parallel placement) of every parameter under its family's tensor plan (the run's: its
    `placements`): "col" (split on dim 0), "row" (split on dim 1), or None (replicated)."""
    (plan, blocks), placement = tensor_plan(module), {}
    for block in blocks:
        placement.update((id(parameter), kind) for parameter, kind in plan.placements(block))
    return [(tuple(p.shape), placement.get(id(p))) for p in module.parameters()]


def split_tensors(module) -> list:
    """How many tensors each parameter of `module` is held as once --tp splits it (the order of placements'): 3
    for a fused q, k and v held apart, else 1 (each tensor keeps its own optimizer step count)."""
    (plan, blocks), apart = tensor_plan(module), set()
    for block in blocks:
        apart.update(id(parameter) for parameter in plan.held_apart(block))
    return [3 if id(p) in apart else 1 for p in module.parameters()]


def layout_rows(settings, module=None):
    """The rows of `settings`' table, for `module` (its model on the meta device: built here if None)."""

    module = meta_model(settings) if module is None else module
    plan, blocks = tensor_plan(module)  # the family's tensor plan's, as --tp splits them
    planned = bool(blocks)  # a model without a plan: DDP's and FSDP's rows only
    if settings.sequence_parallel and any(plan.tokens_unsplit(block) for block in blocks):
        raise UserError(
            f"--sequence-parallel: {settings.arch} has no sequence-parallel plan (ViT's tokens only): drop it"
        )
    params = placements(module)
    split = split_tensors(module)
    units = fsdp_units(module)
    gathers = [1 if unit is None else 2 for unit in units]
    whole = any(kind is None for _, kind in params)  # (weights a tensor group holds whole)
    total = sum(math.prod(shape) for shape, _ in params)
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in module.buffers())  # (BatchNorm's statistics)
    shapes = attention_shapes(module, settings.image_size) if planned else []
    rest, outputs = layer_figures(module, settings, blocks)  # a pipeline layer's bytes an image, and its output
    outside = sum(rest) * settings.amp_bytes / 4
    optimizer = OPTIMIZER_TABLE[settings.optimizer]  # (the run's own table)
    state = (optimizer.state_per_parameter, optimizer.step_bytes_per_tensor)
    out = []
    for gpus in settings.gpus:
        layouts = [("DDP", 1, 1), ("FSDP", 1, gpus)]
        sp = " + SP" if settings.sequence_parallel else ""
        if planned:
            layouts += [
                (f"TP {tp}{sp} x FSDP {gpus // tp}", tp, gpus // tp) for tp in settings.tp if gpus % tp == 0 and tp > 1
            ]
        for name, tp, replicas in layouts:
            if name == "DDP":
                local = total
            else:
                local = sum(local_numel(shape, kind, tp, replicas) for shape, kind in params)
            b = settings.batch_size
            copies = total * settings.amp_bytes if name == "DDP" and settings.amp_bytes < 4 else 0  # autocast's
            by_mode = {  # (checkpointing counted on the transformer blocks alone)
                mode: copies + outside * b + sum(blocks_activations(shapes, b, tp, settings, mode))
                for mode in (CHECKPOINTING if planned else ("none",))
            }
            if name == "DDP":  # the gradients' all-reduce, and the buffers broadcast from rank 0 at each forward
                by_group = {"data": 2 * (gpus - 1) / gpus * 4 * total + (buffers if gpus > 1 else 0)}
                calls = {"data": ddp_collectives(module, gpus)}
            else:
                by_group = {"data": fsdp_bytes_sent(params, gathers, tp, replicas, settings.amp_bytes)}
                calls = {"data": fsdp_collectives(units, 2) if replicas > 1 else 0}
                if tp > 1:  # the plan's collectives on each block's activations (BLOCK_COLLECTIVES), the whole copies'
                    by_group["tensor"] = whole_copies_bytes_sent(params, tp, replicas) + sum(
                        block_sent(shape, b, tp, settings) for shape in shapes
                    )
                    calls["tensor"] = tensor_collectives(shapes, 1, settings.sequence_parallel, whole)
            sent = sum(by_group.values())
            out.append(
                dict(
                    gpus=gpus,
                    layout=name,
                    parameters=total,
                    parameter_bytes=4 * local,
                    gradient_bytes=4 * local,
                    optimizer_bytes=optimizer_bytes(state, local, sum(split) if tp > 1 else len(params)),
                    activation_bytes=by_mode.get(settings.checkpointing, by_mode["none"]),
                    activations_by_checkpointing=by_mode,
                    sent_bytes_per_step=sent,
                    sent_by_group=by_group,
                    collectives_by_group=calls,
                    fsdp_units=len(set(units)),
                    tp=tp,
                    pp=1,
                    spec=Layout(
                        fsdp=name != "DDP",
                        tp=tp,
                        sequence_parallel=tp > 1 and settings.sequence_parallel,
                        checkpointing=settings.checkpointing,
                    ),
                )
            )
        out += pipeline_rows(settings, module, (params, split, units), gpus, shapes, state, (rest, outputs))
    return out, total, planned


def optimizer_bytes(state, numel, tensors):
    """The optimizer state a GPU holds for `numel` elements of `tensors` parameter tensors: `state` (its float32
    tensors an element, the bytes of its step count a tensor), as the optimizer table gives it."""
    per_element, step_bytes = state
    return 4 * per_element * numel + step_bytes * tensors


def meta_model(settings):
    """`settings`' model, built on the meta device (shapes, no memory)."""
    import torch

    from dlojz_lib.model.zoo import create_model

    with torch.device("meta"):
        return create_model(settings.arch, settings.num_classes, False, settings.image_size)


def layer_figures(module, settings, blocks) -> tuple:
    """(kept, outputs), one figure of each per pipeline layer (pipeline.pipeline_layers; for a model without a pipeline
    split, one for the whole): the bytes a float32 training forward keeps for the backward per image outside the
    transformer `blocks` (whose count is BLOCK_BYTES'): a ViT's stem and head, a CoAtNet's MBConv stages, a CNN's
    whole; and the elements of the layer's output per image (what a pipeline stage sends on). Counted on the meta
    model (2 images: BatchNorm's training forward wants two), each storage once (torch_internals.saved_storage_bytes);
    within 4 % of a CPU forward's held bytes for a ResNet-18 and a CoAtNet."""
    import torch

    from dlojz_lib.parallelism.pipeline import pipeline_layers
    from dlojz_lib.torch_internals import forget_handles, saved_storage_bytes, storage_handles

    try:
        runs = [layer.run for layer in pipeline_layers(module, settings.arch)]
    except UserError:
        runs = [module]
    x = torch.empty(2, 3, settings.image_size, settings.image_size, device="meta")
    seen = storage_handles(module.parameters())
    kept, outputs = [], []
    module.train()
    for run in runs:
        saved, x = saved_storage_bytes(run, x, blocks, seen)
        kept.append(saved / 2)
        outputs.append(x.numel() // 2)
    forget_handles(seen)
    return kept, outputs


def pipeline_rows(settings, module, params, gpus, shapes, state, per_layer):
    """PP p x FSDP d rows: the stages cut by parameters as dlojz_lib/parallelism/pipeline.py cuts them, FSDP over the d
    pipelines; the largest stage's state, and under 1F1B the first stage's activations (min(p, M) micro-batches in
    flight, each of b p / M images, a pipeline taking b images a GPU; with `batch_per_copy` b / M, the pipeline b),
    and each GPU's sends: its stage's output
    forward and its input's gradient backward, for every micro-batch, with FSDP's on its stage. A model without a
    pipeline split gets none. `params`: (placements', split_tensors', fsdp_units'); `per_layer`: layer_figures'."""
    from dlojz_lib.parallelism.pipeline import layer_sizes, owner, pipeline_layers, stage_bounds

    params, split, units = params
    try:
        layers = pipeline_layers(module, settings.arch)
    except UserError:
        return []
    names = [name for name, _ in module.named_parameters()]  # (the order of `params`, placements')
    rest, sent_per_image = per_layer  # each layer's kept bytes and output (the activations a stage sends on), an image
    rows = []
    splits = [1, *(tp for tp in settings.tp if tp > 1 and shapes)]  # PP x TP x FSDP where the model has a TP plan
    for pp, tp in ((pp, tp) for pp in settings.pp for tp in splits):
        if pp < 2 or gpus % (pp * tp) or pp > len(layers):
            continue
        replicas = gpus // (pp * tp)
        bounds = stage_bounds(layer_sizes(module, layers), pp)
        stage_of_layer = [k for k, (first, last) in enumerate(bounds) for _ in range(first, last)]
        stage_of = [stage_of_layer[owner(name, layers)] for name in names]
        local = [0] * pp
        held = [0] * pp
        stage_params = [[] for _ in range(pp)]
        stage_units = [[] for _ in range(pp)]  # (the FSDP unit of each of its parameters)
        tensors = [0] * pp  # (each rank holds a part of each of its stage's tensors)
        for stage, (shape, kind), parts, unit in zip(stage_of, params, split, units):
            stage_units[stage].append(unit)
            tensors[stage] += parts if tp > 1 else 1
            local[stage] += local_numel(shape, kind if tp > 1 else None, tp, replicas)
            held[stage] += local_numel(shape, kind if tp > 1 else None, tp, 1)  # the group rank's part
            stage_params[stage].append((shape, kind if tp > 1 else None))
        m = settings.pp_microbatches or 2 * pp
        b = settings.batch_size if settings.batch_per_copy else settings.batch_size * pp  # the pipeline's images
        images = b / m  # a micro-batch (a tensor-parallel group shares it)
        sent = [{"data": 0.0, "pipe": 0.0, "tensor": 0.0} for _ in range(pp)]  # each GPU's sends, by group
        calls = [dict.fromkeys(sent[0], 0) for _ in range(pp)]  # and the collectives that send them
        stage_blocks = [set() for _ in range(pp)]  # each stage's blocks (their index in `shapes`)
        for index, shape in enumerate(shapes):
            stage = stage_of_layer[owner(shape.path, layers)]
            stage_blocks[stage].add(index)
            if tp > 1:
                sent[stage]["tensor"] += block_sent(shape, b, tp, settings)
        outside = [sum(rest[first:last]) * settings.amp_bytes / 4 for first, last in bounds]  # a stage's, an image
        by_mode = pipeline_activations(shapes, stage_blocks, outside, images, m, tp, settings)
        for stage, (first, last) in enumerate(bounds):  # its input's gradient back, its output on
            ends = [sent_per_image[i] for i in (first - 1, last - 1) if 0 <= i < len(layers) - 1]
            sent[stage]["pipe"] += sum(ends) * b * settings.amp_bytes
            calls[stage]["pipe"] = len(ends) * m
            its = stage_params[stage], stage_units[stage], [shapes[index] for index in sorted(stage_blocks[stage])]
            its_sent, its_calls = stage_sends(*its, (tp, replicas, m), settings)
            sent[stage] = {group: sent[stage][group] + its_sent.get(group, 0.0) for group in sent[stage]}
            calls[stage].update(its_calls)
        busiest = max(range(pp), key=lambda stage: sum(sent[stage].values()))
        largest = max(local)  # (the stage holding most)
        rows.append(
            dict(
                gpus=gpus,
                layout=f"PP {pp}{f' x TP {tp}' if tp > 1 else ''} x FSDP {replicas}",
                parameters=sum(held),
                parameter_bytes=4 * largest,
                gradient_bytes=4 * largest,
                optimizer_bytes=max(map(optimizer_bytes, [state] * pp, local, tensors)),
                activation_bytes=by_mode.get(settings.checkpointing, by_mode["none"]),
                activations_by_checkpointing=by_mode,
                sent_bytes_per_step=sum(sent[busiest].values()),
                sent_by_group=sent[busiest],
                collectives_by_group=calls[busiest],
                tp=tp,
                pp=pp,
                bubble=(pp - 1) / (m + pp - 1),
                spec=Layout(fsdp=True, tp=tp, pp=pp, microbatches=m, checkpointing=settings.checkpointing),
            )
        )
    return rows


def pipeline_activations(shapes, stage_blocks, outside, images, m, tp, settings) -> dict:
    """The activations of a pipeline's busiest stage under 1F1B, by --activation-checkpointing mode: stage k of p
    holds min(p - k, M) micro-batches (`m`) of `images` in its blocks (`stage_blocks[k]`) and outside them
    (`outside[k]` bytes an image), and recomputes one block."""
    pp = len(stage_blocks)
    plain = dataclasses.replace(settings, sequence_parallel=False)
    return {
        mode: max(
            (kept + outside[stage] * images) * min(pp - stage, m) + recomputed
            for stage in range(pp)
            for kept, recomputed in [blocks_activations(shapes, images, tp, plain, mode, stage_blocks[stage])]
        )
        for mode in (CHECKPOINTING if shapes else ("none",))
    }


# ------------------------------------------------------------------ the planner: which layout for an allocation
# Jean Zay's GPU partitions, nominal figures (IDRIS's descriptions; each one a flag of `dlojz_lab.py plan`): GPUs a
# node, memory, dense bfloat16 TFLOP/s, GB/s a GPU sends over NVLink inside its node and over InfiniBand across nodes;
# and a collective's latency, inside a node and across (NCCL's small messages, an order of magnitude: `--probe`
# measures all of them on the allocation itself)
LATENCIES_US = dict(latency_us=10.0, network_latency_us=25.0)
GPUS = {
    "h100": dict(
        gpus_per_node=4, gpu_memory_gib=80.0, tflops=989.0, nvlink_gbs=450.0, network_gbs=50.0, float8_tflops=1979.0,
        **LATENCIES_US,
    ),
    "a100": dict(gpus_per_node=8, gpu_memory_gib=80.0, tflops=312.0, nvlink_gbs=300.0, network_gbs=12.5, **LATENCIES_US),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The GPUs a job has, and the roofline's figures for them."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    tflops: float  # dense bfloat16 TFLOP/s a GPU (a data sheet's peak, or what --probe measures at the model's shapes)
    nvlink_gbs: float  # GB/s a GPU sends to the others of its node
    network_gbs: float  # GB/s a GPU sends to other nodes
    float8_tflops: float | None = None  # dense float8 TFLOP/s a GPU (None: no float8, an A100's case)
    # the share of the sends beside the compute (DDP's bucketed all-reduces, FSDP's prefetched gathers and
    # reduce-scatters, a pipeline's asynchronous sends between micro-batches) hidden behind it: a GPU's copy engines
    # hide them all; a CPU rank computing with its cores hides less (bench/plan_vs_runs.py measures it). TP's
    # all-reduces sit between a block's products, which wait for them: never hidden.
    overlap: float = 1.0
    latency_us: float = 0.0  # a collective's fixed cost inside a node, whatever its size
    network_latency_us: float = 0.0  # and across nodes

    @property
    def gpus(self):
        return self.nodes * self.gpus_per_node


def spans_nodes(group, tp, pp, allocation) -> bool:
    """Whether a row's `group` (tensor, pipe or data) holds ranks of several nodes, the ranks laid out as dlojz.py's
    mesh lays them (tensor innermost, then the pipeline's stages, the data replicas outermost)."""
    inside = {"tensor": tp, "pipe": tp * pp, "data": allocation.gpus, "shard": allocation.gpus_per_node}[group]
    return inside > allocation.gpus_per_node or allocation.gpus_per_node % inside != 0


def hsdp_row(node_fsdp, allocation):
    """HSDP over the allocation's nodes: FSDP within each node (the one-node FSDP row's bytes and sends), then each
    rank's float32 gradient shard all-reduced across the nodes (a ring: 2 (R - 1) / R of it)."""
    nodes = allocation.nodes
    across = 2 * (nodes - 1) / nodes * node_fsdp["gradient_bytes"]
    sent = {"shard": node_fsdp["sent_by_group"]["data"], "data": across}
    calls = {"shard": node_fsdp["collectives_by_group"]["data"], "data": node_fsdp["fsdp_units"] if nodes > 1 else 0}
    return dict(
        node_fsdp,
        gpus=allocation.gpus,
        layout=f"HSDP {nodes} x FSDP {allocation.gpus_per_node}",
        spec=dataclasses.replace(node_fsdp["spec"], replicate=nodes),
        sent_by_group=sent,
        collectives_by_group=calls,  # (across the replicas: one all-reduce a unit)
        sent_bytes_per_step=sum(sent.values()),
    )


def estimate(row, allocation, settings, flops_per_image) -> dict:
    """`row` with what it needs on the allocation: its bytes a GPU (state and activations), whether they fit, the
    bytes sent inside a node and across nodes, and the roofline's step: the compute at the GPU's peak plus the sends
    at the links' bandwidths and each collective's latency, less what the compute hides of the data and pipeline groups' sends (the allocation's
    `overlap` share of the shorter of the two; the tensor group's, which its products wait for, never), stretched by
    the pipeline's bubble; and the images a GPU then trains a second. Activations a model family's count leaves
    out (a CNN's) count as 0."""
    state = row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"]
    used = state + (row["activation_bytes"] or 0)
    intra = inter = 0.0
    seconds = {"hidden": 0.0, "waited": 0.0}  # the sends' seconds, by whether the compute can hide them
    for group, sent in row["sent_by_group"].items():
        across = spans_nodes(group, row["tp"], row["pp"], allocation)
        if across:
            inter += sent
        else:
            intra += sent
        link = allocation.network_gbs if across else allocation.nvlink_gbs
        latency = allocation.network_latency_us if across else allocation.latency_us
        calls = row["collectives_by_group"].get(group, 0)
        seconds["waited" if group == "tensor" else "hidden"] += sent / (link * 1e9) + calls * latency * 1e-6
    # a GPU's share of a step: a tensor group shares its images, and a pipeline where -b is a model copy's
    images = settings.batch_size / row["tp"] / (row["pp"] if settings.batch_per_copy else 1)
    compute = flops_per_image * images / (allocation.tflops * 1e12)
    sends = seconds["hidden"] + seconds["waited"]
    hidden = allocation.overlap * min(compute, seconds["hidden"])
    step = (compute + sends - hidden) / (1 - row.get("bubble", 0.0))
    fits = used <= allocation.gpu_memory_gib * 2**30
    return dict(
        row, used_bytes=used, fits=fits, intra_bytes=intra, inter_bytes=inter, compute_s=compute, sends_s=sends,
        step_s=step, images_per_gpu_s=images / step,
    )  # fmt: skip


def plan(settings, allocation, model=None):
    """Every layout dlojz can run on `allocation` for `settings`' model (`model`: it on the meta device, built here
    if None), each row estimated, the ones that fit first, fastest first (images a GPU trains a second). Returns
    (rows, parameters, planned)."""
    from dlojz_lib.model.zoo import train_flops_per_image

    gpus, per_node = allocation.gpus, allocation.gpus_per_node
    tps = tuple(t for t in (2, 4, 8) if t <= per_node and per_node % t == 0)
    pps = tuple(p for p in (2, 4, 8) if gpus % p == 0)
    sizes = (gpus, per_node) if allocation.nodes > 1 else (gpus,)  # (one node's rows: HSDP's FSDP within a node)
    model = meta_model(settings) if model is None else model  # (one for the rows, the FLOPs, the float8 linears)
    rows, total, planned = layout_rows(dataclasses.replace(settings, gpus=sizes, tp=tps, pp=pps), model)
    if allocation.nodes > 1:
        node_fsdp = next(row for row in rows if row["gpus"] == per_node and row["layout"] == "FSDP")
        rows = [row for row in rows if row["gpus"] == gpus] + [hsdp_row(node_fsdp, allocation)]
    flops = train_flops_per_image(model, settings.image_size)
    recomputed = flops * (1 + RECOMPUTED_FLOPS[settings.checkpointing])  # (the run's own checkpointing)
    rows = [estimate(row, allocation, settings, recomputed) for row in rows]
    rows += checkpointed_rows(rows, allocation, settings, flops)
    rows += float8_rows(rows, model, allocation, settings, recomputed)
    rows.sort(key=lambda row: (not row["fits"], -row["images_per_gpu_s"]))
    return rows, total, planned


def float8_rows(rows, model, allocation, settings, flops_per_image) -> list:
    """Each of `rows` dlojz.py runs with --float8 tensorwise (DDP, FSDP, HSDP: not with --tp or --pp), again with the
    linears --float8 converts (model.float8.float8_linears) computing at the GPU's float8 peak, and under FSDP their
    weights gathered in float8 (1 byte, not the AMP dtype's); none where the GPU has no float8 or the model no such
    linear. Their activations and state are counted as without float8."""
    from dlojz_lib.model import families
    from dlojz_lib.model.float8 import float8_linears, tokens_per_image

    paths = float8_linears(model, families.family_of(model), "tensorwise")
    if allocation.float8_tflops is None or not paths:
        return []
    chosen = [model.get_submodule(path) for path in paths]
    tokens = tokens_per_image(model, paths, settings.image_size)  # the rows of an image each linear multiplies
    converted = sum(6 * tokens[p] * m.in_features * m.out_features for p, m in zip(paths, chosen))  # forward 2, back 4
    flops = flops_per_image - converted + converted * allocation.tflops / allocation.float8_tflops
    found = []
    for row in rows:
        if row["tp"] > 1 or row["pp"] > 1 or "checkpointing" in row:
            continue
        group = "shard" if "shard" in row["sent_by_group"] else "data"
        n = allocation.gpus_per_node if group == "shard" else allocation.gpus
        saved = (
            0
            if row["layout"] == "DDP"
            else sum(  # a block's 2 gathers a step, each byte fewer an element
                (n - 1) * math.ceil(m.out_features / n) * m.in_features * 2 * (settings.amp_bytes - 1) for m in chosen
            )
        )
        sent = dict(row["sent_by_group"], **{group: row["sent_by_group"][group] - saved})
        spec = dataclasses.replace(row["spec"], float8="tensorwise")
        variant = dict(row, layout=f"{row['layout']} + float8", sent_by_group=sent, float8="tensorwise", spec=spec)
        found.append(estimate(dict(variant, sent_bytes_per_step=sum(sent.values())), allocation, settings, flops))
    return found


# The share of a training step's FLOPs activation checkpointing adds: full runs the blocks' forwards again (a forward
# is a third of a step), selective only their cheap ops (norms, activations: memory-bound, no FLOPs on the roofline)
RECOMPUTED_FLOPS = {"none": 0.0, "selective": 0.0, "full": 1 / 3}


def checkpointed_rows(rows, allocation, settings, flops_per_image):
    """Each of `rows` (estimated) that does not fit with the activations `settings.checkpointing` keeps, again with
    --activation-checkpointing selective (where that keeps less) and, if that does not fit either, full: its
    activations under that mode and the recomputation's FLOPs on the roofline. Rows without an activation count get
    none."""
    found = []
    for row in rows:
        by_mode = row.get("activations_by_checkpointing")
        if row["fits"] or not by_mode:
            continue
        for mode in (m for m in CHECKPOINTING[CHECKPOINTING.index(settings.checkpointing) + 1 :] if m in by_mode):
            variant = dict(
                row,
                layout=f"{row['layout']} + AC {mode}",
                activation_bytes=by_mode[mode],
                checkpointing=mode,
                spec=dataclasses.replace(row["spec"], checkpointing=mode),
            )
            found.append(estimate(variant, allocation, settings, flops_per_image * (1 + RECOMPUTED_FLOPS[mode])))
            if found[-1]["fits"]:
                break
    return found


def pick_line(rows, allocation) -> str:
    """The planner's choice and why, in one line; or that no layout fits, with the smallest one's overflow."""
    gib = 2**30
    best = rows[0]
    if not best["fits"]:
        least = min(rows, key=lambda row: row["used_bytes"])
        over = (least["used_bytes"] - allocation.gpu_memory_gib * gib) / gib
        return (
            f"no layout fits in {allocation.gpu_memory_gib:.4g} GiB a GPU: the smallest, {least['layout']}, needs "
            f"{least['used_bytes'] / gib:.1f} GiB ({over:.1f} GiB over); add GPUs or activation checkpointing, or "
            "take a smaller -b"
        )
    return f"pick: {best['layout']} ({why(best, rows, allocation)})"


def named_layout_line(name, rows, allocation) -> str:
    """Whether the layout of `rows` named `name` fits, in one line: its bytes a GPU, and where it does not, how many
    over the GPU's memory and the planner's pick instead."""
    row, gib = next(row for row in rows if row["layout"] == name), 2**30
    used, memory = row["used_bytes"] / gib, allocation.gpu_memory_gib
    if row["fits"]:
        return (
            f"{name}: fits, {used:.1f} of {memory:.4g} GiB a GPU, {row['images_per_gpu_s']:,.0f} images a second a GPU"
        )
    activations = (row["activation_bytes"] or 0) / gib
    return (
        f"{name}: does not fit: {used:.1f} GiB a GPU ({used - activations:.1f} of state, {activations:.1f} of "
        f"activations), {used - memory:.1f} GiB over the {memory:.4g} GiB of a GPU; {pick_line(rows, allocation)}"
    )


def why(best, rows, allocation) -> str:
    """Why `best`, the first of `rows`, is the pick, in words."""
    bound = "compute" if best["compute_s"] >= best["sends_s"] else "communication"
    bubble = f", a bubble of {best['bubble']:.0%}" if best.get("bubble") else ""
    return (
        f"{best['used_bytes'] / 2**30:.1f} of {allocation.gpu_memory_gib:.4g} GiB a GPU, "
        f"{best['images_per_gpu_s']:,.0f} images a second a GPU by the roofline, {bound}-bound{bubble}; the fastest "
        f"of the {sum(row['fits'] for row in rows)} layouts that fit"
    )


def choose_layout(args):
    """--layout auto: the Layout the planner picks for this job's ranks (the launcher's nodes and ranks a node), the
    device's memory (a GPU's, or on the CPU the host's shared by the node's ranks) and H100 figures for the roofline
    (auto_layout), with the run's other flags `args` (dlojz.py's parsed flags, left as they are); and the line that
    says so."""
    import os

    import torch

    from dlojz_lib.settings.config import local_device
    from dlojz_lib.settings.launch import load_idr_torch
    from dlojz_lib.settings.layout import check_layout

    check_layout(vars(args))  # a layout flag given beside --layout auto: one line, before the choice replaces it
    launch = load_idr_torch()
    nodes = max(1, launch.num_nodes)
    per_node = max(1, launch.world_size // nodes)
    device = torch.device(local_device(args.device, launch.local_rank))
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / per_node / 2**30
    return auto_layout(args, Allocation(nodes, **dict(GPUS["h100"], gpus_per_node=per_node, gpu_memory_gib=memory)))


def auto_layout(args, allocation):
    """The Layout the planner picks on `allocation` among those dlojz.py runs with the run's other flags (`args`,
    parsed: each row's record asked for its problems with them): DDP, FSDP, HSDP over the nodes, TP x FSDP inside
    a node, and the pipelines (PP x FSDP, PP x TP) the run's -b, micro-batches and flags allow (a pipeline takes -b
    images, as dlojz.py's); with the activation checkpointing the pick needs, unless the run gives its own (whose
    activations the rows then count); and the line that says so. The model is counted with 1000 classes (its data
    is not read yet: the head is small beside the rest)."""
    own = args.activation_checkpointing or ("full" if args.grad_checkpointing else "none")  # the user's: kept
    settings = LayoutTable(
        args.arch, args.image_size or 224, 1000, args.batch_size or 16, pp_microbatches=args.pp_microbatches,
        optimizer=args.optimizer, checkpointing=own,
        batch_per_copy=True,
    )  # fmt: skip
    from dlojz_lib.parallelism.pipeline import micro_batch_problem

    values = vars(args)
    model = meta_model(settings)  # (the rows', and the run's own checks: a BatchNorm pipeline's micro-batches)
    rows = [
        row for row in plan(settings, allocation, model)[0]
        if not row["spec"].problems(values) and (row["pp"] == 1 or args.teacher is None)
        and (row["pp"] == 1 or micro_batch_problem(model, args.arch, settings.batch_size,
                                                   row["spec"].microbatches) is None)
        and not (own != "none" and "checkpointing" in row)
        and "float8" not in row  # (--float8 needs torchao: the user's to give)
    ]  # fmt: skip
    chosen = rows[0]
    if not chosen["fits"]:
        fail(f"--layout auto: {pick_line(rows, allocation)}")
    spec = chosen["spec"]
    flags = " ".join(
        flag for flag, on in (("--fsdp", spec.fsdp), (f"--fsdp-replicate {spec.replicate}", spec.replicate > 1),
                              (f"--pp {spec.pp}", spec.pp > 1), (f"--tp {spec.tp}", spec.tp > 1),
                              (f"--activation-checkpointing {spec.checkpointing}", "checkpointing" in chosen)) if on
    ) or "no layout flag"  # fmt: skip
    return spec, f"--layout auto: {chosen['layout']} ({flags}; {why(chosen, rows, allocation)})"
