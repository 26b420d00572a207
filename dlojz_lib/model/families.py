"""The model families the parallel layouts know, one row each, as torchtitan's model spec carries its parallelize
function and state adapter: how to tell a model of the family, its residual or transformer blocks in forward order
(FSDP's units, the pipeline's layers between the stem and the head), what runs before the first block and after the
last (the pipeline's first and last layers), and its tensor-parallel plan (`tensor_plans.TensorPlan`: which blocks
--tp splits and how, and the state-dict adapter between its split names and an ordinary model's), or none.

A new family is one row, added by `register_family(Family(...))` (a test adds a toy one): `--fsdp` shards its blocks
one by one, `--pp` cuts it between blocks, and `--tp` splits its blocks by its plan. A model of no family still
shards under `--fsdp` (blocks found by their class names, `fsdp.BLOCK_SUFFIXES`); `--pp` and `--tp` refuse it in
one line naming the families.

Written against timm 1.0.31 (`VisionTransformer._pos_embed`) and torchvision 0.29
(`VisionTransformer._process_input`): the private attributes the stems read are here and nowhere else.
"""

import dataclasses
from typing import Callable

import torch
from torch import nn

from dlojz_lib.model import tensor_plans


@dataclasses.dataclass
class Layer:
    """One step of a model's forward as the pipeline cuts it."""

    name: str
    owns: tuple  # the paths of the modules and parameters it runs; the last layer (the head) owns all the others'
    run: Callable  # its forward: an activation in, an activation out


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # as the one-line refusals name it
    matches: Callable[[nn.Module], bool]
    blocks: Callable[[nn.Module], list]  # [(path, module)]: the blocks, in the order the forward runs them
    stem: Callable[[nn.Module], Layer] | None = None  # what runs before the first block (None: nothing)
    head: Callable[[nn.Module], Callable] | None = None  # what runs after the last block, activation to logits
    tensor_plan: tensor_plans.TensorPlan | None = None  # how --tp splits its blocks (None: --tp refuses it)


def is_class(module_path, name):
    return lambda model: type(model).__module__.startswith(module_path) and type(model).__name__ == name


def is_torchvision(name):
    def matches(model):
        import torchvision

        return isinstance(model, getattr(torchvision.models, name))

    return matches


def timm_vit_stem(model):
    return Layer(
        "stem",
        ("patch_embed", "cls_token", "reg_token", "pos_embed", "norm_pre", "patch_drop"),
        lambda x: model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x)))),
    )


def timm_head(model):
    return lambda x: model.forward_head(model.norm(x))


def torchvision_vit_stem(model):
    def embed(x):
        x = model._process_input(x)
        x = torch.cat([model.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return model.encoder.dropout(x + model.encoder.pos_embedding)

    return Layer("stem", ("conv_proj", "class_token", "encoder.pos_embedding"), embed)


FAMILIES = (
    Family(
        "timm's ViT family (timm:vit_*, timm:deit_*, timm:test_vit ...)",
        is_class("timm.models.vision_transformer", "VisionTransformer"),
        blocks=lambda model: [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)],
        stem=timm_vit_stem,
        head=timm_head,
        tensor_plan=tensor_plans.TIMM,
    ),
    Family(
        "timm's CoAtNet/MaxViT family (timm:coatnet_*, timm:maxvit_*, timm:coatnet_7_224 ...)",
        is_class("timm.models.maxxvit", "MaxxVit"),
        blocks=lambda model: [
            (f"stages.{s}.blocks.{i}", block)
            for s, stage in enumerate(model.stages)
            for i, block in enumerate(stage.blocks)
        ],
        stem=lambda model: Layer("stem", ("stem",), model.stem),
        head=timm_head,
        tensor_plan=tensor_plans.TIMM,  # its transformer blocks; the MBConv stages stay whole on every rank
    ),
    Family(
        "torchvision's ResNets",
        is_torchvision("ResNet"),
        blocks=lambda model: [
            (f"layer{k}.{i}", block) for k in range(1, 5) for i, block in enumerate(getattr(model, f"layer{k}"))
        ],
        stem=lambda model: Layer(
            "stem", ("conv1", "bn1"), lambda x: model.maxpool(model.relu(model.bn1(model.conv1(x))))
        ),
        head=lambda model: lambda x: model.fc(torch.flatten(model.avgpool(x), 1)),
    ),
    Family(
        "torchvision's ViT",
        is_torchvision("VisionTransformer"),
        blocks=lambda model: [
            (f"encoder.layers.{name}", block) for name, block in model.encoder.layers.named_children()
        ],
        stem=torchvision_vit_stem,
        head=lambda model: lambda x: model.heads(model.encoder.ln(x)[:, 0]),
        tensor_plan=tensor_plans.TORCHVISION_VIT,
    ),
    Family(
        "an nn.Sequential (each child a layer)",
        lambda model: isinstance(model, nn.Sequential),
        blocks=lambda model: list(model.named_children()),
    ),
)


def register_family(family: Family) -> Family:
    """Add a model family's row for this process: the layouts know it from then on. A registered row is matched
    before the built-in ones (a subclass of a known model may be a family of its own); one of the same name as a row
    already there replaces it. Returns the row."""
    global FAMILIES
    FAMILIES = (family, *(row for row in FAMILIES if row.name != family.name))
    return family


def family_of(model):
    """The first row of FAMILIES that `model` belongs to, or None."""
    return next((family for family in FAMILIES if family.matches(model)), None)


def blocks_of(model):
    """`model`'s blocks as its family lists them, [(path, module)] in forward order; None for a model of none."""
    family = family_of(model)
    return None if family is None else family.blocks(model)


def names(tensor_parallel=False):
    """The families (those whose blocks --tp splits), as a refusal lists them."""
    known = [family.name for family in FAMILIES if family.tensor_plan is not None or not tensor_parallel]
    return ", ".join(known[:-1]) + " and " + known[-1] if len(known) > 1 else known[0]


def layers(model, family=None):
    """`model`'s forward as the Layers of its family (`family`: its row where known; None: looked up), whose
    composition is the forward; None for a model of none."""
    family = family_of(model) if family is None else family
    if family is None:
        return None
    blocks = [Layer(path, (path,), block) for path, block in family.blocks(model)]
    if family.stem is None:
        return blocks
    return [family.stem(model), *blocks, Layer("head", (), family.head(model))]
