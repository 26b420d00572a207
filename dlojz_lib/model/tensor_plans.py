"""The tensor-parallel plans of the model families (Megatron-LM's layout on PyTorch's DTensor), one `TensorPlan` a
plan, carried by its family's row (`families.Family.tensor_plan`): which blocks it splits, the check that a block
splits over N ranks, the split of one block in place, and its state-dict adapter (the tensors an ordinary model
holds fused, q, k and v, that the split blocks hold apart). `dlojz_lib/parallelism/tensor.py` applies a row's plan
over a tensor mesh.

- `TIMM`: timm's ViT family (`Block`: `attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`) and the transformer blocks of
  timm's CoAtNet/MaxViT family (`TransformerBlock2d`, `PartitionAttentionCl`/`2d`: the same four projections, as
  Linear layers or as 1x1 convolutions over NCHW maps):
  - attention: q, k and v column-wise, so that each rank holds whole heads and computes them alone, then the output
    projection row-wise (its partial sums all-reduced). timm's ViT fuses q, k and v in one `qkv` projection whose
    weight is [q; k; v]: a column-wise split of it would give rank 0 all of q and half of k. `HeadShardedQKV` holds
    the three apart instead, and reads a fused `qkv` from a checkpoint or published weights. CoAtNet's and MaxViT's
    `qkv` is laid out head by head ([q, k, v] of head 0, then head 1...: timm's head_first): split as it is, each
    rank gets whole heads; the TensorFlow ports' (head_first False) are held apart as ViT's;
  - a relative position bias (CoAtNet, MaxViT): computed whole on each rank (a table of a few thousand numbers per
    head), each rank adding its own heads' slice; its gradient gathered over the group, so the table trains whole;
  - MLP: fc1 column-wise, fc2 row-wise (one all-reduce);
  - a 1x1 convolution becomes `Pointwise`, a Linear layer over the channels of the NCHW map with the convolution's
    weight (same name, same shape: checkpoints and published weights are timm's), which PyTorch's styles split;
  - with sequence parallelism (ViT's blocks): the norms and layer scales on each rank's share of the tokens.
- `TORCHVISION_VIT`: torchvision's ViT (`EncoderBlock`: an `nn.MultiheadAttention`, whose q, k and v are one fused
  `in_proj_weight`, then `mlp`, an nn.Sequential of Linear, GELU, Dropout, Linear, Dropout): the attention held as
  `HeadSplitAttention` (q, k and v Linear layers, column-wise; `out_proj` row-wise), `mlp.0` column-wise and `mlp.3`
  row-wise. No sequence parallelism.

The norms, the stems, patch embeddings, position embeddings, the MBConv blocks, the head stay whole on every rank
(`tensor.WholeCopies` keeps their copies equal). A new family's plan is one more `TensorPlan` on its row.
"""

import dataclasses
from typing import Callable

import torch
from torch import nn

from dlojz_lib.checks import UserError
from dlojz_lib.torch_internals import move_forward_hook_last

PARTS = ("q", "k", "v")  # the parts a fused attention projection is held as
SEQUENCE_PARALLEL_LAYERS = ("norm1", "norm2", "ls1", "ls2")  # a ViT block's layers on a rank's tokens alone


def no_names(block):
    return []


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """How --tp splits a family's blocks over a tensor group, as the family's own functions."""

    blocks: Callable[[nn.Module], list]  # the blocks it splits in a module (a whole model, or a pipeline's stage)
    check: Callable[[nn.Module, int, str], None]  # (block, ranks, --arch): a UserError if it does not split so
    split: Callable[[nn.Module, object, bool], None]  # (block, tensor mesh, sequence parallel): split in place
    said: str  # the plan in words, for the run's line
    # the state-dict adapter: (a fused tensor's name ending, its parts' with {} for q, k or v): an ordinary model's
    # checkpoint loads into the split blocks, and theirs fuses back into an ordinary one's
    fused: tuple = ()
    tokens_unsplit: Callable[[nn.Module], str | None] = lambda block: "blocks have no sequence-parallel plan here"
    token_sharded: Callable[[nn.Module], list] = no_names  # under sequence parallelism: a block's weights each rank
    # runs on its own tokens (their gradients parts of a sum over the group)
    # what the planner prices (parallelism.plan): a block's parameters the split cuts, each "col" (its dim 0 split)
    # or "row" (dim 1), the others whole (a row-wise layer's bias among them)...
    placements: Callable[[nn.Module], list] = no_names
    # ...the fused parameters the split holds as q, k and v apart (three tensors each, each with its optimizer state)...
    held_apart: Callable[[nn.Module], list] = no_names
    # ...and its attention: (the module whose input is the tokens, its width, its heads)
    attention: Callable[[nn.Module], tuple] | None = None
    # ...and the elements of a tensor the split gathers over the heads once a step (a relative position bias)
    gathered: Callable[[nn.Module], int] = lambda attention: 0
    # ...and the width of its MLP's hidden layer (fc1's outputs: 4 x the tokens' in Megatron-LM's count)
    mlp_width: Callable[[nn.Module], int] | None = None


class Pointwise(nn.Linear):
    """A 1x1 convolution of an NCHW map as a Linear layer over its pixels' channels, keeping the convolution's weight
    ([out, in, 1, 1]: the same state dict), so that PyTorch's column- and row-wise styles, which take Linear layers,
    split it as they split a Linear's last dimension. The map turns channels-last before every other forward
    pre-hook (the styles' read their input as a Linear's), and back after every other forward hook
    (`hooks_last()`, once a style has added its own)."""

    def __init__(self, conv: nn.Conv2d):
        nn.Module.__init__(self)
        pointwise = conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.groups == 1
        if not pointwise or conv.padding not in ((0, 0), "valid"):
            raise ValueError(f"not a pointwise convolution: {conv}")
        self.in_features, self.out_features = conv.in_channels, conv.out_channels
        self.weight = conv.weight
        self.register_parameter("bias", conv.bias)
        self.register_forward_pre_hook(channels_last_input, prepend=True)
        self.output_hook = self.register_forward_hook(channels_first_output)

    def forward(self, x):
        return nn.functional.linear(x, self.weight.squeeze(3).squeeze(2), self.bias)

    def hooks_last(self):
        move_forward_hook_last(self, self.output_hook)


def channels_last_input(module, inputs):
    # contiguous: a matrix of pixels (DTensor's matrix product views it so); free for a channels-last map
    return (inputs[0].movedim(1, -1).contiguous(),)


def channels_first_output(module, inputs, output):
    return output.movedim(-1, 1)


def channel_dim(layer):
    """Where a layer's output channels are: 1 for a Pointwise (NCHW), the last dimension for a Linear."""
    return 1 if isinstance(layer, Pointwise) else -1


class HeadShardedQKV(nn.Module):
    """A fused `qkv` projection laid out [q; k; v] (timm's ViT, the TensorFlow ports of MaxViT) as three (q, k, v),
    whose outputs are concatenated as the fused one's: split column-wise, each rank's concatenation is its own heads'
    [q; k; v], which the attention's forward reshapes as it does the whole. A state dict with the fused
    `qkv.weight` (and bias) loads into it."""

    def __init__(self, qkv: nn.Linear):
        super().__init__()
        width, bias = qkv.out_features // 3, qkv.bias is not None
        like = dict(device=qkv.weight.device, dtype=qkv.weight.dtype)
        if isinstance(qkv, Pointwise):
            parts = (Pointwise(nn.Conv2d(qkv.in_features, width, 1, bias=bias, **like)) for _ in PARTS)
        else:
            parts = (nn.Linear(qkv.in_features, width, bias=bias, **like) for _ in PARTS)
        self.q, self.k, self.v = parts
        self.dim = channel_dim(qkv)
        with torch.no_grad():
            for name in ("weight", "bias") if bias else ("weight",):
                for part, chunk in zip(self.parts(), getattr(qkv, name).chunk(3)):
                    getattr(part, name).copy_(chunk)
        self.register_load_state_dict_pre_hook(split_on_load("{}"))

    def parts(self):
        return self.q, self.k, self.v

    def forward(self, x):
        return torch.cat([part(x) for part in self.parts()], dim=self.dim)


def split_on_load(fused):
    """A load_state_dict pre-hook reading a fused weight and bias (an ordinary model's; `fused` their name in the
    module, {} for weight or bias) as the three parts' q, k and v."""

    def split(module, state_dict, prefix, *_):
        for name in ("weight", "bias"):
            tensor = state_dict.pop(prefix + fused.format(name), None)
            if tensor is not None:
                for part, chunk in zip(PARTS, tensor.chunk(3)):
                    state_dict[f"{prefix}{part}.{name}"] = chunk

    return split


def attention_classes():
    """timm's attention and MLP classes the plan knows: ViT's, and CoAtNet's/MaxViT's (NCHW and channels-last)."""
    from timm.layers import Attention, ConvMlp, Mlp
    from timm.models.maxxvit import Attention2d, AttentionCl

    return (Attention, Attention2d, AttentionCl), (Mlp, ConvMlp)


def transformer_blocks(module):
    """The blocks the plan knows: a plain timm attention (`attn`) beside a plain timm MLP (`mlp`)."""
    attentions, mlps = attention_classes()
    return [
        block
        for block in module.modules()
        if type(getattr(block, "attn", None)) in attentions and type(getattr(block, "mlp", None)) in mlps
    ]


def is_vit_block(block):
    from timm.layers import Attention

    return type(block.attn) is Attention


def check_splittable(block, n, arch):
    attn, mlp = block.attn, block.mlp
    if is_vit_block(block):
        if not isinstance(attn.norm, nn.Identity) or getattr(attn, "gate", None) is not None:
            raise UserError(
                f"--tp: {arch}'s attention normalises or gates its heads together, which --tp does not split"
            )
        if not hasattr(attn, "attn_dim"):  # older timm reshapes the heads' output to the input's width
            raise UserError(
                "--tp: this timm's Attention has no attn_dim to give each rank its heads: install a newer timm"
            )
    if not isinstance(getattr(mlp, "norm", nn.Identity()), nn.Identity):
        raise UserError(f"--tp: {arch}'s MLP normalises its hidden layer as a whole, which --tp does not split")
    if attn.num_heads % n:
        raise UserError(f"--tp {n}: {arch} has {attn.num_heads} heads in a block; give a --tp that divides it")
    if hidden_width(mlp) % n:
        raise UserError(f"--tp {n}: {arch}'s MLP is {hidden_width(mlp)} wide; give a --tp that divides it")


def hidden_width(mlp):
    fc1 = mlp.fc1
    return fc1.out_channels if isinstance(fc1, nn.Conv2d) else fc1.out_features


def block_plan(block, sequence_parallel):
    """The plan of one block: Megatron-LM's, and with sequence parallelism the norms (and layer scales) on this
    rank's share of the tokens, the attention's and the MLP's input gathered, their outputs reduce-scattered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    qkv = [f"attn.qkv.{part}" for part in PARTS] if isinstance(block.attn.qkv, HeadShardedQKV) else ["attn.qkv"]
    plan = {name: ColwiseParallel() for name in (*qkv, "mlp.fc1")}
    if not sequence_parallel:
        if len(qkv) == 3:  # q, k and v read one DTensor: their input gradients summed, then one all-reduce
            plan["attn.qkv"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
        return {**plan, "attn.proj": RowwiseParallel(), "mlp.fc2": RowwiseParallel()}
    # The gathered tokens stay a DTensor: the attention's (or MLP's) input gradients, partial sums on each rank, are
    # summed as one and reduce-scattered back to the tokens' shards (Megatron-LM's), rather than all-reduced whole.
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False)
    plan.update(
        {
            "attn": PrepareModuleInput(**gather),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(**gather),
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        }
    )
    # The norms and layer scales run on this rank's tokens with plain weights (no style): their gradients are each
    # rank's part of the sum, which WholeCopies adds up over the group in its one all-reduce a step
    # (token_sharded_weights), where SequenceParallel's replicated DTensors sent one all-reduce a weight
    return plan


def pointwise_layers(block):
    """A CoAtNet block's 1x1 convolutions as Pointwise layers, in place."""
    for owner, name in ((block.attn, "qkv"), (block.attn, "proj"), (block.mlp, "fc1"), (block.mlp, "fc2")):
        layer = getattr(owner, name)
        if isinstance(layer, nn.Conv2d):
            setattr(owner, name, Pointwise(layer))


def heads_of_this_rank(rel_pos, tp_mesh):
    """`rel_pos`'s bias (every head's: [1,] heads, tokens, tokens) cut to this rank's heads. The cut is a DTensor
    redistribution (replicated to sharded on the heads), whose backward gathers the heads' gradients: the table,
    replicated, gets its whole gradient on every rank, as the norms do."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole = rel_pos.get_bias

    def get_bias():
        bias = whole()
        replicated = DTensor.from_local(bias, tp_mesh, [Replicate()], run_check=False)
        return replicated.redistribute(tp_mesh, [Shard(bias.dim() - 3)]).to_local()

    rel_pos.get_bias = get_bias  # what the attention's forward and rel_pos's own forward call


def token_sharded_layers(block):
    """A ViT block's norms' and layer scales' weights (names within the block), which sequence parallelism runs on
    each rank's tokens."""
    layers = [(layer, getattr(block, layer)) for layer in SEQUENCE_PARALLEL_LAYERS]
    return [f"{path}.{name}" for path, layer in layers for name, _ in layer.named_parameters()]


def tokens_unsplit(block):
    if is_vit_block(block):
        return None
    return "attention runs on windows or NCHW maps, whose tokens --sequence-parallel does not split (ViT's do)"


def qkv_held_apart(block) -> bool:
    """Whether a timm block's `qkv` is laid out [q; k; v] (not head by head), so held as three to split by heads."""
    return is_vit_block(block) or not block.attn.head_first


def timm_held_apart(block) -> list:
    qkv = block.attn.qkv
    return [p for p in (qkv.weight, qkv.bias) if p is not None] if qkv_held_apart(block) else []


def rel_pos_numel(attention) -> int:
    """The elements of `attention`'s relative position bias (every head's), whose gradient heads_of_this_rank
    gathers over the heads once a step; 0 without one."""
    rel_pos = getattr(attention, "rel_pos", None)
    return 0 if rel_pos is None else rel_pos.get_bias().numel()


def split_timm_block(block, tp_mesh, sequence_parallel):
    """One timm transformer block split over `tp_mesh` in place (block_plan), its attention left with this rank's
    heads."""
    from torch.distributed.tensor.parallel import parallelize_module

    attn = block.attn
    pointwise_layers(block)
    if qkv_held_apart(block):
        attn.qkv = HeadShardedQKV(attn.qkv)
    parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
    for layer in block.modules():
        if isinstance(layer, Pointwise):
            layer.hooks_last()
    # timm's forward reshapes with these: this rank's heads only
    attn.num_heads //= tp_mesh.size()
    if is_vit_block(block):
        attn.attn_dim //= tp_mesh.size()
    if getattr(attn, "rel_pos", None) is not None:
        heads_of_this_rank(attn.rel_pos, tp_mesh)


def linear_placements(pairs) -> list:
    """(parameter, "col" or "row") of each (layer, kind) of `pairs`: its weight split so, its bias with a column-wise
    weight (a row-wise layer's bias is added whole, after the reduction)."""
    found = []
    for layer, kind in pairs:
        found.append((layer.weight, kind))
        if layer.bias is not None and kind == "col":
            found.append((layer.bias, kind))
    return found


def timm_placements(block) -> list:
    attn, mlp = block.attn, block.mlp
    return linear_placements(((attn.qkv, "col"), (mlp.fc1, "col"), (attn.proj, "row"), (mlp.fc2, "row")))


TIMM = TensorPlan(
    transformer_blocks,
    check_splittable,
    split_timm_block,
    "q, k, v and fc1 column-wise, proj and fc2 row-wise",
    fused=(("attn.qkv.weight", "attn.qkv.{}.weight"), ("attn.qkv.bias", "attn.qkv.{}.bias")),
    tokens_unsplit=tokens_unsplit,
    token_sharded=token_sharded_layers,
    placements=timm_placements,
    held_apart=timm_held_apart,
    attention=lambda block: (block.attn, block.attn.qkv.weight.shape[0] // 3, block.attn.num_heads),
    gathered=rel_pos_numel,
    mlp_width=lambda block: block.mlp.fc1.weight.shape[0],
)


class HeadSplitAttention(nn.Module):
    """torchvision's self-attention (an nn.MultiheadAttention, q, k and v fused in its `in_proj_weight`) as three
    Linear layers q, k and v and its `out_proj`, computing the same (a batch-first self-attention: the query is the
    key and the value): split column-wise, each rank's q, k and v are its own heads'. A state dict with the fused
    `in_proj_weight` (and bias) loads into it."""

    def __init__(self, attention: nn.MultiheadAttention):
        super().__init__()
        fused, bias = attention.in_proj_weight, attention.in_proj_bias
        width = attention.embed_dim
        self.q, self.k, self.v = (
            nn.Linear(width, width, bias=bias is not None, device=fused.device, dtype=fused.dtype) for _ in PARTS
        )
        with torch.no_grad():
            for name, whole in (("weight", fused), ("bias", bias)) if bias is not None else (("weight", fused),):
                for part, chunk in zip((self.q, self.k, self.v), whole.chunk(3)):
                    getattr(part, name).copy_(chunk)
        self.out_proj = attention.out_proj
        self.num_heads, self.dropout = attention.num_heads, attention.dropout
        self.register_load_state_dict_pre_hook(split_on_load("in_proj_{}"))

    def forward(self, query, key=None, value=None, need_weights=False):
        # (the encoder block passes its input as query, key and value: the query alone is read)
        q, k, v = (part(query).unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for part in (self.q, self.k, self.v))
        x = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(x.transpose(1, 2).flatten(2)), None


def encoder_blocks(module):
    """torchvision's ViT encoder blocks in `module`."""
    from torchvision.models.vision_transformer import EncoderBlock

    return [block for block in module.modules() if isinstance(block, EncoderBlock)]


def check_encoder_block(block, n, arch):
    attention = block.self_attention
    if isinstance(attention, nn.MultiheadAttention):
        plain = attention.in_proj_weight is not None and attention.bias_k is None and not attention.add_zero_attn
        if not (plain and attention.batch_first):
            raise UserError(f"--tp: {arch}'s attention is not a plain batch-first self-attention, which --tp splits")
    if attention.num_heads % n:
        raise UserError(f"--tp {n}: {arch} has {attention.num_heads} heads in a block; give a --tp that divides it")
    if block.mlp[0].out_features % n:
        raise UserError(f"--tp {n}: {arch}'s MLP is {block.mlp[0].out_features} wide; give a --tp that divides it")


def split_encoder_block(block, tp_mesh, sequence_parallel):
    """One torchvision encoder block split over `tp_mesh` in place: q, k, v and mlp.0 column-wise, out_proj and
    mlp.3 row-wise; q, k and v read one DTensor input (their input gradients summed before one all-reduce)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    block.self_attention = HeadSplitAttention(block.self_attention)
    query = dict(input_layouts=(Replicate(), None, None), desired_input_layouts=(Replicate(), None, None))
    plan = {f"self_attention.{part}": ColwiseParallel() for part in PARTS}
    plan.update(
        {
            "self_attention": PrepareModuleInput(**query, use_local_output=False),
            "self_attention.out_proj": RowwiseParallel(),
            "mlp.0": ColwiseParallel(),
            "mlp.3": RowwiseParallel(),
        }
    )
    parallelize_module(block, tp_mesh, plan)
    block.self_attention.num_heads //= tp_mesh.size()


def encoder_placements(block) -> list:
    """A torchvision encoder block's split parameters: the fused q, k and v (`in_proj_weight` and its bias: each
    third split column-wise, the whole split on dim 0), mlp.0 column-wise, out_proj and mlp.3 row-wise."""
    attention = block.self_attention
    fused = [(attention.in_proj_weight, "col")]
    fused += [(attention.in_proj_bias, "col")] if attention.in_proj_bias is not None else []
    return fused + linear_placements(((block.mlp[0], "col"), (attention.out_proj, "row"), (block.mlp[3], "row")))


TORCHVISION_VIT = TensorPlan(
    encoder_blocks,
    check_encoder_block,
    split_encoder_block,
    "q, k, v and mlp.0 column-wise, out_proj and mlp.3 row-wise",
    fused=(
        ("self_attention.in_proj_weight", "self_attention.{}.weight"),
        ("self_attention.in_proj_bias", "self_attention.{}.bias"),
    ),
    tokens_unsplit=lambda block: "blocks (torchvision's) have no sequence-parallel plan here (timm's ViT's do)",
    placements=encoder_placements,
    held_apart=lambda block: [
        p for p in (block.self_attention.in_proj_weight, block.self_attention.in_proj_bias) if p is not None
    ],
    attention=lambda block: (block.self_attention, block.self_attention.embed_dim, block.self_attention.num_heads),
    mlp_width=lambda block: block.mlp[0].out_features,
)
