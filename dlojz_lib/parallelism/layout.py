"""The model laid out for the run (torchtitan's order: the model is built whole by `dlojz_lib.model.build`, then
laid out here): DDP, FSDP's sharding, tensor parallelism's plan, the pipeline's stages, torch.compile. `Model`
keeps the wrapped and the bare module side by side: the loop trains the first, checkpoints and validation use the
second.
"""

import contextlib
import dataclasses
import functools

import torch

from dlojz_lib.checks import fail
from dlojz_lib.dist import start_compile_workers
from dlojz_lib.model.recompute import apply_checkpointing
from dlojz_lib.model.zoo import meta_copy
from dlojz_lib.parallelism.pipeline import (
    PipelineCut,
    PipelineRun,
    RankStages,
    Stage,
    bubble_formula,
    build_pipeline,
    expected_bubble,
    micro_batch_problem,
    time_layers,
)
from dlojz_lib.parallelism.tensor import check_plan, parallelize, plan_blocks
from dlojz_lib.torch_internals import allow_recompiles


@dataclasses.dataclass
class Model:
    net: torch.nn.Module  # what trains: wrapped by DDP and torch.compile when asked
    module: torch.nn.Module  # the model without those wrappers (sharded in place by --fsdp): checkpointed, validated
    ema: torch.nn.Module | None  # --model-ema's averaged copy
    num_classes: int
    parallel: str  # "none", or "ddp" or "fsdp" across ranks
    unsharded: torch.nn.Module  # the model whole, for FLOP counts: `module`, or with --fsdp its meta-device copy
    cuda_graphs: bool = False  # compiled in a mode that replays CUDA graphs
    tensor_parallel: bool = False  # --tp: gradients on two meshes, (data, tensor) and data
    pipeline: object = None  # --pp: the PipelineRun (also `net`): this rank's stage is `module`
    whole_copies: object = None  # --tp: the weights a tensor group holds whole (tensor_parallel.WholeCopies)
    after_step: object = None  # called after each optimizer step (--float8 under --fsdp: the weights' scales)

    @property
    def evaluated(self):
        """What validation runs: the model without its wrappers, or under --pp the pipeline (every rank its stage)."""
        return self.module if self.pipeline is None else self.pipeline

    def begin_step(self):
        """Before a forward: under CUDA graphs, tells torch that the previous step's outputs are no longer used (their
        memory is the next replay's), which it cannot always infer when validation runs between training steps."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def clip_grad_norm(self, max_norm):
        """Scale the gradients so that their global norm is at most `max_norm` (torch's clip_grad_norm_). Under --tp
        the split layers' gradients live on the (data, tensor) mesh and the replicated ones' on the data mesh, whose
        DTensors do not combine: each mesh's norm is reduced apart, then the norms are, as torchtitan does; under
        --pp, then the stages' norms."""
        if not self.tensor_parallel and self.pipeline is None:
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, foreach=True)
        from torch.distributed.tensor import DTensor

        by_mesh = {}
        for p in self.module.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        norms = [torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True) for group in by_mesh.values()]
        total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
        if self.pipeline is not None:  # each stage holds its own layers' gradients
            total = self.pipeline.norm_across_stages(total)
        for group in by_mesh.values():  # one mesh at a time: a DTensor operation takes one
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
        return total

    def gradient_sync(self, sync):
        """Context of a micro-batch's forward and backward: gradients are reduced across ranks only when `sync`
        (the last micro-batch before an optimizer step)."""
        if self.parallel == "fsdp":
            self.module.set_requires_gradient_sync(sync)  # no reduce-scatter while accumulating
        elif self.parallel == "ddp" and not sync:
            return self.net.no_sync()  # no all-reduce while accumulating
        return contextlib.nullcontext()


COMPILE_DIST_TIMEOUT_S = 600  # --dist-timeout's default: a compiled first step's wait, said below it


def lay_out(model, cfg, ranks, log) -> Model:
    """`model` (a `model.build.BuiltModel`) laid out as the run's Layout says (`cfg.parallelism`): the unit pass on
    the model (tensor plan, activation checkpointing, torch.compile block by block, FSDP), or on each pipeline stage
    (--pp), inside the meta build's one bracket; then DDP, or torch.compile of the whole model where no block was."""
    layout = cfg.parallelism
    if layout.compile and ranks.enabled and cfg.dist_timeout < COMPILE_DIST_TIMEOUT_S:
        log(
            f"torch.compile on {ranks.world_size} ranks: each compiles in its first step (minutes for a large model) "
            f"while the others wait at most --dist-timeout {cfg.dist_timeout:g} s: give "
            f"{COMPILE_DIST_TIMEOUT_S} or more if the compile outlasts it"
        )
    module, family = model.module, model.family
    unsharded = meta_copy(module) if layout.fsdp else module  # the model whole, for FLOP counts
    if layout.pp > 1:
        training = cfg.section("training")
        return build_pipeline_model(
            model, layout, unsharded, ranks, log, training, cfg.grad_acc, cfg.channels_last, cfg.test
        )
    with filled_from_first_rank(module, layout, ranks) as laid_out:
        done = parallelize_unit(module, layout, ranks, family, arch=cfg.arch, val_crop_size=cfg.val_crop_size)
        laid_out.append(module)
    if layout.fsdp and layout.checkpointing != "none":  # the copy recomputes as the model does (the report's bytes)
        apply_checkpointing(unsharded, layout.checkpointing, layout.checkpoint_every, family, cfg.arch)
    log_unit_pass(done, layout, ranks, family, log)
    net, parallel = module, "fsdp" if layout.fsdp else "none"
    if ranks.enabled and not layout.fsdp:
        net = torch.nn.parallel.DistributedDataParallel(
            net, device_ids=[ranks.device.index] if ranks.device.type == "cuda" else None, gradient_as_bucket_view=True
        )
        parallel = "ddp"
    if layout.compile and done.compiled is None:  # the whole model (its DDP wrapper too) as one graph
        start_compile_workers()  # deaf to Slurm's preemption signal, which this process handles
        net = torch.compile(net, mode=layout.compile_mode)
        log(f"torch.compile: mode {layout.compile_mode or 'default'}")
    steps = dict(
        whole_copies=whole_copies(layout, module, ranks, family),
        after_step=float8_scales(layout.float8, layout.fsdp, module),
    )
    return Model(
        net, module, model.ema, model.num_classes, parallel, unsharded, layout.cuda_graphs, layout.tp > 1, **steps
    )


@dataclasses.dataclass
class UnitPass:
    """What the unit pass did to one unit (the model, or a pipeline stage)."""

    split: int = 0  # blocks the tensor plan split over the tensor group
    compiled: str | None = None  # compile_blocks' line, None where the blocks were not compiled one by one
    sharded: int | None = None  # FSDP's blocks (each sharded apart, the unit's root after them), None without FSDP


def parallelize_unit(unit, layout, ranks, family, arch="this model", val_crop_size=None, blocks=None) -> UnitPass:
    """One unit of the model laid out in place, torchtitan's order: the family's tensor plan on its blocks (a
    stage without blocks stays whole over the tensor group), activation checkpointing (a stage recomputes its
    layers, a model its blocks), torch.compile of each block where FSDP or a stage holds them, then FSDP's shards
    (each block, then the unit). `blocks`: the unit's blocks (a stage's, which the family names on the whole
    model), else its family's. The flat model's one call and the pipeline builder's call for each stage."""
    done = UnitPass()
    is_stage = isinstance(unit, Stage)
    if blocks is None and family is not None:  # (read before the plan and the checkpointing change them)
        blocks = [block for _, block in family.blocks(unit)]
    if layout.tp > 1 and (not is_stage or plan_blocks(unit, family)):
        sequence_parallel = layout.sequence_parallel
        done.split = parallelize(unit, ranks.mesh["tensor"], arch, sequence_parallel, val_crop_size, family)
    if is_stage:
        unit.recompute_layers(layout.checkpointing, layout.checkpoint_every)
    else:
        apply_checkpointing(unit, layout.checkpointing, layout.checkpoint_every, family, arch)
    if layout.compiled_by_block and blocks is not None:  # between the plan and FSDP
        done.compiled = compile_blocks(blocks, layout.compile_mode)
    if layout.fsdp:
        from dlojz_lib.parallelism.fsdp import shard_model

        units, row = (blocks, None) if is_stage else (None, family)  # (a Stage is of no family)
        mesh, reshard = ranks.sharding_mesh(), layout.reshard_after_forward
        done.sharded = shard_model(unit, reshard, param_dtype(layout), ranks.device, mesh, units, row, layout.offload)
    return done


def param_dtype(layout):
    """The torch dtype of the layout's `param_dtype` (FSDP's gathers, autocast's), None for float32."""
    return None if layout.param_dtype is None else getattr(torch, layout.param_dtype)


@contextlib.contextmanager
def filled_from_first_rank(module, layout, ranks):
    """The meta build's one bracket, around either branch: under --fsdp, `module` (whole on the first rank, on the
    meta device on the others) turned to the meta device on every rank before the body lays it out, and the parts
    the body appends to the list it is given (the model, or this rank's stages) filled from the first rank's values
    once it is done (fsdp.to_meta, fill_from_first_rank); without --fsdp, nothing."""
    parts = []
    if not layout.fsdp:
        yield parts
        return
    from dlojz_lib.parallelism.fsdp import fill_from_first_rank, to_meta

    catalogue, values = to_meta(module, ranks)
    yield parts
    fill_from_first_rank(parts, catalogue, values, ranks.device, layout.offload)


def log_unit_pass(done, layout, ranks, family, log):
    """The flat model's unit pass in lines: the tensor plan, the blocks compiled, FSDP's shards."""
    if layout.tp > 1:
        log(
            f"tensor parallelism: {done.split} blocks over groups of {layout.tp} ranks ({family.tensor_plan.said}"
            f"{'; the tokens split between them: sequence parallelism' if layout.sequence_parallel else ''}), "
            f"{ranks.data_size} data replica{'s' if ranks.data_size > 1 else ''}; the weights each group holds "
            "whole get its average gradient"
            f"{f', their copies compared every {layout.check_replicas} steps' if layout.check_replicas else ''}"
        )
    if done.compiled is not None:
        log(done.compiled)
    if layout.fsdp:
        log(
            f"FSDP: {done.sharded} blocks and the root sharded over {sharded_over(ranks, layout.replicate)}, "
            f"parameters gathered in {layout.param_dtype or 'float32'}, gradients reduced in float32, "
            f"{'resharded' if layout.reshard_after_forward else 'kept gathered'} after each block's forward"
            f"{'; the shards, their gradients and the optimizer in pinned host memory (--fsdp-offload)' if layout.offload else ''}"
            f"{hsdp_hint(ranks, layout.replicate)}"
        )


def float8_scales(float8, fsdp, module):
    """What runs after each optimizer step for --float8: under --fsdp with tensorwise scaling, FSDP gathers float8
    weights, whose scales are then computed for all of them at once; else nothing (None)."""
    if float8 != "tensorwise" or not fsdp:
        return None
    from dlojz_lib.model.float8 import scales_for_fsdp

    return functools.partial(scales_for_fsdp, module)


def sharded_over(ranks, replicate, what="rank") -> str:
    """Who holds the shards, in words: the data ranks, or with --fsdp-replicate R, R groups of them (HSDP)."""
    shards = ranks.data_size // replicate
    ranks_said = f"{shards} {what}{'s' if shards > 1 else ''}"
    if replicate == 1:
        return ranks_said
    return (
        f"{ranks_said} in each of {replicate} replicas (HSDP: gathered within a replica, gradients all-reduced "
        "across the replicas once a step)"
    )


def hsdp_hint(ranks, replicate) -> str:
    """On several nodes without --fsdp-replicate: what HSDP would change, in words (else nothing)."""
    nodes = len(set(ranks.hosts))
    if replicate > 1 or nodes < 2 or ranks.data_size % nodes:
        return ""
    return (
        f"; over {nodes} nodes every all-gather crosses them: --fsdp-replicate {nodes} would gather within each "
        f"node and send only the gradients' all-reduce across nodes (HSDP: {nodes}x the shards' memory a rank)"
    )


def resolved_with_layout(args):
    """dlojz.py's flags resolved (settings.config.resolve_config), with --layout auto's choice made first (the
    planner's Layout, parallelism.plan.choose_layout: the run's as it is) and said among the run's notes."""
    from dlojz_lib.settings.config import resolve_config

    if args.layout != "auto":
        return resolve_config(args)
    from dlojz_lib.parallelism.plan import choose_layout

    chosen, said = choose_layout(args)
    cfg = resolve_config(args, chosen)
    return dataclasses.replace(cfg, notes=(*cfg.notes, said))


def held_blocks(stage, paths) -> list:
    """The blocks of `paths` (the whole model's) that `stage` holds."""
    held = []
    for path in paths:
        try:
            held.append(stage.get_submodule(path))
        except AttributeError:  # another stage's: pruned from this one
            continue
    return held


def compile_blocks(blocks, mode) -> str:
    """torch.compile on each block's forward, one graph a block (fullgraph), as torchtitan compiles under FSDP, TP
    and PP: the parallel plan's and FSDP's hooks run around the graphs, not in them, and blocks of the same code
    compile once. Returns the line that says so."""
    start_compile_workers()  # deaf to Slurm's preemption signal, which this process handles
    # static shapes: a CNN's blocks share their code at several shapes (a ResNet's four stages), and one graph
    # with symbolic shapes for all of them fails to compile its backward; a graph for each shape instead, each in
    # training and validation (grad mode, BatchNorm's mode): up to 4 a block
    allow_recompiles(4 * len(blocks))
    for block in blocks:
        block.forward = torch.compile(block.forward, mode=mode, fullgraph=True, dynamic=False)
    n = len(blocks)
    return f"torch.compile: each of {n} block{'s' if n != 1 else ''} (fullgraph, mode {mode or 'default'}), around them eager"


def whole_copies(layout, module, ranks, family):
    """--tp: the weights each tensor group holds whole, their gradients averaged over it (--check-replicas: and
    their copies compared). `layout`: the run's Layout (its tp, sequence_parallel, check_replicas)."""
    if layout.tp == 1:
        return None
    from dlojz_lib.parallelism.tensor import WholeCopies, token_sharded_weights

    summed = token_sharded_weights(module, family) if layout.sequence_parallel else ()
    return WholeCopies(module, ranks.mesh["tensor"], layout.check_replicas, ranks.all_gather, summed)


def check_micro_batches(module, arch, batch_size, grad_acc, pp, microbatches):
    """One step of the pipeline takes -b in equal micro-batches, without --grad-acc (--global-batch may have chosen
    them), and a BatchNorm model's hold 2 images or more (its training statistics of one image fail in its first
    forward): one line naming the -b and --pp-microbatches that work, before any step."""
    if grad_acc > 1 or batch_size % microbatches:
        fail(
            f"--pp {pp}: -b {batch_size} x --grad-acc {grad_acc} per rank; the schedule accumulates its "
            f"--pp-microbatches {microbatches} (which must divide -b) instead of --grad-acc: give a --global-batch "
            "or -b that one step of the pipeline takes"
        )
    problem = micro_batch_problem(module, arch, batch_size, microbatches)
    if problem is not None:
        fail(problem)


def build_pipeline_model(
    model, layout, unsharded, ranks, log, training, grad_acc=1, channels_last=False, test=False
) -> Model:
    """--pp: `model` cut into the `layout`'s stages, the unit pass on each of this rank's (its tensor plan, its
    layers' recomputation, its blocks compiled, FSDP over the data dimension) inside the meta build's one bracket,
    run by the schedule (dlojz_lib.parallelism.pipeline). `unsharded`: the model whole on the meta device;
    `training`: the training group's settings (the batch, the image size, the seed); `grad_acc`: the micro-batches
    a step accumulates besides the schedule's (a resume's --keep-global-batch: refused); `test`: the chronometer's
    run, which times the stages."""
    module, family, arch, batch_size = model.module, model.family, model.arch, training.batch_size
    check_micro_batches(module, arch, batch_size, grad_acc, layout.pp, layout.microbatches)
    pipe = ranks.mesh["pipe"]
    micro = batch_size // layout.microbatches
    precision = param_dtype(layout)
    layer_weights = None
    if layout.split == "time":  # a micro-batch as the run feeds it (its own draws: the run's stay one process's)
        size = training.image_size
        sample = torch.randn(micro, 3, size, size, generator=torch.Generator().manual_seed(0))
        sample = sample.to(memory_format=torch.channels_last) if channels_last else sample
        layer_weights = time_layers(module, arch, sample, ranks.device, precision, family)
    if layout.tp > 1:  # the plan checked once, on the whole model: the stages hold its blocks or none
        check_plan(module, layout.tp, arch, family)
    block_paths = [path for path, _ in model.blocks or ()]  # (none: build_pipeline refuses the model)
    passes = []  # the unit pass's record of each stage

    def unit_pass(stage):  # the family's blocks the stage holds: FSDP's units (no guess from class names)
        passes.append(parallelize_unit(stage, layout, ranks, family, arch, blocks=held_blocks(stage, block_paths)))

    cut = PipelineCut(
        pp=layout.pp,
        schedule=layout.schedule,
        microbatches=layout.microbatches,
        stages_per_rank=layout.stages_per_rank,
        split=layout.split,
        layer_weights=layer_weights,
        autocast_dtype=precision,
        seed=training.seed,
        wrap=unit_pass,
    )
    with filled_from_first_rank(module, layout, ranks) as laid_out:
        runner, stages, loss = build_pipeline(model, cut, pipe.get_local_rank(), ranks.device, pipe.get_group())
        laid_out.extend(stages)
    rank, group = pipe.get_local_rank(), pipe.get_group()
    run = PipelineRun(runner, stages, loss, rank, layout.pp, group, batch_size, model.num_classes)
    if test:  # the chronometer's run: the stages' compute and idle time, for the bubble
        run.time_steps(ranks.device, layout.schedule, layout.microbatches, layout.stages_per_rank)
    log(pipeline_line(layout, ranks, stages, passes, family, micro))
    held = stages[0] if len(stages) == 1 else RankStages(stages)  # what the optimizer and the checkpoint see
    whole = whole_copies(layout, held, ranks, family)
    return Model(run, held, model.ema, model.num_classes, "fsdp", unsharded, False, layout.tp > 1, run, whole)


def pipeline_line(layout, ranks, stages, passes, family, micro) -> str:
    """The pipeline in one line: its stages, each rank's (the same cut on every data replica, or one line to stop
    at once), its schedule and bubble, the unit pass's work on each stage."""
    pp, tp, per_rank = layout.pp, layout.tp, layout.stages_per_rank
    mine = [
        f"{s.names[0] if len(s.names) == 1 else f'{s.names[0]} to {s.names[-1]}'} "
        f"({sum(p.numel() for p in s.parameters()):,} parameters"
        f"{', no block: replicated over the tensor group' if tp > 1 and not plan_blocks(s, family) else ''})"
        for s in stages
    ]
    everyone = ranks.all_gather(" and ".join(mine))
    # the world's ranks as the mesh lays them out: data replicas outermost, then stages, tensor peers innermost
    replicas = [everyone[r * pp * tp : (r + 1) * pp * tp : tp] for r in range(ranks.data_size)]
    if any(cut != replicas[0] for cut in replicas):  # their sends would never meet: stop now, not at --dist-timeout
        split = layout.split if isinstance(layout.split, str) else ",".join(map(str, layout.split))
        fail(
            f"--pp-split {split}: the data replicas cut the model differently ({' | '.join(map('; '.join, replicas))})"
        )
    looped = f", {per_rank} a rank" if per_rank > 1 else ""
    bubble = expected_bubble(pp, layout.microbatches, per_rank)
    compiled = [done.compiled for done in passes if done.compiled is not None]
    return (
        f"pipeline: {pp * per_rank} stages{looped}, schedule {layout.schedule}, {layout.microbatches} micro-batches"
        f" of {micro} images a step (bubble {bubble_formula(per_rank)} = {bubble:.0%}); "
        f"stages: {'; '.join(replicas[0])}"
        f"{f', the same cut on each of {ranks.data_size} data replicas' if ranks.data_size > 1 else ''}; each"
        f"{f' split over {tp} ranks by the tensor-parallel plan and' if tp > 1 else ''} sharded by FSDP "
        f"({passes[0].sharded} blocks) over {sharded_over(ranks, layout.replicate, 'data replica')}"
        f"{'; each layer recomputed in the backward (--grad-checkpointing)' if layout.checkpointing != 'none' else ''}"
        f"{'; ' + '; '.join(compiled) if compiled else ''}"
    )


def state_bytes_per_rank(model, training, ranks) -> dict:
    """Bytes of parameters, gradients and optimizer state on each rank (the largest), and each rank's peak."""
    from dlojz_lib.observers.chrono import peak_memory_bytes
    from dlojz_lib.parallelism.fsdp import state_bytes

    local = dict(state_bytes(model.module, training.optimizer), peak_memory_bytes=peak_memory_bytes(ranks.device))
    every = ranks.all_gather(local) if ranks.enabled else [local]
    result = {f"{key}_per_rank": max(rank[key] for rank in every) for key in local if key != "peak_memory_bytes"}
    result["peak_memory_bytes_per_rank"] = [rank["peak_memory_bytes"] for rank in every]
    pp = model.pipeline.pp if model.pipeline is not None else 1
    result["parallel"] = "pp" if pp > 1 else "tp" if model.tensor_parallel else model.parallel
    result["tensor_parallel_size"] = ranks.world_size // ranks.data_size // pp
    result["pipeline_size"] = pp
    hsdp = ranks.mesh is not None and "replicate" in ranks.mesh.mesh_dim_names
    result["fsdp_replicas"] = ranks.mesh["replicate"].size() if hsdp else 1  # (--fsdp-replicate's copies)
    return result
