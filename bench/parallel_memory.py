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
- activations (an estimate): Megatron-LM's count per transformer layer with fused attention (the scores, 5 a s / h
  more, are not kept: scaled_dot_product_attention), s b h 34 bytes at 16 bits, and with tensor parallelism
  s b h (10 + 24 / t) (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"), and
  with --sequence-parallel s b h 34 / t, summed over the transformer blocks for the per-GPU batch, s a block's tokens
  per image; DDP's adds autocast's 16-bit copy of the weights, kept for the backward (FSDP's gathered weights are
  not counted); outside the transformer blocks (a ViT's stem and head, a CoAtNet's MBConv stages, a CNN's whole),
  what the meta model's training forward saves for the backward, each storage once. Within 7 % of a ViT-S/16's, a
  CoAtNet's and a ResNet's forwards on the CPU (tests/parallelism/test_planner.py);
- sent per step (ring algorithms: an all-reduce sends 2 (n-1)/n of its buffer, an all-gather or a reduce-scatter
  n - 1 times a rank's shard): DDP all-reduces the float32 gradients; FSDP all-gathers each block's padded shards in
  the AMP dtype twice (forward and backward; the root's once: kept gathered) and reduce-scatters float32 gradients;
  TP sends what dlojz_lib/parallelism/tensor.py's BLOCK_COLLECTIVES counts on each block's activations, in the AMP
  dtype, within its group (2 all-reduces each way; with --sequence-parallel 2 all-gathers and 2 reduce-scatters each
  way: the same bytes), and one float32 all-reduce of the weights the group holds whole; FSDP runs over the
  replicas on what the group's rank holds. Counted against 7 layouts' runs in tests/parallelism/test_planner.py;
- PP p x FSDP d: the layers cut into p stages balanced by parameters (dlojz_lib/parallelism/pipeline.py's cut), FSDP over the d
  pipelines; the largest stage's state; under 1F1B with --pp-microbatches M, the first stage's blocks hold min(p, M)
  micro-batches of b p / M images (a pipeline takes b images a GPU, as the other rows); each GPU sends its stage's
  output forward and its input's gradient backward for every micro-batch (the AMP dtype; the first stage the first
  alone, the last the second alone), and FSDP's on its stage (each part gathered once a step: the schedule keeps it
  gathered): the busiest stage's figure. PP p x TP t x FSDP d
  (3-D, dlojz.py --pp p --tp t --fsdp): each stage's blocks split as the TP rows', its group's all-reduces added.
  The price these bytes do not show is the bubble, (p - 1) / (M + p - 1) of the step idle, said under the table.
"""

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.optim import OPTIMIZER_TABLE  # noqa: E402  (no torch: the flags are checked first)
from dlojz_lib.settings.flags import COUNT, PIXELS  # noqa: E402

GiB = 2**30


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
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_TABLE))
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


def main(argv=None) -> int:
    args = get_args(argv)
    from dlojz_lib.checks import UserError
    from dlojz_lib.parallelism.plan import LayoutTable, layout_rows

    fields = {field.name for field in dataclasses.fields(LayoutTable)}
    try:
        table, total, planned = layout_rows(
            LayoutTable(**{key: value for key, value in vars(args).items() if key in fields})
        )
    except UserError as err:
        sys.exit(str(err))
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

        print(f"{args.arch} has no tensor-parallel plan in dlojz (its TP rows are left out): {names(True)} have one")
    if args.json:
        Path(args.json).write_text(
            json.dumps(table, indent=1, default=dataclasses.asdict)
        )  # (a row's Layout: its fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
