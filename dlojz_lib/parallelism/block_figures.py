"""A transformer block of its family's tensor plan as the planner (`dlojz_lib.parallelism.plan`) prices it, read
from a forward of the model on the meta device: its shapes (`BlockShape`, `attention_shapes`), what it keeps for
its backward under each --activation-checkpointing mode (`BLOCK_BYTES`, `blocks_activations`: Megatron-LM's count,
scaled by the block's MLP), and what a rank of its tensor group sends a step (`block_sent`: each collective at its
own tensor's width, a relative position bias gathered over the heads). `tensor_plan(module)`: the plan and blocks.
"""

import typing


def tensor_plan(module) -> tuple:
    """(`module`'s family's tensor plan, the one `--tp` applies (model.tensor_plans' `TensorPlan`), the blocks it
    splits, as `tensor.plan_blocks` finds them): (None, []) for a model of no family or of a family without one."""
    from dlojz_lib.model.families import family_of
    from dlojz_lib.parallelism.tensor import plan_blocks

    family = family_of(module)
    return (None if family is None else family.tensor_plan), plan_blocks(module, family)


class BlockShape(typing.NamedTuple):
    """A block of the tensor plan as the planner prices it (attention_shapes)."""

    tokens: int  # an image's
    span: int  # the tokens each one attends to
    width: int  # the attention's
    heads: int
    path: str  # the block's, in the model
    moved: int  # the widths of the tensors its collectives move, summed (tensor.BLOCK_TENSORS of them)
    gathered: int  # the elements its split gathers over the heads a step (a relative position bias)
    hidden: int  # its MLP's hidden width


def attention_shapes(module, image_size):
    """A BlockShape (tokens per image, tokens each one attends to, attention width, heads, the block's path, the
    widths of the tensors its collectives move summed, the elements its split gathers a step, the MLP's hidden
    width) of every block of the plan, read
    from a forward of the meta model: a ViT's tokens all attend to each other, a CoAtNet block's map too (NCHW), a
    MaxViT block's attend within a window or a grid cell (its input: images x windows, tokens, channels). The plan's
    `attention` names each block's attention module, width and heads; its `placements`, the layers whose inputs
    (column-wise) and outputs (row-wise) the collectives move; its `gathered`, a relative position bias; its
    `mlp_width`, fc1's outputs."""
    import torch

    (plan, blocks), shapes = tensor_plan(module), []
    paths = {id(block): path for path, block in module.named_modules()}

    def recorder(block, width, heads, moved, gathered, hidden):
        def record(attention, inputs):
            x = inputs[0]
            if x.dim() == 4:
                tokens = span = x.shape[2] * x.shape[3]
            else:
                tokens, span = x.shape[0] * x.shape[1], x.shape[1]  # one image: its windows' tokens
            shapes.append(BlockShape(tokens, span, width, heads, paths[id(block)], moved, gathered, hidden))

        return record

    hooks = []
    for block in blocks:
        attention, width, heads = plan.attention(block)
        moved = sum(p.shape[1] if kind == "col" else p.shape[0] for p, kind in plan.placements(block) if p.dim() > 1)
        figures = (moved, plan.gathered(attention), plan.mlp_width(block))  # (the block's own: not the forward's)
        hooks.append(attention.register_forward_pre_hook(recorder(block, width, heads, *figures)))
    with torch.no_grad():
        module.eval()(torch.empty(1, 3, image_size, image_size, device="meta"))
    for hook in hooks:
        hook.remove()
    return shapes


# What a transformer block keeps for its backward, in bytes a token and unit of width at 16 bits, as functions of the
# tensor-parallel degree t and the MLP's ratio r (its hidden width over the tokens'): Megatron-LM's count (Korthikanti
# et al. 2022, r = 4) with fused attention (dlojz's families call scaled_dot_product_attention: the scores, 5 a s / h
# more, are not kept): 8 whole (the norms' inputs and outputs; Megatron-LM's 10 add the dropouts' two masks, which a
# block keeps only with its dropouts on: dlojz's families' are off by default) and 8 + 4 r split (q, k, v and
# proj's input 8; the activation's input and fc2's 2 r each); --activation-checkpointing selective keeps the costly
# ops' outputs (q, k, v 6, the attention's 2, fc1's 2 r split; proj's and fc2's 4 whole) and the block's input (2);
# full, the block's input alone. With sequence parallelism every term is split. (whole, split, split a unit of r):
# held to a ViT-S/16's forward (r = 4) and the tests' ViT's (r = 3) in tests/parallelism/test_planner.py.
BLOCK_BYTES = {
    "none": (8, 8, 4),
    "selective": (6, 8, 2),
    "full": (2, 0, 0),
}
CHECKPOINTING = tuple(BLOCK_BYTES)  # --activation-checkpointing's modes


def block_sent(shape, images, tp, settings):
    """The bytes a rank of a `tp` group sends in a step for one block of the plan (`shape`: attention_shapes') of
    `images` images: the collectives on the tensors its split layers read and write, each at its own width, in the
    AMP dtype; and a relative position bias's float32 gradient gathered over the heads (a ring: n - 1 shards)."""
    from dlojz_lib.parallelism.tensor import block_bytes_sent

    moved_bytes = shape.tokens * images * shape.moved * settings.amp_bytes
    return block_bytes_sent(settings.sequence_parallel, tp, moved_bytes) + (tp - 1) * 4 * shape.gathered / tp


def blocks_activations(shapes, images, tp, settings, mode, blocks=None):
    """(bytes kept, bytes of the recomputation's peak) of the transformer blocks `shapes` (attention_shapes', or
    `blocks`: those of them a stage holds) for `images` images under --activation-checkpointing `mode`: what each
    keeps from its forward to its backward, and under `full` one block's whole activations while it is recomputed.
    In the AMP dtype (`settings.amp_bytes`)."""

    def per_token(bytes_of_mode, shape):
        whole, split, per_ratio = BLOCK_BYTES[bytes_of_mode]
        split += per_ratio * shape.hidden / shape.width
        return (whole + split) / tp if settings.sequence_parallel else whole + split / tp

    held = [shape for index, shape in enumerate(shapes) if blocks is None or index in blocks]
    scale = settings.amp_bytes / 2
    kept = sum(s.tokens * images * s.width * per_token(mode, s) for s in held) * scale
    peaks = [s.tokens * images * s.width * per_token("none", s) for s in held]
    recomputed = max(peaks, default=0) * scale if mode == "full" else 0.0
    return kept, recomputed
