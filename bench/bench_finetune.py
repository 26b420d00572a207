"""Fine-tuning against training from scratch, on data no one here wrote: the glyphs of the fonts installed on this
machine (matplotlib's DejaVu, STIX and Computer Modern, and the system's), drawn at random sizes, places, angles and
colours. A model learns 10 letters (A-J) from scratch; its checkpoint is then fine-tuned with `--initial-checkpoint`
on the 10 digits (a new head) from a few images per class, against the same epochs from random weights, and plain
fine-tuning against `--layer-decay` and `--freeze-backbone-epochs`. Validation images use fonts that training never
saw.

Every run is `python dlojz.py` in its own process, with the same flags but the ones compared; the table gives the
digits' top-1 after each epoch (from `--val-history`), then the commands. On 2 CPU cores (resnet18, 32 px) the whole
benchmark takes about 5 minutes. Run from the repository root::

    python bench/bench_finetune.py                      # writes its data and runs under a temporary folder
    python bench/bench_finetune.py --out /tmp/finetune --target-images 100 --epochs 2
"""

from __future__ import annotations

import glob
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.settings.flags import COUNT  # noqa: E402

LETTERS, DIGITS = "ABCDEFGHIJ", "0123456789"
SYMBOL_FONTS = ("cmex10", "cmsy10")  # Computer Modern's symbols at the letters' code points: not letters
SIZE = 40  # px of the drawn images (the runs crop 32)
COMMON = [
    "--device", "cpu", "--arch", "resnet18", "--image-size", "32", "--val-resize-size", "36",
    "--val-crop-size", "32", "-b", "32", "--no-wandb", "--num-workers", "1", "--lr-scheduler", "cosine",
    "--lr", "0.05", "--wd", "5e-5",
]  # fmt: skip


def font_files():
    """Every TrueType font here that draws each letter and digit as a distinct, visible glyph (symbol fonts out)."""
    import matplotlib
    from PIL import Image, ImageDraw, ImageFont

    found = glob.glob(os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "*.ttf"))
    found += glob.glob("/usr/share/fonts/**/*.ttf", recursive=True)
    usable, seen = [], set()
    for path in sorted(found):
        if Path(path).stem in SYMBOL_FONTS:
            continue
        font = ImageFont.truetype(path, 28)
        masks = []
        for char in LETTERS + DIGITS:
            image = Image.new("L", (SIZE, SIZE))
            ImageDraw.Draw(image).text((SIZE / 2, SIZE / 2), char, fill=255, font=font, anchor="mm")
            masks.append(image.tobytes())
        if len(set(masks)) == len(masks) and all(any(mask) for mask in masks) and masks[0] not in seen:
            usable.append(path)
            seen.add(masks[0])  # the same font in two folders counts once
    return usable


def draw(char, font_path, rng):
    from PIL import Image, ImageDraw, ImageFont

    background = tuple(rng.randrange(150, 256) for _ in range(3))  # light paper, dark ink, of any tint
    ink = tuple(rng.randrange(0, 100) for _ in range(3))
    image = Image.new("RGB", (SIZE, SIZE), background)
    font = ImageFont.truetype(font_path, rng.randrange(30, 40))
    centre = (SIZE / 2 + rng.uniform(-3, 3), SIZE / 2 + rng.uniform(-3, 3))
    ImageDraw.Draw(image).text(centre, char, fill=ink, font=font, anchor="mm")
    return image.rotate(rng.uniform(-15, 15), fillcolor=background)


def make_glyphs(root, chars, fonts, per_font, seed):
    """root/{train,val}/<char>/*.jpg: every 4th font only in val, the others only in train."""
    rng = random.Random(seed)
    for index, font_path in enumerate(fonts):
        split = "val" if index % 4 == 3 else "train"
        for char in chars:
            folder = Path(root) / split / f"char_{char}"
            folder.mkdir(parents=True, exist_ok=True)
            for n in range(per_font if split == "train" else max(1, per_font // 3)):
                draw(char, font_path, rng).save(folder / f"{Path(font_path).stem}_{n:03d}.jpg", quality=92)
    return root


def run(name, flags, out, commands):
    folder = out / name
    history = folder / "val.jsonl"
    args = [sys.executable, "dlojz.py", *COMMON, *map(str, flags), "--output-dir", folder, "--val-history", history]
    commands.append(shlex.join(map(str, args[1:])))
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_finetune: {name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return [json.loads(line)["val_accuracy"] for line in history.read_text().splitlines()]


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for the data and the runs (default: a temporary one)")
    parser.add_argument("--per-font", type=COUNT, default=40, help="training images per font and class (default 40)")
    parser.add_argument("--source-epochs", type=COUNT, default=3, help="epochs on the letters (default 3)")
    parser.add_argument("--epochs", type=COUNT, default=4, help="epochs on the digits (default 4)")
    parser.add_argument(
        "--target-images", type=COUNT, default=30, help="digits' training images per class (default 30)"
    )
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_finetune_"))
    fonts = font_files()
    if len(fonts) < 8:
        sys.exit(f"bench_finetune: only {len(fonts)} usable fonts here; 8 or more are needed")
    letters = make_glyphs(out / "letters", LETTERS, fonts, args.per_font, seed=1)
    digits = make_glyphs(out / "digits", DIGITS, fonts, args.per_font, seed=2)
    train_images = sum(1 for _ in (digits / "train").rglob("*.jpg"))
    val_images = sum(1 for _ in (digits / "val").rglob("*.jpg"))
    print(
        f"{len(fonts)} fonts; letters and digits: {train_images} training images each (the digits' runs use "
        f"{args.target_images} per class), {val_images} validation (fonts training never saw)"
    )

    commands = []
    source = out / "letters_run"
    run("letters_run", ["--data-root", letters, "--epochs", args.source_epochs], out, commands)
    checkpoint = source / (source / "latest").read_text().strip()
    target = ["--data-root", digits, "--epochs", args.epochs, "--train-subset", args.target_images]
    finetune = [*target, "--initial-checkpoint", checkpoint]
    rows = [
        ("from random weights", run("scratch", target, out, commands)),
        ("fine-tuned from the letters", run("finetune", finetune, out, commands)),
        ("fine-tuned, --layer-decay 0.7", run("layer_decay", [*finetune, "--layer-decay", "0.7"], out, commands)),
        (
            "fine-tuned, --freeze-backbone-epochs 1",
            run("freeze", [*finetune, "--freeze-backbone-epochs", "1"], out, commands),
        ),
    ]
    print(f"\n| digits' top-1 after epoch | {' | '.join(str(e + 1) for e in range(args.epochs))} |")
    print(f"|---|{'---:|' * args.epochs}")
    for name, accuracies in rows:
        print(f"| {name} | {' | '.join(f'{100 * a:.1f} %' for a in accuracies)} |")
    print("\ncommands (from the repository root):")
    for command in commands:
        print(f"  python {command}")


if __name__ == "__main__":
    main()
