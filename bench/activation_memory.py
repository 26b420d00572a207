"""Activation checkpointing's memory and recomputation: per --activation-checkpointing mode (and --ac-every 2), the
bytes one training forward holds for its backward and the time of a forward and backward, on the CPU, side by side
in one run (the ratios to no checkpointing are what carry to a GPU; the bytes are the model's at this batch).

    python bench/activation_memory.py                                      # timm's ViT-B/16, 224 px, 8 images
    python bench/activation_memory.py --arch resnet50 -b 16
    python bench/activation_memory.py --arch timm:test_vit --image-size 32 --json out.json

The bytes are the tensors the forward made that are still alive once it returns (autograd's saved tensors and
selective checkpointing's cache alike, each storage once: dlojz_lib/torch_internals.py's held_after_forward), the
output included; the modes are dlojz.py's (dlojz_lib/model/zoo.py: full recomputes each stage or block whole, selective
keeps each block's matrix products', convolutions' and attentions' outputs and recomputes the rest).
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS  # noqa: E402

MODES = (("none", 1), ("full", 1), ("selective", 1), ("full", 2), ("selective", 2))  # (mode, --ac-every)


def get_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="timm:vit_base_patch16_224", help="a model (default: ViT-B/16)")
    p.add_argument("--image-size", type=PIXELS, default=224)
    p.add_argument("-b", "--batch-size", type=COUNT, default=8, help="images a forward (default: 8)")
    p.add_argument("--repeats", type=COUNT, default=2, help="timed forward and backward passes a mode (default: 2)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return p.parse_args(argv)


def checkpointed(arch, image_size, mode, every):
    """The model as dlojz.py lays it out for this mode (the unit pass's checkpointing step, model.families'
    apply_checkpointing), in training mode."""
    import torch

    from dlojz_lib.model.families import family_of
    from dlojz_lib.model.recompute import apply_checkpointing
    from dlojz_lib.model.zoo import create_model

    torch.manual_seed(0)
    model = create_model(arch, 1000, None, image_size).train()
    apply_checkpointing(model, mode, every, family_of(model), arch)
    return model


def rows(args):
    import torch

    from dlojz_lib.torch_internals import held_after_forward

    images = torch.randn(
        args.batch_size, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(0)
    )
    out = []
    for mode, every in MODES:
        model = checkpointed(args.arch, args.image_size, mode, every)
        held = held_after_forward(model, images)
        seconds = []
        for _ in range(args.repeats + 1):  # the first pass warms the allocator and the kernels up
            start = time.perf_counter()
            model(images).sum().backward()
            seconds.append(time.perf_counter() - start)
        out.append(dict(mode=mode, every=every, held_bytes=held, step_s=min(seconds[1:])))
    return out


def main(argv=None) -> int:
    args = get_args(argv)
    table = rows(args)
    none = table[0]
    print(f"{args.arch}, {args.image_size} px, {args.batch_size} images, on the CPU (min of {args.repeats} passes)")
    print(f"{'mode':<12}{'every':>6}{'held MiB':>10}{'x none':>8}{'fwd+bwd s':>11}{'x none':>8}")
    for row in table:
        print(
            f"{row['mode']:<12}{row['every']:>6}{row['held_bytes'] / 2**20:>10.1f}"
            f"{row['held_bytes'] / none['held_bytes']:>8.2f}{row['step_s']:>11.3f}{row['step_s'] / none['step_s']:>8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
