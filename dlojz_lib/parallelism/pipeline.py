"""Pipeline parallelism (GPipe's and its successors' layout) on PyTorch's `torch.distributed.pipelining`: the model cut
into stages of consecutive layers, each rank holding one stage (or several, for the interleaved schedules), the
micro-batches flowing through them; the price is the bubble, the time a stage waits for the others.

- `pipeline_layers(model, arch)`: the model as the layers its forward runs one after another: the stem (patch
  embedding, class token and position embedding; a ResNet's first convolution and pooling), each block, the head
  (final norm, pooling, classifier), as the model's row of families.py gives them; a model of no family is one line
  (UserError).
- `stage_bounds(weights, n)`: where to cut the layers into n stages of balanced weight (parameters, or measured
  forward time: `layer_seconds`), each stage at least one layer.
- `Stage(model, layers, first, last)`: layers [first, last) of `model` as a module of their own, holding them under
  the model's own names (a stage's state dict is the model's, less the other stages' entries: the stages' state
  dicts together are an ordinary model's), the rest of the model dropped.
- `build_pipeline(model, cut, rank, device, group)`: this rank's stages (one, or several for the interleaved schedules: stages
  rank, rank + N, ...) as PyTorch's PipelineStages, and the schedule that runs them (`--pp-schedule`).
- `pipeline_step(runner, rank, ranks, images, labels)`: one step, each rank giving the schedule what its stages
  need (the images on the first, the labels on the last).
- `pipeline_eval(runner, rank, ranks, images, batch_size)`: a forward-only pass of any number of images (a
  validation's last batch too) through the schedule, padded to the training batch's shape (the stages' buffers are
  made for its micro-batches): the last stage's logits of the real images, None elsewhere.
- The bubble's clock, formula and toy: `dlojz_lib.parallelism.bubble`.
"""

import contextlib
import copy
import dataclasses
import hashlib
import itertools

import torch
from torch import nn

from dlojz_lib.checks import UserError
from dlojz_lib.model import families
from dlojz_lib.parallelism.bubble import StageClock, bubble_formula, expected_bubble, seconds_between, time_mark
from dlojz_lib.torch_internals import (
    child_slots,
    prune,
    recv_buffers_for_backward,
    schedule_forward_prepared,
    schedule_microbatches,
    share_own_tensors,
    take_own_tensors,
)

# --pp-schedule: PyTorch's class, and whether a rank holds several stages (looped: rank, rank + N, ...)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved": ("ScheduleInterleaved1F1B", True),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", True),
}


def pipeline_layers(model, arch="this model", family=None) -> list:
    """`model`'s forward as a list of Layers whose composition is the forward (eval or train mode alike): its
    family's stem, blocks and head (`family`: its row of model.families as the build resolved it; None: looked up)."""
    found = families.layers(model, family)
    if found is None:
        raise UserError(f"--pp: --arch {arch} has no pipeline split here: {families.names()} have one")
    return found


def owner(path, layers):
    """The index of the layer that owns parameter, buffer or module `path`: the one that names it or a module above
    it, else the head (the last)."""
    for index, layer in enumerate(layers[:-1]):
        if any(path == owned or path.startswith(owned + ".") for owned in layer.owns):
            return index
    return len(layers) - 1


def layer_sizes(model, layers) -> list:
    """Parameters each layer owns."""
    sizes = [0] * len(layers)
    for path, parameter in model.named_parameters():
        sizes[owner(path, layers)] += parameter.numel()
    return sizes


def layer_seconds(model, layers, sample, repeats=3) -> list:
    """Each layer's forward time on `sample` (a micro-batch's images, on the device that times them), the median of
    `repeats` after a warm-up: on a GPU by CUDA events read once at the end, on the CPU by the host clock. One layer's
    weights on the device at a time (moved there for its timing, then back): a model cut because it does not fit on
    one GPU is timed whole. Start-up work, not a step's."""
    device = sample.device
    cuda = device.type == "cuda"
    owned = [[] for _ in layers]
    for path, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        owned[owner(path, layers)].append(tensor)
    marks = []  # per layer, its timed runs' (start, end)
    x = sample
    with torch.no_grad():
        for layer, tensors in zip(layers, owned):
            homes = [tensor.data for tensor in tensors]
            for tensor in tensors:
                tensor.data = tensor.data.to(device)
            try:
                runs = []
                for attempt in range(1 + repeats):
                    start = time_mark(cuda)
                    y = layer.run(x)
                    if attempt:
                        runs.append((start, time_mark(cuda)))
            finally:
                for tensor, home in zip(tensors, homes):
                    tensor.data = home
            marks.append(runs)
            x = y
        if cuda:
            torch.cuda.synchronize(device)  # once: the events' times are read below
    seconds = [sorted(seconds_between(start, end, cuda) for start, end in runs) for runs in marks]
    return [column[len(column) // 2] for column in seconds]


def stage_bounds(weights, n) -> list:
    """Cut points [(first, last), ...] splitting `weights` (one per layer) into n runs of consecutive layers, each
    non-empty, whose largest sum is the smallest possible (a stage as slow as the slowest sets the pace)."""
    count = len(weights)
    if n > count:
        raise UserError(f"--pp {n}: the model has {count} layers (stem, blocks, head): give a --pp of {count} or less")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the smallest largest-stage for the first i layers cut into k stages; cut[k][i]: where its last starts
    best = [[float("inf")] * (count + 1) for _ in range(n + 1)]
    cut = [[0] * (count + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for i in range(k, count - (n - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, end = [], count
    for k in range(n, 0, -1):
        start = cut[k][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def bounds_at(cuts, count, n):
    """[(first, last), ...] for stages starting at layers `cuts` (the first stage at 0), one line if they do not make
    n non-empty stages of the `count` layers."""
    if len(cuts) != n - 1 or list(cuts) != sorted(set(cuts)) or not all(0 < c < count for c in cuts):
        raise UserError(
            f"--pp-split {','.join(map(str, cuts))}: {n - 1} increasing layer indices between 1 and {count - 1} "
            f"(where stages 2 to {n} start; layer 0 is the stem, {count - 1} the head)"
        )
    starts = [0, *cuts, count]
    return list(zip(starts[:-1], starts[1:]))


def stage_copy(model, layers, first, last):
    """A copy of `model` for the stage of layers [first, last): its own parameters and buffers copied, the others'
    meta tensors in their place (no memory; Stage prunes them), so that a rank's stages cost their own size in host
    memory, not the whole model's each."""
    mine = range(first, last)
    memo = {}
    for path, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if owner(path, layers) not in mine:
            empty = tensor.detach().to("meta")
            memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def stage_seed(seed, index, call):
    """The seed of stage `index`'s `call`-th training forward: every stage draws its own random numbers (dropout,
    stochastic depth), where ranks seeded alike would draw the same masks on every stage; a function of the run's
    seed and the training step (not a stream kept apart), so a resumed run draws what the uninterrupted one did."""
    digest = hashlib.blake2b(f"{seed}:{index}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # (torch.manual_seed takes 63 bits)


class ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous (a stage's input gradient is sent as it is; a
    hook would pile up on the receive buffer the schedule gives every step)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gradient):
        return gradient.contiguous()


class Stage(nn.Module):
    """Layers [first, last) of `model` (a model of its own: the rest of it is dropped) as one module, holding the
    model's top-level modules that kept parameters or buffers, and its own, under their own names. `recompute`
    (--grad-checkpointing, --activation-checkpointing): each layer's activations are dropped after its forward and
    computed again in the backward (PyTorch's non-reentrant checkpoint), its input alone kept (True or "full"), or
    all but its costly ops' outputs ("selective"); `every`: the stage's 1st layer, its every+1-th... only. `seed`: each training forward draws from
    stage_seed(seed, index, its count), the process's own generators left as they were (the data's, the schedule's
    draws); the same on a stage's tensor peers and data replicas, other on each stage."""

    def __init__(self, model, layers, first, last, recompute=False, seed=None, index=0, every=1):
        super().__init__()
        self.seed, self.index, self.calls = seed, index, 0
        self.numbered = None  # the draws of the micro-batch the schedule runs now (number_forwards), else None
        mine = range(first, last)
        prune(model, lambda path: owner(path, layers) in mine)
        for name, child in child_slots(model).items():
            if child is not None and any(True for _ in itertools.chain(child.parameters(), child.buffers())):
                self.add_module(name, child)
        take_own_tensors(self, model)
        # The layers' forwards read the model's own parameters (a ViT's class token): one registry for both, so that
        # what FSDP puts on the stage (its shards, then the gathered parameters in a forward) is what they read.
        share_own_tensors(model, self)
        self.runs = [layer.run for layer in layers[first:last]]
        self.names = [layer.name for layer in layers[first:last]]
        object.__setattr__(self, "model", model)  # the layers' forwards read it; not a submodule (no name prefix)
        self.recompute_layers(recompute, every)

    def recompute_layers(self, mode, every=1):
        """Each layer (the 1st, the every+1-th...) recomputed in the backward from its input (True or "full"), or
        all but its costly ops' outputs ("selective"); False or "none": kept. The unit pass's checkpointing of a
        stage (parallelism.layout.parallelize_unit)."""
        if mode in (False, "none"):
            return
        from dlojz_lib.model.recompute import recomputed, without_inplace_activations

        if mode == "selective":  # (what selective keeps, an in-place activation would write into)
            without_inplace_activations(self)
        # the recomputation leaves BatchNorm's statistics as the forward left them: a micro-batch counted once
        self.runs = [
            recomputed(run, self.model, selective=mode == "selective") if k % every == 0 else run
            for k, run in enumerate(self.runs)
        ]

    def forward(self, x):
        if self.seed is None or not self.training:
            return self.run_layers(x)
        # a forward the schedule does not number (torch's shape inference after an eval -> train switch) draws as
        # the next micro-batch will, and moves no count
        number = self.calls if self.numbered is None else self.numbered
        devices = [x.device] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the generators as they were, once the stage has drawn
            torch.manual_seed(stage_seed(self.seed, self.index, number))
            return self.run_layers(x)

    def run_layers(self, x):
        if x.requires_grad:  # what goes back to the previous stage: the send takes contiguous tensors only
            x = ContiguousGradient.apply(x)
        for run in self.runs:
            x = run(x)
        return x.contiguous()  # the next stage's input (a layer may end on a transposed view: a family's stem)

    def seek(self, calls):
        """Go on as after `calls` training forwards of micro-batches (a resumed run: its steps x the micro-batches)."""
        self.calls = calls

    def train(self, mode=True):
        self.model.train(mode)  # the dropped parts' flags too, as the layers' forwards may read the model's
        return super().train(mode)


def number_forwards(pipeline_stage, stage):
    """The training forwards the schedule runs through `pipeline_stage` (one a micro-batch: `forward_one_chunk`)
    numbered in `stage`'s count, the draws of each a function of (step, micro-batch); a forward the schedule runs
    for its own ends (shape inference after every eval -> train switch, which a resumed run need not repeat) is
    not counted."""
    forward = pipeline_stage.forward_one_chunk

    def numbered(*args, **kwargs):
        if not stage.training:
            return forward(*args, **kwargs)
        stage.numbered = stage.calls
        stage.calls += 1
        try:
            return forward(*args, **kwargs)
        finally:
            stage.numbered = None

    pipeline_stage.forward_one_chunk = numbered  # this stage's own: the schedule calls it


class RankStages(nn.Module):
    """The stages a rank holds under the interleaved schedules (stages rank, rank + N, ...; each a Stage of its
    own, as PyTorch's schedules run them) as one module under the model's own names, for what sees the rank's part
    of the model whole: the optimizer, the checkpoint, the clip. Built once the stages are wrapped (FSDP's sharded
    parameters are the ones it holds); a container (a ViT's `blocks`) that several stages hold a part of is merged,
    entry by entry."""

    def __init__(self, stages):
        super().__init__()
        for stage in stages:
            for name, child in child_slots(stage).items():
                mine = child_slots(self).get(name)
                if mine is None:
                    self.add_module(name, child)
                    continue
                if mine is child:
                    continue
                if not isinstance(mine, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or type(mine) is not type(child):
                    raise ValueError(f"stages hold two {name}s that are not containers of layers")
                if not getattr(mine, "_merged", False):  # a merged copy of the first stage's, so as not to change it
                    merged = type(mine)()
                    child_slots(merged).update(child_slots(mine))
                    merged._merged = True
                    child_slots(self)[name] = mine = merged
                for key, entry in child_slots(child).items():
                    if entry is not None:
                        child_slots(mine)[key] = entry
            take_own_tensors(self, stage)


def is_meta(module) -> bool:
    return any(tensor.is_meta for tensor in itertools.chain(module.parameters(), module.buffers()))


@contextlib.contextmanager
def state_kept(model, device):
    """A forward the training loop does not own (timing) in training mode, as the run will train: afterwards the
    model's buffers (BatchNorm's statistics and counts) and the random generators (drop-path's draws) are as they
    were before it, as torch's own shape inference leaves them."""
    kept = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


def time_layers(model, arch, sample, device, autocast_dtype=None, family=None) -> list:
    """Each layer's forward time on `sample` (a micro-batch in the run's memory format, under autocast to
    `autocast_dtype` when given), measured on this rank and summed over the world: every rank of the world must cut
    alike, the other data replicas' and tensor peers' pipelines as this one, or their sends would not meet. A model
    on the meta device (shapes only: --fsdp's ranks but the first) adds nothing. `family`: as pipeline_layers'."""
    layers = pipeline_layers(model, arch, family)
    if is_meta(model):
        seconds = [0.0] * len(layers)
    else:  # (no cache of the weights' casts: each layer's weights leave the device once timed)
        with (
            torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None, cache_enabled=False),
            state_kept(model, device),
        ):
            seconds = layer_seconds(model, layers, sample.to(device))  # (the model stays where it is)
    seconds = torch.tensor(seconds, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(seconds)  # over the world: one cut for every replica and tensor peer
    return seconds.tolist()


@dataclasses.dataclass(frozen=True)
class PipelineCut:
    """How a model is cut into stages and run: what --pp, --pp-schedule, --pp-microbatches, --pp-stages-per-rank and
    --pp-split say, and what each stage does (see Stage). `split`: "params" (balanced by parameters), "time" (by
    each layer's forward time on `sample`: time_layers, summed over the world), or the layers where stages 2, 3...
    start; `layer_weights`: the layers' weights to balance, measured beforehand (time_layers' before the model
    turned meta), instead. `wrap`: called on each Stage before PyTorch's PipelineStage takes it (dlojz.py's unit pass:
    the tensor plan, the stage's recomputation, compile and FSDP over the data dimension)."""

    pp: int
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int = 1
    split: object = "params"
    layer_weights: list | None = None
    sample: object = None
    autocast_dtype: object = None
    seed: int | None = None
    wrap: object = None


class MicroBatchLoss:
    """The schedule's loss on the last stage: `criterion` (the run's training loss, given once it is built, before
    the first step), each micro-batch's loss divided by their number (its share of the step's mean: the gradients
    need no scaling after the backward, a loop over the parameters that torch's `scale_grads` would run; a step's
    gradients are the mean over its images, as one process's)."""

    def __init__(self, microbatches, criterion=None):
        self.microbatches, self.criterion = microbatches, criterion

    def __call__(self, outputs, targets):
        return self.criterion(outputs, targets) / self.microbatches


def build_pipeline(model, cut, rank, device, group=None):
    """This rank's stages of `model` (a `model.build.BuiltModel`: its module, name and family) cut into pp x
    stages_per_rank stages (`cut`, a PipelineCut; each stage a copy of the module pruned to its layers), as
    PipelineStages over `group`, and the schedule running `cut.microbatches` micro-batches through them. A model on
    the meta device is cut as it is: its stages are given storage by the caller. Returns (the schedule, the Stages,
    its MicroBatchLoss, whose criterion the caller gives before the first step)."""
    from torch.distributed import pipelining

    module, arch, family = model.module, model.arch, model.family
    class_name, looped = SCHEDULES[cut.schedule]
    per_rank = cut.stages_per_rank if looped else 1
    total = cut.pp * per_rank
    layers = pipeline_layers(module, arch, family)
    if looped and total > len(layers):
        raise UserError(
            f"--pp {cut.pp} x --pp-stages-per-rank {per_rank} = {total} stages: the model has {len(layers)} layers "
            "(stem, blocks, head): give fewer stages"
        )
    if cut.layer_weights is not None:
        bounds = stage_bounds(cut.layer_weights, total)
    elif cut.split == "params":
        bounds = stage_bounds(layer_sizes(module, layers), total)
    elif cut.split == "time":
        bounds = stage_bounds(time_layers(module, arch, cut.sample, device, cut.autocast_dtype, family), total)
    else:
        bounds = bounds_at(cut.split, len(layers), total)
    modules, stages = [], []
    for index in range(rank, total, cut.pp):
        copied = stage_copy(module, layers, *bounds[index])
        own_layers = pipeline_layers(copied, arch, family)
        stage = Stage(copied, own_layers, *bounds[index], seed=cut.seed, index=index)
        stage = stage if is_meta(stage) else stage.to(device)  # (a meta model: its owner gives it storage)
        if cut.wrap is not None:
            cut.wrap(stage)
        modules.append(stage)
        stages.append(pipelining.PipelineStage(stage, index, total, device, group=group))
        number_forwards(stages[-1], stage)
    loss = MicroBatchLoss(cut.microbatches)
    runner = getattr(pipelining, class_name)
    held = stages if looped else stages[0]
    return runner(held, cut.microbatches, loss_fn=loss, scale_grads=False), modules, loss


def pipeline_step(runner, rank, ranks, images, labels):
    """One step of the schedule on this rank: the first stage's rank gives the images, the last's the labels (it
    computes the loss); returns the last stage's outputs (the micro-batches' merged) and losses, each micro-batch's
    share of the step's mean (their sum is the mean loss; None and [] elsewhere)."""
    losses = []
    outputs = runner.step(*(images,) if rank == 0 else (), target=labels if rank == ranks - 1 else None, losses=losses)
    return outputs, losses


def pipeline_eval(runner, rank, ranks, images, batch_size):
    """The logits of `images` (at most `batch_size`, the training batch) on the last stage's rank, None elsewhere: a
    forward-only pass of the schedule on the images padded with zeros to `batch_size`, the padding's logits dropped.
    Every rank calls it with the same number of images (the other ranks' `images` only give that number)."""
    count = images.shape[0]
    if count > batch_size:
        raise ValueError(f"{count} images for a pipeline built for batches of {batch_size}")
    if rank == 0 and count < batch_size:
        images = torch.cat([images, images.new_zeros((batch_size - count, *images.shape[1:]))])
    last = rank == ranks - 1
    # the schedule computes its loss on the last stage: placeholder labels, a loss nobody reads
    target = torch.zeros(batch_size, dtype=torch.long, device=images.device) if last else None
    first_step = not schedule_forward_prepared(runner)
    outputs = runner.eval(*(images,) if rank == 0 else (), target=target)
    if first_step:
        recv_buffers_for_backward(runner)  # the training steps after it send gradients back through them
    return outputs[:count] if last else None


class PipelineRun(nn.Module):
    """The pipeline as dlojz.py trains and validates with it (--pp): this rank's stages (`stages`, FSDP-sharded over
    the data dimension: one, or several under the interleaved schedules) of a model cut over `pp` ranks, the
    schedule running them (`runner`, with its MicroBatchLoss `loss`), the pipeline's process group. Validation calls
    it like a model; `train()`, `eval()` and `buffers()` are its stages'."""

    def __init__(self, runner, stages, loss, pipe_rank, pp, group, batch_size, num_classes):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.runner, self.micro_batch_loss, self.pipe_rank, self.pp, self.group = runner, loss, pipe_rank, pp, group
        self.batch_size, self.num_classes = batch_size, num_classes
        self.clock, self.steps = None, []  # time_steps(): the stage's compute, and each step's marks

    def time_steps(self, device, schedule, microbatches, stages_per_rank=1):
        """Keep each step's length and this rank's compute in it (time marks: CUDA events on a GPU, read at the run's
        end, so no step waits for the host), for `bubble_report` (the chronometer's runs, --test)."""
        self.clock, self.schedule, self.microbatches = StageClock(self.runner, device), schedule, microbatches
        self.stages_per_rank = stages_per_rank

    @property
    def last(self):
        return self.pipe_rank == self.pp - 1

    def give_loss(self, criterion):
        """The training loss the schedule computes on the last stage, given once it is built (dlojz_lib.optim.training),
        before the first step. (A method, not an attribute: nn.Module would keep a loss module as a submodule.)"""
        self.micro_batch_loss.criterion = criterion

    def step(self, images, targets):
        """One training step of the schedule (forwards, backwards, gradients reduced over the data dimension by
        FSDP); returns (the batch's mean loss, its accuracy) on every rank of the pipeline: the last stage's, which
        alone has them, summed with the other stages' zeros by one all-reduce of two numbers (stream-ordered on a
        GPU: no wait for the host)."""
        from dlojz_lib.optim.losses import soft_target_accuracy

        start = time_mark(self.clock.cuda) if self.clock is not None else None
        outputs, losses = pipeline_step(self.runner, self.pipe_rank, self.pp, images, targets)
        if self.clock is not None:
            self.steps.append((start, time_mark(self.clock.cuda), self.clock.take_spans()))
        figures = torch.zeros(2, device=images.device)
        if self.last:
            with torch.no_grad():
                accuracy = soft_target_accuracy(outputs, targets)
                figures = torch.stack([torch.stack(losses).sum().detach().float(), accuracy.float()])  # shares
        torch.distributed.all_reduce(figures, group=self.group)
        return figures[0], figures[1]

    def seek(self, global_step):
        """Each stage's random draws as after `global_step` training steps of the schedule's micro-batches."""
        for stage in self.stages:
            stage.seek(global_step * schedule_microbatches(self.runner))

    def forward(self, images):
        """Validation's forward: the logits of `images` on every rank of the pipeline, computed by the schedule in
        pieces of at most the training batch (its stages' buffers are made for it) and broadcast from the last."""
        pieces = []
        for piece in images.split(self.batch_size):
            logits = pipeline_eval(self.runner, self.pipe_rank, self.pp, piece, self.batch_size)
            if logits is None:
                logits = torch.empty(piece.shape[0], self.num_classes, device=piece.device)
            logits = logits.float().contiguous()
            torch.distributed.broadcast(logits, group=self.group, group_src=self.pp - 1)
            pieces.append(logits)
        return torch.cat(pieces)

    def bubble_report(self, ranks):
        """(a line, its figures): each stage's compute and idle time per step (the medians over the timed steps after
        the first, which makes the stages' buffers), the bubble (the largest idle share of a step) beside its
        formula. Every rank calls it (it gathers the stages' times)."""
        import statistics

        if self.clock.cuda:
            torch.cuda.synchronize()  # the run's end: the last events recorded
        timed = self.steps[1:] or self.steps
        cuda = self.clock.cuda
        busy = statistics.median(sum(seconds_between(a, b, cuda) for a, b in spans) for _, _, spans in timed)
        step = statistics.median(seconds_between(start, end, cuda) for start, end, _ in timed)
        stages = ranks.all_gather((self.pipe_rank, busy, step))[: self.pp]  # the first pipeline's ranks
        rows = [dict(stage=i + 1, compute_s=b, step_s=t, idle_share=max(0.0, 1 - b / t)) for i, b, t in stages]
        bubble = max(row["idle_share"] for row in rows)
        expected = expected_bubble(self.pp, self.microbatches, self.stages_per_rank)
        what = "rank" if self.stages_per_rank > 1 else "stage"  # a rank's stages are timed together
        line = (
            f"pipeline ({self.schedule}, {self.pp * self.stages_per_rank} stages on {self.pp} ranks, "
            f"{self.microbatches} micro-batches; medians of {len(timed)} steps): "
            + "; ".join(
                f"{what} {r['stage']} computes {r['compute_s'] * 1e3:.1f} ms of a {r['step_s'] * 1e3:.1f} ms step "
                f"(idle {r['idle_share']:.0%})"
                for r in rows
            )
            + f"; bubble {bubble:.2f} (the largest idle share), {expected:.2f} by {bubble_formula(self.stages_per_rank)}; "
            "the "
            "chronometer's forward below is the schedule's whole step"
        )
        return line, dict(stages=rows, bubble=bubble, expected_bubble=expected, schedule=self.schedule)

    def norm_across_stages(self, norm):
        """The gradients' global norm from this stage's: the squares summed over the pipeline."""
        squared = norm.double() ** 2
        torch.distributed.all_reduce(squared, group=self.group)
        return squared.sqrt().to(norm.dtype)


def micro_batch_problem(module, arch, batch_size, microbatches):
    """Why a pipeline cannot take -b `batch_size` in `microbatches` for `module` (a meta model will do), or None: a
    BatchNorm model's micro-batches hold 2 images or more (its training statistics of one image fail in its first
    forward). What the run refuses and what `--layout auto` leaves out."""
    if batch_size // microbatches > 1:
        return None
    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)
    if not any(isinstance(m, norms) for m in module.modules()):
        return None
    return (
        f"-b {batch_size} in --pp-microbatches {microbatches}: micro-batches of 1 image, whose statistics "
        f"{arch}'s BatchNorm cannot take; give -b {2 * microbatches} or more, or --pp-microbatches "
        f"{batch_size // 2 if batch_size >= 2 else 1} (2 images or more a micro-batch)"
    )
