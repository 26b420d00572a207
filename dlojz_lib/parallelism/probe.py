"""`dlojz_lab.py plan --probe FILE`: the planner's figures measured where the job runs instead of a data sheet's,
saved in FILE and reused by the next plans of the same model, batch and ranks.

- `compute_seconds(model, images, labels, steps, device, amp)`: the median seconds of one training step (forward
  and backward) of the model alone; the FLOPs of its images over them are the FLOP/s it reaches at its own shapes
  and dtype, typically a third to a half of a GPU's peak, all of it on a CPU rank.
- `link_seconds(group, device, elements, steps)`: the median seconds of one all-reduce of `elements` float32 over
  `group`: a small one is a collective's latency, a large one its bandwidth.
- `measure(settings, device, groups)`: the figures (`Allocation`'s names: tflops, nvlink_gbs, latency_us,
  network_gbs, network_latency_us, overlap): the model's step; each group's links (inside a node: its node's ranks;
  across: all of them); the share of a large all-reduce a step hides when both run at once.
- `measure_job(settings)`: the figures of a launch's slowest rank (one process: its compute alone).
- `probed(path, settings, world, measure_here, say, rank)`: FILE's figures when it was measured for the same model, image
  size, batch, dtype and ranks; else measured and saved (atomically); one line for a file that is not a probe's.

The figures replace the data sheet's in the roofline (`plan.estimate`); what they leave out (the smaller products of
a tensor-parallel rank, a pipeline's schedule beyond its bubble) is what bench/plan_vs_runs.py's errors show.
"""

import datetime
import json
import os
import socket
import statistics
import time
from pathlib import Path

from dlojz_lib.checks import fail

PROBE_FORMAT = 1
SMALL_ELEMENTS = 256  # a 1 KiB all-reduce: its time is the collective's latency
LARGE_ELEMENTS = 16 * 2**20  # a 64 MiB one: its time is the link's bandwidth
FIGURES = ("tflops", "nvlink_gbs", "latency_us", "network_gbs", "network_latency_us", "overlap")


def timed(run, steps, device):
    """The median seconds of `run()` over `steps` calls after a warm-up one (the device waited for at each end)."""
    import torch

    seconds = []
    for _ in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def training_step(model, images, labels, device, amp):
    """One forward and backward of `model` on `images`, under bfloat16 autocast where `amp` (as dlojz.py's)."""
    import torch

    def step():
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()

    return step


def link_seconds(group, device, elements, steps):
    """The median seconds of an all-reduce of `elements` float32 over `group` (None: every rank)."""
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(elements, device=device)
    return timed(lambda: dist.all_reduce(buffer, group=group), steps, device)


def link_figures(group, size, device, steps=5) -> tuple:
    """(GB/s a rank sends, a collective's latency in µs, the large all-reduce's seconds) over `group` of `size`
    ranks: a ring all-reduce sends 2 (n - 1) / n of its buffer; the latency is the small all-reduce's time less its
    bytes at that bandwidth."""
    large = link_seconds(group, device, LARGE_ELEMENTS, steps)
    small = link_seconds(group, device, SMALL_ELEMENTS, steps * 4)
    ring = 2 * (size - 1) / size
    gbs = ring * 4 * LARGE_ELEMENTS / large / 1e9
    return gbs, max(0.0, small - ring * 4 * SMALL_ELEMENTS / (gbs * 1e9)) * 1e6, large


def measure(settings, device, groups=None, steps=3) -> dict:
    """This rank's figures for `settings` (the plan's LayoutTable) on `device`: the FLOP/s of a step of the model at
    -b images; with `groups` ({"node": (group, size), "world": (group, size)} of a started process group, "world"
    only across nodes), each link's bandwidth and latency and the overlap. Only the figures measured are returned."""
    import torch

    from dlojz_lib.model.zoo import create_model, train_flops_per_image

    torch.manual_seed(0)
    b = settings.batch_size
    model = create_model(settings.arch, settings.num_classes, False, settings.image_size).to(device)
    images = torch.randn(b, 3, settings.image_size, settings.image_size, device=device)
    labels = torch.randint(0, settings.num_classes, (b,), device=device)
    step = training_step(model, images, labels, device, amp=settings.amp_bytes == 2 and device.type == "cuda")
    seconds = timed(step, steps, device)
    figures = {"tflops": train_flops_per_image(model, settings.image_size) * b / seconds / 1e12}
    large = {}  # each group's large all-reduce, in seconds
    for name, (gbs, latency) in (
        ("node", ("nvlink_gbs", "latency_us")),
        ("world", ("network_gbs", "network_latency_us")),
    ):
        if groups and name in groups:
            figures[gbs], figures[latency], large[name] = link_figures(*groups[name], device)
    if groups:
        import torch.distributed as dist

        name = "world" if "world" in groups else "node"
        (group, _), alone = groups[name], large[name]  # (the overlap over the widest group's links)
        buffer = torch.zeros(LARGE_ELEMENTS, device=device)

        def both():  # the all-reduce in flight while the step computes
            work = dist.all_reduce(buffer, group=group, async_op=True)
            step()
            work.wait()

        hidden = seconds + alone - timed(both, steps, device)
        figures["overlap"] = min(1.0, max(0.0, hidden / min(seconds, alone)))
    return figures


def measure_job(settings) -> tuple:
    """(the figures of the job's slowest rank, this rank, the world): one process measures its device's compute
    alone; the ranks of a torchrun or srun launch (a process group started here: NCCL on their GPUs, else gloo) also
    their node's links and, over several nodes, the links across."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    if world == 1:
        return measure(settings, torch.device("cuda" if cuda else "cpu")), 0, 1
    import torch.distributed as dist

    rank, per_node = int(os.environ["RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))  # (the node's cores shared out)
        dist.init_process_group("gloo")
    nodes = world // per_node
    node_groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
    groups = {"node": (node_groups[rank // per_node], per_node)} if per_node > 1 else {}
    if nodes > 1:
        groups["world"] = (None, world)
    figures = measure(settings, device, groups)
    everyone = [None] * world
    dist.all_gather_object(everyone, figures)
    dist.destroy_process_group()
    slowest = {key: (max if "latency" in key else min)(found[key] for found in everyone) for key in figures}
    return slowest, rank, world


def probe_key(settings, world) -> dict:
    """What a probe file's figures hold for: the model, its images, the batch, the dtype and the ranks."""
    return dict(
        arch=settings.arch, image_size=settings.image_size, batch_size=settings.batch_size,
        amp_bytes=settings.amp_bytes, ranks=world,
    )  # fmt: skip


def read_probe(path) -> dict:
    """A probe file's record; one line naming it for one that is not."""
    try:
        record = json.loads(Path(path).read_text())
        if record.get("format") != PROBE_FORMAT or not set(record["figures"]) <= set(FIGURES):
            raise ValueError("not written by dlojz_lab.py plan --probe")
        return record
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        fail(f"--probe {path}: not a probe file ({error}): delete it, or name another file to measure into")


def probed(path, settings, world, measure_here, say=print, rank=0) -> dict:
    """The figures of `path` where it was measured for `settings` on `world` ranks; else `measure_here()`'s, saved
    there by rank 0 (its folder made; written to a temporary name, then renamed: a probe cut short leaves the old
    file)."""
    path = Path(path)
    key = probe_key(settings, world)
    if path.exists():
        record = read_probe(path)
        if record["key"] == key:
            say(
                f"--probe {path}: the figures measured {record['measured']} on {record['host']}; delete it to measure again"
            )
            return record["figures"]
        say(f"--probe {path}: measured for {record['key']}, not {key}: measuring again")
    started = time.perf_counter()
    figures = measure_here()
    if rank != 0:
        return figures
    measured = datetime.datetime.now().isoformat(timespec="seconds")
    record = dict(format=PROBE_FORMAT, measured=measured, host=socket.gethostname(), key=key, figures=figures)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, path)
    say(f"--probe {path}: measured in {time.perf_counter() - started:.1f} s, saved")
    return figures
