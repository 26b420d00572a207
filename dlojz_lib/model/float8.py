"""`--float8`: the linears of a model family's blocks trained in float8 (torchao's float8 training: each matrix
product's inputs cast to float8 with a scale per tensor, "tensorwise", or per row, "rowwise"; the weights, their
gradients and the optimizer in float32 or bfloat16 as before), as torchtitan converts its models. Which linears:
those of the family's blocks (the stem, the head and a model of no family stay as they are) whose sizes are
multiples of 16 (float8 tensor cores' tiles) and above the sizes below which torchao measured float8 slower than
bfloat16 on an H100 (its `_auto_filter_for_recipe`, repeated here so that `float8_linears` says which without
torchao). With `--fsdp` and tensorwise scaling, FSDP gathers the weights in float8 (half the bytes of bfloat16), their
scales computed for all of them in one operation after each optimizer step (`scales_for_fsdp`).

float8 runs on a GPU of compute capability 8.9 or more (L4, H100, H200, B200) with torchao installed:
`settings.config` refuses it elsewhere in one line, before the model is built.
"""

import dataclasses

from torch import nn

# (out_features, in_features) at or below which torchao leaves a linear alone, as its auto filters (torchao.float8,
# 2026): tensorwise skips K <= 4096 and N <= 1024; rowwise skips N <= 2048, K <= 1024, or N <= 4096 and K <= 2048,
# where K, N = the weight's shape (out, in)


def too_small(recipe, out_features, in_features) -> bool:
    k, n = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def float8_linears(model, family, recipe) -> list:
    """The paths of the linears of `model` that --float8 `recipe` converts: in its `family`'s blocks, sizes multiples
    of 16, not too small for float8 to pay (too_small); [] for a model of no family."""
    if family is None:
        return []
    chosen = []
    for path, block in family.blocks(model):
        for name, layer in block.named_modules():
            if type(layer) is not nn.Linear or not name:  # (a subclass may compute something else; a bare linear
                continue  # as a block, an nn.Sequential's child, may be its head)
            sizes = (layer.out_features, layer.in_features)
            if all(size % 16 == 0 for size in sizes) and not too_small(recipe, *sizes):
                chosen.append(f"{path}.{name}")
    return chosen


def convert(model, family, recipe, fsdp) -> list:
    """`model`'s float8_linears swapped in place for torchao's Float8Linear (before any layout: FSDP then gathers
    their weights in float8 under tensorwise scaling). Returns their paths."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    chosen = set(float8_linears(model, family, recipe))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda layer, path: path in chosen)
    return sorted(chosen)


def scales_for_fsdp(module):
    """After an optimizer step under --fsdp with tensorwise scaling: every float8 weight's scale for the next
    all-gathers, in one operation (torchao's), where each would otherwise compute its own."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)
