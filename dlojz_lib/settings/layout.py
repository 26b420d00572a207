"""The run's layout as one typed record, torchtitan's parallelism section: `Layout` (the data, tensor and pipeline
degrees, how FSDP shards, what each unit recomputes and compiles, float8), read from the flags once
`resolve_layout` has filled their defaults and checked their combination rules, as
`Config.parallelism` by the model's build, the unit pass (`parallelism.layout.parallelize_unit`), the pipeline's
builder and the planner, which ask it what a layout question needs instead of reading the flags.

The rules are problems, not exceptions (`layout_problems` yields each as the line that says it): dlojz.py refuses
the first one (`check_layout`), the planner leaves out the layouts that have one. Importing this module imports no
torch.
"""

import dataclasses
import os

from dlojz_lib.checks import fail
from dlojz_lib.settings.flags import CUDA_GRAPH_MODES, LOOPED_SCHEDULES
from dlojz_lib.settings.launch import launch_world_size, model_copy_problem

SPLITS = ("params", "time")  # --pp-split's named cuts; else the layers where stages 2, 3... start


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the model is laid out over the ranks, and what each of its units does (every field a flag's, resolved)."""

    fsdp: bool = False
    """--fsdp: parameters, gradients and optimizer state sharded over the data ranks (FSDP2); False: DDP's copies"""
    replicate: int = 1
    """--fsdp-replicate: the replicas the data ranks form, each sharding the model over its own ranks (HSDP)"""
    tp: int = 1
    """--tp: the ranks a block's layers are split over (tensor parallelism on DTensor)"""
    sequence_parallel: bool = False
    """--sequence-parallel: the tokens split over the tensor group outside the blocks' split layers"""
    check_replicas: int = 0
    """--check-replicas: every how many steps the weights a tensor group holds whole are compared (0: never)"""
    pp: int = 1
    """--pp: the pipeline's stages over ranks (its degree)"""
    schedule: str = "1f1b"
    """--pp-schedule: PyTorch's pipeline schedule"""
    microbatches: int = 1
    """--pp-microbatches: the micro-batches one step of the pipeline runs (1 without --pp)"""
    stages_per_rank: int = 1
    """--pp-stages-per-rank: a rank's stages under a looped schedule (1 under the others)"""
    split: str | tuple = "params"
    """--pp-split: params or time (balanced), or the layers where stages 2, 3... start"""
    reshard_after_forward: bool | None = None
    """--fsdp-reshard-after-forward: each block's parameters freed after its forward (None without --fsdp)"""
    offload: bool = False
    """--fsdp-offload: the shards, their gradients and the optimizer state in pinned host memory"""
    float8: str | None = None
    """--float8: torchao's recipe for the large block linears (None: none)"""
    checkpointing: str = "none"
    """--activation-checkpointing: what each unit recomputes in the backward (none, full, selective)"""
    checkpoint_every: int = 1
    """--ac-every: the 1st, (every+1)-th... block recomputed"""
    compile: bool = False
    """--compile: torch.compile (block by block where FSDP or a stage holds the blocks, else the whole model)"""
    compile_mode: str | None = None
    """--compile-mode: torch.compile's mode (None: its default)"""
    param_dtype: str | None = None
    """--amp-dtype under --amp: what FSDP gathers the weights in and autocast runs (None: float32)"""

    @classmethod
    def of(cls, values) -> "Layout":
        """The record of resolved flag values (`resolve_layout`'s: a dict, or a Config, by its flags' names)."""
        get = values.get if isinstance(values, dict) else lambda name: getattr(values, name)
        pp, looped = get("pp"), get("pp_schedule") in LOOPED_SCHEDULES
        split = get("pp_split")
        return cls(
            fsdp=get("fsdp"),
            replicate=get("fsdp_replicate"),
            tp=get("tp"),
            sequence_parallel=get("sequence_parallel"),
            check_replicas=get("check_replicas"),
            pp=pp,
            schedule=get("pp_schedule"),
            microbatches=get("pp_microbatches") or 1,
            stages_per_rank=(get("pp_stages_per_rank") or 2) if looped else 1,
            split=split if split in SPLITS else tuple(int(layer) for layer in split.split(",")),
            reshard_after_forward=get("fsdp_reshard_after_forward"),
            offload=get("fsdp_offload"),
            float8=get("float8"),
            checkpointing=get("activation_checkpointing") or "none",
            checkpoint_every=get("ac_every"),
            compile=get("compile"),
            compile_mode=get("compile_mode"),
            param_dtype=get("amp_dtype") if get("amp") else None,
        )

    def flags(self) -> dict:
        """The flag values that make this layout (the inverse of `of` for the degrees and the checkpointing): what a
        run given it records in its args; the others (float8, compile, the pipeline's schedule) are the run's."""
        return dict(
            fsdp=self.fsdp,
            fsdp_replicate=self.replicate,
            tp=self.tp,
            pp=self.pp,
            activation_checkpointing=self.checkpointing,
        )

    def problems(self, values) -> list:
        """The lines dlojz.py would refuse this layout with beside a run's other flags (`values`, parsed: a dict):
        what the planner asks of each of its rows (none: the run accepts it). Its float8, where it has one, beside
        the run's own (which `flags` leaves to the run)."""
        own = {"float8": self.float8} if self.float8 is not None else {}
        return list(layout_problems(dict(values, **self.flags(), **own, layout=None)))

    def builds_on_meta(self, is_main) -> bool:
        """Whether this rank builds the model's shapes only, its values filled from the first rank once laid out."""
        return self.fsdp and not is_main

    @property
    def compiled_by_block(self) -> bool:
        """torch.compile on each block, between the tensor plan and FSDP (under --fsdp or --pp), not the model."""
        return self.compile and (self.fsdp or self.pp > 1)

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compile mode replays CUDA graphs."""
        return self.compile_mode in CUDA_GRAPH_MODES

    @property
    def name(self) -> str:
        """The layout in the planner's words: DDP, FSDP, HSDP, TP 2 x FSDP, PP 2 x FSDP, PP 2 x TP 2..."""
        data = "DDP" if not self.fsdp else "HSDP" if self.replicate > 1 else "FSDP"
        if self.pp > 1:
            return f"PP {self.pp} x " + (f"TP {self.tp}" if self.tp > 1 else data)
        return f"TP {self.tp} x {data}" if self.tp > 1 else data


def fill_layout_defaults(values, notes):
    """The layout flags' defaults, where not given: FSDP's resharding, the pipeline's micro-batches and stages a
    rank, --grad-checkpointing as --activation-checkpointing full (each says the other), --compile-mode's
    --compile."""
    if values["fsdp"] and values["fsdp_reshard_after_forward"] is None:  # a stage's blocks serve every micro-batch
        values["fsdp_reshard_after_forward"] = values["pp"] == 1
    if values["pp"] > 1 and values["pp_microbatches"] is None:  # a bubble of (N - 1) / (3 N - 1): about a third
        values["pp_microbatches"] = 2 * values["pp"]
    if values["pp_schedule"] in LOOPED_SCHEDULES and values["pp_stages_per_rank"] is None:
        values["pp_stages_per_rank"] = 2
    if values["pp"] > 1 and values["drop_last"] is None:
        values["drop_last"] = True
        notes.append("--pp: the last incomplete batch of each epoch is dropped (the stages' buffers hold one shape)")
    if values["activation_checkpointing"] is None:
        values["activation_checkpointing"] = "full" if values["grad_checkpointing"] else "none"
    values["grad_checkpointing"] = values["activation_checkpointing"] != "none"
    if values["compile_mode"] is not None:
        values["compile"] = True


def resolve_layout(values, notes):
    """The layout flags of a run's values (a dict, filled in place) resolved for its record (`Layout.of`, which
    Config.parallelism reads): the defaults, then the rules (the first problem is one line, exit 2)."""
    fill_layout_defaults(values, notes)
    check_layout(values)


def check_layout(values):
    """dlojz.py's layout rules on the parsed values: the first problem, in one line."""
    for problem in layout_problems(values):
        fail(problem)


def layout_problems(values):
    """Each problem of the layout flags with the run's other flags (a dict of values), as the line that says it:
    the tensor group's, the pipeline's, the sharding's."""
    if values["layout"] == "auto":
        yield from auto_layout_problems(values)
        return
    tp = values["tp"]
    if tp > 1 and not values["fsdp"]:
        # FSDP2 over the data dimension is PyTorch's way to replicate a model whose parameters are DTensors
        yield (
            f"--tp {tp} runs with --fsdp over the data dimension (2-D; a data dimension of 1 rank is plain tensor "
            "parallelism): add --fsdp (PyTorch's DDP does not take tensor-parallel parameters)"
        )
    if values["sequence_parallel"] and tp == 1:
        yield "--sequence-parallel splits the tokens over a tensor-parallel group: add --tp N (and --fsdp)"
    if values["check_replicas"] and tp == 1:
        yield "--check-replicas compares the weights a tensor-parallel group holds whole: add --tp N (and --fsdp)"
    if tp > 1 and values["loader_only"]:
        yield f"--tp {tp} splits the model, which --loader-only does not build: drop one of them"
    yield from pipeline_problems(values)
    yield from sharding_problems(values)


# What --layout auto chooses, what it takes from the run, said in each of its refusals
AUTO_CHOOSES = "--layout auto chooses --fsdp, --fsdp-replicate, --tp and --pp (it takes -b, --pp-microbatches and --activation-checkpointing from the run)"


def auto_layout_problems(values):
    """--layout auto beside the flags it chooses (each its own to set), and beside those that only say how a chosen
    layout runs (--sequence-parallel, --fsdp-offload, a pipeline's schedule...), which it may not choose: the line
    says what it chooses and takes. The other layout rules apply to the layout it picks (Layout.problems)."""
    chosen = {"--fsdp": values["fsdp"], "--tp": values["tp"] > 1, "--pp": values["pp"] > 1,
              "--fsdp-replicate": values["fsdp_replicate"] > 1}  # fmt: skip
    if any(chosen.values()):
        given = " and ".join(flag for flag, on in chosen.items() if on)
        yield f"{AUTO_CHOOSES}: drop {given}, or --layout auto and give the layout yourself"
    dependent = {
        "--sequence-parallel": values["sequence_parallel"],
        "--check-replicas": values["check_replicas"],
        "--fsdp-offload": values["fsdp_offload"],
        "--fsdp-reshard-after-forward/--no-fsdp-reshard-after-forward": values["fsdp_reshard_after_forward"]
        is not None,
        "--pp-schedule": values["pp_schedule"] != "1f1b",
        "--pp-stages-per-rank": values["pp_stages_per_rank"] is not None,
        "--pp-split": values["pp_split"] != "params",
    }
    for flag, given in dependent.items():
        if given:
            yield (
                f"{flag} says how a layout runs that --layout auto may not choose; {AUTO_CHOOSES}: drop {flag}, or "
                "--layout auto and give the layout yourself"
            )


def sharding_problems(values):
    """--fsdp's own flags, each with --fsdp; --float8 with --fsdp or alone;
    --fsdp-replicate's replicas out of the ranks the launcher gives (a single process is told at start-up)."""
    own = {
        "--fsdp-reshard-after-forward/--no-fsdp-reshard-after-forward": values["fsdp_reshard_after_forward"]
        is not None,
        f"--fsdp-replicate {values['fsdp_replicate']}": values["fsdp_replicate"] > 1,
        "--fsdp-offload": values["fsdp_offload"],
    }
    for flag, given in own.items():
        if given and not values["fsdp"]:
            yield f"{flag} without --fsdp: it says how --fsdp shards; add --fsdp"
    for flag, given in ((f"--tp {values['tp']}", values["tp"] > 1), (f"--pp {values['pp']}", values["pp"] > 1)):
        if given and values["float8"] is not None:  # torchao's float8 styles and stages: not applied here yet
            yield (
                f"--float8 {values['float8']} with {flag}: dlojz trains float8 linears without --tp and --pp (alone "
                "or with --fsdp); drop one"
            )
    launched = launch_world_size(os.environ)
    if launched > 1:
        problem = model_copy_problem(launched, values["pp"], values["tp"], values["fsdp_replicate"])
        if problem is not None:
            yield problem


# torch infers a pipeline stage's shapes again only after an eval -> train switch: a new resolution between two
# validations sends activations of another size than the next stage's buffers (gloo aborts; NCCL need not notice)
PIPELINE_RESIZING = (
    "the stages send activations of the shape they inferred at the first step, and progressive resizing changes it; "
    "train at one --image-size"
)


def pipeline_problems(values):
    """--pp: its own flags with --pp, what composes with the pipeline in dlojz.py, and the micro-batches."""
    pp = values["pp"]
    if pp == 1:
        counts = values["pp_microbatches"], values["pp_stages_per_rank"]
        if counts != (None, None) or values["pp_split"] != "params" or values["pp_schedule"] != "1f1b":
            yield (
                "--pp-schedule, --pp-microbatches, --pp-stages-per-rank and --pp-split set how --pp N cuts the "
                "model: add --pp N"
            )
        return
    if values["pp_schedule"] == "zero-bubble":  # its split backward runs after FSDP's reduction of the weights'
        yield (
            f"--pp {pp} --pp-schedule zero-bubble computes the weights' gradients apart, after FSDP has reduced them: "
            "use --pp-schedule interleaved (bench/pipeline_bubble.py measures zero-bubble without FSDP)"
        )
    if values["pp_stages_per_rank"] is not None and values["pp_schedule"] not in LOOPED_SCHEDULES:
        yield (
            f"--pp-stages-per-rank is the interleaved schedules' (several stages a rank): --pp-schedule "
            f"{values['pp_schedule']} holds one; add --pp-schedule interleaved or zero-bubble"
        )
    if not values["fsdp"]:
        # FSDP2 over the data dimension is the replication PyTorch's pipeline stages support (torchtitan's layout)
        yield (
            f"--pp {pp} runs with --fsdp over the data dimension (a data dimension of 1 rank is the pipeline "
            "alone): add --fsdp"
        )
    yield from pipeline_refusals(values)
    launched = launch_world_size(os.environ)  # (a single process is told at start-up, after the other flags)
    if launched > 1 and (problem := model_copy_problem(launched, pp, values["tp"])) is not None:
        yield problem  # first: the micro-batches' default follows --pp
        return
    yield from micro_batch_problems(values)


def pipeline_refusals(values):
    """The flags dlojz.py's pipeline does not take, each with why."""
    pp = values["pp"]
    refused = {
        "sequence_parallel": (values["sequence_parallel"], "the stages send whole activations, not token shards"),
        "loader_only": (values["loader_only"], "--loader-only does not build the model"),
        "min_res": (values["min_res"] is not None, PIPELINE_RESIZING),
        "mixup_alpha": (
            values["mixup_alpha"] > 0 or values["cutmix_alpha"] > 0,
            "the first and last stages would have to mix alike",
        ),
        "findlr": (values["findlr"], "the LR range test is not wired to the schedule's step"),
        "freeze_backbone_epochs": (bool(values["freeze_backbone_epochs"]), "the head is on the last stage alone"),
        "layer_decay": (values["layer_decay"] is not None, "the layers' depths are counted on one stage alone"),
    }
    for name, (given, why) in refused.items():
        if given:
            yield f"--pp {pp} with --{name.replace('_', '-')}: {why}; drop one of them"
    if values["drop_last"] is False:
        yield f"--pp {pp} with --no-drop-last: the stages' buffers hold one batch shape; drop --no-drop-last"
    if values["grad_acc"] > 1:
        yield (
            f"--pp {pp} with --grad-acc {values['grad_acc']}: the schedule already accumulates its micro-batches; for "
            f"the same global batch and memory give -b {values['batch_size']} x {values['grad_acc']} and "
            f"--pp-microbatches {values['grad_acc']} x M"
        )


def micro_batch_problems(values):
    """The pipeline's micro-batches against --pp, -b and the schedule's rounds, and --pp-split's cut."""
    pp, size, schedule = values["pp"], values["batch_size"], values["pp_schedule"]
    looped = schedule in LOOPED_SCHEDULES
    microbatches = values["pp_microbatches"] or 2 * pp
    if microbatches < pp:
        yield f"--pp-microbatches {microbatches}: at least --pp {pp}, or the last stages never start before the first ends"
    if size is not None and size % microbatches:
        yield f"--pp-microbatches {microbatches} must divide -b {size} (each micro-batch the same size)"
    rounds = max(1, microbatches // pp)  # PyTorch's looped schedules run the micro-batches in rounds of equal size
    if looped and microbatches % rounds:
        fits = [m for m in range(pp, (size or 0) + 1, pp) if size % m == 0]
        example = f" (e.g. {min(fits, key=lambda m: abs(m - microbatches))})" if fits else ""
        yield (
            f"--pp-microbatches {microbatches}: --pp-schedule {schedule} over --pp {pp} runs them in {rounds} rounds "
            f"of equal size; give a multiple of --pp {pp} that divides -b{example}"
        )
    split = values["pp_split"]
    stages = pp * ((values["pp_stages_per_rank"] or 2) if looped else 1)
    if split not in SPLITS:
        try:
            cuts = [int(part) for part in split.split(",")]
        except ValueError:
            cuts = None
        if cuts is None or len(cuts) != stages - 1:
            yield (
                f"--pp-split {split}: params, time, or {stages - 1} layer indices separated by commas (where stages "
                f"2 to {stages} start)"
            )
