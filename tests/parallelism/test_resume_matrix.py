"""Resume across layouts: a run saved in one layout (DDP, --fsdp, --fsdp --tp 2, --fsdp --pp 2, and on 4 ranks
--fsdp --pp 2 --tp 2 and HSDP, --fsdp --fsdp-replicate 2) goes on in another, from the end of an epoch and from the
middle of one, to the weights, the step count and the learning rate of the same training in one process; between
ordinary and sharded checkpoints it is refused in one line saying what to run, before the model is built, and the
checkpoint the command it names makes goes on. Every layout trains 16 images a step (the data-parallel width times
-b).

The suite takes each ordered pair once, from the end of an epoch or the middle of one by turns (each layout saves and
resumes at both points), HSDP with --fsdp and DDP only; DLOJZ_RESUME_MATRIX=full takes every pair at both points
(docs/testing.md: 60 runs)."""

import os

import pytest
from conftest import run_dlojz, show
from test_dlojz import assert_one_line_error
from test_fsdp import BASE, assert_same_weights, checkpoint

import dlojz_fsdp
import dlojz_lib.checkpoint as ckpt

# name: (ranks, flags), each 2 epochs of 2 steps of 16 images (--train-subset 0.5: 36 of the 72 images, the last
# incomplete batch dropped): a resume's seams, the end of an epoch and a step into the next, at half the steps of the
# whole set, whose steps on 4 ranks are most of the matrix's time; "ddp" resumes on 2 ranks, and its checkpoints
# (ordinary files, one rank writes them) are one process's; a pipeline's step in 2 micro-batches of 8 (the
# schedules' own micro-batches against one process: tests/parallelism/test_pipeline.py), half the sends and
# tensor-parallel all-reduces of 4
LAYOUTS = {
    "ddp": (2, ["-b", "8"]),
    "fsdp": (2, ["-b", "8", "--fsdp"]),
    "tp": (2, ["-b", "16", "--fsdp", "--tp", "2"]),
    "pp": (2, ["-b", "16", "--fsdp", "--pp", "2", "--pp-microbatches", "2"]),
    "pp-tp": (4, ["-b", "16", "--fsdp", "--pp", "2", "--tp", "2", "--pp-microbatches", "2"]),
    "hsdp": (4, ["-b", "4", "--fsdp", "--fsdp-replicate", "2"]),  # 2 replicas, each sharded over 2 ranks
}
# the data ranks x each one's batch a layout writes its checkpoints with ("ddp"'s: one process's, 1 x 16)
WRITTEN = {"ddp": "1 x 16", "fsdp": "2 x 8", "tp": "1 x 16", "pp": "1 x 16", "pp-tp": "1 x 16", "hsdp": "4 x 4"}
# the layouts HSDP is taken into and out of in the suite: its own sharded checkpoint read by plain FSDP and back,
# and the ordinary one's refusal both ways (DLOJZ_RESUME_MATRIX=full: every layout)
HSDP_PEERS = ("fsdp", "ddp")
STEPS = 2  # an epoch's
# where a saved run is picked up: the end of epoch 1, and a step into epoch 2
POINTS = {"end": STEPS, "mid": STEPS + 1}


def common(tiny_data):
    # 4 ranks on 2 cores: no CPU for a DataLoader worker; a cosine schedule: the learning rate moves every step
    flags = ["--num-workers", "0", "--drop-last", "--epochs", "2", "--train-subset", "0.5"]
    return [*BASE, "--data-root", tiny_data, *flags]


def pairs():
    names = list(LAYOUTS)
    every = [(a, b, point) for a in names for b in names if a != b for point in POINTS]
    if os.environ.get("DLOJZ_RESUME_MATRIX") == "full":
        return every
    # each unordered pair at both points, one each way; each layout saves and resumes at both
    turn = {(a, b): (names.index(a) + names.index(b) + (names.index(a) > names.index(b))) % 2 for a, b, _ in every}
    taken = [(a, b, point) for a, b, point in every if list(POINTS).index(point) == turn[a, b]]
    return [(a, b, point) for a, b, point in taken if "hsdp" not in (a, b) or {a, b} - {"hsdp"} <= set(HSDP_PEERS)]


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory):
    """Each sharded layout's uninterrupted run of 2 epochs, and one process's ("ddp": the ordinary checkpoints of a
    run without --fsdp, and the reference), a checkpoint at every log point, all kept."""
    out = tmp_path_factory.mktemp("matrix")
    for name, (ranks, flags) in {**LAYOUTS, "ddp": (1, ["-b", "16"])}.items():
        proc = run_dlojz(*common(tiny_data), *flags, "--checkpoint-every", "1e-9", "--keep-checkpoints", "0",
                         "--output-dir", out / name, ranks=ranks)  # fmt: skip
        assert proc.returncode == 0, show(proc)
        if name == "hsdp":  # 2 replicas of 2 shards, as the flag says (not FSDP over the 4 ranks)
            assert "sharded over 2 ranks in each of 2 replicas (HSDP" in proc.stdout, show(proc)
    return out


def at_step(folder, step):
    return next(path for path in ckpt.list_checkpoints(folder) if ckpt.load(path)["global_step"] == step)


def final(folder):
    state = checkpoint(folder)
    return state["model"], state["global_step"], [group["lr"] for group in state["optimizer"]["param_groups"]]


@pytest.mark.parametrize("before, after, point", pairs())
@pytest.mark.multirank
def test_a_run_goes_on_in_another_layout(saved, tiny_data, tmp_path, capsys, before, after, point):
    """Resumed at `point` of the `before` layout's run, the `after` layout ends where one process ends: weights,
    steps and learning rate; between ordinary and sharded checkpoints, refused in one line saying what to run, and
    the command it names (dlojz_fsdp.py shard or consolidate) makes the checkpoint that goes on."""
    step = POINTS[point]
    source = at_step(saved / before, step)
    ranks, flags = LAYOUTS[after]
    out = tmp_path / "run"
    proc = run_dlojz(*common(tiny_data), *flags, "--resume", source, "--output-dir", out, ranks=ranks)
    if before == "ddp":  # refused before the model is built, then done as the line says
        assert_one_line_error(proc, f"--resume {source}: --fsdp resumes training from sharded", "dlojz_fsdp.py shard")
        assert "model: timm:test_vit, " not in proc.stdout, proc.stdout  # (the build's line)
        assert dlojz_fsdp.main(["shard", str(source), str(out)]) == 0
        source = ckpt.load_latest(out)[1]
        assert capsys.readouterr().out.startswith(f"written: {source}: resume it with --fsdp --resume auto")
        assert dlojz_fsdp.main(["shard", str(at_step(saved / before, step)), str(out)]) == 2  # not over it
        assert (
            capsys.readouterr().err.strip()
            == f"dlojz_fsdp.py: error: {source} exists: give another folder, or remove it"
        )
        proc = run_dlojz(*common(tiny_data), *flags, "--resume", "auto", "--output-dir", out, ranks=ranks)
    elif after == "ddp":
        assert_one_line_error(proc, f"python dlojz_fsdp.py consolidate {source} OUT.pt")
        assert "model: timm:test_vit, " not in proc.stdout, proc.stdout
        assert dlojz_fsdp.main(["shard", str(source), str(tmp_path / "again")]) == 2
        assert "is already sharded: --resume it with --fsdp" in capsys.readouterr().err
        source = dlojz_fsdp.consolidate(source, tmp_path / "consolidated.pt")
        proc = run_dlojz(*common(tiny_data), *flags, "--resume", source, "--output-dir", out, ranks=ranks)
    assert proc.returncode == 0, show(proc)
    assert (
        f"resumed from {source} (epoch {step // STEPS + 1}, step {step % STEPS}/{STEPS}, global step {step})"
        in proc.stdout
    ), proc.stdout
    written = WRITTEN[before]
    if point == "mid" and written != ("2 x 8" if after == "ddp" else WRITTEN[after]):  # ("ddp" resumes on 2 ranks)
        assert f"a checkpoint written on {written}: the epoch goes on after its first 16 images" in proc.stdout
    assert all(ckpt.load(path)["global_step"] > step for path in ckpt.list_checkpoints(out) if path != source)
    weights, steps, lrs = final(out)
    expected, expected_steps, expected_lrs = final(saved / "ddp")
    assert_same_weights(weights, expected, atol=1e-5)
    assert steps == expected_steps == 2 * STEPS
    assert lrs == pytest.approx(expected_lrs)
