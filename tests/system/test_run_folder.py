"""Nothing lost, nothing hung: an output folder holds one run (refused when it holds another's checkpoints without
--resume, locked while a run writes in it, moved aside by --start-over); a run ends non-zero when a checkpoint it
cannot end without is not on disk (a full disk, a folder turned read-only: on a real tmpfs where the test can mount
one); side files never end a run; a named pipe with an image's name is skipped, never waited on; a failed requeue
is said and ends non-zero."""

import errno
import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL, script_python

import dlojz_lib.checkpoint as ckpt

TINY = [*SMALL, "--image-size", "16", "--val-resize-size", "18", "--val-crop-size", "16", "-b", "8", "--no-wandb"]
TINY += ["--num-workers", "0"]  # 72 train images: 9 steps an epoch


def run_args(tiny_data, out, *more):
    return [*TINY, "--data-root", tiny_data, "--output-dir", out, *more]


def one_error_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dlojz: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


# ----------------------------------------------------------------------------- one run in a folder
def test_a_folder_holding_a_run_is_refused_unless_resumed_or_started_over(tiny_data, tmp_path, run_inline):
    out, metrics = tmp_path / "run", tmp_path / "metrics.json"
    assert run_inline(*run_args(tiny_data, out, "-e", "1", "--metrics-json", metrics)).returncode == 0
    first = ckpt.list_checkpoints(out)
    saved = {path: path.read_bytes() for path in [*first, out / "latest", out / "args.toml", metrics]}

    again = run_inline(*run_args(tiny_data, out, "-e", "1", "--metrics-json", metrics))
    assert again.returncode == 2
    line = one_error_line(again)
    assert f"--output-dir {out} holds a run (its checkpoint {first[-1].name})" in line and "--resume auto" in line
    assert {path: path.read_bytes() for path in saved} == saved  # nothing of the first run touched

    # Resumed with no epoch left: said, and its metrics left as they were (not rewritten with 0 steps).
    done = run_inline(*run_args(tiny_data, out, "-e", "1", "--metrics-json", metrics, "--resume", "auto"))
    assert done.returncode == 0, done.stderr
    assert "nothing to train: the run has done its 1 epochs; give --epochs N > 1 to go on" in done.stdout
    assert {path: path.read_bytes() for path in saved} == saved  # args.toml too: it trained nothing

    over = run_inline(*run_args(tiny_data, out, "-e", "1", "--start-over"))
    assert over.returncode == 0, over.stderr
    (aside,) = out.glob("previous-*")
    assert f"--start-over: the run that was in {out} is now in {aside}" in over.stdout
    assert sorted(p.name for p in aside.glob("ckpt_*.pt")) == sorted(p.name for p in first)
    assert ckpt.load(out / ckpt.latest_name(out))["global_step"] == 9  # trained from scratch: one epoch, not two


def test_a_refused_run_leaves_the_run_s_record_and_its_rerun_goes_on(tiny_data, tmp_path, run_inline):
    """A run refused once it has claimed the folder (a checkpoint of another --arch, another number of classes)
    leaves the run's args.toml as it was: the documented rerun, --config args.toml --resume auto, goes on."""
    from test_resume import make_classes

    out = tmp_path / "run"
    assert run_inline(*run_args(tiny_data, out, "-e", "1")).returncode == 0
    record = (out / "args.toml").read_bytes()
    for more in (["--arch", "resnet34"], ["--data-root", make_classes(tmp_path / "four", 4)]):
        proc = run_inline(*run_args(tiny_data, out, "-e", "2", "--resume", "auto"), *more)
        assert proc.returncode == 2 and "a checkpoint of --arch" in one_error_line(proc)
        assert (out / "args.toml").read_bytes() == record, more
    proc = run_inline("--config", out / "args.toml", "--resume", "auto", "-e", "2")
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and b"-e 2" in (out / "args.toml").read_bytes()


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("args.toml", b"my notes on this experiment\n", "args.toml is not dlojz's (it would hold a run's settings)"),
        ("args.toml", None, "args.toml is not a file"),
        ("latest", b"the latest figures: 76.1%\n", "latest is not dlojz's (it would hold a checkpoint's name)"),
        ("best", None, "best is not a file"),
    ],
)
def test_a_file_of_the_user_s_under_a_record_s_name_is_not_replaced(tiny_data, tmp_path, run_inline, name, content,
                                                                     fragment):  # fmt: skip
    """The folder's args.toml, latest and best are the run's own only when their content says so: the user's own
    file (or a folder) of that name is refused in one line, and left as it was."""
    out = tmp_path / "run"
    out.mkdir()
    if content is None:
        (out / name).mkdir()
    else:
        (out / name).write_bytes(content)
    proc = run_inline(*run_args(tiny_data, out, "-e", "1"))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert f"--output-dir {out}: {out / name} " in line and fragment in line and "move it" in line, line
    assert (out / name).is_dir() if content is None else (out / name).read_bytes() == content
    assert not ckpt.list_checkpoints(out)


@pytest.mark.parametrize(
    "where, flags",
    [
        ("train/disc/run", []),  # a class folder of the training data
        ("val", []),
        ("runs", ["--test"]),  # (a --test run writes its traces there too)
        ("elsewhere", ["--tensorboard", "{data}/val/disc/tb"]),
    ],
)
def test_what_a_run_writes_is_never_inside_its_data_set(tiny_data, tmp_path, run_inline, where, flags):
    """--output-dir, --tensorboard's folder inside the data set: refused in one line naming the data root, before
    anything is written there (its next scan would read checkpoints and event files as images)."""
    data = shutil.copytree(tiny_data, tmp_path / "data")
    before = sorted(str(path) for path in data.rglob("*"))
    out = data / where if where != "elsewhere" else tmp_path / "run"
    proc = run_inline(*run_args(data, out, "-e", "1", *[flag.format(data=data) for flag in flags]))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert f"is inside the data set {data}" in line and "give a folder outside it" in line, line
    assert sorted(str(path) for path in data.rglob("*")) == before


def test_eval_only_into_a_folder_a_run_is_writing_in_is_refused(tiny_data, tmp_path, run_inline, trained_run):
    """--eval-only writes its results (per_class.csv, confusion.png) into --output-dir: it takes the folder's lock,
    and waits for no live run there (one line, nothing written)."""
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    before = {path: path.read_bytes() for path in out.iterdir() if path.is_file()}
    with open(out / ".dlojz.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = run_inline(*run_args(tiny_data, out, "--arch", "resnet18", "--eval-only", "--resume", "auto"))
        assert proc.returncode == 2 and "another run is writing there" in one_error_line(proc)
    assert {path: path.read_bytes() for path in out.iterdir() if path.is_file()} == before
    proc = run_inline(*run_args(tiny_data, out, "--arch", "resnet18", "--eval-only", "--resume", "auto"))
    assert proc.returncode == 0, proc.stderr
    assert (out / "per_class.csv").is_file() and (out / "args.toml").read_bytes() == before[out / "args.toml"]


def test_a_second_run_into_a_folder_a_run_is_writing_in_is_refused(tiny_data, tmp_path, run_inline):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".dlojz.lock").write_text("pid 4242 on node17\n")
    with open(out / ".dlojz.lock") as held:  # a run writing there (a flock is an open file's: held apart from cli's)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = run_inline(*run_args(tiny_data, out, "-e", "1"))
        assert proc.returncode == 2
        assert f"--output-dir {out}: another run is writing there (pid 4242 on node17)" in one_error_line(proc)
    assert not ckpt.list_checkpoints(out)
    stale = out / ".ckpt_e0001_s000000009.pt.x1y2.tmp"  # a write that died with its process
    stale.write_bytes(b"half a checkpoint")
    proc = run_inline(*run_args(tiny_data, out, "-e", "1"))  # the lock went with its holder
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists() and len(ckpt.list_checkpoints(out)) == 1
    assert run_inline(*run_args(tiny_data, out, "-e", "2", "--resume", "auto")).returncode == 0  # released at its end


def test_start_over_and_resume_together_are_refused(run_inline):
    proc = run_inline(*TINY, "--synthetic", "--start-over", "--resume", "auto")
    assert proc.returncode == 2 and "--start-over trains from scratch, --resume continues a run" in proc.stderr


# ----------------------------------------------------------------------------- checkpoints that did not reach the disk
@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mounted at tmp_path/disk (root only): `fill()` shrinks it to what it holds (the next write finds it
    full), `read_only()` remounts it read-only. Where no tmpfs can be mounted, the same errors are raised by
    torch.save (the checkpoint's write) and by the side files' writes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None
    if mounted:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(disk)]).returncode == 0
    state = dict(error=None)

    class Disk:
        path = disk
        real = mounted  # a tmpfs (else torch.save and the side files' writes fail by hand)

        def fill(self, room=0):
            self._set("size=" + str(max(shutil.disk_usage(disk).used + room, 4096)), errno.ENOSPC)

        def read_only(self):
            self._set("ro", errno.EROFS)

        def _set(self, option, code):
            if mounted:
                subprocess.run(["mount", "-o", f"remount,{option}", str(disk)], check=True)
            else:
                state["error"] = code

    if not mounted:
        real_save, real_write_text = torch.save, __import__("dlojz_lib.log").write_text

        def failing(real):
            def call(*args, **kwargs):
                if state["error"] is not None:
                    raise OSError(state["error"], os.strerror(state["error"]))
                return real(*args, **kwargs)

            return call

        mp = pytest.MonkeyPatch()
        mp.setattr(torch, "save", failing(real_save))
        mp.setattr("dlojz_lib.log.write_text", failing(real_write_text))
        mp.setattr("dlojz_lib.log.open", failing(open), raising=False)  # the validation history's appends
    try:
        yield Disk()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)])
        else:
            mp.undo()


def test_a_full_disk_under_avg_consolidate_and_shard_is_one_line_and_leaves_nothing_half_written(
    trained_run, small_disk, tmp_path, capsys
):
    """dlojz_avg.py, dlojz_fsdp.py consolidate and shard writing on a full disk: one line naming the disk, the
    space free and about what the checkpoint needs, exit 2; no temporary file or .dcp.tmp folder left there."""
    from test_output_rule import two_checkpoints

    import dlojz_avg
    import dlojz_fsdp

    checkpoints = [str(path) for path in ckpt.list_checkpoints(trained_run)]
    sharded = tmp_path / "sharded"
    assert dlojz_fsdp.main(["shard", checkpoints[-1], str(sharded)]) == 0
    source = ckpt.load_latest(sharded)[1]
    capsys.readouterr()
    small_disk.fill(room=256 * 1024)  # a folder can be made and a probe written: the checkpoints do not fit
    commands = [
        (dlojz_avg.main, [*two_checkpoints(trained_run, tmp_path), "-o", str(small_disk.path / "avg.pt")]),
        (dlojz_fsdp.main, ["consolidate", str(source), str(small_disk.path / "whole.pt")]),
    ]
    if small_disk.real:  # (torch.distributed.checkpoint writes with its own writer: a real full disk only)
        commands.append((dlojz_fsdp.main, ["shard", checkpoints[-1], str(small_disk.path / "resharded")]))
    for main, argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "no room on the disk of" in err and "MiB needed" in err, err
        assert "nothing half-written was left" in err and "Traceback" not in err
        left = [path.name for path in small_disk.path.rglob("*")]
        assert not [name for name in left if name.endswith(".tmp") or name.endswith(".pt")], left


def after_epochs(monkeypatch, n, then):
    """Call `then()` once the checkpoint of epoch `n` is on disk."""
    import dlojz

    real = dlojz.save_epoch_checkpoint

    def save_epoch_checkpoint(saver, state, periodic, log, best=False):
        real(saver, state, periodic, log, best)
        if state.epoch == n:
            saver.wait()
            then()

    monkeypatch.setattr(dlojz, "save_epoch_checkpoint", save_epoch_checkpoint)


def test_a_full_disk_at_the_last_checkpoint_ends_the_run_non_zero_naming_the_last_good_one(
    tiny_data, small_disk, run_inline, monkeypatch
):
    out, history = small_disk.path / "run", small_disk.path / "val_history.jsonl"
    after_epochs(monkeypatch, 1, small_disk.fill)
    flags = ["-e", "2", "--val-every", "2", "--val-history", history]  # its first line comes after the disk is full
    proc = run_inline(*run_args(tiny_data, out, *flags))
    assert proc.returncode == 5, proc.stderr
    assert "Validation Accuracy" in proc.stdout  # the epoch validated: its history was not kept, and the run went on
    assert f"WARNING: {history} not written (No space left on device); the run goes on" in proc.stderr
    good = out / "ckpt_e0001_s000000009.pt"
    assert one_error_line(proc) == (
        f"dlojz: error: the run's last checkpoint (ckpt_e0002_s000000018.pt) not written to {out} (No space left on "
        f"device): the last good checkpoint is {good}; free space in {out} (or give another --output-dir), then "
        "continue with --resume auto"
    )
    assert (out / "latest").read_text().strip() == good.name and ckpt.load(good)["global_step"] == 9


def test_a_folder_turned_read_only_warns_then_ends_non_zero_keeping_the_first_checkpoint(
    tiny_data, small_disk, run_inline, monkeypatch
):
    out = small_disk.path / "run"
    after_epochs(monkeypatch, 1, small_disk.read_only)
    proc = run_inline(*run_args(tiny_data, out, "-e", "3", "--metrics-json", out / "metrics.json"))
    assert proc.returncode == 5, proc.stderr
    assert proc.stderr.count("not written (Read-only file system)") == 3  # epochs 2 and 3, then the metrics
    assert f"WARNING: {out / 'metrics.json'} not written (Read-only file system); the run goes on" in proc.stderr
    assert "the last good checkpoint is " + str(out / "ckpt_e0001_s000000009.pt") in one_error_line(proc)


def test_a_full_disk_at_a_stop_is_not_a_clean_stop(tiny_data, tmp_path, run_inline, monkeypatch):
    import dlojz_lib.dist

    real_install = dlojz_lib.dist.StopSignal.install

    def signalled(self):  # SIGTERM already received: the run stops at its first step, with a checkpoint
        real_install(self)
        self.name = "SIGTERM"
        return self

    monkeypatch.setattr(dlojz_lib.dist.StopSignal, "install", signalled)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    out = tmp_path / "run"
    proc = run_inline(*run_args(tiny_data, out, "-e", "1"))
    assert proc.returncode == 5, proc.stderr
    assert "stopped cleanly" not in proc.stdout and "requeue" not in proc.stdout
    assert one_error_line(proc) == (
        f"dlojz: error: the checkpoint of the stop (SIGTERM) not written to {out} (No space): no checkpoint of this "
        f"run is on disk; free space in {out} (or give another --output-dir), then continue with --resume auto"
    )


# ----------------------------------------------------------------------------- special files, requeue
def test_a_named_pipe_with_an_image_s_name_is_skipped_never_waited_on(tiny_data, tmp_path, run_inline):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    pipe = next((data / "train").iterdir()) / "zz_pipe.jpg"
    os.mkfifo(pipe)
    proc = run_inline(*run_args(data, tmp_path / "run", "-e", "1"))  # (a blocking open would never return)
    assert proc.returncode == 0, proc.stderr
    assert f"WARNING: skipping unreadable image {pipe}" in proc.stderr and "not a regular file" in proc.stderr

    packed = subprocess.run(
        [*script_python(), str(ROOT / "dlojz_pack.py"), str(data), str(tmp_path / "packed")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert packed.returncode == 2, packed.stderr
    assert f"SRC file {pipe}: not a regular file (a named pipe, device or socket)" in packed.stderr


def test_a_failed_requeue_is_one_line_and_an_error(tmp_path, monkeypatch):
    import dlojz_lib.dist

    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text("#!/bin/sh\necho 'scontrol: error: Requested operation is presently disabled' >&2\nexit 1\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    cfg = type("Cfg", (), dict(test=False, requeue=True, output_dir=str(tmp_path / "run")))()
    ranks = type("Ranks", (), dict(is_main=True))()
    with pytest.raises(dlojz_lib.dist.RequeueFailed) as failed:
        dlojz_lib.dist.requeue(cfg, cfg.test, ranks, "SIGUSR1")
    assert str(failed.value) == (
        "scontrol requeue 777 failed (scontrol: error: Requested operation is presently disabled): the job is not "
        f"requeued; its checkpoint is kept: submit it again with --resume auto --output-dir {tmp_path / 'run'}"
    )
    Path(scontrol).write_text("#!/bin/sh\nexit 0\n")
    dlojz_lib.dist.requeue(cfg, cfg.test, ranks, "SIGUSR1")  # a requeue Slurm takes: no error
