"""Export a trained model for the tools outside dlojz: ONNX, a torch.export program, TorchScript and a safetensors
state dict, each checked in the same command against the PyTorch model on real images, with the preprocessing
written beside them (preprocessing.json: resize, crop, interpolation, mean, std, class names).

    python dlojz_export.py runs/JOB -o exported/ --check-images photos/           # every format
    python dlojz_export.py runs/JOB/best --ema --format onnx safetensors -o exported/
    python dlojz_export.py --arch resnet50 --pretrained DEFAULT -o exported/ --check-images photos/

The model is any dlojz checkpoint (raw, EMA, averaged, consolidated; a run's folder: its newest) or published weights
from the offline cache. The check runs each exported file the way its users will (onnxruntime for ONNX,
torch.export.load, torch.jit.load, load_state_dict into the architecture) on up to 8 of the images, prepared as
validation prepares them (by default the run's own validation images, where its data set is still there), and
prints the largest absolute difference from PyTorch's logits; above --tolerance (1e-4: float32 kernels that sum in
another order differ by ~1e-6 of logits of order 1) the command fails. Exports are float32, on the CPU, the batch
size free.
"""

import sys
from pathlib import Path

from dlojz_lib.checks import OneLineArgumentParser, check_output_folder, claim_output, command, fail
from dlojz_lib.export import EXPORTERS, PREPROCESSING_FILE, is_exported
from dlojz_lib.settings.flags import NON_NEGATIVE

FORMATS = tuple(EXPORTERS)  # the table's rows (torch-free: read before the flags are checked)


def get_parser():
    parser = OneLineArgumentParser(prog="dlojz_export.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="a dlojz checkpoint, or a run's folder (its newest checkpoint)")
    parser.add_argument("--arch", default=None, help="with --pretrained: the model (torchvision's name or timm:NAME)")
    parser.add_argument("--pretrained", default=None, metavar="WEIGHTS", help="published weights (DEFAULT, ...)")
    parser.add_argument("--ema", action="store_true", help="the checkpoint's EMA weights (its run had --model-ema)")
    parser.add_argument("-o", "--output", required=True, help="the folder to write the exports in")
    parser.add_argument(
        "--format",
        nargs="+",
        choices=FORMATS,
        default=list(FORMATS),
        help=f"what to write (default: all {len(FORMATS)})",
    )
    parser.add_argument(
        "--check-images",
        nargs="+",
        default=None,
        metavar="PATH",
        help="image files or folders for the check (default: the run's validation images)",
    )
    parser.add_argument(  # (NaN would pass every check: it compares false)
        "--tolerance", type=NON_NEGATIVE, default=1e-4, help="largest logit difference accepted (a finite number >= 0)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace files of these names in -o that an export did not write"
    )
    return parser


@command("dlojz_export.py")
def main(argv=None) -> int:
    args = get_parser().parse_args(argv)
    from dlojz_lib.data.datasets import written_inside_data
    from dlojz_lib.inference import check_checkpoint_or_weights, load_for_inference

    check_checkpoint_or_weights(args.checkpoint, args.arch, args.pretrained)
    model = load_for_inference(args.checkpoint, args.arch, args.pretrained, args.ema)
    print(f"model: {model.source}", flush=True)
    if (problem := written_inside_data(model.settings.get("data_root"), {"-o": args.output})) is not None:
        fail(problem)  # (before -o is made: the run's next scan would read the exports as a class's images)
    check_output_folder(args.output, "-o")
    given = [path for path in (args.checkpoint, *(args.check_images or ())) if path]
    for name in (PREPROCESSING_FILE, *(EXPORTERS[fmt].file for fmt in args.format)):
        claim_output(Path(args.output) / name, "-o", "a file dlojz_export.py wrote", is_exported, given, args.force)
    return export_model(model, args)


def export_model(model, args) -> int:
    from dlojz_lib.export import check_images, export, max_difference, record_export, write_preprocessing
    from dlojz_lib.inference import image_files

    images = check_images(model, image_files(args.check_images or [default_check_images(model, args)]))
    folder = Path(args.output)
    folder.mkdir(parents=True, exist_ok=True)
    print(f"preprocessing: {write_preprocessing(model, folder)}", flush=True)
    worst = 0.0
    for fmt in args.format:
        path = export(model, fmt, folder, images[:2])
        record_export(path)  # (a later export may replace it)
        difference = max_difference(model, fmt, path, images)
        worst = max(worst, difference)
        print(
            f"{fmt}: {path} ({path.stat().st_size / 2**20:.1f} MiB; {EXPORTERS[fmt].readers}): largest logit difference "
            f"from PyTorch on {len(images)} images {difference:.2e}",
            flush=True,
        )
    if worst > args.tolerance:
        print(f"dlojz_export.py: an export differs by {worst:.2e} > --tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


def default_check_images(model, args):
    """The run's validation folder, when the checkpoint names a data set that is still there."""

    data_root = model.settings.get("data_root")
    folder = Path(data_root) / "val" if data_root else None
    if folder is None or not folder.is_dir():
        fail("give --check-images PATH...: images to check the exports on (the run's own validation set is not here)")
    return folder


if __name__ == "__main__":
    sys.exit(main())
