"""The project's prepared check of the paths a CPU cannot run, in one command for a lent H100/H200 (about 6 minutes
without DALI, 9 with it); on the CPU it runs the checks that can run there (the suite runs them).

    python bench/gpu_checks.py [--device cuda|cpu] [--only NAME,...] [--json FILE] [--quick] [--data FOLDER]

Each check prints one row (ok, FAILED or skipped with why) and its figures; the JSON holds them all, with the GPU,
torch and DALI versions and the date. Exit 1 if a check failed.

- selective_policy: activation checkpointing's selective policy under bfloat16 autocast (a ViT's blocks and a
  ResNet's stages): the backward runs as many matrix products, convolutions and attentions as without
  checkpointing (none recomputed); the negative control, full checkpointing, runs more.
- meta_fill: --fsdp's start (the model on the meta device, given storage on the device and filled from the first
  rank's values, fsdp.to_meta / fill_from_first_rank) on a process group of one (NCCL on a GPU): the model's
  parameters and buffers exactly.
- fsdp_compile: --fsdp --compile (each block compiled, FSDP's hooks around them) on a group of one: two SGD steps'
  losses and weights equal eager FSDP's (within float32 tolerance).
- fsdp_offload (GPU): --fsdp-offload (FSDP2's CPUOffloadPolicy) against --fsdp on a group of one, a ViT-B/16 a few
  SGD steps: the same losses, a smaller GPU peak, and each one's step time.
- float8: --float8 against bfloat16 on a ViT-L/16 at 224 px, batch 64 (GPU), both under --compile: unsynchronised
  img/s, the peak GPU bytes and the losses of a few SGD steps for bfloat16, tensorwise and rowwise (the losses within
  10 % of bfloat16's); on the CPU a ViT-B/16 at 32 px in eager mode, tensorwise only (a check of the numerics).
- dali_loader: loader-only img/s of DALI's training pipeline for --dali-decode roi and whole, --dali-threads 6 and
  12 (the rows that decide --dali-decode's GPU default and --dali-pad-channels'); on the CPU 1 thread, roi and whole.
- dali_memory (GPU): DALI's GPU bytes and this process's resident host bytes (pinned buffers included) after the
  build, after the first batch and after the twentieth (prefetch done), and NVML's JPEG engine utilisation while
  the loader runs.
- dali_lifetimes (GPU): each batch's buffers kept until the step that read it has run (BatchLifetimes): sums taken
  later on the training stream equal sums taken at once; the negative control lets each batch go at once and says
  whether the sums then differ.
- seams (GPU): bench/gpu_seams.py's checks (a stage's draws, the cut by time, the whole copies).
"""

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dlojz_lib.model.recompute import checkpoint_blocks  # noqa: E402
from dlojz_lib.model.zoo import create_model  # noqa: E402


class Skipped(Exception):
    """A check that cannot run here: its reason is the row."""


def counted_costly_ops(model, images, autocast_type):
    """{"forward": n, "backward": n}: the matrix products, convolutions and attentions one training step runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dlojz_lib.torch_internals import costly_ops

    costly = {op for op in costly_ops() if op.namespace == "aten"}
    counts = {"forward": 0, "backward": 0}
    phase = ["forward"]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[phase[0]] += func in costly
            return func(*args, **(kwargs or {}))

    with Count():
        with torch.autocast(autocast_type, dtype=torch.bfloat16):
            loss = model(images).float().logsumexp(1).mean()
        phase[0] = "backward"
        loss.backward()
    return counts


def selective_policy(device, quick):
    counted = {}
    for kind, arch, size in (("vit", "timm:test_vit", 32), ("resnet", "resnet18", 32)):
        for mode in ("none", "selective", "full"):
            torch.manual_seed(0)
            model = create_model(arch, 10, False, size).to(device)
            blocks = list(model.blocks) if kind == "vit" else [model.layer1, model.layer2, model.layer3, model.layer4]
            if mode != "none":
                checkpoint_blocks(blocks, mode)
            images = torch.randn(4, 3, size, size, device=device)
            counted[f"{kind} {mode}"] = counted_costly_ops(model, images, device.type)["backward"]
    ok = all(
        counted[f"{kind} selective"] == counted[f"{kind} none"] < counted[f"{kind} full"] for kind in ("vit", "resnet")
    )
    return ok, {f"backward_costly_ops {name}": count for name, count in counted.items()}


@contextlib.contextmanager
def group_of_one(device):
    """A process group of this process alone: NCCL on a GPU, gloo on the CPU."""
    with tempfile.TemporaryDirectory() as folder:
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=torch.distributed.FileStore(os.path.join(folder, "store"), 1),
            rank=0,
            world_size=1,
            **({"device_id": device} if device.type == "cuda" else {}),
        )
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


def meta_fill(device, quick):
    from types import SimpleNamespace

    from dlojz_lib.parallelism.fsdp import fill_from_first_rank, shard_model, to_meta

    torch.manual_seed(0)
    model = create_model("resnet18", 10, False, 32)  # BatchNorm's buffers, a counter of batches among them
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with group_of_one(device):
        catalogue, values = to_meta(model, SimpleNamespace(is_main=True))
        shard_model(model, True, None, device)
        fill_from_first_rank([model], catalogue, values, device)
        state = {
            name: getattr(tensor, "full_tensor", lambda t=tensor: t)() for name, tensor in model.state_dict().items()
        }
    differ = [name for name in expected if not torch.equal(state[name].cpu(), expected[name])]
    where = {str(tensor.device) for tensor in state.values()}
    return not differ and where == {str(device)}, dict(tensors=len(expected), differ=differ[:3], on=sorted(where))


def fsdp_compile(device, quick):
    from dlojz_lib.model import families
    from dlojz_lib.parallelism.fsdp import shard_model
    from dlojz_lib.parallelism.layout import compile_blocks

    torch.manual_seed(0)
    first = create_model("timm:test_vit", 10, False, 32)
    images, labels = torch.randn(8, 3, 32, 32, device=device), torch.arange(8, device=device) % 10
    trained = {}
    with group_of_one(device):
        for compiled in (False, True):
            model = create_model("timm:test_vit", 10, False, 32)
            model.load_state_dict(first.state_dict())
            if compiled:
                compile_blocks([block for _, block in families.blocks_of(model)], None)
            shard_model(model, True, None, device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            losses = []
            for _ in range(2):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
            weights = {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()}
            trained[compiled] = torch.stack(losses).cpu(), weights
    (eager_losses, eager), (losses, weights) = trained[False], trained[True]
    gap = max((weights[name] - eager[name]).abs().max().item() for name in eager)
    ok = torch.allclose(losses, eager_losses, rtol=1e-4, atol=1e-5) and gap < 1e-4
    return ok, dict(eager_losses=eager_losses.tolist(), compiled_losses=losses.tolist(), largest_weight_gap=gap)


def fsdp_offload(device, quick):
    """--fsdp-offload against --fsdp on a group of one: a ViT's losses over a few SGD steps (the same within float32
    tolerance: the offloaded step runs on the CPU), the GPU's peak bytes and the step time of each."""
    from types import SimpleNamespace

    from dlojz_lib.parallelism.fsdp import fill_from_first_rank, shard_model, to_meta

    if device.type != "cuda":
        raise Skipped("GPU only: on the CPU the shards are in host memory already (dlojz refuses --fsdp-offload)")
    arch, size, steps = ("timm:test_vit", 32, 3) if quick else ("timm:vit_base_patch16_224", 224, 6)
    torch.manual_seed(0)
    first = create_model(arch, 10, False, size)
    images = torch.randn(16, 3, size, size, device=device)
    labels = torch.arange(16, device=device) % 10
    runs = {}
    with group_of_one(device):
        for offload in (False, True):
            model = create_model(arch, 10, False, size)
            model.load_state_dict(first.state_dict())
            catalogue, values = to_meta(model, SimpleNamespace(is_main=True))
            shard_model(model, True, torch.bfloat16, device, offload=offload)
            fill_from_first_rank([model], catalogue, values, device, offload)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            losses, start = [], time.perf_counter()
            for step in range(steps):
                if step == 1:  # the first step's allocations and copies set up, then the timed ones
                    torch.cuda.synchronize(device)
                    start = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
            torch.cuda.synchronize(device)
            seconds = (time.perf_counter() - start) / (steps - 1)
            runs[offload] = torch.stack(losses).cpu(), torch.cuda.max_memory_allocated(device), seconds
    (plain, plain_bytes, plain_s), (offloaded, offload_bytes, offload_s) = runs[False], runs[True]
    ok = torch.allclose(offloaded, plain, rtol=1e-3, atol=1e-4) and offload_bytes < plain_bytes
    return ok, dict(
        arch=arch, losses=plain.tolist(), offloaded_losses=offloaded.tolist(),
        peak_gib=plain_bytes / 2**30, offloaded_peak_gib=offload_bytes / 2**30,
        step_s=plain_s, offloaded_step_s=offload_s,
    )  # fmt: skip


def dali_or_skip():
    from dlojz_lib.data.dali import check_available

    problem = check_available()
    if problem is not None:
        raise Skipped("DALI does not import here")
    import nvidia.dali

    return nvidia.dali.__version__


IMAGES = [None]  # --data: an image folder; else JPEGs of ImageNet's typical size, made once and kept in a cache


def bench_images(quick):
    """The image folder the DALI checks read: --data's, or natural-looking 500 x 375 JPEGs (bench_loader's set)."""
    from bench_loader import resolve_train_folder

    return resolve_train_folder(IMAGES[0], 256 if quick else 2_048, 8, max(1, min(8, os.cpu_count() or 1)))


def dali_batches(folder, device, threads, decode, batch_size=64, by_epoch=False, keep_batches=True):
    from dlojz_lib.data.dali import DaliBatches, DaliSettings, train_pipeline
    from dlojz_lib.data.datasets import SafeImageFolder
    from dlojz_lib.data.samplers import EpochSampler

    dataset = SafeImageFolder(str(folder))
    sampler = EpochSampler(dataset, 1, 0, shuffle=True, seed=0)
    device_id = device.index if device.type == "cuda" else None
    settings = DaliSettings(threads=threads, decode=decode)
    batches = DaliBatches(
        dataset,
        sampler,
        batch_size,
        lambda source: train_pipeline(source, batch_size, 224, device_id, settings, 0),
        device,
        drop_last=True,
        by_epoch=by_epoch,
    )
    if not keep_batches:
        batches.lifetimes = None
    return sampler, batches


def endless(sampler, batches):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from batches
        epoch += 1


def dali_loader(device, quick):
    version = dali_or_skip()
    folder = bench_images(quick)
    rows = {}
    counts = (6, 12) if device.type == "cuda" else (1,)
    for decode in ("roi", "whole"):
        for threads in counts:
            sampler, batches = dali_batches(folder, device, threads, decode)
            stream = endless(sampler, batches)
            for _ in range(5):
                next(stream)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            measured = 10 if quick else 40
            start = time.perf_counter()
            for _ in range(measured):
                images, _ = next(stream)
            images.float().sum().item()  # the last batch ready: the window's one wait
            rows[f"img_s {decode} threads {threads}"] = round(measured * 64 / (time.perf_counter() - start))
            del stream, batches
    return all(value > 0 for value in rows.values()), dict(rows, dali=version)


def dali_memory(device, quick):
    if device.type != "cuda":
        raise Skipped("DALI's GPU memory needs a GPU")
    version = dali_or_skip()
    import psutil

    from dlojz_lib.data.dali import jpeg_utilisation_reader

    folder = bench_images(quick)
    process = psutil.Process()

    def taken():
        torch.cuda.synchronize(device)
        free = torch.cuda.mem_get_info(device)[0]
        return free, process.memory_info().rss

    before = taken()
    sampler, batches = dali_batches(folder, device, 6, "roi")
    stream = endless(sampler, batches)
    batches._build((0, 0))
    figures = {}
    readings, jpeg = [], jpeg_utilisation_reader(device)
    for when, count in (("built", 0), ("batch 1", 1), ("batch 20", 19)):
        for _ in range(count):
            next(stream)
            if jpeg is not None:
                readings.append(jpeg())
        free, resident = taken()
        figures[f"gpu_mib {when}"] = round((before[0] - free) / 2**20)
        figures[f"host_mib {when}"] = round((resident - before[1]) / 2**20)
    figures["jpeg_engine_utilisation_pct"] = max(readings) if readings else None
    return figures["gpu_mib batch 20"] > 0, dict(figures, dali=version)


def dali_lifetimes(device, quick):
    if device.type != "cuda":
        raise Skipped("batch lifetimes are a CUDA stream's: a GPU")
    version = dali_or_skip()
    folder = bench_images(True)
    found = {}
    for kept in (True, False):
        sampler, batches = dali_batches(folder, device, 6, "roi", keep_batches=kept)
        stream = endless(sampler, batches)
        at_once, later = [], []
        side = torch.cuda.Stream(device)
        for _ in range(12):
            images, _ = next(stream)
            at_once.append(images.float().sum())
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # read again behind a delay, as a slow step would
                torch.cuda._sleep(20_000_000)
                later.append(images.float().sum())
        torch.cuda.synchronize(device)
        found[kept] = sum(int(a.item() != b.item()) for a, b in zip(at_once, later))
    return found[True] == 0, dict(differ_kept=found[True], differ_let_go_at_once=found[False], dali=version)


def seams(device, quick):
    if device.type != "cuda":
        raise Skipped("bench/gpu_seams.py's checks need a GPU")
    import gpu_seams

    figures = {}
    with group_of_one(device):
        for name, check in (("stage_draws", gpu_seams.stage_draws), ("cut_by_time", gpu_seams.cut_by_time),
                            ("whole_copies", gpu_seams.whole_copies)):  # fmt: skip
            ok, found = check(device)
            figures[name] = dict(found, ok=ok)
    return all(row["ok"] for row in figures.values()), figures


def float8(device, quick):
    """--float8's linears (model.float8: the family's, torchao's Float8Linear) against bfloat16 autocast on the same
    weights and batches, compiled on a GPU: img/s after the first steps (compilation, warm-up), without a sync per
    step, the peak bytes and each step's loss."""
    import importlib.util

    from dlojz_lib.model.families import family_of
    from dlojz_lib.model.float8 import convert, float8_linears

    if importlib.util.find_spec("torchao") is None:
        raise Skipped("torchao is not installed (pip install torchao==0.18.0)")
    on_gpu = device.type == "cuda"
    if on_gpu and torch.cuda.get_device_capability(device) < (8, 9):
        raise Skipped(f"{torch.cuda.get_device_name(device)} has no float8 matrix products (compute capability < 8.9)")
    arch, size, batch, steps = (
        ("timm:vit_large_patch16_224", 224, 64, 12) if on_gpu else ("timm:vit_base_patch16_224", 32, 4, 3)
    )
    recipes = ("none", "tensorwise", "rowwise") if on_gpu else ("none", "tensorwise")
    torch.manual_seed(0)
    first = create_model(arch, 1000, False, size).state_dict()
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.arange(batch, device=device) % 1000
    figures = dict(arch=arch, image_size=size, batch=batch, steps=steps, compiled=on_gpu)
    for recipe in recipes:
        model = create_model(arch, 1000, False, size)
        model.load_state_dict(first)
        if recipe != "none":
            chosen = float8_linears(model, family_of(model), recipe)
            convert(model, chosen, recipe, fsdp=False)
            figures[f"converted {recipe}"] = len(chosen)
        model = model.to(device)
        net = torch.compile(model) if on_gpu else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        losses, start = [], None
        for step in range(steps):
            if step == 2:  # compiled and warmed up: the timed steps
                if on_gpu:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(net(images).float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        if on_gpu:
            torch.cuda.synchronize(device)
            figures[f"peak_gib {recipe}"] = torch.cuda.max_memory_allocated(device) / 2**30
        figures[f"img_s {recipe}"] = batch * (steps - 2) / (time.perf_counter() - start)
        figures[f"losses {recipe}"] = torch.stack(losses).float().cpu().tolist()
        del model, net, optimizer
    plain = torch.tensor(figures["losses none"])
    ok = all(torch.allclose(torch.tensor(figures[f"losses {recipe}"]), plain, rtol=0.1) for recipe in recipes[1:])
    return ok, figures


CHECKS = {  # name: the check, run in this order
    "selective_policy": selective_policy,
    "meta_fill": meta_fill,
    "fsdp_compile": fsdp_compile,
    "fsdp_offload": fsdp_offload,
    "float8": float8,
    "dali_loader": dali_loader,
    "dali_memory": dali_memory,
    "dali_lifetimes": dali_lifetimes,
    "seams": seams,
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default=None, help=f"the checks to run, separated by commas ({', '.join(CHECKS)})")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and figures here")
    parser.add_argument("--quick", action="store_true", help="fewer images and batches (the suite's run)")
    parser.add_argument("--data", default=None, help="an image folder for the DALI checks (default: generated JPEGs)")
    args = parser.parse_args(argv)
    IMAGES[0] = args.data
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a check; the checks are {', '.join(CHECKS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_checks.py: no CUDA GPU visible (--device cpu runs the checks a CPU can)")
        return 1
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    report = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "checks": {},
    }
    failed = 0
    for name in names:
        start = time.perf_counter()
        try:
            ok, figures = CHECKS[name](device, args.quick)
            status = "ok" if ok else "FAILED"
        except Skipped as why:
            status, figures = "skipped", {"why": str(why)}
        failed += status == "FAILED"
        seconds = round(time.perf_counter() - start, 1)
        report["checks"][name] = dict(status=status, seconds=seconds, **figures)
        print(f"{name:<17} {status:<8} {seconds:>6.1f} s  {json.dumps(figures)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
