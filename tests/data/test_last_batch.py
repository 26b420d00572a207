"""The last training batch: kept when incomplete, but never a batch of one image (BatchNorm cannot train on it),
on any number of ranks; validation keeps every image."""

import pytest
from conftest import SMALL, read_json, run_dlojz, show

from dlojz_lib.data.samplers import EpochSampler


@pytest.mark.parametrize(
    "images, ranks, batch, per_rank_trained",
    [
        (25, 1, 4, 24),  # 6 batches of 4 and one of 1: the one waits
        (26, 1, 4, 26),  # a last batch of 2 is kept
        (24, 1, 4, 24),
        (72, 2, 5, 35),  # 36 per rank: 7 batches of 5 and one of 1 on each rank
        (72, 3, 23, 23),  # 24 per rank
        (73, 3, 4, 24),  # 25 per rank after DistributedSampler's padding
        (1, 1, 4, 1),  # a single image in all: nothing else to train on (refused elsewhere if -b > 1)
    ],
)
def test_no_rank_gets_a_last_batch_of_one(images, ranks, batch, per_rank_trained):
    samplers = [EpochSampler(range(images), ranks, rank, seed=3, batch_size=batch) for rank in range(ranks)]
    for sampler in samplers:
        got = [index for _, index in sampler]
        assert len(got) == len(sampler) == per_rank_trained
        assert len(got) % batch != 1 or per_rank_trained == 1


def test_the_image_that_waits_changes_with_the_epoch():
    sampler = EpochSampler(range(25), 1, 0, seed=3, batch_size=4)
    waiting = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        waiting.append(frozenset(range(25)) - {i for _, i in sampler})
    assert all(len(w) == 1 for w in waiting) and len(set(waiting)) > 1, waiting


def test_resume_mid_epoch_keeps_the_rule():
    sampler = EpochSampler(range(25), 1, 0, seed=3, batch_size=4)
    whole = [i for _, i in sampler]
    sampler.skip = 8
    assert [i for _, i in sampler] == whole[8:] and len(sampler) == 16


def test_drop_last_is_unchanged():
    sampler = EpochSampler(range(25), 1, 0, seed=3, drop_last=True, batch_size=4)
    assert len(sampler) == 25  # the DataLoader drops the last batch itself


@pytest.mark.parametrize("ranks, batch", [(1, 71), (2, 5), (3, 23)])
@pytest.mark.multirank
def test_a_share_leaving_one_image_trains_to_the_end(tiny_data, tmp_path, ranks, batch):
    """72 training images: each rank's share leaves a last batch of one; the epoch ends, validation sees all 15."""
    metrics = tmp_path / "m.json"
    proc = run_dlojz(
        *SMALL,
        "--data-root",
        tiny_data,
        "-b",
        batch,
        "--epochs",
        "2",
        "--num-workers",
        "0",
        "--no-wandb",
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path / "o",
        ranks=ranks,
    )
    assert proc.returncode == 0, show(proc)
    m = read_json(metrics)
    assert m["steps"] == 2 * ((72 // ranks) // batch) and m["val_images"] == 15, m
