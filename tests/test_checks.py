"""Paths checked before any work (dlojz_lib.checks), in dlojz.py and its sibling scripts: an output that cannot be
written, a file name that is a folder, an input that cannot be read: one line naming the flag, exit status 2."""

import os
from pathlib import Path

import pytest
from conftest import SMALL
from test_dlojz import assert_one_line_error

from dlojz_lib.checks import UserError, check_output_file, check_output_folder


def refused(check, path, flag="--x"):
    with pytest.raises(UserError) as err:
        check(path, flag)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{flag} ")
    return str(err.value)


def test_output_files(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "is a folder: give a file name" in refused(check_output_file, tmp_path)
    assert f"{blocker} is a file, not a folder" in refused(check_output_file, blocker / "m.json")
    check_output_file(tmp_path / "new" / "m.json", "--x")  # a folder to make: made
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())  # the probe is removed
    check_output_file(blocker, "--x")  # an existing file: replaced by the run


def test_output_folders(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "is a file, not a folder" in refused(check_output_folder, blocker)
    assert f"run: {blocker} is a file, not a folder" in refused(check_output_folder, blocker / "run")
    assert "cannot write in /proc" in refused(check_output_folder, "/proc/dlojz-run")  # read-only for root too
    check_output_folder(tmp_path / "run", "--x")


@pytest.mark.parametrize("flag", ["--metrics-json", "--val-history"])
def test_a_dlojz_output_file_that_is_a_folder_is_refused_before_the_data_is_read(tmp_path, run_inline, flag):
    # --data-root does not exist: a check that waited for the data would report that first.
    proc = run_inline(*SMALL, "--data-root", tmp_path / "no-such-dir", flag, tmp_path, "--output-dir", tmp_path / "o")
    assert_one_line_error(proc, flag, "is a folder")


def test_the_test_mode_s_output_folder_is_checked_too(tmp_path, run_inline):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_inline(*SMALL, "--synthetic", "--test", "--output-dir", blocker)
    assert_one_line_error(proc, "--output-dir", "is a file, not a folder")


def test_chrono_plot_into_a_folder_that_cannot_be(tmp_path, capsys):
    import dlojz_lib.observers.chrono_report

    trace = tmp_path / "trace.json"
    trace.write_text('{"load_s": [], "forward_s": [], "backward_s": [], "step_s": []}')
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    status = dlojz_lib.observers.chrono_report.main(["plot", str(trace), "-o", str(blocker / "timeline.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "-o/--output" in err[0] and "is a file, not a folder" in err[0], err


@pytest.mark.parametrize("storage", ["{blocker}/study.journal", "sqlite:///{blocker}/x.db", "{folder}"])
def test_hpo_search_storage_that_cannot_be_written(tmp_path, capsys, storage):
    import dlojz_hpo

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    space = tmp_path / "space.toml"
    space.write_text("[lr]\nlow = 0.01\nhigh = 0.1\n")
    storage = storage.format(blocker=blocker, folder=tmp_path)
    status = dlojz_hpo.main(["search", "--study", "s", "--storage", storage, "--space", str(space), "--trials", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "--storage" in err[0], err
    assert "is a file, not a folder" in err[0] or "is a folder" in err[0], err


def test_hpo_report_out_that_is_a_file(tmp_path, capsys):
    import dlojz_hpo

    journal, blocker = tmp_path / "s.journal", tmp_path / "a-file"
    journal.write_text("")
    blocker.write_text("")
    status = dlojz_hpo.main(["report", "--study", "s", "--storage", str(journal), "--out", str(blocker)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "--out" in err[0] and "is a file, not a folder" in err[0], err


def test_fsdp_consolidate_onto_a_folder(tmp_path, capsys):
    import dlojz_fsdp

    status = dlojz_fsdp.main(["consolidate", str(tmp_path / "ckpt.dcp"), str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "is a folder: give a file name" in err[0], err


# ---------------------------------------------------------------- inputs that cannot be read (root reads everything:
# the refusals are simulated where the permission bits would not stop the test's user)
def test_an_unreadable_split_folder_is_named(tiny_data, monkeypatch):
    from pathlib import Path

    from dlojz_lib.checks import DataError
    from dlojz_lib.data.layout import find_layout

    iterdir = Path.iterdir

    def guarded(path):
        if path.name == "train":
            raise PermissionError(13, "Permission denied", str(path))
        return iterdir(path)

    monkeypatch.setattr(Path, "iterdir", guarded)
    with pytest.raises(DataError, match=r"/train: cannot be read \(Permission denied\); check its permissions"):
        find_layout(tiny_data)


def test_an_unreadable_class_folder_is_named_not_called_empty(tiny_data, monkeypatch):
    import dlojz_lib.data.layout
    from dlojz_lib.checks import DataError
    from dlojz_lib.data.datasets import build_datasets

    hidden = sorted((tiny_data / "train").iterdir())[1]
    walk = os.walk

    def walk_as_a_user(top, onerror=None, **kw):  # os.walk hands a folder it cannot list to onerror, then skips it
        if str(top) == str(hidden):
            onerror(PermissionError(13, "Permission denied", str(hidden)))
            return iter(())
        return walk(top, onerror=onerror, **kw)

    monkeypatch.setattr(dlojz_lib.data.layout.os, "walk", walk_as_a_user)  # (list_split's listing)
    with pytest.raises(DataError, match=rf"^{hidden}: cannot be read \(Permission denied\)"):
        build_datasets(tiny_data, None, None)


def test_an_unwritable_cache_for_the_embedded_data_set(tmp_path):
    from dlojz_lib.checks import DataError
    from dlojz_lib.data.embedded import make_embedded_dataset

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(DataError, match=r"cannot be written into .*a-file .*set XDG_CACHE_HOME"):
        make_embedded_dataset(blocker / "embedded", n_classes=1, train_per_class=1, val_per_class=1)


@pytest.mark.parametrize(
    "arch, fragment",
    [
        ("fasterrcnn_resnet50_fpn", "not a torchvision classification model"),  # would download a backbone
        ("resnet5O", "did you mean resnet50"),
        ("timm:resnet5O", "unknown timm model"),
    ],
)
def test_an_arch_that_is_no_classification_model_is_refused_before_the_data_is_read(
    tmp_path, run_inline, arch, fragment
):
    proc = run_inline(
        *SMALL[:2], *SMALL[4:], "--arch", arch, "--data-root", tmp_path / "no-such-dir", "--output-dir", tmp_path
    )
    assert_one_line_error(proc, f"--arch {arch}", fragment)


# ---------------------------------------------------------------- messages that say what is wrong
def test_resume_given_a_run_folder_says_so(tmp_path):
    import dlojz_lib.checkpoint as ckpt

    (tmp_path / "ckpt_e1_s10.pt").write_bytes(b"")
    (tmp_path / "ckpt_e2_s20.pt").write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match=r"is a folder, not a checkpoint: its newest is ckpt_e2_s20\.pt; "):
        ckpt.load(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"is a folder, not a checkpoint: give a checkpoint file"):
        ckpt.load((tmp_path / "empty").mkdir() or tmp_path / "empty")


def test_a_batch_larger_than_the_data_set_is_refused(tiny_data, tmp_path, run_inline):
    proc = run_inline(*SMALL, "--data-root", tiny_data, "-b", "100000", "--output-dir", tmp_path)
    assert_one_line_error(proc, "--batch-size 100000 is more than the 72 training images", "--batch-size 72 at most")


def test_a_pack_with_a_corrupt_manifest_is_named_as_such(tmp_path):
    from dlojz_lib.checks import DataError
    from dlojz_lib.data.datasets import build_datasets

    for split in ("train", "val"):
        (tmp_path / split / "cls").mkdir(parents=True)
    (tmp_path / "dlojz_pack.json").write_text("{not json")
    with pytest.raises(DataError, match=r"dlojz_pack\.json: unreadable"):
        build_datasets(tmp_path, None, None)


HPO_FREE = {
    "study": "a name",
    "storage": "a journal file or a database URL, checked writable before the search",
    "space": "a TOML file, read and checked key by key",
    "launch": "a command prefix (srun ...)",
    "out": "a folder, checked writable before the report",
}


def test_every_flag_of_dlojz_hpo_refuses_what_it_cannot_take(tmp_path, capsys):
    """The walk of test_config's, over dlojz_hpo.py's two commands: each option with a value has bounds or a reason."""
    import argparse

    from test_config import out_of_bounds

    import dlojz_hpo

    parser = dlojz_hpo.get_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    required = {
        "search": ["--study", "s", "--storage", str(tmp_path / "j"), "--space", "x.toml", "--trials", "1"],
        "report": ["--study", "s", "--storage", str(tmp_path / "j"), "--out", str(tmp_path)],
    }
    walked = 0
    for name, command in commands.items():
        for action in command._actions:
            if action.nargs == 0 or action.dest == "help":
                continue
            values = out_of_bounds(action)
            if not values:
                assert action.dest in HPO_FREE, f"dlojz_hpo {name} {action.option_strings[-1]} has no bounds"
                continue
            for value in values:
                with pytest.raises(SystemExit) as exit:
                    dlojz_hpo.main([name, *required[name], action.option_strings[-1], value])
                lines = capsys.readouterr().err.strip().splitlines()
                assert exit.value.code == 2 and len(lines) == 1, (name, action.dest, value, lines)
                assert action.option_strings[-1] in lines[0], lines
                walked += 1
    assert walked > 30


# ---------------------------------------------------------------- data that cannot train
def test_a_class_without_one_readable_training_image_is_refused(tmp_path):
    import shutil

    from dlojz_lib.checks import DataError
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.embedded import make_embedded_dataset

    data = make_embedded_dataset(tmp_path / "d", n_classes=3, train_per_class=4, val_per_class=1, size=(32, 32))
    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    for path in (broken / "train" / "square").iterdir():
        path.write_bytes(b"<html>not an image</html>")
    with pytest.raises(DataError, match=r"^class 'square': none of its 4 training images can be read"):
        build_datasets(broken, None, None)


def test_a_class_with_some_unreadable_images_is_a_warning(tmp_path, capsys):
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.embedded import make_embedded_dataset

    data = make_embedded_dataset(tmp_path / "d", n_classes=3, train_per_class=4, val_per_class=1, size=(32, 32))
    first = sorted((data / "train" / "square").iterdir())[0]
    first.write_bytes(b"")
    train, _, classes, _ = build_datasets(data, None, None)
    err = capsys.readouterr().err
    assert "class 'square': 1 of its 4 training images cannot be read" in err and len(train) == 12, err


def test_an_unreadable_image_is_named_once_not_every_epoch(tmp_path, capsys):
    from dlojz_lib.data.datasets import build_datasets
    from dlojz_lib.data.embedded import make_embedded_dataset

    data = make_embedded_dataset(tmp_path / "d", n_classes=2, train_per_class=3, val_per_class=1, size=(32, 32))
    bad = sorted((data / "train" / "square").iterdir())[1]
    bad.write_bytes(b"")
    train, _, _, _ = build_datasets(data, lambda image: 0, None)
    index = [path for path, _ in train.samples].index(str(bad))
    capsys.readouterr()
    for epoch in range(3):
        assert train[(epoch, index)] == (0, train.samples[index + 1][1])  # the next image takes its place
    assert capsys.readouterr().err.count(f"skipping unreadable image {bad}") == 1


def test_a_global_batch_larger_than_the_data_set_names_global_batch(tiny_data, tmp_path, run_inline):
    """A recipe's --global-batch on a small set: the advice is about the global batch, not the -b it chose."""
    proc = run_inline(*SMALL, "--data-root", tiny_data, "--global-batch", "256", "--output-dir", tmp_path)
    assert_one_line_error(proc, "--global-batch 256 makes 1 optimizer step", "give a smaller --global-batch")
    assert "--no-global-batch" in proc.stderr and "--grad-acc" not in proc.stderr
    proc = run_inline(  # a per-rank batch beyond a rank's share: the same advice
        *SMALL, "--data-root", tiny_data, "--global-batch", "256", "-b", "256", "--output-dir", tmp_path
    )
    assert_one_line_error(
        proc, "--global-batch 256 gives each of 1 process(es) 256 images", "--global-batch 72 at most"
    )


def test_every_command_goes_through_the_one_door(capsys):
    """Each sibling command's main (found by name) is checks.command's door, and no command catches a one-line
    error by hand; the door turns any OneLineError (a checkpoint's, a sweep's too) into one line and exit 2."""
    import ast
    import importlib.util

    from dlojz_lib.checkpoint import CheckpointError
    from dlojz_lib.checks import command
    from dlojz_lib.lab.sweep import LabError

    door = command("x")(lambda argv: 0).__code__
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.glob("dlojz_*.py")):
        source = path.read_text()
        if path.name == "dlojz_chrono.py":  # its command line is chrono_report's
            path = root / "dlojz_lib" / "observers" / "chrono_report.py"
            source = path.read_text()
        spec = importlib.util.spec_from_file_location(f"door_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.main.__code__ is door, path.name
        handlers = [
            ast.unparse(node.type)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ExceptHandler) and node.type is not None
        ]
        assert not [h for h in handlers if "UserError" in h or "CheckpointError" in h or "LabError" in h], path.name
    for error in (CheckpointError("a.pt: damaged"), LabError("bad grid\nsecond line")):

        def fails(argv, error=error):
            raise error

        assert command("dlojz_x.py")(fails)([]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dlojz_x.py: error: "), err
