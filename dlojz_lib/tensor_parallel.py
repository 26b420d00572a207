"""Tensor parallelism (Megatron-LM's layout) on PyTorch's DTensor: each of the N ranks of a tensor group holds a
slice of every transformer block's weights and computes a slice of each of its matrix products.

The plan, per block of timm's ViT family (`Block`: `attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`):
- attention: q, k and v column-wise, so that each rank holds whole heads and computes them alone, then the output
  projection row-wise (its partial sums all-reduced). timm fuses q, k and v in one `qkv` projection, whose weight is
  [q; k; v]: a column-wise split of it would give rank 0 all of q and half of k. `HeadShardedQKV` holds the three
  apart instead, and reads a fused `qkv` from a checkpoint or published weights;
- MLP: fc1 column-wise, fc2 row-wise (one all-reduce);
- the norms, the patch embedding, the class token and position embedding, the head: replicated. They are small next to
  the blocks, their input is the same on every rank of the group, and so are their gradients.
Each block costs two all-reduces of its activations in the forward, and two in the backward.

- `parallelize(module, tp_mesh)`: the plan applied in place; a model without one, or whose heads or MLP width do not
  split over the ranks, is one line (UserError).
- `fused_state_dict(state)`, `fused_optimizer_state(state)`: a parallelised model's full state dict (q, k and v
  apart), and its optimizer's by parameter name (torch.distributed.checkpoint's form), with timm's fused `qkv` again:
  what an ordinary model and its optimizer load (`dlojz_fsdp.py consolidate`).
"""

import torch
from torch import nn

from dlojz_lib.checks import UserError

FAMILIES = "timm's ViT family (timm:vit_*, timm:deit_*, timm:test_vit ...)"
PARTS = ("q", "k", "v")


class HeadShardedQKV(nn.Module):
    """timm's fused `qkv` projection as three (q, k, v), whose outputs are concatenated as the fused one's: split
    column-wise, each rank's concatenation is its own heads' [q; k; v], which timm's Attention.forward reshapes as it
    does the whole. A state dict with the fused `qkv.weight` (and bias) loads into it."""

    def __init__(self, qkv: nn.Linear):
        super().__init__()
        width, bias = qkv.out_features // 3, qkv.bias is not None
        like = dict(device=qkv.weight.device, dtype=qkv.weight.dtype)
        self.q, self.k, self.v = (nn.Linear(qkv.in_features, width, bias=bias, **like) for _ in PARTS)
        with torch.no_grad():
            for name in ("weight", "bias") if bias else ("weight",):
                for part, chunk in zip(self.parts(), getattr(qkv, name).chunk(3)):
                    getattr(part, name).copy_(chunk)
        self.register_load_state_dict_pre_hook(split_fused_qkv)

    def parts(self):
        return self.q, self.k, self.v

    def forward(self, x):
        return torch.cat([part(x) for part in self.parts()], dim=-1)


def split_fused_qkv(module, state_dict, prefix, *_):
    """A fused `qkv.weight`/`qkv.bias` (an ordinary model's) read as the three parts."""
    for name in ("weight", "bias"):
        fused = state_dict.pop(prefix + name, None)
        if fused is not None:
            for part, chunk in zip(PARTS, fused.chunk(3)):
                state_dict[f"{prefix}{part}.{name}"] = chunk


def fused_name(key):
    """(the fused parameter's name, which part) for a HeadShardedQKV part's parameter name, else (key, None)."""
    stem, _, leaf = key.rpartition(".")
    base, _, part = stem.rpartition(".")
    if part in PARTS and base.endswith("attn.qkv"):
        return f"{base}.{leaf}", part
    return key, None


def part_name(fused, part):
    """The name of `part`'s parameter for the fused parameter's name `fused` (blocks.0.attn.qkv.weight, "k" ->
    blocks.0.attn.qkv.k.weight)."""
    base, _, leaf = fused.rpartition(".")
    return f"{base}.{part}.{leaf}"


def fused_state_dict(state: dict) -> dict:
    """`state` (full tensors) with each HeadShardedQKV's q, k and v fused into timm's `qkv` again, in order."""
    fused = {}
    for key, value in state.items():
        name, part = fused_name(key)
        if part is None:
            fused[key] = value
        elif part == "q":
            fused[name] = torch.cat([state[part_name(name, p)] for p in PARTS])
    return fused


def fused_optimizer_state(state: dict) -> dict:
    """An optimizer state dict keyed by parameter name (get_state_dict's) with each part's state fused as the
    parameters are: the tensors of q, k and v concatenated, a scalar (a step count) q's."""
    fused_state = {}
    for key, entries in state["state"].items():
        name, part = fused_name(key)
        if part is None:
            fused_state[key] = entries
        elif part == "q":
            siblings = [state["state"][part_name(name, p)] for p in PARTS]
            fused_state[name] = {
                entry: torch.cat([s[entry] for s in siblings]) if torch.is_tensor(value) and value.dim() else value
                for entry, value in entries.items()
            }
    groups = []
    for group in state["param_groups"]:
        params = [fused_name(key)[0] for key in group["params"] if fused_name(key)[1] in (None, "q")]
        groups.append(dict(group, params=params))
    return {"state": fused_state, "param_groups": groups}


def transformer_blocks(module):
    """The blocks the plan knows: timm's ViT `Block`s (a plain `Attention` and a plain `Mlp`)."""
    from timm.layers import Attention, Mlp

    return [
        block
        for block in module.modules()
        if type(getattr(block, "attn", None)) is Attention and type(getattr(block, "mlp", None)) is Mlp
    ]


def check_splittable(block, n, arch):
    attn, mlp = block.attn, block.mlp
    if not isinstance(attn.norm, nn.Identity) or getattr(attn, "gate", None) is not None:
        raise UserError(f"--tp: {arch}'s attention normalises or gates its heads together, which --tp does not split")
    if not isinstance(mlp.norm, nn.Identity):
        raise UserError(f"--tp: {arch}'s MLP normalises its hidden layer as a whole, which --tp does not split")
    if not hasattr(attn, "attn_dim"):  # older timm reshapes the heads' output to the input's width
        raise UserError("--tp: this timm's Attention has no attn_dim to give each rank its heads: install a newer timm")
    if attn.num_heads % n:
        raise UserError(f"--tp {n}: {arch} has {attn.num_heads} heads per block; give a --tp that divides it")
    if mlp.fc1.out_features % n:
        raise UserError(f"--tp {n}: {arch}'s MLP is {mlp.fc1.out_features} wide; give a --tp that divides it")


def sequence_length(module):
    """The tokens a ViT's blocks see: its patch grid and its prefix tokens (class, registers)."""
    grid = module.patch_embed.grid_size
    return grid[0] * grid[1] + getattr(module, "num_prefix_tokens", 0)


def block_plan(block, sequence_parallel):
    """The plan of one block: Megatron-LM's, and with sequence parallelism the norms (and layer scales) on this
    rank's share of the tokens, the attention's and the MLP's input gathered, their outputs reduce-scattered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {f"attn.qkv.{part}": ColwiseParallel() for part in PARTS}
    plan["mlp.fc1"] = ColwiseParallel()
    if not sequence_parallel:
        return {**plan, "attn.proj": RowwiseParallel(), "mlp.fc2": RowwiseParallel()}
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    plan.update(
        {
            "attn": PrepareModuleInput(**gather),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(**gather),
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        }
    )
    for name in ("norm1", "norm2", "ls1", "ls2"):
        if not isinstance(getattr(block, name), nn.Identity):
            plan[name] = SequenceParallel(use_local_output=True)  # a local shard, as the residual it joins
    return plan


def parallelize(module, tp_mesh, arch="this model", sequence_parallel=False) -> int:
    """The plan above applied to `module` in place over `tp_mesh` (a 1-D DeviceMesh, or the tensor dimension of a
    2-D one). `sequence_parallel`: between the blocks' matrix products the tokens are split over the group too
    (the norms, residuals and dropouts on 1/N of them; all-gather and reduce-scatter instead of all-reduce: the same
    volume, 1/N of the activations). Returns the number of blocks parallelised."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    blocks = transformer_blocks(module)
    if not blocks:
        raise UserError(f"--tp: --arch {arch} has no tensor-parallel plan here: {FAMILIES} has one")
    n = tp_mesh.size()
    for block in blocks:
        check_splittable(block, n, arch)
    if sequence_parallel and sequence_length(module) % n:
        raise UserError(
            f"--sequence-parallel: {arch} sees {sequence_length(module)} tokens at this image size, which do not "
            f"split over {n} ranks; give an --image-size or a --tp that makes them a multiple of {n}"
        )
    for block in blocks:
        attn = block.attn
        attn.qkv = HeadShardedQKV(attn.qkv)
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
        # timm's forward reshapes with these: this rank's heads only
        attn.num_heads //= n
        attn.attn_dim //= n
    if sequence_parallel:  # the tokens split before the first block, gathered after the last
        parallelize_module(
            blocks[0],
            tp_mesh,
            PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
        )
        parallelize_module(
            blocks[-1],
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True
            ),
        )
    return len(blocks)
