"""The one rule for every file a command writes (dlojz_lib.checks.claim_output): a new file, or one of the
command's own kind (known by its content), or with --force any regular file; never a checkpoint, its checksum, a
run's args.toml, an image or a file of the user's without --force, never an input of the same command, a device node
or a pipe. Each command against each kind of victim: exit 2, one line naming the flag, the victim untouched."""

import ast
import io
import json
import os
import shutil
from pathlib import Path

import pytest

import dlojz_avg
import dlojz_export
import dlojz_fsdp
import dlojz_lib.checkpoint as ckpt
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


def two_checkpoints(run, tmp_path):
    """The run's newest checkpoint and a copy of it (with its checksum) elsewhere: what dlojz_avg.py averages (the
    same file twice is refused)."""
    checkpoint = sorted(run.glob("ckpt_e*.pt"))[-1]
    copy = tmp_path / "copy" / checkpoint.name
    if not copy.exists():
        copy.parent.mkdir(exist_ok=True)
        for source in (checkpoint, checkpoint.with_name(checkpoint.name + ".sha256")):
            shutil.copy(source, copy.parent)
    return [str(checkpoint), str(copy)]


def commands(run, image, trace, tmp_path):
    """{command: (main, argv writing to the victim at path, the flag named)}."""
    averaged = two_checkpoints(run, tmp_path)
    return {
        "dlojz_predict.py": (dlojz_predict.main, lambda v: [str(run), str(image), "-o", str(v)], "-o"),
        "dlojz_avg.py": (dlojz_avg.main, lambda v: [*averaged, "-o", str(v)], "-o"),
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


def test_force_replaces_a_file_but_never_an_input_or_a_device(trained_run, victims, tmp_path, capsys):
    averaged = two_checkpoints(trained_run, tmp_path)
    checkpoint = Path(averaged[0])
    notes = victims["a user's file"]
    assert dlojz_avg.main([*averaged, "-o", str(notes), "--force"]) == 0
    assert notes.read_bytes()[:2] == b"PK"  # a torch checkpoint (a zip) now
    for victim in (checkpoint, victims["a pipe"], victims["a device"]):
        before = state_of(victim)
        assert dlojz_avg.main([*averaged, "-o", str(victim), "--force"]) == 2
        assert state_of(victim) == before
    assert "also an input of this command" in capsys.readouterr().err


def test_force_never_replaces_a_file_inside_an_input_folder(trained_run, tiny_data, tmp_path, capsys):
    """--force replaces a file of another kind, never one of the command's inputs, folders' contents included: an
    image of the folder dlojz_predict.py reads, the .dcp folder's own dlojz.pt under consolidate."""
    images = shutil.copytree(Path(tiny_data) / "val", tmp_path / "imgs")
    victim = sorted(images.rglob("*.JPEG"))[0]
    before = victim.read_bytes()
    checkpoint = str(ckpt.load_latest(trained_run)[1])
    assert dlojz_predict.main([checkpoint, str(images), "-o", str(victim), "--force", "--arch", "resnet18"]) == 2
    assert victim.read_bytes() == before
    assert f"-o {victim}: a file inside {images}, an input of this command" in capsys.readouterr().err
    sharded = tmp_path / "ckpt_e0001_s000000009.dcp"
    sharded.mkdir()
    (sharded / "dlojz.pt").write_bytes(b"the sharded checkpoint's settings")
    assert dlojz_fsdp.main(["consolidate", str(sharded), str(sharded / "dlojz.pt"), "--force"]) == 2
    assert (sharded / "dlojz.pt").read_bytes() == b"the sharded checkpoint's settings"
    assert "an input of this command; give a path outside it" in capsys.readouterr().err


def test_a_command_replaces_its_own_output(trained_run, tiny_data, tmp_path, capsys):
    """Run twice to the same path: the second run replaces what the first wrote, which it knows by its content."""
    image = str(sorted(Path(tiny_data).rglob("*.JPEG"))[0])
    out = tmp_path / "out"
    runs = {
        "avg": (dlojz_avg.main, [*two_checkpoints(trained_run, tmp_path), "-o", str(out / "avg.pt")]),
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
    "dlojz_lib/checks.py",  # (dlojz.py's side outputs: check_side_outputs; a report folder's: claim_outputs_in)
    "dlojz_lib/lab/report.py", "dlojz_lib/hpo/search.py",  # (compare's --out; the report's --out and --storage)
}  # fmt: skip


def test_every_command_claims_its_outputs_through_the_rule():
    """A command module that checks an output file calls claim_output (or claim_outputs_in, for a folder's):
    check_output_file alone (writable, not a folder) would let it replace any file."""
    claimed, checked_only = set(), set()
    for path in [*ROOT.glob("dlojz*.py"), *ROOT.glob("dlojz_lib/**/*.py")]:
        calls = {
            node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
        }
        name = str(path.relative_to(ROOT))
        if calls & {"claim_output", "claim_outputs_in"}:
            claimed.add(name)
        elif "check_output_file" in calls:
            checked_only.add(name)
    assert claimed == WRITERS, claimed ^ WRITERS
    assert checked_only == set(), checked_only


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


# ---------------------------------------------------------------------------------------------------------------
# Report folders: dlojz_lab.py compare --out and dlojz_hpo.py report --out, each file by the rule; HPO's --storage.
@pytest.fixture
def sweep(tmp_path):
    """A sweep folder whose one run has not started: compare writes its compare.csv and no figure."""
    folder = tmp_path / "runs" / "s"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(
        json.dumps({"name": "s", "runs": [{"name": "r", "settings": {"b": "4"}, "argv": []}]})
    )
    return folder


def test_lab_compare_writes_only_its_own_files_in_out(sweep, tmp_path, capsys):
    import dlojz_lab

    out = tmp_path / "out"
    out.mkdir()
    user = out / "compare.csv"
    user.write_text("my table\n")
    assert dlojz_lab.main(["compare", str(sweep), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {user}: an existing file that is not a compare.csv" in err, err
    assert "add --force" in err and user.read_text() == "my table\n"
    (out / "phases.png").write_bytes(PNG)  # a figure of the user's, under a name compare draws
    user.unlink()
    assert dlojz_lab.main(["compare", str(sweep), "--out", str(out)]) == 2
    assert "phases.png: an existing file that is not a figure of dlojz_lab.py compare" in capsys.readouterr().err
    assert not user.exists()  # every file checked before any is written
    assert dlojz_lab.main(["compare", str(sweep), "--out", str(out), "--force"]) == 1  # (no run has figures)
    assert user.read_text().startswith("sweep,run,state") and (out / "phases.png").read_bytes() == PNG
    user.write_text("my table\n")
    assert dlojz_lab.main(["compare", str(sweep), "--out", str(out), "--force"]) == 1
    assert user.read_text().startswith("sweep,run,state")
    (out / "phases.png").unlink()  # (no run had figures: --force drew none over it)
    assert dlojz_lab.main(["compare", str(sweep), "--out", str(out)]) == 1  # its own, again: replaced
    assert dlojz_lab.main(["compare", str(sweep), "--out", str(out / "compare.csv")]) == 2  # a file, not a folder
    assert "is a file, not a folder" in capsys.readouterr().err


def test_lab_compare_knows_its_own_figures(tmp_path):
    """A figure compare drew carries its Software entry: a later compare replaces it, not another PNG."""
    from dlojz_lib.lab import report

    rows = [
        {"sweep": "s", "run": "a", "state": "done", "b": "1", "img_s": 10.0, "load_ms": 1.0, "forward_ms": 2.0,
         "backward_ms": 3.0, "step_ms": 7.0}
    ]  # fmt: skip
    figure = report.plot_phases(rows)
    assert figure is not None
    drawn = io.BytesIO()
    figure.savefig(drawn, format="png", metadata={"Software": report.PLOT_SOFTWARE})
    is_own = report.claimed_files()["phases.png"][1]
    kinds = {}
    for name, data in (("ours", drawn.getvalue()), ("theirs", PNG)):
        path = tmp_path / f"{name}.png"
        path.write_bytes(data)
        kinds[name] = is_own(path)
    assert kinds == {"ours": True, "theirs": False}


def test_lab_sweep_folder_is_the_sweep_s_own(tmp_path, monkeypatch, capsys):
    """A sweep never writes into a folder holding files of another kind (a run's output, a user's files)."""
    import dlojz_lab

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "taken"
    folder.mkdir(parents=True)
    (folder / "ckpt_e0001.pt").write_bytes(b"weights")
    assert dlojz_lab.main(["sweep", "--name", "taken", "--grid=batch-size=4,8", "--"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--name taken: runs/taken holds files that are not a sweep's (ckpt_e0001.pt)" in err
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt_e0001.pt"]
    (tmp_path / "runs" / "afile").write_text("x")
    assert dlojz_lab.main(["sweep", "--name", "afile", "--grid=batch-size=4,8", "--"]) == 2
    assert "--name afile: runs/afile is a file, not a folder" in capsys.readouterr().err


@pytest.fixture
def small_study(tmp_path):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    journal = tmp_path / "j.log"
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.optimize(lambda trial: trial.suggest_float("lr", 0.01, 0.1), n_trials=2)
    return journal


def test_hpo_report_writes_only_its_own_files_in_out(small_study, tmp_path, capsys):
    import dlojz_hpo

    out = tmp_path / "report"
    argv = ["report", "--study", "s", "--storage", str(small_study), "--out", str(out)]
    assert dlojz_hpo.main(argv) == 0
    capsys.readouterr()
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"trials.csv", "best.toml", "history.png"} <= set(written), written.keys()
    assert dlojz_hpo.main(argv) == 0  # its own files, again: replaced
    for name, victim in (("best.toml", b"lr = 0.5\n"), ("history.png", PNG), ("trials.csv", b"a,b\n")):
        for other in out.iterdir():
            other.unlink()
        (out / name).write_bytes(victim)
        assert dlojz_hpo.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {out / name}: an existing file that is not a" in err, err
        assert "add --force" in err and [p.name for p in out.iterdir()] == [name]  # nothing written
        assert (out / name).read_bytes() == victim
        assert dlojz_hpo.main([*argv, "--force"]) == 0
        assert (out / name).read_bytes() != victim
    (tmp_path / "trials.csv").write_bytes(small_study.read_bytes())  # the storage itself, under a report's name
    argv = ["report", "--study", "s", "--storage", str(tmp_path / "trials.csv"), "--out", str(tmp_path), "--force"]
    assert dlojz_hpo.main(argv) == 2
    assert "also an input of this command" in capsys.readouterr().err


def test_hpo_storage_is_a_study_s_or_new(small_study, tmp_path, capsys):
    """--storage names the study's journal (or SQLite file): a user's file, an image, a checkpoint are refused
    before any trial, and the journal that is one is taken."""
    from dlojz_lib.checks import UserError
    from dlojz_lib.hpo.search import check_storage

    check_storage(str(small_study))
    check_storage(str(tmp_path / "new.log"))
    check_storage(f"sqlite:///{tmp_path / 'new.db'}")
    for victim in (b"my notes\n", PNG, b"\x80\x02weights"):
        path = tmp_path / "victim"
        path.write_bytes(victim)
        with pytest.raises(UserError, match="--storage .*victim: an existing file that is not an Optuna journal"):
            check_storage(str(path))
        with pytest.raises(
            UserError, match="--storage \\(its SQLite file\\) .*: an existing file that is not a SQLite"
        ):
            check_storage(f"sqlite:///{path}")
        assert path.read_bytes() == victim
    import sqlite3

    sqlite3.connect(tmp_path / "real.db").execute("create table t (x)").connection.commit()
    check_storage(f"sqlite:///{tmp_path / 'real.db'}")


@pytest.mark.parametrize(
    "command", ["dlojz_predict.py", "dlojz_avg.py", "dlojz_fsdp.py consolidate", "dlojz_chrono.py plot"]
)
def test_force_never_replaces_a_run_s_own_files(command, trained_run, trace, tiny_data, tmp_path, capsys):
    """With --force, a command still refuses a run's own files (a checkpoint, its checksum, latest, best,
    args.toml: what a resume reads) in one line naming the flag, and leaves each untouched: a copy of the run here
    (dlojz_predict.py --force RUN/ckpt.pt IMAGES -o RUN/ckpt.pt.sha256 once replaced the checksum it had just read)."""
    run = shutil.copytree(trained_run, tmp_path / "run")
    image = sorted(Path(tiny_data).rglob("*.JPEG"))[0]
    main, argv, flag = commands(run, image, trace, tmp_path)[command]
    checkpoint = sorted(run.glob("ckpt_e*.pt"))[-1]
    if command == "dlojz_predict.py":  # (the checkpoint read, not the run's folder: the folder's files are inputs)
        argv = lambda v: [str(checkpoint), str(image), "-o", str(v)]  # noqa: E731
    own = [checkpoint, checkpoint.with_name(checkpoint.name + ".sha256"), run / "latest", run / "args.toml"]
    own += [run / "best"] if (run / "best").exists() else []
    for victim in own:
        before = state_of(victim)
        assert status_of(main, [*argv(victim), "--force"]) == 2, victim.name
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and flag in error and str(victim) in error, (victim.name, error)
        if "an input of this command" not in error:  # (dlojz_avg.py's checkpoint: one it reads)
            assert "a run's own file" in error and "even with --force" in error, error
        assert state_of(victim) == before, f"{command} changed {victim.name}"
