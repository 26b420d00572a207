"""The model families the parallel layouts know (dlojz_lib/model/families.py): a new family is one row. A toy
transformer whose block class no rule knows gets FSDP units, a pipeline cut and a tensor-parallel plan from its row
alone, and trains under PP 2 x TP 2 to one process's weights (tests/parallelism/test_pipeline.py's 4-rank test)."""

import copy

import pytest
import torch
from torch import nn

from dlojz_lib.checks import UserError
from dlojz_lib.model import families, tensor_plans
from dlojz_lib.model.families import Family, Layer
from dlojz_lib.parallelism.fsdp import sharding_units
from dlojz_lib.parallelism.pipeline import Stage, pipeline_layers
from dlojz_lib.parallelism.tensor import check_plan


class Mixer(nn.Module):
    """A pre-norm transformer block of timm's attention and MLP, under a class name FSDP's rule does not know."""

    def __init__(self, dim, heads):
        from timm.layers import Attention, Mlp

        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads, qkv_bias=True)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ToyNet(nn.Module):
    """Patches of 8 px as tokens, 4 Mixers, the mean token's logits."""

    def __init__(self, dim=16, heads=2, depth=4, classes=3):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 8, 8)
        self.mixers = nn.ModuleList(Mixer(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def tokens(self, images):
        return self.embed(images).flatten(2).transpose(1, 2)

    def logits(self, tokens):
        return self.head(self.norm(tokens).mean(1))

    def forward(self, images):
        x = self.tokens(images)
        for mixer in self.mixers:
            x = mixer(x)
        return self.logits(x)


TOY = Family(
    "a toy family (tests/model/test_families.py)",
    lambda model: isinstance(model, ToyNet),
    blocks=lambda model: [(f"mixers.{i}", mixer) for i, mixer in enumerate(model.mixers)],
    stem=lambda model: Layer("stem", ("embed",), model.tokens),
    head=lambda model: model.logits,
    tensor_plan=tensor_plans.TIMM,  # its blocks are timm's attention and MLP
)


def toy_with_its_row():
    """A ToyNet (seeded), its row added to this process's families (a pipeline rank's too: it builds its model here)."""
    families.register_family(TOY)
    torch.manual_seed(0)
    return ToyNet()


def test_a_new_family_is_one_row(monkeypatch):
    """Without its row the toy has no pipeline cut (one line naming the families) and FSDP shards its top-level
    children; with it, FSDP shards each Mixer, the pipeline cuts it into stem, 4 blocks and head that compose to its
    forward, --tp splits its 4 blocks, and the refusals name it; a row that says no plan makes --tp refuse it."""
    torch.manual_seed(0)
    toy = ToyNet()
    with pytest.raises(UserError, match="--pp: --arch toy has no pipeline split here: timm's ViT family"):
        pipeline_layers(toy, "toy")
    assert sharding_units(toy) == [toy.embed, toy.mixers, toy.norm, toy.head]

    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES)  # (the rows as they were, after the test)
    assert families.register_family(TOY) is TOY and families.family_of(toy) is TOY
    assert sharding_units(toy) == list(toy.mixers)
    layers = pipeline_layers(toy, "toy")
    assert [layer.name for layer in layers] == ["stem", "mixers.0", "mixers.1", "mixers.2", "mixers.3", "head"]
    images = torch.randn(2, 3, 32, 32)
    x = images
    for first, last in ((0, 2), (2, 6)):  # a stage drops the rest of its model: each from a copy, as a rank's
        copied = copy.deepcopy(toy)
        x = Stage(copied, pipeline_layers(copied, "toy"), first, last)(x)
    torch.testing.assert_close(x, toy(images), rtol=0, atol=0)
    assert check_plan(toy, 2, "toy") == list(toy.mixers)
    assert TOY.name in families.names() and TOY.name in families.names(tensor_parallel=True)

    no_plan = Family(TOY.name, TOY.matches, TOY.blocks, TOY.stem, TOY.head, tensor_plan=None)
    families.register_family(no_plan)  # (the same name: it replaces the row)
    assert [row for row in families.FAMILIES if row.name == TOY.name] == [no_plan]
    with pytest.raises(UserError, match="--tp: --arch toy has no tensor-parallel plan here"):
        check_plan(toy, 2, "toy")
    assert TOY.name in families.names() and TOY.name not in families.names(tensor_parallel=True)


def test_every_row_names_its_family_and_the_first_match_wins():
    """The rows' names are the refusals' words; a model belongs to the first row that matches (nn.Sequential, which
    any model could subclass, last)."""
    assert len({family.name for family in families.FAMILIES}) == len(families.FAMILIES)
    assert families.FAMILIES[-1].matches(nn.Sequential(nn.Linear(2, 2)))
    assert families.family_of(nn.Linear(2, 2)) is None
    assert families.names().endswith(" and an nn.Sequential (each child a layer)")
