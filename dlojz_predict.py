"""Predict the classes of unlabelled images with a trained model: a folder (recursive) or image files in, one CSV
row per image out (its top-k classes, named, with their probabilities).

    python dlojz_predict.py runs/JOB photos/ -o predictions.csv          # the run's newest checkpoint
    python dlojz_predict.py runs/JOB/best --ema a.jpg b.png --top-k 3    # its best checkpoint's EMA weights
    python dlojz_predict.py --arch resnet50 --pretrained DEFAULT photos/ --device cuda --amp

The model is any dlojz checkpoint (raw, EMA, averaged by dlojz_avg.py, consolidated by dlojz_fsdp.py) or published
weights from the offline cache (`--pretrained`, as dlojz.py's), the images prepared as its run validated them
(resize, center crop, interpolation, mean and std from the checkpoint; the published ones for `--pretrained`), the
logits those of validation (`--tta-flip`: averaged with the mirror's). The probabilities are the same numbers as
`dlojz.py --eval-only --predictions` gives on the same images. An unreadable file is one warning and counted, never
the end of the run. Rows follow the files: sorted within each folder, in the order given.
"""

import os
import sys
from pathlib import Path

from dlojz_lib.checks import OneLineArgumentParser, UserError, claim_output, command
from dlojz_lib.settings.flags import COUNT, WHOLE


def get_parser():
    parser = OneLineArgumentParser(prog="dlojz_predict.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="a dlojz checkpoint, or a run's folder (its newest checkpoint)")
    parser.add_argument("images", nargs="*", help="image files and folders (searched recursively)")
    parser.add_argument("--arch", default=None, help="with --pretrained: the model (torchvision's name or timm:NAME)")
    parser.add_argument("--pretrained", default=None, metavar="WEIGHTS", help="published weights (DEFAULT, ...)")
    parser.add_argument("--ema", action="store_true", help="the checkpoint's EMA weights (its run had --model-ema)")
    parser.add_argument("-o", "--output", default="predictions.csv", help="the CSV to write (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace -o even if it is not a predictions CSV")
    parser.add_argument("--top-k", type=COUNT, default=5, metavar="K", help="classes per image (default: 5)")
    parser.add_argument("-b", "--batch-size", type=COUNT, default=64, help="images per forward (default: 64)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda where there is one")
    parser.add_argument("--amp", action="store_true", help="autocast: float16 on a GPU, bfloat16 on the CPU")
    parser.add_argument("--tta-flip", action="store_true", help="average the logits with the mirrored image's")
    parser.add_argument(
        "--num-workers",
        type=WHOLE,
        default=None,
        help="processes decoding the images (default: the task's CPUs - 1, at most 8)",
    )
    return parser


CHECKPOINT_SUFFIXES = (".pt", ".pth", ".dcp", ".safetensors")  # what is weights, not an image


@command("dlojz_predict.py")
def main(argv=None) -> int:
    args = get_parser().parse_intermixed_args(argv)  # the images after flags too: CKPT --ema photos/ --top-k 3
    if args.pretrained is not None and args.checkpoint is not None:  # then the first positional is an image
        args.images, args.checkpoint = [args.checkpoint, *args.images], None
    if args.pretrained is not None and args.images and Path(args.images[0]).suffix in CHECKPOINT_SUFFIXES:
        raise UserError(
            f"{args.images[0]} is a checkpoint and --pretrained gives weights too: give one of them (the "
            "checkpoint alone, or --pretrained and the images)"
        )
    from dlojz_lib.inference import check_checkpoint_or_weights

    check_checkpoint_or_weights(args.checkpoint, args.arch, args.pretrained)
    if not args.images:
        raise UserError("give the images: files or folders after the checkpoint")
    given = [path for path in (args.checkpoint, *args.images) if path]
    claim_output(args.output, "-o", "a dlojz_predict.py CSV", is_predictions_csv, given, args.force)
    return predict_images(args)


def is_predictions_csv(path) -> bool:
    """Whether `path` is a CSV this command wrote (its header, the first line)."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.readline().startswith("image,predicted_class,")
    except (OSError, UnicodeDecodeError):
        return False


def predict_images(args) -> int:
    import torch

    from dlojz_lib.inference import image_files, load_for_inference, predict, write_csv

    files = image_files(args.images)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU visible here; leave --device out (or --device cpu)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        from dlojz_lib.dist import keep_freed_host_memory

        keep_freed_host_memory()  # as dlojz.py on a CPU: each batch's activations reuse the last one's pages
    model = load_for_inference(args.checkpoint, args.arch, args.pretrained, args.ema)
    print(f"model: {model.source}", flush=True)
    workers = args.num_workers if args.num_workers is not None else min(8, max(0, len(os.sched_getaffinity(0)) - 1))
    amp = (torch.float16 if device.type == "cuda" else torch.bfloat16) if args.amp else None
    rows, unreadable, rate = predict(model, files, args.batch_size, device, amp, args.tta_flip, args.top_k, workers)
    write_csv(args.output, rows, min(args.top_k, len(model.classes)))
    skipped = f"; {unreadable} unreadable file(s) skipped (warnings above)" if unreadable else ""
    speed = f"{rate:.0f} images/s after the first batch" if rate else "one batch: no rate past the first"
    print(
        f"written: {args.output}, {len(rows)} images ({speed}, on {device.type}, {workers} decoding workers){skipped}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
