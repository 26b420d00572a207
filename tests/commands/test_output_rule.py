"""The one rule for every file a command writes (dlojz_lib.checks.claim_output): a new file, or one of the
command's own kind (known by its content), or with --force any regular file; never a checkpoint, its checksum, a
run's args.toml, an image or a file of the user's without --force, never an input of the same command, a device node
or a pipe. Each command against each kind of victim: exit 2, one line naming the flag, the victim untouched."""

import ast
import json
import os
import shutil
from pathlib import Path

import pytest

import dlojz_avg
import dlojz_export
import dlojz_fsdp
import dlojz_predict
from dlojz_lib.observers import chrono_report

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(64)  # an image of the user's


def status_of(command, argv):
    try:
        return command(argv)
    except SystemExit as stop:  # (argparse's parser.error)
        return stop.code


@pytest.fixture
def victims(trained_run, tmp_path):
    """{kind: path} of files a command must not replace, copied from a finished run where they come from one."""
    folder = tmp_path / "victims"
    folder.mkdir()
    checkpoint = sorted(trained_run.glob("ckpt_e*.pt"))[-1]
    found = {
        "checkpoint": shutil.copy(checkpoint, folder),
        "checksum": shutil.copy(checkpoint.with_name(checkpoint.name + ".sha256"), folder),
        "args.toml": shutil.copy(trained_run / "args.toml", folder),
        "a user's file": folder / "notes.txt",
        "an image": folder / "photo.png",
        "a pipe": folder / "pipe",
        "a device": Path("/dev/null"),
    }
    found["a user's file"].write_text("my notes\n")
    found["an image"].write_bytes(PNG)
    os.mkfifo(found["a pipe"])
    return {kind: Path(path) for kind, path in found.items()}


def state_of(path):
    info = path.stat()
    return (info.st_mode, info.st_rdev, path.read_bytes() if path.is_file() else None)


def commands(run, image, trace, tmp_path):
    """{command: (main, argv writing to the victim at path, the flag named)}."""
    checkpoint = str(sorted(run.glob("ckpt_e*.pt"))[-1])
    return {
        "dlojz_predict.py": (dlojz_predict.main, lambda v: [str(run), str(image), "-o", str(v)], "-o"),
        "dlojz_avg.py": (dlojz_avg.main, lambda v: [checkpoint, checkpoint, "-o", str(v)], "-o"),
        "dlojz_fsdp.py consolidate": (
            dlojz_fsdp.main,
            lambda v: ["consolidate", str(tmp_path / "ckpt_e0001_s000000001.dcp"), str(v)],
            "target",
        ),
        "dlojz_chrono.py plot": (chrono_report.main, lambda v: ["plot", str(trace), "-o", str(v)], "-o/--output"),
    }


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "chrono_trace.json"
    path.write_text(json.dumps({key: [0.01, 0.01] for key in chrono_report.TRACE_LISTS}))
    return path


@pytest.mark.parametrize(
    "command", ["dlojz_predict.py", "dlojz_avg.py", "dlojz_fsdp.py consolidate", "dlojz_chrono.py plot"]
)
def test_a_command_replaces_no_file_of_another_kind(command, victims, trained_run, trace, tiny_data, tmp_path, capsys):
    image = sorted(Path(tiny_data).rglob("*.JPEG"))[0]
    main, argv, flag = commands(trained_run, image, trace, tmp_path)[command]
    for kind, victim in victims.items():
        before = state_of(victim)
        assert status_of(main, argv(victim)) == 2, kind
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and flag in error and str(victim) in error, (kind, error)
        assert state_of(victim) == before, f"{command} changed {kind}"
        if kind in ("a pipe", "a device"):
            assert "not a regular file" in error, error
        else:
            assert "--force" in error, error


def test_force_replaces_a_file_but_never_an_input_or_a_device(trained_run, victims, capsys):
    checkpoint = sorted(trained_run.glob("ckpt_e*.pt"))[-1]
    notes = victims["a user's file"]
    assert dlojz_avg.main([str(checkpoint), str(checkpoint), "-o", str(notes), "--force"]) == 0
    assert notes.read_bytes()[:2] == b"PK"  # a torch checkpoint (a zip) now
    for victim in (checkpoint, victims["a pipe"], victims["a device"]):
        before = state_of(victim)
        assert dlojz_avg.main([str(checkpoint), str(checkpoint), "-o", str(victim), "--force"]) == 2
        assert state_of(victim) == before
    assert "also an input of this command" in capsys.readouterr().err


def test_a_command_replaces_its_own_output(trained_run, tiny_data, tmp_path, capsys):
    """Run twice to the same path: the second run replaces what the first wrote, which it knows by its content."""
    checkpoint = str(sorted(trained_run.glob("ckpt_e*.pt"))[-1])
    image = str(sorted(Path(tiny_data).rglob("*.JPEG"))[0])
    out = tmp_path / "out"
    runs = {
        "avg": (dlojz_avg.main, [checkpoint, checkpoint, "-o", str(out / "avg.pt")]),
        "predict": (dlojz_predict.main, [str(trained_run), "--top-k", "2", image, "-o", str(out / "p.csv")]),
        "export": (
            dlojz_export.main,
            [str(trained_run), "--format", "safetensors", "--check-images", image, "-o", str(out / "exported")],
        ),
    }
    out.mkdir()
    for name, (main, argv) in runs.items():
        assert main(argv) == 0, (name, capsys.readouterr().err)
        assert main(argv) == 0, (name, capsys.readouterr().err)


def test_an_export_replaces_no_file_in_its_folder_that_it_did_not_write(trained_run, tiny_data, tmp_path, capsys):
    image = str(sorted(Path(tiny_data).rglob("*.JPEG"))[0])
    folder = tmp_path / "run-copy"
    folder.mkdir()
    argv = [str(trained_run), "--format", "safetensors", "--check-images", image, "-o", str(folder)]
    for name in ("preprocessing.json", "model.safetensors"):
        mine = folder / name
        mine.write_text('{"mine": 1}\n')
        assert dlojz_export.main(argv) == 2
        assert mine.read_text() == '{"mine": 1}\n' and name in capsys.readouterr().err
        mine.unlink()
    assert dlojz_export.main(argv) == 0
    written = folder / "model.safetensors"
    written.write_bytes(written.read_bytes() + b"changed by the user")  # no longer what the export recorded
    assert dlojz_export.main(argv) == 2 and "model.safetensors" in capsys.readouterr().err


WRITERS = {  # every command's module that writes a file a user names, and the call that claims it
    "dlojz_predict.py", "dlojz_avg.py", "dlojz_export.py", "dlojz_fsdp.py", "dlojz_lib/observers/chrono_report.py",
    "dlojz_lib/checks.py",  # (dlojz.py's side outputs: check_side_outputs)
}  # fmt: skip


def test_every_command_claims_its_outputs_through_the_rule():
    """A command module that checks an output file calls claim_output: check_output_file alone (writable, not a
    folder) would let it replace any file. The one exception writes what it also reads: an HPO study's storage."""
    claimed, checked_only = set(), set()
    for path in [*ROOT.glob("dlojz*.py"), *ROOT.glob("dlojz_lib/**/*.py")]:
        calls = {
            node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
        }
        name = str(path.relative_to(ROOT))
        if "claim_output" in calls:
            claimed.add(name)
        elif "check_output_file" in calls:
            checked_only.add(name)
    assert claimed == WRITERS, claimed ^ WRITERS
    assert checked_only == {"dlojz_lib/hpo/search.py"}, checked_only


def test_a_run_s_side_output_is_never_a_device_or_a_pipe(victims):
    """dlojz.py --predictions /dev/full, run as root, replaced the device node with its CSV (the atomic rename)."""
    from dlojz_lib.checks import UserError, check_side_outputs

    for kind in ("a pipe", "a device"):
        with pytest.raises(UserError, match="--predictions .*: not a regular file"):
            check_side_outputs({"--predictions": (str(victims[kind]), "predictions")})


def test_the_advice_for_a_sharded_checkpoint_is_a_command_that_parses(monkeypatch, tmp_path):
    """dlojz_predict.py and dlojz_export.py on a sharded checkpoint say how to consolidate it: with the arguments
    dlojz_fsdp.py consolidate takes (its advice named an -o the command does not have)."""
    import shlex

    import dlojz_lib.checkpoint as ckpt
    from dlojz_lib.checks import UserError
    from dlojz_lib.inference import load_for_inference

    sharded = tmp_path / "ckpt_e0001_s000000009.dcp"
    monkeypatch.setattr(ckpt, "load", lambda path: {"sharded_path": str(path)})
    with pytest.raises(UserError) as refused:
        load_for_inference(sharded)
    advice = str(refused.value).split("python ", 1)[1].split(", then")[0]
    words = shlex.split(advice)
    assert words[:2] == ["dlojz_fsdp.py", "consolidate"], advice
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(dlojz_fsdp, "consolidate", lambda source, target: Path(target).write_bytes(b"consolidated"))
    assert dlojz_fsdp.main(words[1:]) == 0  # the advice, as typed
    assert (tmp_path / words[-1]).read_bytes() == b"consolidated"
    with pytest.raises(SystemExit) as old:  # the advice it gave: an -o the command does not have
        dlojz_fsdp.main(["consolidate", str(sharded), "-o", "out.pt"])
    assert old.value.code == 2
