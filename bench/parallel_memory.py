"""The course's day-4 table: per GPU, the bytes of parameters, gradients, optimizer state and activations, and the
bytes each GPU sends per step, under DDP, FSDP, tensor parallelism with FSDP (2-D), pipeline parallelism with
FSDP and all three (3-D), for a model built on the meta device (no memory, no GPU: a 2.4 B-parameter model is read in seconds).

    python bench/parallel_memory.py                                        # timm's ViT-g/14, 8/16/32 GPUs, --tp 4
    python bench/parallel_memory.py --arch timm:coatnet_7_224              # the course's CoAtNet-7 (2.4 B)
    python bench/parallel_memory.py --arch timm:vit_huge_patch14_224 --gpus 8,16 --tp 2,4 -b 32
    python bench/parallel_memory.py --arch timm:test_vit --image-size 32 --gpus 2,4 --tp 2 --json out.json

What each figure is (float32 parameters, gradients and optimizer state, as dlojz keeps them; the AMP dtype for what
travels and for activations):
- parameters, gradients: DDP a whole copy; FSDP 1/N of each parameter's first dimension (rounded up, as FSDP2 shards
  it); TP x FSDP: the split layers (q, k, v, fc1 column-wise, proj and fc2 row-wise) 1/tp on the tensor dimension,
  then every parameter sharded over the data replicas as FSDP does: the exact local shapes of dlojz's plan, which a
  real run's metrics JSON measures (parameter_bytes_per_rank; tests/parallelism/test_tensor_parallel.py compares them);
- optimizer state: 1 float32 per parameter for SGD's momentum, 2 for AdamW, LAMB and Lion's... (its table's number);
- activations (an estimate): Megatron-LM's count per transformer layer, s b h (34 + 5 a s / h) bytes at 16 bits, and
  with tensor parallelism s b h (10 + 24 / t + 5 a s / (h t)) (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models"), and with --sequence-parallel s b h (34 + 5 a s / h) / t, summed over
  the transformer blocks for the per-GPU batch; s is a block's tokens per image, and in the attention scores' term
  the tokens each one attends to (a MaxViT block's window or grid cell); a CoAtNet's MBConv blocks are not counted;
- sent per step (ring algorithms: an all-reduce sends 2 (n-1)/n of its buffer, an all-gather or a reduce-scatter
  (n-1)/n): DDP all-reduces the float32 gradients; FSDP all-gathers the parameters in the AMP dtype twice (forward and
  backward) and reduce-scatters float32 gradients; TP sends what dlojz_lib/parallelism/tensor.py's
  BLOCK_COLLECTIVES counts on each block's activations, in the AMP dtype, within its group (2 all-reduces each way;
  with --sequence-parallel 2 all-gathers and 2 reduce-scatters each way: the same bytes), and FSDP runs over the
  replicas on what the group's rank holds;
- PP p x FSDP d: the layers cut into p stages balanced by parameters (dlojz_lib/parallelism/pipeline.py's cut), FSDP over the d
  pipelines; the largest stage's state; under 1F1B with --pp-microbatches M, the first stage's blocks hold min(p, M)
  micro-batches of b p / M images (a pipeline takes b images a GPU, as the other rows); each GPU sends its stage's
  output forward and its input's gradient backward for every micro-batch (the AMP dtype; the first stage the first
  alone, the last the second alone), and FSDP's on its stage: the busiest stage's figure. PP p x TP t x FSDP d
  (3-D, dlojz.py --pp p --tp t --fsdp): each stage's blocks split as the TP rows', its group's all-reduces added.
  The price these bytes do not show is the bubble, (p - 1) / (M + p - 1) of the step idle, said under the table.
"""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS  # noqa: E402

GiB = 2**30
STATE_PER_PARAMETER = {"sgd": 1, "adamw": 2, "lamb": 2, "lars": 1, "lion": 1, "rmsprop": 2}


def get_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--arch",
        default="timm:vit_giant_patch14_224",
        help="a model (default: ViT-g/14); one without a tensor-parallel plan gets DDP's and FSDP's rows only",
    )
    p.add_argument("--image-size", type=PIXELS, default=224)
    p.add_argument("--num-classes", type=COUNT, default=1000)
    p.add_argument(
        "-b", "--batch-size", type=COUNT, default=16, help="images per GPU (a tensor-parallel group shares them)"
    )
    p.add_argument("--gpus", default="8,16,32", help="world sizes, comma-separated (default: 8,16,32)")
    p.add_argument("--tp", default="4", help="tensor-parallel group sizes, comma-separated (default: 4)")
    p.add_argument("--pp", default="4", help="pipeline stage counts, comma-separated (default: 4)")
    p.add_argument(
        "--pp-microbatches", type=COUNT, default=8, help="micro-batches of a pipeline step, 1F1B (default: 8)"
    )
    p.add_argument("--optimizer", default="adamw", choices=sorted(STATE_PER_PARAMETER))
    p.add_argument("--amp-bytes", type=COUNT, default=2, help="bytes of the AMP dtype (default: 2, bfloat16)")
    p.add_argument(
        "--sequence-parallel", action="store_true", help="the TP rows with --sequence-parallel (activations 1/tp)"
    )
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    for flag in ("gpus", "tp", "pp"):
        try:
            values = [int(v) for v in getattr(args, flag).split(",")]
        except ValueError:
            p.error(f"--{flag} {getattr(args, flag)}: comma-separated whole numbers, e.g. 8,16,32")
        if any(v < 1 for v in values):
            p.error(f"--{flag} {getattr(args, flag)}: each at least 1")
        setattr(args, flag, values)
    return args


def layout(module):
    """(shape, tensor-parallel placement) of every parameter under dlojz's plan: "col" (split on dim 0), "row"
    (split on dim 1), or None (replicated)."""
    from dlojz_lib.model.tensor_plans import transformer_blocks

    placement = {}
    for block in transformer_blocks(module):
        attn, mlp = block.attn, block.mlp
        for linear, kind in ((attn.qkv, "col"), (mlp.fc1, "col"), (attn.proj, "row"), (mlp.fc2, "row")):
            placement[id(linear.weight)] = kind
            if linear.bias is not None:
                placement[id(linear.bias)] = "col" if kind == "col" else None  # a row-wise bias is replicated
    return [(tuple(p.shape), placement.get(id(p))) for p in module.parameters()]


def local_numel(shape, kind, tp, replicas):
    """Elements of one parameter on the largest rank: split 1/tp by the plan, then its dim 0 over the replicas."""
    shape = list(shape)
    if kind == "col":
        shape[0] //= tp
    elif kind == "row":
        shape[1] //= tp
    shape[0] = math.ceil(shape[0] / replicas)
    return math.prod(shape)


def attention_shapes(module, image_size):
    """(tokens per image, tokens each one attends to, attention width, heads, the block's path) of every block of the
    plan, read from a forward of the meta model: a ViT's tokens all attend to each other, a CoAtNet block's map too
    (NCHW), a MaxViT block's attend within a window or a grid cell (its input: images x windows, tokens, channels)."""
    import torch

    from dlojz_lib.model.tensor_plans import transformer_blocks

    shapes = []
    paths = {id(block): path for path, block in module.named_modules()}

    def recorder(block):
        def record(attn, inputs):
            x = inputs[0]
            if x.dim() == 4:
                tokens = span = x.shape[2] * x.shape[3]
            else:
                tokens, span = x.shape[0] * x.shape[1], x.shape[1]  # one image: its windows' tokens
            shapes.append((tokens, span, attn.qkv.weight.shape[0] // 3, attn.num_heads, paths[id(block)]))

        return record

    hooks = [block.attn.register_forward_pre_hook(recorder(block)) for block in transformer_blocks(module)]
    with torch.no_grad():
        module.eval()(torch.empty(1, 3, image_size, image_size, device="meta"))
    for hook in hooks:
        hook.remove()
    return shapes


def rows(args):
    import torch

    from dlojz_lib.model.tensor_plans import is_vit_block, transformer_blocks
    from dlojz_lib.model.zoo import create_model
    from dlojz_lib.parallelism.tensor import block_bytes_sent

    with torch.device("meta"):
        module = create_model(args.arch, args.num_classes, False, args.image_size)
    blocks = transformer_blocks(module)
    planned = bool(blocks)  # a model without a plan: DDP's and FSDP's rows only
    if args.sequence_parallel and not all(is_vit_block(block) for block in blocks):
        sys.exit(f"--sequence-parallel: {args.arch} has no sequence-parallel plan (ViT's tokens only): drop it")
    params = layout(module)
    total = sum(math.prod(shape) for shape, _ in params)
    shapes = attention_shapes(module, args.image_size) if planned else []
    state = STATE_PER_PARAMETER[args.optimizer]
    out = []
    for gpus in args.gpus:
        layouts = [("DDP", 1, 1), ("FSDP", 1, gpus)]
        sp = " + SP" if args.sequence_parallel else ""
        if planned:
            layouts += [
                (f"TP {tp}{sp} x FSDP {gpus // tp}", tp, gpus // tp) for tp in args.tp if gpus % tp == 0 and tp > 1
            ]
        for name, tp, replicas in layouts:
            if name == "DDP":
                local = total
            else:
                local = sum(local_numel(shape, kind, tp, replicas) for shape, kind in params)
            b = args.batch_size
            if not planned:  # Megatron-LM's count is a transformer's
                activations = None
            else:  # per block: s b h (34 + 5 a s / h) at 16 bits, s the tokens and, in the scores, those attended to
                activations = 0
                for tokens, span, h, a, _ in shapes:
                    if tp == 1:
                        per_layer = block_activations(tokens, span, h, a, b)
                    elif args.sequence_parallel:  # the norms' and dropouts' activations split too
                        per_layer = tokens * b * h * (34 + 5 * a * span / h) / tp
                    else:
                        per_layer = tokens * b * h * (10 + 24 / tp + 5 * a * span / (h * tp))
                    activations += per_layer * args.amp_bytes / 2
            if name == "DDP":
                sent = 2 * (gpus - 1) / gpus * 4 * total
            else:
                held = sum(local_numel(shape, kind, tp, 1) for shape, kind in params)  # the group rank's part
                n = replicas
                sent = (n - 1) / n * held * (2 * args.amp_bytes + 4)  # 2 all-gathers + 1 reduce-scatter
                if tp > 1:  # the plan's collectives on each block's activations (BLOCK_COLLECTIVES)
                    sent += sum(
                        block_bytes_sent(args.sequence_parallel, tp, tokens * b * h * args.amp_bytes)
                        for tokens, _, h, *_ in shapes
                    )
            out.append(
                dict(
                    gpus=gpus,
                    layout=name,
                    parameters=total,
                    parameter_bytes=4 * local,
                    gradient_bytes=4 * local,
                    optimizer_bytes=4 * state * local,
                    activation_bytes=activations,
                    sent_bytes_per_step=sent,
                )
            )
        out += pipeline_rows(args, module, params, gpus, shapes, state)
    return out, total, planned


def block_activations(tokens, span, h, a, images):
    """Megatron-LM's count for one transformer block without tensor parallelism, in bytes at 16 bits."""
    return tokens * images * h * (34 + 5 * a * span / h)


def pipeline_rows(args, module, params, gpus, shapes, state):
    """PP p x FSDP d rows: the stages cut by parameters as dlojz_lib/parallelism/pipeline.py cuts them, FSDP over the d
    pipelines; the largest stage's state, and under 1F1B the first stage's activations (min(p, M) micro-batches in
    flight, each of b p / M images: a pipeline takes b images a GPU), and each GPU's sends: its stage's output
    forward and its input's gradient backward, for every micro-batch, with FSDP's on its stage. A model without a
    pipeline split gets none."""
    import torch

    from dlojz_lib.checks import UserError
    from dlojz_lib.parallelism.pipeline import layer_sizes, owner, pipeline_layers, stage_bounds
    from dlojz_lib.parallelism.tensor import block_bytes_sent

    try:
        layers = pipeline_layers(module, args.arch)
    except UserError:
        return []
    names = [name for name, _ in module.named_parameters()]  # (the order of `params`, layout's)
    # each layer's output, per image (the activations a stage sends on), from a forward of the meta model
    x, sent_per_image = torch.empty(1, 3, args.image_size, args.image_size, device="meta"), []
    with torch.no_grad():
        for layer in layers:
            x = layer.run(x)
            sent_per_image.append(x.numel())
    rows, m, b = [], args.pp_microbatches, args.batch_size
    splits = [1, *(tp for tp in args.tp if tp > 1 and shapes)]  # PP x TP x FSDP where the model has a TP plan
    for pp, tp in ((pp, tp) for pp in args.pp for tp in splits):
        if pp < 2 or gpus % (pp * tp) or pp > len(layers):
            continue
        replicas = gpus // (pp * tp)
        bounds = stage_bounds(layer_sizes(module, layers), pp)
        stage_of_layer = [k for k, (first, last) in enumerate(bounds) for _ in range(first, last)]
        stage_of = [stage_of_layer[owner(name, layers)] for name in names]
        local = [0] * pp
        held = [0] * pp
        for stage, (shape, kind) in zip(stage_of, params):
            local[stage] += local_numel(shape, kind if tp > 1 else None, tp, replicas)
            held[stage] += local_numel(shape, kind if tp > 1 else None, tp, 1)  # the group rank's part
        images = b * pp / m  # a micro-batch (a tensor-parallel group shares it)
        per_stage = [0.0] * pp  # activations held, under 1F1B
        sent = [0.0] * pp  # each GPU's sends a step
        for tokens, span, h, a, path in shapes:
            stage = stage_of_layer[owner(path, layers)]
            if tp == 1:
                per_layer = block_activations(tokens, span, h, a, images)
            else:
                per_layer = tokens * images * h * (10 + 24 / tp + 5 * a * span / (h * tp))
                sent[stage] += block_bytes_sent(args.sequence_parallel, tp, tokens * b * pp * h * args.amp_bytes)
            per_stage[stage] += per_layer * min(pp - stage, m)
        activations = max(per_stage) * args.amp_bytes / 2 if shapes else None
        for stage, (first, last) in enumerate(bounds):  # its input's gradient back, its output on
            ends = [sent_per_image[i] for i in (first - 1, last - 1) if 0 <= i < len(layers) - 1]
            sent[stage] += sum(ends) * b * pp * args.amp_bytes
            sent[stage] += (replicas - 1) / replicas * held[stage] * (2 * args.amp_bytes + 4)  # FSDP on the stage
        largest = max(local)
        rows.append(
            dict(
                gpus=gpus,
                layout=f"PP {pp}{f' x TP {tp}' if tp > 1 else ''} x FSDP {replicas}",
                parameters=sum(held),
                parameter_bytes=4 * largest,
                gradient_bytes=4 * largest,
                optimizer_bytes=4 * state * largest,
                activation_bytes=activations,
                sent_bytes_per_step=max(sent),
                bubble=(pp - 1) / (m + pp - 1),
            )
        )
    return rows


def main(argv=None) -> int:
    args = get_args(argv)
    table, total, planned = rows(args)
    unit, name = (GiB, "GiB") if table[0]["parameter_bytes"] >= GiB / 16 else (2**20, "MiB")  # a small model: MiB
    print(
        f"{args.arch}: {total / 1e6:,.1f} M parameters, {args.image_size} px, {args.batch_size} images per GPU, "
        f"{args.optimizer}; {name} per GPU (float32 state, activations estimated), {name} sent per GPU per step"
    )
    print(f"{'GPUs':>5} {'layout':<20}{'params':>9}{'grads':>9}{'optim':>9}{'state':>9}{'activ.':>9}{'sent':>9}")
    for row in table:
        state = row["parameter_bytes"] + row["gradient_bytes"] + row["optimizer_bytes"]
        figures = (row["parameter_bytes"], row["gradient_bytes"], row["optimizer_bytes"], state,
                   row["activation_bytes"], row["sent_bytes_per_step"])  # fmt: skip
        cells = ("n/a" if value is None else f"{value / unit:.2f}" for value in figures)
        print(f"{row['gpus']:>5} {row['layout']:<20}" + "".join(f"{cell:>9}" for cell in cells))
    bubbles = {row["layout"].split(" x ")[0]: row["bubble"] for row in table if "bubble" in row}
    if bubbles:
        print(
            f"PP rows: 1F1B, {args.pp_microbatches} micro-batches a step; idle (the bubble, (p - 1) / (M + p - 1)): "
            + ", ".join(f"{name} {share:.0%}" for name, share in bubbles.items())
        )
    if not planned:
        from dlojz_lib.model.families import names

        print(
            f"{args.arch} has no tensor-parallel plan in dlojz (its TP rows and activations are left out): {names(True)} have one"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
