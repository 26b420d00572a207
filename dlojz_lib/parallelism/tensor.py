"""Tensor parallelism (Megatron-LM's layout) on PyTorch's DTensor: each of the N ranks of a tensor group holds a
slice of every transformer block's weights and computes a slice of each of its matrix products.

The plan, per transformer block: timm's ViT family (`Block`: `attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`) and the
transformer blocks of timm's CoAtNet/MaxViT family (`TransformerBlock2d`, `PartitionAttentionCl`/`2d`: the same four
projections, as Linear layers or as 1x1 convolutions over NCHW maps):
- attention: q, k and v column-wise, so that each rank holds whole heads and computes them alone, then the output
  projection row-wise (its partial sums all-reduced). timm's ViT fuses q, k and v in one `qkv` projection whose
  weight is [q; k; v]: a column-wise split of it would give rank 0 all of q and half of k. `HeadShardedQKV` holds
  the three apart instead, and reads a fused `qkv` from a checkpoint or published weights. CoAtNet's and MaxViT's
  `qkv` is laid out head by head ([q, k, v] of head 0, then head 1...: timm's head_first): split as it is, each rank
  gets whole heads; the TensorFlow ports' (head_first False) are held apart as ViT's;
- a relative position bias (CoAtNet, MaxViT): computed whole on each rank (a table of a few thousand numbers per
  head), each rank adding its own heads' slice; its gradient gathered over the group, so the table trains whole;
- MLP: fc1 column-wise, fc2 row-wise (one all-reduce);
- a 1x1 convolution becomes `Pointwise`, a Linear layer over the channels of the NCHW map with the convolution's
  weight (same name, same shape: checkpoints and published weights are timm's), which PyTorch's styles split;
- the norms, the stems, patch embeddings, position embeddings, the MBConv blocks, the head: replicated. They are small
  next to the transformer blocks and their input is the same on every rank of the group; their gradients should be
  too, but a GPU's kernels need not compute bit-identical gradients on two ranks (cuDNN's autotuned algorithms,
  atomics), and copies that drift apart would stay apart: `WholeCopies` averages them over the group at every step
  (one all-reduce of their few weights), and compares the copies' checksums (--check-replicas).
Each block costs two all-reduces of its activations in the forward, and two in the backward (q, k and v read one
DTensor input: their three input gradients are summed before one all-reduce); with sequence parallelism, two
all-gathers and two reduce-scatters each way (`BLOCK_COLLECTIVES`, counted by the tests), the norms' gradients
(parts of a sum, one a rank's tokens) added up in the whole weights' one all-reduce a step.

- `parallelize(module, tp_mesh)`: the plan applied in place; a model without one, or whose heads or MLP width do not
  split over the ranks, is one line (UserError).
- `fused_state_dict(state)`, `fused_optimizer_state(state)`: a parallelised model's full state dict (q, k and v
  apart), and its optimizer's by parameter name (torch.distributed.checkpoint's form), with timm's fused `qkv` again:
  what an ordinary model and its optimizer load (`dlojz_fsdp.py consolidate`).
- `WholeCopies(module, tp_mesh, check_every, gather, summed)`: the weights the group holds whole (`held_whole`),
  their gradients averaged over the group before each step (summed, in the same all-reduce, for the norms that
  sequence parallelism runs on each rank's tokens: `token_sharded_weights`), their copies compared every N steps
  (`replicas_differ`).
"""

import torch
from torch import nn

from dlojz_lib.checks import UserError
from dlojz_lib.model import families
from dlojz_lib.torch_internals import flatten_dense, move_forward_hook_last, unflatten_dense

PARTS = ("q", "k", "v")
SEQUENCE_PARALLEL_LAYERS = ("norm1", "norm2", "ls1", "ls2")  # a ViT block's layers on a rank's tokens alone

# What the plan sends per transformer block and step, each collective on one block's activations ([tokens, batch,
# width], in the AMP dtype), as Megatron-LM's layout: without sequence parallelism the row-wise layers' outputs
# all-reduced in the forward and the column-wise layers' input gradients in the backward; with it, all-gathers of the
# attention's and the MLP's inputs and reduce-scatters of their outputs, each the other's backward. Counted on 2 ranks
# by tests/parallelism/test_tensor_parallel.py; bench/parallel_memory.py's bytes sent are made of it.
BLOCK_COLLECTIVES = {
    False: {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
    True: {"forward": {"all_gather": 2, "reduce_scatter": 2}, "backward": {"all_gather": 2, "reduce_scatter": 2}},
}
RING_SENDS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # a ring sends this x (n - 1) / n of the buffer


def block_bytes_sent(sequence_parallel, tp, activation_bytes):
    """The bytes one rank of a `tp` group sends per transformer block and step, `activation_bytes` the block's
    activations (BLOCK_COLLECTIVES, ring algorithms)."""
    passes = BLOCK_COLLECTIVES[sequence_parallel].values()
    sends = sum(RING_SENDS[kind] * count for collectives in passes for kind, count in collectives.items())
    return sends * (tp - 1) / tp * activation_bytes


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
        self.register_load_state_dict_pre_hook(split_fused_qkv)

    def parts(self):
        return self.q, self.k, self.v

    def forward(self, x):
        return torch.cat([part(x) for part in self.parts()], dim=self.dim)


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


def split_state_dict(state: dict, keys) -> dict:
    """`state` (full tensors, timm's names: an ordinary checkpoint's) with each fused `qkv` weight and bias that
    `keys` (a parallelised model's state dict keys) holds as a HeadShardedQKV's parts split into q, k and v: what
    such a model loads parameter by parameter, each part distributed over its mesh."""
    keys, split = set(keys), {}
    for key, value in state.items():
        if key.rpartition(".")[0].endswith("attn.qkv") and part_name(key, "q") in keys:
            split.update({part_name(key, part): chunk for part, chunk in zip(PARTS, value.chunk(3))})
        else:
            split[key] = value
    return split


def qkv_layouts_differ(saved_keys, keys) -> bool:
    """Whether a checkpoint's parameter names and a model's differ by a HeadShardedQKV (q, k and v held apart under
    --tp, fused in timm's `qkv` otherwise): the one difference between the tensor-parallel layouts' names."""
    saved_keys, keys = set(saved_keys), set(keys)
    return any(
        fused_name(key)[1] is not None and (fused_name(key)[0] in other)
        for mine, other in ((saved_keys, keys), (keys, saved_keys))
        for key in mine - other
    )


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


def fused_flat_optimizer_state(state: dict) -> dict:
    """fused_optimizer_state for an optimizer state saved parameter by parameter (--pp: keys `state.NAME.ENTRY` and
    `param_groups.NAME.SETTING`)."""
    fused = {}
    for key, value in state.items():
        kind, rest = key.split(".", 1)
        name, entry = rest.rsplit(".", 1)
        whole, part = fused_name(name)
        if part is None:
            fused[key] = value
        elif part == "q":
            parts = [state[f"{kind}.{part_name(whole, p)}.{entry}"] for p in PARTS]
            tensor = kind == "state" and torch.is_tensor(value) and value.dim()
            fused[f"{kind}.{whole}.{entry}"] = torch.cat(parts) if tensor else value
    return fused


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


def check_plan(module, n, arch="this model", family=None) -> list:
    """`module`'s transformer blocks, each checked to split over `n` ranks; a model without any, or of a family whose
    row has no plan (`family`: the model's row as the build resolved it; None: looked up, none for a pipeline's
    stage, whose model was checked), is one line. (--pp checks the whole model once: a stage without blocks, a stem
    or a head, stays replicated over the group.)"""
    family = families.family_of(module) if family is None else family
    blocks = transformer_blocks(module) if family is None or family.tensor_parallel else []
    if not blocks:
        raise UserError(f"--tp: --arch {arch} has no tensor-parallel plan here: {families.names(True)} have one")
    for block in blocks:
        check_splittable(block, n, arch)
    return blocks


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


def sequence_length(module, image_size=None):
    """The tokens a ViT's blocks see: its patch grid (at its own size, or `image_size`) and its prefix tokens
    (class, registers)."""
    grid = module.patch_embed.grid_size
    if image_size is not None:
        grid = [image_size // patch for patch in module.patch_embed.patch_size]
    return grid[0] * grid[1] + getattr(module, "num_prefix_tokens", 0)


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


def token_sharded_weights(module) -> set:
    """Under sequence parallelism, the names of the blocks' norms' and layer scales' weights: each rank runs them on
    its share of the tokens, so each holds a part of their gradient, to be summed over the tensor group (the other
    weights the group holds whole have their whole gradient on every rank, to be averaged)."""
    blocks = {id(block) for block in transformer_blocks(module)}
    names = set()
    for path, block in module.named_modules():
        if id(block) in blocks:
            for layer in SEQUENCE_PARALLEL_LAYERS:
                names |= {f"{path}.{layer}.{name}" for name, _ in getattr(block, layer).named_parameters()}
    return names


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


def parallelize(module, tp_mesh, arch="this model", sequence_parallel=False, val_crop_size=None, family=None) -> int:
    """The plan above applied to `module` in place over `tp_mesh` (a 1-D DeviceMesh, or the tensor dimension of a
    2-D one). `sequence_parallel` (ViT): between the blocks' matrix products the tokens are split over the group too
    (the norms, residuals and dropouts on 1/N of them; all-gather and reduce-scatter instead of all-reduce: the same
    volume, 1/N of the activations). `family`: the model's row (check_plan). Returns the number of blocks
    parallelised."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    n = tp_mesh.size()
    blocks = check_plan(module, n, arch, family)
    if sequence_parallel and not all(is_vit_block(block) for block in blocks):
        raise UserError(
            f"--sequence-parallel: {arch}'s attention runs on windows or NCHW maps, whose tokens --sequence-parallel "
            "does not split (ViT's do): drop --sequence-parallel"
        )
    if sequence_parallel and sequence_length(module) % n:
        raise UserError(
            f"--sequence-parallel: {arch} sees {sequence_length(module)} tokens at this image size, which do not "
            f"split over {n} ranks; give an --image-size or a --tp that makes them a multiple of {n}"
        )
    if sequence_parallel and val_crop_size is not None and sequence_length(module, val_crop_size) % n:
        raise UserError(  # (else validation's collectives mismatch at the end of the first epoch)
            f"--sequence-parallel: {arch} sees {sequence_length(module, val_crop_size)} tokens at validation's "
            f"--val-crop-size {val_crop_size}, which do not split over {n} ranks; give a --val-crop-size that makes "
            f"them a multiple of {n}"
        )
    for block in blocks:
        attn = block.attn
        pointwise_layers(block)
        if is_vit_block(block) or not attn.head_first:  # [q; k; v]: held apart to split by heads
            attn.qkv = HeadShardedQKV(attn.qkv)
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
        for layer in block.modules():
            if isinstance(layer, Pointwise):
                layer.hooks_last()
        # timm's forward reshapes with these: this rank's heads only
        attn.num_heads //= n
        if is_vit_block(block):
            attn.attn_dim //= n
        if getattr(attn, "rel_pos", None) is not None:
            heads_of_this_rank(attn.rel_pos, tp_mesh)
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


def tensor_dim(parameter, tp_mesh):
    """The index of the tensor dimension in `parameter`'s mesh (a DTensor on the tensor mesh, or on a mesh naming
    a "tensor" dimension), else None (a plain tensor, or FSDP's data mesh alone)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(parameter, DTensor):
        return None
    mesh = parameter.device_mesh
    if mesh == tp_mesh:
        return 0
    names = mesh.mesh_dim_names or ()
    return names.index("tensor") if "tensor" in names else None


def held_whole(module, tp_mesh) -> list:
    """(name, parameter) of the trainable parameters that every rank of a tensor group holds whole: not split over
    the tensor dimension by the plan (replicated there, or not on it at all)."""
    whole = []
    for name, parameter in module.named_parameters():
        dim = tensor_dim(parameter, tp_mesh)
        if parameter.requires_grad and (dim is None or not parameter.placements[dim].is_shard()):
            whole.append((name, parameter))
    return whole


def local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class WholeCopies:
    """The weights every rank of a tensor group holds whole (held_whole): before each optimizer step their gradients
    are averaged over the group (one all-reduce of them all, flattened), so the group's copies take the same step
    whatever each rank's kernels computed; with `check_every` N, every N steps two bit checksums of each copy are
    compared across the group and the run ends in one line (UserError, on every rank: `gather` is the world's
    all_gather of Python objects) naming the first weight whose copies differ."""

    def __init__(self, module, tp_mesh, check_every=0, gather=None, summed=()):
        self.named, self.mesh, self.check_every, self.gather = held_whole(module, tp_mesh), tp_mesh, check_every, gather
        self.summed = set(summed)  # token_sharded_weights: each rank's gradient a part of the sum

    def average_gradients(self):
        """One all-reduce of every whole weight's gradient: averaged, or summed for a weight each rank ran on its
        own tokens (sequence parallelism)."""
        named = [(name, local(p.grad)) for name, p in self.named if p.grad is not None]
        if not named:
            return
        grads = [grad for _, grad in named]
        flat = flatten_dense(grads)
        torch.distributed.all_reduce(flat, group=self.mesh.get_group())
        for (name, grad), total in zip(named, unflatten_dense(flat, grads)):
            grad.copy_(total if name in self.summed else total / self.mesh.size())

    def check(self, step):
        """At every check_every-th step: one line, on every rank, if some copies differ."""
        if not self.check_every or step % self.check_every:
            return
        group = self.mesh.get_group()
        found = replicas_differ(self.named, self.mesh)
        if found is not None:
            name, first, other = found
            found = (name, *(torch.distributed.get_global_rank(group, r) for r in (first, other)))
        reported = [f for f in self.gather(found) if f is not None]
        if reported:
            name, first, other = reported[0]
            raise UserError(
                f"--check-replicas {self.check_every}: at step {step} ranks {first} and {other} hold different copies "
                f"of {name}, which their tensor group holds whole: the run stops here; resume it from its last "
                "checkpoint (--resume auto: one copy of each weight was saved) and report the GPUs and torch version"
            )


def replicas_differ(named, tp_mesh):
    """The name of the first of `named` (held_whole's) whose copies differ across the tensor group, with the two
    group ranks, else None. The copies are compared bit for bit (two integer checksums of each tensor's bits: a NaN
    equals itself there, and no rounding of a float sum hides a difference); one all-gather of them, one flag read
    on the host (the check's one wait), the checksums themselves only when the flag is set."""
    if not named:
        return None
    sums = torch.stack([checksum for _, p in named for checksum in bit_checksums(local(p).detach())])
    every = [torch.empty_like(sums) for _ in range(tp_mesh.size())]
    torch.distributed.all_gather(every, sums, group=tp_mesh.get_group())
    every = torch.stack(every)
    if not (every != every[0]).any().item():  # the one wait of the check
        return None
    every = every.cpu()
    for rank in range(1, len(every)):
        differ = (every[rank] != every[0]).nonzero()
        if len(differ):
            return named[int(differ[0]) // 2][0], 0, rank
    return None


BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's bits as an integer


def bit_checksums(tensor):
    """Two int64 checksums of `tensor`'s bits: their sum, and the sum of their squares (wrapping: exact, and the
    same on every rank for the same bits)."""
    bits = tensor.contiguous().view(BITS_OF_SIZE[tensor.element_size()]).long()
    return bits.sum(), (bits * bits).sum()
