"""Activation checkpointing: a block's activations recomputed in the backward instead of kept until it.

- `enable_grad_checkpointing(model, arch)`: recompute each stage's activations in the backward (`--grad-checkpointing`,
  `--activation-checkpointing full`), BatchNorm running statistics updated once per step as without it;
  `checkpoint_blocks(blocks, mode, every)`: the same on given blocks, `selective` keeping each block's costly
  outputs (matrix products, convolutions, attentions) and recomputing the rest, every N-th block only with
  `every` (`--activation-checkpointing selective`, `--ac-every`); `plain_stages(model)` undoes either for as long
  as a `with` lasts (FLOP counts exclude the recomputation).
- `recomputed(forward, module, selective)`: one forward recomputed (a pipeline stage's layers).
- `apply_checkpointing(module, mode, every, family, arch)`: what the unit pass applies to a whole model or a unit,
  on its family's blocks (`recomputed_blocks`).
"""

import contextlib

import torch

from dlojz_lib.checks import fail
from dlojz_lib.model.families import names
from dlojz_lib.torch_internals import batch_norm_base


def selective_checkpoint_context():
    """The context of selective activation checkpointing (torchtitan's op-level policy): the outputs of the costly
    ops (matrix products, convolutions, fused attentions: torch_internals.costly_ops) and tensor parallelism's
    collectives (sent once, as Megatron-LM does) kept for the backward, every other op (norms, activations,
    additions, reshapes) recomputed from them."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from dlojz_lib.torch_internals import costly_ops

    costly = costly_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in costly else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class CheckpointedStage:
    """Mixed into a stage's class: its activations are recomputed in the backward instead of being kept (`selective`:
    all but its costly ops' outputs)."""

    selective = False

    def forward(self, *inputs):
        return recomputed(super().forward, self, self.selective)(*inputs)


def recomputed(forward, module, selective=False):
    """`forward` (of `module`, or of a part of it) whose activations are recomputed in the backward instead of being
    kept (PyTorch's non-reentrant checkpoint; `selective`: all but its costly ops' outputs), the recomputation run
    with `module`'s BatchNorm statistics frozen (running_stats_frozen): a batch counted once."""

    def run_checkpointed(*inputs):
        if not torch.is_grad_enabled():
            return forward(*inputs)
        calls = 0

        def run(*args):
            nonlocal calls
            calls += 1
            if calls == 1:
                return forward(*args)
            with running_stats_frozen(module):  # the recomputation in the backward: same batch statistics, no update
                return forward(*args)

        context = dict(context_fn=selective_checkpoint_context) if selective else {}
        return torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False, **context)

    return run_checkpointed


@contextlib.contextmanager
def running_stats_frozen(module):
    """BatchNorm layers of `module` normalise with the batch's statistics, as in training, and save the same
    tensors for the backward, but leave their running statistics and batch count as they were: a recomputed
    forward must not count the batch twice. Momentum 0 keeps the running statistics exactly, and without its
    batch count a norm counts nothing: the recomputation runs no op the forward did not (selective checkpointing
    replays the forward's ops, and refuses a new one)."""
    norms = [m for m in module.modules() if isinstance(m, batch_norm_base()) and m.training and m.track_running_stats]
    kept = [(norm.momentum, norm.num_batches_tracked) for norm in norms]
    for norm in norms:
        norm.momentum, norm.num_batches_tracked = 0.0, None
    try:
        yield
    finally:
        for norm, (momentum, count) in zip(norms, kept):
            norm.momentum, norm.num_batches_tracked = momentum, count


def enable_grad_checkpointing(model, arch, blocks=()):
    """Recompute each stage's activations in the backward instead of keeping them (ResNet-like layer1..4, or the
    children of `.features`, else `blocks`: a model family's, e.g. a ViT's or a CoAtNet's). Only the stages' classes
    change: parameters and checkpoint keys stay, copies work. Other timm models use their own
    `set_grad_checkpointing`, which does not freeze BatchNorm's running statistics in the recomputation (a
    CoAtNet's convolutional blocks counted each batch twice: hence its family's blocks first)."""
    stages = [getattr(model, name) for name in ("layer1", "layer2", "layer3", "layer4") if hasattr(model, name)]
    if not stages and isinstance(getattr(model, "features", None), torch.nn.Sequential):
        stages = list(model.features)
    stages = stages or list(blocks)
    if not stages and hasattr(model, "set_grad_checkpointing"):  # other timm models: their own block checkpointing
        model.set_grad_checkpointing(True)
        return
    if not stages:
        fail(f"--grad-checkpointing: --arch {arch} has neither layer1..layer4 nor a .features Sequential to checkpoint")
    checkpoint_blocks(stages)


def checkpoint_blocks(blocks, mode="full", every=1):
    """Each of `blocks` (the 1st, the every+1-th...) recomputed in the backward: whole (`full`), or all but its
    costly ops' outputs (`selective`, its activations made out-of-place: `without_inplace_activations`). Only the
    blocks' classes change: parameters and checkpoint keys stay."""
    for index, block in enumerate(blocks):
        if mode != "none" and index % every == 0:
            mixin = CheckpointedStage if mode == "full" else SelectivelyCheckpointed
            block.__class__ = type(f"Checkpointed{type(block).__name__}", (mixin, type(block)), {})
            if mode == "selective":
                without_inplace_activations(block)


def without_inplace_activations(module):
    """`module`'s in-place activations (ReLU, SiLU, GELU... with `inplace=True`: a CoAtNet's squeeze-excitation, a
    ResNet's ReLUs) made out-of-place, the same values: selective checkpointing keeps a convolution's or a matrix
    product's output for the backward, and an activation written into it in place would change what it kept (torch
    refuses it at the first backward: "Tensor cached during selective activation checkpoint has been mutated")."""
    for layer in module.modules():
        if getattr(layer, "inplace", None) is True:
            layer.inplace = False


class SelectivelyCheckpointed(CheckpointedStage):
    selective = True


@contextlib.contextmanager
def plain_stages(model):
    """Temporarily without activation checkpointing: model FLOPs count no recomputation."""
    stages = [(m, type(m)) for m in model.modules() if isinstance(m, CheckpointedStage)]
    for module, cls in stages:
        module.__class__ = cls.__bases__[1]
    try:
        yield model
    finally:
        for module, cls in stages:
            module.__class__ = cls


def recomputed_blocks(module, family, arch) -> list:
    """The blocks --activation-checkpointing selective (or --ac-every) recomputes: its family's,
    in forward order; a model of no family is one line."""
    if family is None:
        fail(
            f"--activation-checkpointing selective and --ac-every recompute a model family's blocks: --arch {arch} is "
            f"none of {names()}; use --activation-checkpointing full (or --grad-checkpointing)"
        )
    return [block for _, block in family.blocks(module)]


def apply_checkpointing(module, mode, every, family, arch):
    """`module` (a whole model) recomputing its activations in the backward (`mode` full or selective, the 1st,
    every+1-th... block; none: as it is): full on every block through the model's own stages (a ResNet's layer1..4,
    a `.features` Sequential, else its family's blocks: enable_grad_checkpointing), else its family's blocks
    (recomputed_blocks). The unit pass's checkpointing of a model (parallelism.layout.parallelize_unit), and what
    bench/activation_memory.py measures."""

    if mode == "none":
        return
    if mode == "full" and every == 1:
        enable_grad_checkpointing(module, arch, [] if family is None else [block for _, block in family.blocks(module)])
    else:
        checkpoint_blocks(recomputed_blocks(module, family, arch), mode, every)
