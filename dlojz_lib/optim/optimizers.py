"""Parameter groups and optimizers: weight decay by kind of parameter (--no-wd-norm-bias, --norm-wd, --bias-wd,
--embedding-wd), layer decay (--layer-decay), the head's groups of a fine-tune and its frozen backbone
(--freeze-backbone-epochs), and `build_optimizer` over dlojz_lib.optim's table (fused steps where torch has them).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from dlojz_lib.checks import fail
from dlojz_lib.model.zoo import classifier_name
from dlojz_lib.optim import OPTIMIZER_TABLE, check_hyperparameters

# Layers whose affine parameters are normalisation scales/shifts: decaying them towards 0 only fights the
# normalisation (see "Bag of Tricks", He et al. 2019), hence --no-wd-norm-bias.
NORM_LAYERS = tuple(
    getattr(nn, name)
    for name in (
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "SyncBatchNorm",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "GroupNorm",
        "LayerNorm",
        "LocalResponseNorm",
        "RMSNorm",
    )
    if hasattr(nn, name)
)


# Parameters that --embedding-wd sets: ViTs' class token and position embeddings, Swin's relative position bias
# (torchvision's --transformer-embedding-decay keys), and those a timm model names in its no_weight_decay().
EMBEDDING_NAMES = ("class_token", "cls_token", "dist_token", "pos_embed", "pos_embedding", "position_embedding")
EMBEDDING_NAMES += ("relative_position_bias_table",)


def parameter_kind(module: nn.Module, full_name: str, name: str, timm_names=()) -> str:
    """ "embedding", "norm", "bias" or "other", in torchvision's order of precedence (set_weight_decay).
    `timm_names`: the model's no_weight_decay() set, where it is a timm model."""
    if name in EMBEDDING_NAMES or full_name in timm_names or name in timm_names:
        return "embedding"
    if isinstance(module, NORM_LAYERS):
        return "norm"
    return "bias" if name == "bias" else "other"


def check_kinds_present(model: nn.Module, kind_decay: dict, arch: str):
    """--norm-wd, --bias-wd, --embedding-wd name a kind of parameter; one that no trainable parameter of the model
    (whole: before a layout cuts it) is of would do nothing: refused in one line."""
    if not kind_decay:
        return
    timm_names = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    present = {
        parameter_kind(module, f"{module_name}.{name}" if module_name else name, name, timm_names)
        for module_name, module in model.named_modules()
        for name, param in module.named_parameters(recurse=False)
        if param.requires_grad
    }
    for kind in kind_decay:
        if kind not in present:
            fail(f"--{kind}-wd: --arch {arch} has no trainable {kind} parameters, so it would do nothing; drop it")


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_wd_norm_bias: bool,
    layer_decay: float | None = None,
    head: str | None = None,
    kind_decay: dict | None = None,
) -> list[dict]:
    """Return optimizer parameter groups for the trainable parameters of ``model``.

    Without ``no_wd_norm_bias``: the parameters take ``weight_decay``. With it: norm-layer parameters and biases
    take ``weight_decay=0``. ``kind_decay`` (``--norm-wd``, ``--bias-wd``, ``--embedding-wd``): the weight decay of
    each kind of parameter it names (``parameter_kind``), over the two above. With ``layer_decay`` (``--layer-decay``), each group's ``lr_scale`` is
    ``layer_decay ** (depth of the head - depth of its layer)``, the depths from ``layer_depths``. With ``head``
    (the classifier's module name), its parameters are groups of their own (``"head": True``), for
    ``--freeze-backbone-epochs``. Groups go from the head (the largest ``lr_scale``) down, so that the first
    group's LR is the schedule's. Frozen parameters (``requires_grad=False``) are left out; shared parameters
    appear once.
    """
    depth = layer_depths(model, head) if layer_decay is not None else {}
    timm_names = model.no_weight_decay() if kind_decay and hasattr(model, "no_weight_decay") else ()
    deepest = max(depth.values(), default=0)
    groups, seen = {}, set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, NORM_LAYERS)
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{name}" if module_name else name
            in_head = head is not None and full_name.startswith(head + ".")
            scale = layer_decay ** (deepest - depth[full_name]) if layer_decay is not None else 1.0
            decays = not (no_wd_norm_bias and (is_norm or name == "bias"))
            decay = weight_decay if decays else 0.0
            kind = parameter_kind(module, full_name, name, timm_names) if kind_decay else ""
            if kind in (kind_decay or {}):
                decay = kind_decay[kind]
            key = (not in_head, -scale, not decays, kind)  # (without kind_decay: the groups of earlier checkpoints)
            group = groups.setdefault(key, {"params": [], "weight_decay": decay, "lr_scale": scale, "head": in_head})
            group["params"].append(param)
    return [groups[key] for key in sorted(groups)]


def layer_depths(model: nn.Module, head: str | None) -> dict[str, int]:
    """Each parameter's depth for ``--layer-decay``, 0 at the input and the head deepest. A timm model's own
    grouping where it has one (``group_matcher``: its stem, each block, its head, as timm's layer decay uses);
    otherwise one layer per block of the model's stages (each child of a plain ``nn.Sequential``/``ModuleList``
    that is not one itself: a ResNet's ``layer1.0``, a ConvNeXt's ``features.1.0``, a ViT's encoder layers) and
    per other module, in the order the model defines them."""
    if hasattr(model, "group_matcher"):
        from timm.models import group_parameters

        return group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    containers = (nn.Sequential, nn.ModuleList)
    keys = {}
    for name, _ in model.named_parameters():
        parts, module, key = name.split("."), model, None
        for index, part in enumerate(parts[:-1]):
            child = module.get_submodule(part)
            if type(module) in containers and type(child) not in containers:  # a block (not a subclass: a ConvBN)
                key = ".".join(parts[: index + 1])
                break
            module = child
        if key is None:
            key = ".".join(parts[:-1]) or name  # the module owning it, or the model's own (a class token)
        if head is not None and name.startswith(head + "."):
            key = head
        keys[name] = key
    order = {}
    for key in keys.values():
        if key != head:
            order.setdefault(key, len(order))
    if head is not None:
        order[head] = len(order)
    return {name: order[key] for name, key in keys.items()}


def build_optimizer(
    name: str, params, lr: float, momentum: float, weight_decay: float, fused: bool = False, nesterov: bool = False
) -> torch.optim.Optimizer:
    """Build the optimizer ``name`` (a row of ``OPTIMIZER_TABLE``) over ``params`` (parameters or param groups).

    ``momentum`` (``--mom``) is SGD/LARS/RMSprop momentum or the first beta of AdamW/LAMB/Lion. ``weight_decay`` is
    the default for groups that do not set their own. LAMB keeps timm's defaults (global gradient-norm clipping at
    1.0), as does LARS (trust coefficient 1e-3: its LR is much larger than SGD's). ``nesterov``: SGD's Nesterov
    momentum. With ``fused``, torch's fused step where the row has one and this torch has it for the parameters'
    device (``optimizer.defaults["fused"]`` says which): one kernel per step, and GradScaler hands it the scale and
    the inf flag as tensors instead of reading the inf flag on the host every step. Otherwise torch's foreach step
    where the row has one (``optimizer.defaults["foreach"]``).
    """
    row = OPTIMIZER_TABLE.get(name)
    if row is None:
        raise ValueError(f"--optimizer {name!r} is unknown: choose one of {', '.join(OPTIMIZER_TABLE)}")
    check_hyperparameters(lr, momentum, weight_decay)
    if nesterov and name != "sgd":
        raise ValueError(f"--nesterov is SGD's: --optimizer {name} has no Nesterov momentum")
    module, _, class_name = row.source.rpartition(".")
    cls = getattr(importlib.import_module(module), class_name)
    options = dict(lr=lr, weight_decay=weight_decay, **row.options(momentum, weight_decay, nesterov))
    if fused and row.fused:
        params = list(params)  # read twice when the fused step is refused
        try:
            optimizer = cls(params, fused=True, **options)
        except (RuntimeError, ValueError):  # no fused kernel for this device or dtype in this torch
            pass
        else:
            zero_momentum_buffers(optimizer)
            return optimizer
    if row.foreach:
        options["foreach"] = True
    return cls(params, **options)


def zero_momentum_buffers(optimizer):
    """Momentum buffers of zeros before the first step of torch's fused SGD. On its first step that SGD allocates
    them uninitialised (`empty_like`) and leaves them so when the float16 GradScaler skips the step for an
    overflow, frequent at the first steps: the next step then moves the weights by whatever that memory held.
    From zeros, the first step sets each buffer to its gradient, as the unfused SGD does."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0) != 0:
            for param in group["params"]:
                optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))


def fine_tuning_head(module, num_classes, args) -> str | None:
    """The classifier's name when the run's flags (a dict: a Config's, or a checkpoint's args) give its groups a
    part of their own (--freeze-backbone-epochs, --layer-decay), else None."""
    if not (args.get("freeze_backbone_epochs") or args.get("layer_decay") is not None):
        return None
    head = classifier_name(module, num_classes)
    if head is None:
        fail(
            f"--freeze-backbone-epochs/--layer-decay: --arch {args['arch']} has no Linear layer with {num_classes} "
            "outputs, the head they start from"
        )
    return head


def freeze_backbone(optimizer, scheduler, frozen_steps: int):
    """``--freeze-backbone-epochs``: for optimizer steps 0 to ``frozen_steps - 1`` (the schedule's count, so a
    resumed run goes on where it was) only the head's groups learn. The other parameters' gradients are dropped
    before each of those steps, so the optimizer neither moves them nor builds their momentum or weight decay. The
    backward still computes them: DDP and FSDP keep one set of buckets for the whole run, and the change to every
    layer is a step like any other, with no new wrapper or optimizer. Returns the function that drops them: the
    loop calls it before clipping and unscaling (the head is clipped by its own norm, and an overflow in a frozen
    gradient skips no step); the optimizer's step pre-hook calls it too, for any other caller of step()."""
    backbone = [param for group in optimizer.param_groups if not group["head"] for param in group["params"]]

    def drop_backbone_gradients():
        if scheduler.last_epoch < frozen_steps:  # a Python int: no device synchronisation
            for param in backbone:
                param.grad = None

    optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: drop_backbone_gradients())
    return drop_backbone_gradients


def kind_decay(args: dict) -> dict:
    """--norm-wd, --bias-wd, --embedding-wd as param_groups' kind_decay (the kinds given only)."""
    given = dict(norm=args.get("norm_wd"), bias=args.get("bias_wd"), embedding=args.get("embedding_wd"))
    return {kind: value for kind, value in given.items() if value is not None}
