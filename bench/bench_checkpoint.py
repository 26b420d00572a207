"""What a checkpoint costs training: the step time around a save, against the same steps without one.

dlojz writes checkpoints in the background (``dlojz_lib.checkpoint.CheckpointSaver(background=True)``): training pauses
only while rank 0 copies the model's and the optimizer's state into host memory; a thread then writes the file and
its SHA-256. This benchmark trains one model (a timm model, ViT-B/16 by default: 86 M parameters, a 1 GB
checkpoint with SGD's momentum) for STEPS steps three times, each in the same process one after the other:

* ``none``: no checkpoint;
* ``foreground``: one checkpoint written at step SAVE_AT before training goes on (what dlojz did before);
* ``background``: the same checkpoint, copied at step SAVE_AT and written by the background thread.

For each, the mean step time from step SAVE_AT to the end (the save's step and the steps that run while the thread
writes), and its ratio to ``none``'s over the same steps. The pause is the ratio's excess: on a GPU the copy is a
device-to-host transfer, on a CPU a memory copy, and the thread's writing competes with training for the CPU's cores
(on a 2-core machine, visibly). Run from the repository root::

    python bench/bench_checkpoint.py                      # ViT-B/16 at 224 px, batch 8, on the CPU
    python bench/bench_checkpoint.py --model resnet50 --image-size 128 --batch-size 16 --json out.json

The checkpoints go to a temporary folder under --dir (default: the system's), removed at the end.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT, PIXELS  # noqa: E402


def build(model_name, num_classes):
    """The model by timm's name, else torchvision's."""
    try:
        import timm

        return timm.create_model(model_name, num_classes=num_classes)
    except (ImportError, RuntimeError):
        import torchvision

        return torchvision.models.get_model(model_name, num_classes=num_classes)


def run(mode, args, folder):
    """Seconds of each step of one run; `mode`: none, foreground or background."""
    import torch

    import dlojz_lib.checkpoint as ckpt

    torch.manual_seed(0)
    model = build(args.model, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.batch_size,))
    saver = ckpt.CheckpointSaver(
        folder / mode, 1, torch.device("cpu"), {}, background=mode == "background", model=model, optimizer=optimizer
    )
    (folder / mode).mkdir(parents=True, exist_ok=True)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == args.save_at and mode != "none":
            saver.save(dict(epoch=0, batch=step + 1, global_step=step + 1))
        times.append(time.perf_counter() - start)
    saver.wait()
    if mode != "none":
        written = ckpt.load_latest(folder / mode)[1]
        assert written is not None, f"{mode}: no checkpoint written"
    return times


def main(argv=None):
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_base_patch16_224")
    parser.add_argument("--image-size", type=PIXELS, default=224)
    parser.add_argument("--batch-size", type=COUNT, default=8)
    parser.add_argument("--steps", type=COUNT, default=10, help="training steps per run (default: 10)")
    parser.add_argument(
        "--save-at", type=COUNT, default=3, help="the step that checkpoints (default: 3, after warm-up)"
    )
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if not 0 < args.save_at < args.steps - 1:
        parser.error("--save-at must leave a step before it and one after it")
    import torch  # after the flags' checks: a bad flag is one line at once

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # one core left for the writer thread
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="dlojz-bench-ckpt-") as tmp:
        steps = {mode: run(mode, args, Path(tmp)) for mode in ("none", "foreground", "background")}
        size = sum(p.stat().st_size for p in Path(tmp).rglob("ckpt_*.pt")) / 2
    window = slice(args.save_at, args.steps)
    mean = {mode: sum(t[window]) / len(t[window]) for mode, t in steps.items()}
    figures = dict(
        model=args.model,
        checkpoint_bytes=int(size),
        steps_timed=len(steps["none"][window]),
        step_s={mode: round(value, 4) for mode, value in mean.items()},
        ratio={mode: round(mean[mode] / mean["none"], 3) for mode in ("foreground", "background")},
        save_step_s={mode: round(steps[mode][args.save_at], 4) for mode in steps},
    )
    print(f"{args.model}: checkpoint of {size / 1e6:,.0f} MB; steps {args.save_at + 1}-{args.steps} (the save's on)")
    print(f"{'':12} {'mean step':>10} {'the save step':>14} {'ratio to none':>14}")
    for mode in steps:
        ratio = "1.000" if mode == "none" else f"{figures['ratio'][mode]:.3f}"
        print(f"{mode:12} {mean[mode]:9.3f}s {steps[mode][args.save_at]:13.3f}s {ratio:>14}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return figures


if __name__ == "__main__":
    main()
