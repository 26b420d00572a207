"""The global batch (images per optimizer step) across allocations: a run fitted to the ranks its job has.

`fit_to_ranks` runs at start-up, once the world size is known and before the loaders and the schedule read
--batch-size, --grad-acc and --lr:
- --global-batch N (a recipe's published global batch): the run keeps N images a step on any number of ranks.
  --batch-size is then the most images a rank computes at once (its memory); each rank's batch and --grad-acc are
  chosen so that ranks x batch x grad-acc = N. Where no such choice exists (N not a multiple of the ranks), the
  nearest global batch is taken and --lr (and --min-lr) follow --lr-scaling's rule (linear, sqrt or none), since
  the file's --lr is the one for N. Every value changed is said in one block, with why.
- --keep-global-batch: a run resumed on another number of ranks keeps its checkpoint's global batch by changing
  --grad-acc.
Either way a --grad-acc above 1 under a CUDA-graph --compile-mode compiles the same mode without graphs (a replay's
gradients live in memory that the next micro-batch's replay reuses).
"""

import dataclasses
import math

import dlojz_lib.checkpoint as ckpt
from dlojz_lib.checks import UserError
from dlojz_lib.settings.flags import CUDA_GRAPH_MODES, GRAPH_FREE_MODE


def fit_to_ranks(cfg, world_size, log):
    """--global-batch, else --keep-global-batch, on `world_size` ranks. Returns cfg with the batch, --grad-acc,
    --lr and --compile-mode the run uses."""
    if cfg.global_batch is not None:
        return fit_global_batch(cfg, world_size, log)
    return keep_global_batch(cfg, world_size, log)


def split_global_batch(global_batch, world_size, most_per_rank):
    """(batch per rank, grad-acc) for `global_batch` images a step on `world_size` ranks that hold at most
    `most_per_rank` images at once: the fewest micro-batches that fit, exact where a split up to twice as many
    micro-batches is (the smallest then), else the nearest global batch."""
    fewest = max(1, math.ceil(global_batch / (world_size * most_per_rank)))
    for grad_acc in range(fewest, 2 * fewest + 1):
        if global_batch % (world_size * grad_acc) == 0:
            return global_batch // (world_size * grad_acc), grad_acc
    per_rank = min(most_per_rank, max(1, round(global_batch / (world_size * fewest))))
    return per_rank, fewest


def scaled_lr(lr, ratio, rule):
    """`lr` for a global batch `ratio` times the one it was given for: linear (Goyal et al.), sqrt (the Adam and
    LAMB family's, timm's default for them) or none."""
    return lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def fit_global_batch(cfg, world_size, log):
    """--global-batch on `world_size` ranks: the per-rank batch and --grad-acc that keep it (or the nearest, with
    --lr scaled by --lr-scaling), said in one block. More ranks than images: one line, exit 2."""
    target = cfg.global_batch
    if world_size > target:
        raise UserError(
            f"--global-batch {target}: this job has {world_size} ranks, more than the images of a step; "
            f"give a --global-batch of at least {world_size}, or fewer ranks"
        )
    layout = cfg.parallelism
    pp, microbatches = layout.pp, layout.microbatches if layout.pp > 1 else None
    if pp > 1:  # the schedule's micro-batches accumulate in place of --grad-acc: -b takes the whole step
        per_rank, grad_acc = pipeline_split(target, world_size, microbatches), 1
    else:
        per_rank, grad_acc = split_global_batch(target, world_size, cfg.batch_size)
    actual = world_size * per_rank * grad_acc
    rule = cfg.lr_scaling or "linear"
    lr, min_lr = cfg.lr, cfg.min_lr
    lines = [
        f"--global-batch {target}: fitted to {world_size} rank{'s' if world_size > 1 else ''} "
        + (
            f"(--batch-size {cfg.batch_size} is the most a rank holds at once):"
            if pp == 1
            else f"of data (--pp {pp}: each step's batch in --pp-microbatches {microbatches}, which "
            "accumulate in place of --grad-acc):"
        ),
        f"  {world_size} x {per_rank} images x --grad-acc {grad_acc} = {actual} images a step"
        + (
            ", as given"
            if actual == target
            else f", the nearest to {target} ({inexact_why(target, world_size, cfg.batch_size, microbatches)})"
        ),
    ]
    if per_rank != cfg.batch_size:
        lines.append(f"  --batch-size {cfg.batch_size} -> {per_rank} per rank")
    if grad_acc != cfg.grad_acc:
        lines.append(f"  --grad-acc {cfg.grad_acc} -> {grad_acc}")
    if actual != target:
        lr = scaled_lr(cfg.lr, actual / target, rule)
        min_lr = cfg.min_lr and scaled_lr(cfg.min_lr, actual / target, rule)
        lines.append(f"  --lr {cfg.lr:g} -> {lr:g} (--lr-scaling {rule}: the given --lr is for {target} images a step)")
        if cfg.min_lr:
            lines.append(f"  --min-lr {cfg.min_lr:g} -> {min_lr:g} (the same rule)")
    else:
        lines.append(f"  --lr {cfg.lr:g} as given (the global batch it is for)")
    if cfg.model_ema:
        lines.append(
            "  the EMA's decay per update from these images a step (--model-ema-adjust)"
            if cfg.model_ema_adjust
            else f"  --model-ema-decay {cfg.model_ema_decay:g} per update, as given"
        )
    compile_mode = graph_free_mode(layout.compile_mode, grad_acc)
    if compile_mode != layout.compile_mode:
        lines.append(
            f"  --compile-mode {layout.compile_mode} -> {compile_mode} (a CUDA graph's next replay overwrites the "
            f"gradients --grad-acc {grad_acc} accumulates)"
        )
    log("\n".join(lines))
    return dataclasses.replace(
        cfg, batch_size=per_rank, grad_acc=grad_acc, lr=lr, min_lr=min_lr, compile_mode=compile_mode
    )


def pipeline_split(global_batch, world_size, microbatches):
    """A pipeline's batch per data replica for `global_batch` images a step over `world_size` replicas: one step of
    the schedule takes it whole, in `microbatches` equal micro-batches (a multiple of them, the nearest)."""
    return max(microbatches, round(global_batch / (world_size * microbatches)) * microbatches)


def inexact_why(global_batch, world_size, most_per_rank, microbatches=None):
    if global_batch % world_size:
        return f"not a multiple of {world_size} ranks"
    if microbatches is not None:
        return f"{global_batch // world_size} images per rank do not split into --pp-microbatches {microbatches}"
    return f"{global_batch // world_size} images per rank have no exact split into micro-batches of at most {most_per_rank}"


def graph_free_mode(compile_mode, grad_acc):
    """The --compile-mode a run with `grad_acc` micro-batches a step can use: a CUDA-graph mode's graph-free twin
    when it accumulates."""
    return GRAPH_FREE_MODE[compile_mode] if grad_acc > 1 and compile_mode in CUDA_GRAPH_MODES else compile_mode


def keep_global_batch(cfg, world_size, log):
    """--keep-global-batch: a run resumed on another number of ranks (a restart without a lost node) keeps its
    checkpoint's global batch, hence the same optimizer steps per epoch and the same learning rates, by changing
    --grad-acc, when ranks x --batch-size divides it; otherwise one line says how the global batch changes.
    Returns cfg, with the --grad-acc that does it."""
    if not cfg.keep_global_batch or not cfg.resume or cfg.eval_only:
        return cfg
    try:
        saved, _ = ckpt.load_latest(cfg.output_dir) if cfg.resume == "auto" else (ckpt.load(cfg.resume), None)
    except ckpt.CheckpointError:
        return cfg  # restore() says it in its own line
    if saved is None:
        return cfg
    args = saved["args"]
    saved_world, saved_batch, saved_acc = (
        saved.get("world_size", world_size),
        args["batch_size"],
        args.get("grad_acc", 1),
    )
    saved_global = saved_world * saved_batch * saved_acc
    per_step = world_size * cfg.batch_size
    if saved_global == per_step * cfg.grad_acc:
        return cfg
    written = f"the checkpoint's global batch of {saved_global} images ({ranks_of(saved_world)} x {saved_batch} x {saved_acc})"
    if saved_global % per_step:
        log(
            f"--keep-global-batch: {ranks_of(world_size)} x {cfg.batch_size} images do not divide {written}: the global "
            f"batch becomes {per_step * cfg.grad_acc} images, and with it the steps per epoch and the LR schedule; "
            f"give a --batch-size B with {world_size} x B dividing {saved_global} to keep it"
        )
        return cfg
    grad_acc = saved_global // per_step
    log(
        f"--keep-global-batch: {ranks_of(world_size)} x {cfg.batch_size} images x --grad-acc {grad_acc} keep {written}: "
        f"the same steps per epoch and learning rates"
    )
    compile_mode = graph_free_mode(cfg.parallelism.compile_mode, grad_acc)
    if compile_mode != cfg.parallelism.compile_mode:
        # A CUDA graph's next replay overwrites the gradients being accumulated: the restart keeps its global batch
        # (what --keep-global-batch asks) and compiles without graphs, slower per step but the same run.
        log(
            f"--keep-global-batch: --compile-mode {cfg.compile_mode} replays CUDA graphs, which cannot accumulate "
            f"gradients over --grad-acc {grad_acc}: this run compiles with --compile-mode {compile_mode} instead"
        )
    return dataclasses.replace(cfg, grad_acc=grad_acc, compile_mode=compile_mode)


def ranks_of(n):
    return f"{n} rank{'s' if n > 1 else ''}"
