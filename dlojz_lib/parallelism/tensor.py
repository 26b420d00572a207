"""Tensor parallelism (Megatron-LM's layout) on PyTorch's DTensor: each of the N ranks of a tensor group holds a
slice of every transformer block's weights and computes a slice of each of its matrix products. What a block's split
is, is its family's: the row's `TensorPlan` (`dlojz_lib/model/tensor_plans.py`: timm's ViT and CoAtNet/MaxViT,
torchvision's ViT); here, what every plan shares.

The weights no plan splits (the norms, the stems, patch and position embeddings, the MBConv blocks, the head) are
replicated: small next to the transformer blocks, their input the same on every rank of the group. Their gradients
should be too, but a GPU's kernels need not compute bit-identical gradients on two ranks (cuDNN's autotuned
algorithms, atomics), and copies that drift apart would stay apart: `WholeCopies` averages them over the group at
every step (one all-reduce of their few weights), and compares the copies' checksums (--check-replicas).
Each block costs two all-reduces of its activations in the forward, and two in the backward (q, k and v read one
DTensor input: their three input gradients are summed before one all-reduce); with sequence parallelism, two
all-gathers and two reduce-scatters each way (`BLOCK_COLLECTIVES`, counted by the tests), the norms' gradients
(parts of a sum, one a rank's tokens) added up in the whole weights' one all-reduce a step.

- `parallelize(module, tp_mesh)`: the family's plan applied in place; a model without one, or whose heads or MLP
  width do not split over the ranks, is one line (UserError).
- `fused_state_dict(state)`, `fused_optimizer_state(state)`: a parallelised model's full state dict (q, k and v
  apart), and its optimizer's by parameter name (torch.distributed.checkpoint's form), with the fused tensors
  again (timm's `qkv`, torchvision's `in_proj_weight`: each plan's `fused` names): what an ordinary model and its
  optimizer load (`dlojz_fsdp.py consolidate`). A checkpoint's names say which family's adapter applies: the
  functions here read every row's.
- `WholeCopies(module, tp_mesh, check_every, gather, summed)`: the weights the group holds whole (`held_whole`),
  their gradients averaged over the group before each step (summed, in the same all-reduce, for the norms that
  sequence parallelism runs on each rank's tokens: `token_sharded_weights`), their copies compared every N steps
  (`replicas_differ`).
"""

import torch

from dlojz_lib.checks import UserError
from dlojz_lib.model import families
from dlojz_lib.model.tensor_plans import PARTS
from dlojz_lib.torch_internals import flatten_dense, unflatten_dense

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
# The tensors those collectives move: the two column-wise layers' inputs and the two row-wise layers' outputs, each
# once each way under sequence parallelism, else once (forward or backward); of one width in a ViT, not in a
# CoAtNet stage's first block (its attention reads the narrower input, its proj and MLP write the wider output).
BLOCK_TENSORS = 4


def block_bytes_sent(sequence_parallel, tp, moved_bytes):
    """The bytes one rank of a `tp` group sends per transformer block and step (BLOCK_COLLECTIVES, ring algorithms),
    `moved_bytes` the bytes of the BLOCK_TENSORS tensors its collectives move, summed (4 x the activations in a ViT)."""
    passes = BLOCK_COLLECTIVES[sequence_parallel].values()
    sends = sum(RING_SENDS[kind] * count for collectives in passes for kind, count in collectives.items())
    return sends / BLOCK_TENSORS * (tp - 1) / tp * moved_bytes


def fused_endings():
    """(a fused tensor's name ending, its parts' with {} for q, k or v) of every family's plan."""
    return [pair for family in families.FAMILIES if family.tensor_plan for pair in family.tensor_plan.fused]


def ends_with(key, ending):
    return key == ending or key.endswith("." + ending)


def fused_name(key):
    """(the fused tensor's name, which part) for the name of a part a plan holds apart, else (key, None)."""
    for fused, parts in fused_endings():
        for part in PARTS:
            if ends_with(key, parts.format(part)):
                return key[: len(key) - len(parts.format(part))] + fused, part
    return key, None


def part_name(fused, part):
    """The name of `part`'s tensor for the fused tensor's name `fused` (blocks.0.attn.qkv.weight, "k" ->
    blocks.0.attn.qkv.k.weight), None for a name no plan fuses."""
    for ending, parts in fused_endings():
        if ends_with(fused, ending):
            return fused[: len(fused) - len(ending)] + parts.format(part)
    return None


def fused_state_dict(state: dict) -> dict:
    """`state` (full tensors) with each part a plan holds apart fused again (timm's `qkv`, torchvision's
    `in_proj_weight`), in order."""
    fused = {}
    for key, value in state.items():
        name, part = fused_name(key)
        if part is None:
            fused[key] = value
        elif part == "q":
            fused[name] = torch.cat([state[part_name(name, p)] for p in PARTS])
    return fused


def split_state_dict(state: dict, keys) -> dict:
    """`state` (full tensors, an ordinary checkpoint's names) with each fused tensor that `keys` (a parallelised
    model's state dict keys) holds as parts split into q, k and v: what such a model loads parameter by parameter,
    each part distributed over its mesh."""
    keys, split = set(keys), {}
    for key, value in state.items():
        if part_name(key, "q") in keys:
            split.update({part_name(key, part): chunk for part, chunk in zip(PARTS, value.chunk(3))})
        else:
            split[key] = value
    return split


def qkv_layouts_differ(saved_keys, keys) -> bool:
    """Whether a checkpoint's parameter names and a model's differ by a tensor a plan holds apart (q, k and v under
    --tp, fused otherwise): the one difference between the tensor-parallel layouts' names."""
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


def plan_of(module, arch, family=None):
    """The tensor-parallel plan of `module`'s family (`family`: its row as the build resolved it, for a pipeline's
    stage the whole model's; None: looked up), one line where the family has none."""
    family = families.family_of(module) if family is None else family
    if family is None or family.tensor_plan is None:
        raise UserError(f"--tp: --arch {arch} has no tensor-parallel plan here: {families.names(True)} have one")
    return family.tensor_plan


def check_plan(module, n, arch="this model", family=None) -> list:
    """`module`'s blocks its family's plan splits, each checked to split over `n` ranks; a model without any, or of
    a family whose row has no plan, is one line. (--pp checks the whole model once: a stage without blocks, a stem
    or a head, stays replicated over the group.)"""
    plan = plan_of(module, arch, family)
    blocks = plan.blocks(module)
    if not blocks:
        raise UserError(f"--tp: --arch {arch} has no tensor-parallel plan here: {families.names(True)} have one")
    for block in blocks:
        plan.check(block, n, arch)
    return blocks


def plan_blocks(module, family) -> list:
    """The blocks of `module` (a whole model, or a pipeline's stage) that `family`'s plan splits."""
    return family.tensor_plan.blocks(module) if family is not None and family.tensor_plan is not None else []


def sequence_length(module, image_size=None):
    """The tokens a ViT's blocks see: its patch grid (at its own size, or `image_size`) and its prefix tokens
    (class, registers)."""
    grid = module.patch_embed.grid_size
    if image_size is not None:
        grid = [image_size // patch for patch in module.patch_embed.patch_size]
    return grid[0] * grid[1] + getattr(module, "num_prefix_tokens", 0)


def token_sharded_weights(module, family=None) -> set:
    """Under sequence parallelism, the names of the weights each rank runs on its share of the tokens (a ViT block's
    norms and layer scales): each holds a part of their gradient, to be summed over the tensor group (the other
    weights the group holds whole have their whole gradient on every rank, to be averaged). `family`: as
    plan_of."""
    plan = plan_of(module, "this model", family)
    blocks = {id(block) for block in plan.blocks(module)}
    return {
        f"{path}.{name}"
        for path, block in module.named_modules()
        if id(block) in blocks
        for name in plan.token_sharded(block)
    }


def parallelize(module, tp_mesh, arch="this model", sequence_parallel=False, val_crop_size=None, family=None) -> int:
    """`module`'s family's plan applied to it in place over `tp_mesh` (a 1-D DeviceMesh, or the tensor dimension of a
    2-D one). `sequence_parallel` (ViT): between the blocks' matrix products the tokens are split over the group too
    (the norms, residuals and dropouts on 1/N of them; all-gather and reduce-scatter instead of all-reduce: the same
    volume, 1/N of the activations). `family`: the model's row (check_plan). Returns the number of blocks
    parallelised."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    n = tp_mesh.size()
    family = families.family_of(module) if family is None else family
    blocks, plan = check_plan(module, n, arch, family), plan_of(module, arch, family)
    unsplit = [reason for reason in map(plan.tokens_unsplit, blocks) if reason] if sequence_parallel else []
    if unsplit:
        raise UserError(f"--sequence-parallel: {arch}'s {unsplit[0]}: drop --sequence-parallel")
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
        plan.split(block, tp_mesh, sequence_parallel)
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
