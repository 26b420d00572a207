"""What a rank sends a step under each of dlojz's layouts, as the planner (`dlojz_lib.parallelism.plan`) counts it:
the bytes (ring algorithms: an all-gather sends n - 1 times a rank's shard, a reduce-scatter n - 1 times its output,
an all-reduce 2 (n - 1) / n of the buffer) and the collectives that send them, each of which pays a latency whatever
its size: DDP's buckets and buffer broadcasts, FSDP's gathers and reduce-scatters unit by unit, the tensor plan's
collectives block by block and micro-batch by micro-batch. Held to the collectives of runs on 4 CPU ranks, 9
layouts, byte for byte and call for call (tests/parallelism/test_planner.py).
"""

import math


def local_numel(shape, kind, tp, replicas):
    """Elements of one parameter on the largest rank: split 1/tp by the plan, then its dim 0 over the replicas."""
    shape = list(shape)
    if kind == "col":
        shape[0] //= tp
    elif kind == "row":
        shape[1] //= tp
    shape[0] = math.ceil(shape[0] / replicas)
    return math.prod(shape)


def fsdp_units(module) -> list:
    """The FSDP unit of each parameter of `module` as dlojz shards it (fsdp.shard_model): its block's index among
    `sharding_units`, None for the root's. A block's are gathered twice a step (before its forward, and again before
    its backward: resharded in between), the root's once (kept gathered from its forward to its backward)."""
    from dlojz_lib.parallelism.fsdp import sharding_units

    unit_of = {id(p): index for index, unit in enumerate(sharding_units(module)) for p in unit.parameters()}
    return [unit_of.get(id(p)) for p in module.parameters()]


def fsdp_collectives(units, gathers) -> int:
    """The collectives FSDP calls a step over the parameters of `units` (fsdp_units'): each unit's all-gathers
    (`gathers` of them, the root's 1) and its gradients' reduce-scatter, one of each for all its parameters."""
    held = set(units)
    return sum(2 if unit is None else gathers + 1 for unit in held)


def ddp_collectives(module, gpus) -> int:
    """The collectives DDP calls a step on `gpus` ranks: its Reducer's buckets (the float32 gradients in reverse
    order, the first bucket closed at 1 MiB, the others at 25 MiB), each all-reduced; and a broadcast of the
    buffers of each dtype from rank 0 (BatchNorm's statistics, float32, and its counts, int64)."""
    if gpus < 2:
        return 0
    buckets, size = 0, 0
    for p in reversed(list(module.parameters())):
        size += 4 * p.numel()
        if size >= (2**20 if buckets == 0 else 25 * 2**20):
            buckets, size = buckets + 1, 0
    return buckets + (size > 0) + len({buffer.dtype for buffer in module.buffers()})


def tensor_collectives(shapes, microbatches, sequence_parallel, whole) -> int:
    """The collectives a rank of a tensor group calls a step: each block's of `shapes` (BLOCK_COLLECTIVES) for each
    of the `microbatches`, a relative position bias's all-gather, and the whole copies' one all-reduce (`whole`: the
    group holds some weights whole)."""
    from dlojz_lib.parallelism.tensor import BLOCK_COLLECTIVES

    per_block = sum(sum(kinds.values()) for kinds in BLOCK_COLLECTIVES[sequence_parallel].values())
    return sum(per_block * microbatches + (shape.gathered > 0) for shape in shapes) + whole


def fsdp_bytes_sent(params, gathers, tp, replicas, amp_bytes):
    """The bytes a rank sends in a step for FSDP over `replicas` ranks (ring algorithms: a rank sends n - 1 times its
    shard in an all-gather and in a reduce-scatter): each parameter's padded shard (local_numel) gathered `gathers`
    times in the AMP dtype, its float32 gradient reduce-scattered once."""
    return sum(
        (replicas - 1) * local_numel(shape, kind, tp, replicas) * (count * amp_bytes + 4)
        for (shape, kind), count in zip(params, gathers)
    )


def whole_copies_bytes_sent(params, tp, replicas):
    """The bytes a rank sends in a step averaging, over its tensor group, the float32 gradients of the weights the
    group holds whole (tensor.WholeCopies: one all-reduce, a ring's 2 (n - 1) / n of them), FSDP's shards of them."""
    whole = sum(local_numel(shape, None, tp, replicas) for shape, kind in params if kind is None)
    return 2 * (tp - 1) / tp * whole * 4


def stage_sends(params, units, blocks, degrees, settings) -> tuple:
    """(bytes, collectives) by group a rank of a pipeline's stage sends a step, beside the pipeline's own: FSDP's
    over its `params` (placements' of the stage, their `units`: the schedule keeps each unit gathered from the
    step's first forward to its last backward, one gather a unit) and, under TP, the whole copies' all-reduce and
    its `blocks`' collectives (their bytes: block_figures.block_sent's). `degrees`: (tp, replicas, micro-batches)."""
    tp, replicas, microbatches = degrees
    sent = {"data": fsdp_bytes_sent(params, [1] * len(params), tp, replicas, settings.amp_bytes)}
    calls = {"data": fsdp_collectives(units, 1) if replicas > 1 else 0}
    if tp > 1:
        sent["tensor"] = whole_copies_bytes_sent(params, tp, replicas)
        whole = any(kind is None for _, kind in params)
        calls["tensor"] = tensor_collectives(blocks, microbatches, settings.sequence_parallel, whole)
    return sent, calls
