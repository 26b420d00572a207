"""Day 4's seams on one GPU: what the CPU tests cannot see of a pipeline stage's random draws, the cut by time and
the tensor group's whole copies, checked on CUDA in one process (a process group of one).

    python bench/gpu_seams.py [--json FILE]

1. A pipeline stage's own random draws (pipeline.Stage with a seed): stage 1's stochastic-depth masks differ from
   stage 0's, a peer's are the same, the process's CPU and CUDA generators are left as they were, and the forward
   makes no host-device synchronisation (torch.cuda.set_sync_debug_mode("error")).
2. --pp-split time: the layers timed on the GPU under bfloat16 autocast, one layer's weights there at a time (the
   peak below half the model's bytes), the model left on the host: after the build the GPU holds the stage, not
   the model and the stage.
3. --tp's whole copies (tensor_parallel.WholeCopies) on a tensor mesh of one GPU: the gradients' average makes no
   host synchronisation; the check finds the copies equal.
Prints one line per check and exits 1 if one fails.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dlojz_lib.model.build import BuiltModel  # noqa: E402
from dlojz_lib.parallelism.pipeline import PipelineCut, Stage, build_pipeline, layer_seconds, pipeline_layers  # noqa: E402


def stage_draws(device):
    from timm.layers import DropPath

    def stage(index):
        model = torch.nn.Sequential(torch.nn.Identity(), DropPath(0.5), DropPath(0.5), torch.nn.Identity())
        return Stage(model, pipeline_layers(model), 1, 3, seed=7, index=index)

    def masks(module):
        torch.manual_seed(7)
        before = torch.get_rng_state(), torch.cuda.get_rng_state(device)
        x = torch.ones(4096, 1, device=device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = module(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        after = torch.get_rng_state(), torch.cuda.get_rng_state(device)
        return out.flatten().cpu(), all(torch.equal(a, b) for a, b in zip(before, after))

    (first, kept0), (peer, _), (second, kept1) = masks(stage(0)), masks(stage(0)), masks(stage(1))
    ok = torch.equal(first, peer) and not torch.equal(first, second) and kept0 and kept1
    return ok, dict(peers_equal=torch.equal(first, peer), stages_differ=not torch.equal(first, second),
                    generators_kept=kept0 and kept1)  # fmt: skip


def cut_by_time(device):
    import timm

    model = timm.create_model("vit_small_patch16_224", num_classes=10)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    warm = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    (warm @ warm).float().sum().item()  # cuBLAS's workspace allocated before the count starts
    del warm
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    # the timing alone, as build_pipeline runs it: one layer's weights there at a time, no cache of their casts
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        seconds = layer_seconds(model, pipeline_layers(model), torch.randn(8, 3, 224, 224, device=device))
    timing_peak = torch.cuda.max_memory_allocated(device) - start
    cut = PipelineCut(1, "gpipe", 2, split="time", sample=torch.randn(8, 3, 224, 224), autocast_dtype=torch.bfloat16)
    _, stages, _ = build_pipeline(BuiltModel.of(model, "vit"), cut, 0, device)
    held = torch.cuda.memory_allocated(device) - start
    home = {p.device.type for p in model.parameters()}
    ok = home == {"cpu"} and held < 1.5 * model_bytes and timing_peak < model_bytes / 2 and len(seconds) == 14
    return ok, dict(model_mb=round(model_bytes / 2**20, 1), timing_peak_mb=round(timing_peak / 2**20, 1),
                    allocated_after_build_mb=round(held / 2**20, 1), model_left_on=sorted(home),
                    stage_on=str(next(stages[0].parameters()).device))  # fmt: skip


def whole_copies(device):
    import timm
    from torch.distributed.device_mesh import init_device_mesh

    from dlojz_lib.parallelism.tensor import WholeCopies, parallelize

    mesh = init_device_mesh("cuda", (1,))
    model = timm.create_model("vit_small_patch16_224", num_classes=10).to(device)
    parallelize(model, mesh, "vit")
    copies = WholeCopies(model, mesh, check_every=1, gather=lambda obj: [obj])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 3, 224, 224, device=device)).float().logsumexp(1).mean()
    loss.backward()
    torch.cuda.set_sync_debug_mode("error")
    try:
        copies.average_gradients()
        synced = False
    except RuntimeError:
        synced = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    copies.check(1)  # raises on a difference
    return not synced, dict(whole_tensors=len(copies.named), average_synchronised=synced)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_seams.py: no CUDA GPU visible")
        return 1
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory() as folder:
        torch.distributed.init_process_group(
            "nccl", store=torch.distributed.FileStore(os.path.join(folder, "store"), 1), rank=0, world_size=1,
            device_id=device,
        )  # fmt: skip
        try:
            figures, failed = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}, 0
            for name, check in (("stage_draws", stage_draws), ("cut_by_time", cut_by_time),
                                ("whole_copies", whole_copies)):  # fmt: skip
                ok, found = check(device)
                figures[name] = dict(found, ok=ok)
                failed += not ok
                print(f"{name}: {'ok' if ok else 'FAILED'} {found}", flush=True)
        finally:
            torch.distributed.destroy_process_group()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
