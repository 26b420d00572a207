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
from dlojz_lib.model.zoo import meta_copy
from dlojz_lib.parallelism.pipeline import (
    SCHEDULES,
    PipelineCut,
    PipelineRun,
    RankStages,
    bubble_formula,
    build_pipeline,
    expected_bubble,
    time_layers,
)
from dlojz_lib.settings.flags import CUDA_GRAPH_MODES
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


def lay_out(model, cfg, ranks, log) -> Model:
    """`model` (a `model.build.BuiltModel`) laid out for the run: DDP, FSDP's shards, the --tp plan, the --pp stages,
    torch.compile. Each layout reads the family the build resolved (`model.family`)."""
    module, ema, num_classes = model.module, model.ema, model.num_classes
    net, parallel, unsharded = module, "none", module
    if cfg.pp > 1:
        return build_pipeline_model(cfg, model, ranks, log)
    compiled_blocks = model.blocks if cfg.compile and cfg.fsdp else None  # FSDP's: block by block
    if cfg.fsdp:
        from dlojz_lib.parallelism.fsdp import fill_from_first_rank, shard_model, to_meta

        catalogue, values = to_meta(module, ranks)
        unsharded = meta_copy(module)
        if cfg.tp > 1:
            from dlojz_lib.parallelism.tensor import parallelize

            split = parallelize(
                module, ranks.mesh["tensor"], cfg.arch, cfg.sequence_parallel, cfg.val_crop_size, model.family
            )
            log(
                f"tensor parallelism: {split} blocks over groups of {cfg.tp} ranks ({model.family.tensor_plan.said}"
                f"{'; the tokens split between them: sequence parallelism' if cfg.sequence_parallel else ''}), "
                f"{ranks.data_size} data replica{'s' if ranks.data_size > 1 else ''}; the weights each group holds "
                "whole get its average gradient"
                f"{f', their copies compared every {cfg.check_replicas} steps' if cfg.check_replicas else ''}"
            )
        if compiled_blocks is not None:  # each block, between the plan and FSDP
            log(compile_blocks([block for _, block in compiled_blocks], cfg.compile_mode))
        precision = cfg.amp_torch_dtype
        blocks = shard_model(
            module, cfg.fsdp_reshard_after_forward, precision, ranks.device, ranks.sharding_mesh(), None, model.family,
            cfg.fsdp_offload,
        )  # fmt: skip
        fill_from_first_rank([module], catalogue, values, ranks.device, cfg.fsdp_offload)
        parallel = "fsdp"
        log(
            f"FSDP: {blocks} blocks and the root sharded over {sharded_over(ranks, cfg.fsdp_replicate)}, parameters "
            f"gathered in {cfg.amp_dtype if cfg.amp else 'float32'}, gradients reduced in float32, "
            f"{'resharded' if cfg.fsdp_reshard_after_forward else 'kept gathered'} after each block's forward"
            f"{'; the shards, their gradients and the optimizer in pinned host memory (--fsdp-offload)' if cfg.fsdp_offload else ''}"
            f"{hsdp_hint(ranks, cfg.fsdp_replicate)}"
        )
    elif ranks.enabled:
        net = torch.nn.parallel.DistributedDataParallel(
            net, device_ids=[ranks.device.index] if ranks.device.type == "cuda" else None, gradient_as_bucket_view=True
        )
        parallel = "ddp"
    if cfg.compile and compiled_blocks is None:
        start_compile_workers()  # deaf to Slurm's preemption signal, which this process handles
        net = torch.compile(net, mode=cfg.compile_mode)
        log(f"torch.compile: mode {cfg.compile_mode or 'default'}")
    cuda_graphs = cfg.compile_mode in CUDA_GRAPH_MODES  # (a --compile-mode implies --compile)
    whole = whole_copies(cfg.section("distribution"), module, ranks, model.family)
    steps = dict(whole_copies=whole, after_step=float8_scales(cfg.float8, cfg.fsdp, module))
    return Model(net, module, ema, num_classes, parallel, unsharded, cuda_graphs, cfg.tp > 1, **steps)


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
    planner's, parallelism.plan.choose_layout) and said among the run's notes."""
    from dlojz_lib.settings.config import resolve_config

    if args.layout != "auto":
        return resolve_config(args)
    from dlojz_lib.parallelism.plan import choose_layout

    args, said = choose_layout(args)
    cfg = resolve_config(args)
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


def whole_copies(distribution, module, ranks, family):
    """--tp: the weights each tensor group holds whole, their gradients averaged over it (--check-replicas: and
    their copies compared)."""
    if distribution.tp == 1:
        return None
    from dlojz_lib.parallelism.tensor import WholeCopies, token_sharded_weights

    summed = token_sharded_weights(module, family) if distribution.sequence_parallel else ()
    return WholeCopies(module, ranks.mesh["tensor"], distribution.check_replicas, ranks.all_gather, summed)


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
    if batch_size // microbatches > 1:
        return
    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
    if any(isinstance(m, norms) for m in module.modules()):
        fail(
            f"-b {batch_size} in --pp-microbatches {microbatches}: micro-batches of 1 image, whose statistics "
            f"{arch}'s BatchNorm cannot take; give -b {2 * microbatches} or more, or --pp-microbatches "
            f"{batch_size // 2 if batch_size >= 2 else 1} (2 images or more a micro-batch)"
        )


def build_pipeline_model(cfg, model, ranks, log) -> Model:
    """--pp: `model` cut into --pp stages, this rank's sharded by FSDP over the data dimension, run by the
    schedule (dlojz_lib.parallelism.pipeline)."""
    module, ema, num_classes = model.module, model.ema, model.num_classes
    from dlojz_lib.parallelism.fsdp import fill_from_first_rank, shard_model, to_meta

    check_micro_batches(module, cfg.arch, cfg.batch_size, cfg.grad_acc, cfg.pp, cfg.pp_microbatches)
    pipe = ranks.mesh["pipe"]
    unsharded = meta_copy(module)
    split = cfg.pp_split if cfg.pp_split in ("params", "time") else [int(i) for i in cfg.pp_split.split(",")]
    micro = cfg.batch_size // cfg.pp_microbatches
    layer_weights = None
    if split == "time":  # a micro-batch as the run feeds it (its own draws: the run's stay one process's)
        sample = torch.randn(micro, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(0))
        sample = sample.to(memory_format=torch.channels_last) if cfg.channels_last else sample
        layer_weights = time_layers(module, cfg.arch, sample, ranks.device, cfg.amp_torch_dtype, model.family)
    catalogue, values = to_meta(module, ranks)
    blocks = []  # the FSDP units of each stage

    if cfg.tp > 1:  # the plan checked once, on the whole model: the stages hold its blocks or none
        from dlojz_lib.parallelism.tensor import check_plan, parallelize, plan_blocks

        check_plan(module, cfg.tp, cfg.arch, model.family)
    block_paths = [path for path, _ in model.blocks or ()]  # (none: build_pipeline refuses the model)
    compiled = []  # compile_blocks' lines, a stage each

    def shard(stage):
        if cfg.tp > 1 and plan_blocks(stage, model.family):  # 3-D: the blocks split over the tensor dimension
            parallelize(stage, ranks.mesh["tensor"], cfg.arch, family=model.family)
        # the family's blocks the stage holds: FSDP's units (a Stage is of no family: no guess from class names)
        units = held_blocks(stage, block_paths)
        if cfg.compile:  # each of the stage's blocks, between the plan and FSDP
            compiled.append(compile_blocks(units, cfg.compile_mode))
        mesh, precision = ranks.sharding_mesh(), cfg.amp_torch_dtype
        offload = cfg.fsdp_offload
        blocks.append(
            shard_model(stage, cfg.fsdp_reshard_after_forward, precision, ranks.device, mesh, units, None, offload)
        )

    per_rank = cfg.pp_stages_per_rank if SCHEDULES[cfg.pp_schedule][1] else 1
    cut = PipelineCut(
        cfg.pp, cfg.pp_schedule, cfg.pp_microbatches, per_rank, split, layer_weights, None,
        cfg.activation_checkpointing, cfg.ac_every, cfg.amp_torch_dtype, cfg.seed, wrap=shard,
    )  # fmt: skip
    runner, stages, loss = build_pipeline(model, cut, pipe.get_local_rank(), ranks.device, pipe.get_group())
    fill_from_first_rank(stages, catalogue, values, ranks.device, cfg.fsdp_offload)
    rank, group = pipe.get_local_rank(), pipe.get_group()
    run = PipelineRun(runner, stages, loss, rank, cfg.pp, group, cfg.batch_size, num_classes)
    if cfg.test:  # the chronometer's run: the stages' compute and idle time, for the bubble
        run.time_steps(ranks.device, cfg.pp_schedule, cfg.pp_microbatches, per_rank)
    mine = [
        f"{s.names[0] if len(s.names) == 1 else f'{s.names[0]} to {s.names[-1]}'} "
        f"({sum(p.numel() for p in s.parameters()):,} parameters"
        f"{', no block: replicated over the tensor group' if cfg.tp > 1 and not plan_blocks(s, model.family) else ''})"
        for s in stages
    ]
    everyone = ranks.all_gather(" and ".join(mine))
    # the world's ranks as the mesh lays them out: data replicas outermost, then stages, tensor peers innermost
    replicas = [everyone[r * cfg.pp * cfg.tp : (r + 1) * cfg.pp * cfg.tp : cfg.tp] for r in range(ranks.data_size)]
    if any(cut != replicas[0] for cut in replicas):  # their sends would never meet: stop now, not at --dist-timeout
        fail(
            f"--pp-split {cfg.pp_split}: the data replicas cut the model differently ({' | '.join(map('; '.join, replicas))})"
        )
    looped = f", {per_rank} a rank" if per_rank > 1 else ""
    bubble = expected_bubble(cfg.pp, cfg.pp_microbatches, per_rank)
    log(
        f"pipeline: {cfg.pp * per_rank} stages{looped}, schedule {cfg.pp_schedule}, {cfg.pp_microbatches} micro-batches"
        f" of {micro} images a step (bubble {bubble_formula(per_rank)} = {bubble:.0%}); "
        f"stages: {'; '.join(replicas[0])}"
        f"{f', the same cut on each of {ranks.data_size} data replicas' if ranks.data_size > 1 else ''}; each"
        f"{f' split over {cfg.tp} ranks by the tensor-parallel plan and' if cfg.tp > 1 else ''} sharded by FSDP "
        f"({blocks[0]} blocks) over {sharded_over(ranks, cfg.fsdp_replicate, 'data replica')}"
        f"{'; each layer recomputed in the backward (--grad-checkpointing)' if cfg.grad_checkpointing else ''}"
        f"{'; ' + '; '.join(compiled) if compiled else ''}"
    )
    held = stages[0] if len(stages) == 1 else RankStages(stages)  # what the optimizer and the checkpoint see
    whole = whole_copies(cfg.section("distribution"), held, ranks, model.family)
    return Model(run, held, ema, num_classes, "fsdp", unsharded, False, cfg.tp > 1, run, whole)


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
    return result
