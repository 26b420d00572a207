"""`--float8`: the linears of a model family's blocks trained in float8 (torchao's float8 training: each matrix
product's inputs cast to float8 with a scale per tensor, "tensorwise", or per row, "rowwise", "rowwise_with_gw_hp"
keeping the weight gradient's product in high precision; the weights, their gradients and the optimizer in float32
or bfloat16 as before), as torchtitan converts its models. Which linears: those of the family's blocks (the stem,
the head and a model of no family stay as they are) whose sizes are multiples of 16 (float8 tensor cores' tiles) and
above the sizes below which torchao measured float8 slower than bfloat16 on an H100 (its `_auto_filter_for_recipe`,
repeated here so that the planner says which without torchao, and held to torchao's by a test). With `--fsdp` and
tensorwise scaling, FSDP gathers the weights in float8 (half the bytes of bfloat16), their scales computed for all
of them in one operation after each optimizer step (`scales_for_fsdp`); the rowwise recipes gather in the AMP dtype.

float8 trains on a GPU of compute capability 8.9 or more (L4, H100, H200, B200), and on the CPU as a check of the
numerics (torchao's float8 matrix products run there too, not faster); `settings.config` refuses an older GPU, or a
site without torchao, in one line before the model is built. The weights stay plain tensors: a float8 run's
checkpoint loads without torchao and resumes with or without `--float8`.
"""

import dataclasses

from torch import nn

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao 0.18's float8 training recipes

# the sizes at or below which torchao leaves a linear alone, as its auto filters (torchao 0.18,
# float8_linear_utils): with (N, K) = the weight's shape, (out_features, in_features), tensorwise skips K <= 4096 and
# N <= 1024; rowwise skips N <= 2048, K <= 1024, or N <= 4096 and K <= 2048. torchao has no filter of its own for
# rowwise_with_gw_hp, whose forward and input-gradient products are rowwise's: its sizes are rowwise's.


def too_small(recipe, out_features, in_features) -> bool:
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def torchao_float8(*names):
    """`names` from torchao.float8, imported without the warning torch's pytree logs when torchao 0.18 registers an
    enum newer torch versions take natively (a line on every rank's stderr, about nothing the run does)."""
    import importlib
    import logging

    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        module = importlib.import_module("torchao.float8")
    finally:
        pytree.setLevel(level)
    return tuple(getattr(module, name) for name in names)


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


def convert(model, paths, recipe, fsdp, pad=False):
    """`model`'s linears `paths` (float8_linears') swapped in place for torchao's Float8Linear (before any layout:
    FSDP then gathers their weights in float8 under tensorwise scaling); `pad`: their products' inner dimension
    padded with zeros to a multiple of 16 (uneven_rows)."""
    Float8LinearConfig, convert_to_float8_training = torchao_float8("Float8LinearConfig", "convert_to_float8_training")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=pad)
    if fsdp and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    chosen = set(paths)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda layer, path: path in chosen)


def as_plain_linears(module):
    """`module`'s float8 linears (a copy's) made torch's Linear again, in place: the same parameters and FLOPs, for a
    count on the meta device, where float8's products check sizes a count's batch need not have."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and type(layer).__module__.startswith("torchao."):
            layer.__class__ = nn.Linear
    return module


def tokens_per_image(meta_module, paths, image_size) -> dict:
    """{path: the rows (tokens) of one image each of `paths` (linears of `meta_module`, a meta copy) multiplies}, from
    one forward on the meta device, in forward order: what float8's products take (uneven_rows) and the planner
    prices (parallelism.plan.float8_rows)."""
    import torch

    rows = {}

    def count(path):
        def seen(layer, args):
            rows.setdefault(path, args[0].shape[:-1].numel())

        return seen

    hooks = [meta_module.get_submodule(path).register_forward_pre_hook(count(path)) for path in paths]
    with torch.no_grad():
        meta_module.eval()(torch.empty(1, 3, image_size, image_size, device="meta"))
    for hook in hooks:
        hook.remove()
    return rows


def uneven_rows(meta_module, paths, recipe, batch_size, image_size):
    """(path, tokens an image) of the first of `paths` (linears of `meta_module`, a meta copy before conversion) whose
    rows in a micro-batch of `batch_size` images (images x tokens) are not a multiple of 16, or None. The weight
    gradient's float8 product (tensorwise, rowwise) sums over those rows, and float8's matrix products on a GPU take
    them in multiples of 16: torchao then pads them with zeros (`convert`'s `pad`)."""
    if recipe == "rowwise_with_gw_hp" or not paths:  # (its weight gradient's product is in high precision)
        return None
    tokens = tokens_per_image(meta_module, paths, image_size)
    return next(((path, n) for path, n in tokens.items() if batch_size * n % 16), None)


def scales_for_fsdp(module):
    """After an optimizer step under --fsdp with tensorwise scaling: every float8 weight's scale for the next
    all-gathers, in one operation (torchao's), where each would otherwise compute its own."""
    (precompute,) = torchao_float8("precompute_float8_dynamic_scale_for_fsdp")
    precompute(module)
