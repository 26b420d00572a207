"""The pipeline's bubble, the time a stage waits for the others: each rank's compute clock (`StageClock`), the
formula it is measured against (`expected_bubble`, `bubble_formula`), and a toy of known compute time
(`paused_toy`: each layer pauses, twice as long in its backward), with which the formula shows on any machine
(bench/pipeline_bubble.py).
"""

import time

import torch
from torch import nn

from dlojz_lib.torch_internals import schedule_stages


def time_mark(cuda):
    """A point in time: a recorded CUDA event on a GPU (no wait), the host clock on the CPU."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start, end, cuda):
    """Seconds between two time_marks (on a GPU, once their events are done)."""
    return start.elapsed_time(end) / 1e3 if cuda else end - start


class StageClock:
    """The compute time of the PipelineStages a schedule (`runner`) runs on this rank: each call of the
    per-micro-batch methods the schedules run (forward, backward, the weights' backward) timed, on a GPU by CUDA
    events read once a step (`busy_seconds`, after the step's synchronisation), on the CPU by the host clock."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, runner, device):
        self.cuda = device.type == "cuda"
        self.spans = []  # this step's (start, end) time_marks
        stages = schedule_stages(runner)  # PyTorch's schedules keep their stages privately
        for stage in stages:
            for name in self.METHODS:
                setattr(stage, name, self.timed(getattr(stage, name)))  # this stage's own: the schedule calls it

    def timed(self, method):
        def run(*args, **kwargs):
            start = time_mark(self.cuda)
            try:
                return method(*args, **kwargs)
            finally:
                self.spans.append((start, time_mark(self.cuda)))

        return run

    def take_spans(self):
        """This step's (start, end) time marks, and a new step begins."""
        spans, self.spans = self.spans, []
        return spans

    def busy_seconds(self):
        """This step's compute seconds, and a new step begins (on a GPU, once the step's work is done)."""
        return sum(seconds_between(start, end, self.cuda) for start, end in self.take_spans())


def expected_bubble(ranks, microbatches, stages_per_rank=1):
    """The idle share of a GPipe or 1F1B step over `ranks` stages (Huang et al. 2019; Narayanan et al. 2021),
    (N - 1) / (M + N - 1); interleaved, V stages a rank: (N - 1) / (V M + N - 1)."""
    return (ranks - 1) / (stages_per_rank * microbatches + ranks - 1)


def bubble_formula(stages_per_rank=1):
    """expected_bubble's formula, as the lines that print it write it."""
    return "(N - 1) / (M + N - 1)" if stages_per_rank == 1 else "(N - 1) / (V M + N - 1)"


class Pause(torch.autograd.Function):
    """Compute that takes a known time whatever the machine: a pause (no CPU used) of `seconds`, twice as long in
    the backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        time.sleep(seconds)
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class Paused(nn.Linear):
    """A Linear layer whose forward pauses `seconds_per_image` an image (its backward twice as long)."""

    def __init__(self, width, seconds_per_image):
        super().__init__(width, width)
        self.seconds_per_image = seconds_per_image

    def forward(self, x):
        return Pause.apply(super().forward(x), self.seconds_per_image * x.shape[0])


def paused_toy(layers, width, seconds_per_image):
    """An nn.Sequential of `layers` Paused layers: `width` features in, `width` classes out."""
    return nn.Sequential(*(Paused(width, seconds_per_image) for _ in range(layers)))
