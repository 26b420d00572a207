"""dlojz_avg.py: the mean of a run's last checkpoints as one ordinary checkpoint (torchvision's MobileNetV3 recipe,
timm's avg_checkpoints.py), that --eval-only and --initial-checkpoint read; bad input is one line."""

import pytest
import torch
from conftest import TINY

import dlojz_avg
import dlojz_lib.checkpoint as ckpt


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, tiny_data):
    """Three epochs of a tiny run, every checkpoint kept."""
    import dlojz

    out = tmp_path_factory.mktemp("avg") / "run"
    argv = [*TINY, "--data-root", tiny_data, "--output-dir", out, "-e", "3", "--keep-checkpoints", "3", "--lr", "0.5"]
    assert dlojz.cli([str(a) for a in argv]) == 0
    return out


def test_the_average_is_the_mean_of_the_last_checkpoints_models(run_folder, tmp_path, capsys):
    averaged = tmp_path / "averaged.pt"
    assert dlojz_avg.main([str(run_folder), "--last", "2", "-o", str(averaged)]) == 0
    assert "the mean of 2 checkpoints" in capsys.readouterr().out
    last_two = ckpt.list_checkpoints(run_folder)[-2:]
    models = [ckpt.load(path)["model"] for path in last_two]
    result = ckpt.load(averaged)  # its checksum beside it: load checks it
    assert result["averaged_from"] == [str(path) for path in last_two] and result["ema"] is None
    moved = 0
    for name, value in result["model"].items():
        if value.is_floating_point():  # parameters and BatchNorm's running statistics
            torch.testing.assert_close(value, (models[0][name] + models[1][name]) / 2)
            moved += not torch.equal(models[0][name], models[1][name])
        else:  # num_batches_tracked: the newest's
            assert torch.equal(value, models[1][name]), name
    assert moved > 0  # the two checkpoints differ: the mean is not either of them


def test_an_averaged_checkpoint_is_evaluated_and_fine_tuned_from(run_folder, tiny_data, tmp_path, run_inline):
    averaged = tmp_path / "averaged.pt"
    assert dlojz_avg.main([str(run_folder), "--last", "3", "-o", str(averaged)]) == 0
    proc = run_inline(
        *TINY, "--data-root", tiny_data, "--eval-only", "--resume", averaged, "--output-dir", tmp_path / "e"
    )
    assert proc.returncode == 0 and "##EVALUATION##" in proc.stdout, proc.stderr
    proc = run_inline(
        *TINY, "--data-root", tiny_data, "--initial-checkpoint", averaged, "-e", "1", "--output-dir", tmp_path / "f"
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["{run}", "--last", "5"], "--last 5: "),
        (["{run}", "--last", "0"], "--last"),
        (["{first}"], "give two checkpoint files or more"),
        (["{first}", "{run}/latest"], "the pointer to the newest checkpoint"),
        (["{first}", "{last}", "-o", "{last}"], "also an input of this command"),
        (["{first}", "{last}", "-o", "{run}/missing/out.pt"], "missing/out.pt: its folder does not exist"),
        (["{run}", "--last", "2", "--improved", "2"], "not allowed with argument"),
        (["{first}", "{first}"], "given twice ({first}); each checkpoint counts once in the mean"),
        (["{first}", "{run}"], "{run}: a folder among checkpoint files; give a run folder alone with --last N"),
    ],
)
def test_bad_input_is_one_line(argv, fragment, run_folder, tmp_path, capsys):
    found = ckpt.list_checkpoints(run_folder)
    names = dict(run=run_folder, first=found[0], last=found[-1])
    argv = [word.format(**names) for word in argv]
    fragment = fragment.format(**names)
    if "-o" not in argv:
        argv += ["-o", str(tmp_path / "out.pt")]
    try:
        status = dlojz_avg.main(argv)
    except SystemExit as err:  # the parser's own one line (a number out of its bounds)
        status = err.code
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and fragment in err, err
    assert not (tmp_path / "out.pt").exists()


def test_improved_takes_the_newest_checkpoints_that_were_the_best_when_written(run_folder, tmp_path, monkeypatch):
    """torchvision's MobileNetV3 rule, "the last checkpoints that improved top-1": a checkpoint improved when the
    epoch it closes was the best validation so far (its best_epoch is its epoch); epochs 1 and 3 here, not 2."""
    from pathlib import Path

    found = ckpt.list_checkpoints(run_folder)
    assert dlojz_avg.improved_when_written(found[0])  # a run's first validation is its best so far
    real = ckpt.load
    fields = {found[0]: (1, 1), found[1]: (2, 1), found[2]: (3, 3)}  # (epoch, best_epoch) as written
    monkeypatch.setattr(
        ckpt, "load", lambda path: {**real(path), **dict(zip(("epoch", "best_epoch"), fields[Path(path)]))}
    )
    averaged = tmp_path / "averaged.pt"
    assert dlojz_avg.main([str(run_folder), "--improved", "2", "-o", str(averaged)]) == 0
    assert real(averaged)["averaged_from"] == [str(found[0]), str(found[2])]
    assert dlojz_avg.main([str(run_folder), "--improved", "3", "-o", str(tmp_path / "three.pt")]) == 2
