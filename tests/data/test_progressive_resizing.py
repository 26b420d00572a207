"""Progressive resizing (--min-res/--max-res/--start-ramp/--end-ramp/--res-step): the resolution of each epoch,
in every DataLoader worker, persistent ones too, and after a mid-epoch resume."""

import pytest
import torch

import dlojz
from dlojz_lib.checks import UserError
from dlojz_lib.data.augment import resolution_at
from dlojz_lib.dist import Distribution
from dlojz_lib.log import Console
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import get_args_parser

RAMP = ["--min-res", "16", "--max-res", "32", "--start-ramp", "1", "--end-ramp", "3", "--res-step", "8"]


def test_the_schedule_holds_both_ends_and_rounds_to_the_step():
    # FFCV's rn50_16_epochs: 160 px up to epoch 11, 192 px from 13; 176 px at 12 rounds (half to even, as numpy) to 192
    assert [resolution_at(e, 160, 192, 11, 13, 32) for e in range(9, 16)] == [160, 160, 160, 192, 192, 192, 192]
    assert [resolution_at(e, 16, 32, 1, 3, 8) for e in range(5)] == [16, 16, 24, 32, 32]
    assert [resolution_at(e, 128, 192, 0, 4, 16) for e in range(5)] == [128, 144, 160, 176, 192]


def loaders_for(tiny_data, tmp_path, *flags):
    cfg = resolve_config(
        get_args_parser().parse_args(
            [
                "--device",
                "cpu",
                "--data-root",
                str(tiny_data),
                "-b",
                "8",
                "--val-resize-size",
                "36",
                "--val-crop-size",
                "32",
                "--output-dir",
                str(tmp_path / "run"),
                *flags,
            ]
        )
    )
    ranks, log = Distribution(1, 0, 0, torch.device("cpu")), Console(False)
    train_set, val_set, classes = dlojz.build_data(cfg, ranks, log)
    return dlojz.build_loaders(cfg, train_set, val_set, len(classes), ranks, log)


def sizes_of_epoch(loaders, epoch, first_batch=0):
    loaders.start_epoch(epoch, first_batch)
    return {tuple(images.shape[-2:]) for images, _ in loaders.train_batches}


def test_every_worker_crops_at_the_epochs_resolution(tiny_data, tmp_path):
    loaders = loaders_for(tiny_data, tmp_path, *RAMP, "--num-workers", "2", "--persistent-workers")
    try:
        # the same persistent workers serve all epochs: the resolution follows the epoch in each sample's key
        assert [sizes_of_epoch(loaders, epoch) for epoch in range(4)] == [
            {(16, 16)},
            {(16, 16)},
            {(24, 24)},
            {(32, 32)},
        ]
        assert sizes_of_epoch(loaders, 2, first_batch=5) == {(24, 24)}  # resumed mid-epoch 2
    finally:
        loaders.close()


def test_without_the_flags_the_resolution_is_fixed(tiny_data, tmp_path):
    loaders = loaders_for(tiny_data, tmp_path, "--image-size", "24", "--num-workers", "0")
    assert sizes_of_epoch(loaders, 0) == sizes_of_epoch(loaders, 3) == {(24, 24)}


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--min-res", "16"], "needs both --min-res and --max-res"),
        (["--min-res", "32", "--max-res", "16", "--end-ramp", "2"], "--min-res 32 must be at most --max-res 16"),
        (["--min-res", "16", "--max-res", "32", "--start-ramp", "2", "--end-ramp", "2"], "--start-ramp 2 must be"),
        (["--min-res", "16", "--max-res", "32", "--end-ramp", "2", "--synthetic"], "--synthetic trains on one fixed"),
    ],
)
def test_bad_ramps_are_one_line(flags, fragment):
    with pytest.raises(UserError, match=fragment):
        resolve_config(get_args_parser().parse_args(["--device", "cpu", *flags]))


def test_the_run_says_each_epochs_resolution(tiny_data, tmp_path, run_inline):
    proc = run_inline(
        "--device",
        "cpu",
        "--arch",
        "resnet18",
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--no-wandb",
        "--num-workers",
        "0",
        "--epochs",
        "3",
        "--val-resize-size",
        "36",
        "--val-crop-size",
        "32",
        *RAMP,
        "--output-dir",
        tmp_path / "run",
    )
    assert proc.returncode == 0, proc.stderr
    assert "epoch 1: training resolution 16 px" in proc.stdout and "epoch 3: training resolution 24 px" in proc.stdout
    assert "validation 32 px, 1.33x" in proc.stdout
