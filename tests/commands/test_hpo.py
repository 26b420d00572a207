"""dlojz_hpo.py: Optuna searches over dlojz.py runs, and the dlojz.py flags they use (--train-subset,
--val-history, --no-requeue, SIGUSR2).

Searches run as a user runs them (subprocesses, each trial a dlojz.py run on the tiny data set at 16 px, started by
the worker through --launch as a fork of the tests' preloaded server); the search-space checks run in this process.
The Slurm job array runs on the one-node test cluster, its trials fresh interpreters as a user's are.

Modules: dlojz_lib/hpo/ (the space, the search, and dlojz_lib/hpo/report.py: its CSV, figures and recipe)."""

import csv
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import preloaded
import pytest
from conftest import ROOT, SMALL, TINY, clean_env, read_json, run_dlojz, script_python, show
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

# torchvision's resnet18: the Slurm job array's trials are fresh interpreters, where timm's import costs more than
# it saves at 16 px; the trials forked from the preloaded server (timm imported) train timm's test ResNet, the
# smallest model that shows a trial validate, fail, get pruned and resume
TRIAL = [*TINY, "--arch", "resnet18"]
PRELOADED_TRIAL = TINY
SPACE = "[lr]\nlow = 0.01\nhigh = 0.3\nlog = true\n[label-smoothing]\nlow = 0.0\nhigh = 0.2\n"


def write_space(folder, text=SPACE):
    path = Path(folder) / "space.toml"
    path.write_text(text)
    return path


def hpo(*args, timeout=600, env=None):
    """dlojz_hpo.py ARGS run to its end, as a fork of the preloaded server (script_python) where the environment
    allows; hpo_popen's workers, which the tests kill, are fresh interpreters (a fork outlives its client's SIGKILL)."""
    env = env or clean_env()
    return subprocess.run(
        [*script_python(env), str(ROOT / "dlojz_hpo.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def hpo_popen(*args, log):
    return subprocess.Popen(
        [sys.executable, str(ROOT / "dlojz_hpo.py"), *map(str, args)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=clean_env(),
        cwd=ROOT,
    )


def load(storage, study):
    if "://" in str(storage):  # a database URL
        return optuna.load_study(study_name=study, storage=str(storage))
    backend = optuna.storages.journal.JournalFileBackend(str(storage))
    return optuna.load_study(study_name=study, storage=optuna.storages.JournalStorage(backend))


def search_args(
    tmp_path, data, *options, study="s", trial_flags=("--epochs", "1"), storage=None, launch=None, trial=None
):
    """`launch`: the trials' launcher prefix (preloaded_launch: forks of the tests' preloaded server); `trial`: the
    trials' model flags (default: PRELOADED_TRIAL for forked trials, else TRIAL)."""
    return [
        "search",
        *(["--launch", launch] if launch else []),
        "--study",
        study,
        "--storage",
        storage or tmp_path / "j.log",
        "--space",
        write_space(tmp_path),
        "--poll-interval",
        "0.2",
        *options,
        "--",
        *(trial or (PRELOADED_TRIAL if launch else TRIAL)),
        "--data-root",
        data,
        "--output-dir",
        tmp_path / "out",
        *trial_flags,
    ]


@pytest.fixture(scope="module")
def preloaded_launch():
    """--launch for the trials of the searches run here: each trial is still its own process started by the worker
    (its signals, its exit status, its death with the worker), a fork of the preloaded server instead of a fresh
    interpreter (4-5 s of imports). The search on Slurm runs its trials as a user's do."""
    return shlex.join(preloaded.launch_prefix(clean_env()))


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


# ---------------------------------------------------------------- dlojz.py: --train-subset, --val-history, stops
def subset_paths(root, spec, seed):
    from dlojz_lib.data.datasets import build_datasets, select_train_subset

    train, _, _, _ = build_datasets(root, None, None, seed=seed)
    line = select_train_subset(train, spec)
    return [(Path(p).name, t) for p, t in train.samples], line


def test_train_subset_is_stratified_and_the_same_whatever_the_seed_and_process(tiny_data):
    quarter, line = subset_paths(tiny_data, 0.25, seed=1)
    assert [t for _, t in quarter].count(0) == [t for _, t in quarter].count(2) == 6, quarter  # 24 per class
    assert "18 of 72 training images" in line, line
    assert subset_paths(tiny_data, 0.25, seed=99)[0] == quarter  # not tied to --seed: every trial sees these
    # Another interpreter (another hash seed) picks the same images.
    code = (
        f"import json, sys; sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT / 'tests' / 'commands')!r}]; from test_hpo import subset_paths; "
        f"print(json.dumps(subset_paths({str(tiny_data)!r}, 0.25, 5)[0]))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(PYTHONHASHSEED="7"),
        cwd=ROOT,
    )
    assert [tuple(s) for s in json.loads(other.stdout)] == quarter, other.stderr
    per_class, _ = subset_paths(tiny_data, 5, seed=1)
    assert sorted({t: [x for _, x in per_class].count(t) for t in range(3)}.values()) == [5, 5, 5]
    assert len(subset_paths(tiny_data, 100, seed=1)[0]) == 72  # more than a class has: all of it
    from dlojz_lib.data.datasets import build_datasets

    every = [Path(p).name for p, t in build_datasets(tiny_data, None, None)[0].samples if t == 0]
    assert [name for name, t in quarter if t == 0] != every[:6]  # a random pick, not the first files of the class


def test_train_subset_and_val_history_reach_the_run(tiny_data, tmp_path):
    history = tmp_path / "history.jsonl"
    proc = run_dlojz(
        *TRIAL,
        "--data-root",
        tiny_data,
        "--epochs",
        "2",
        "--train-subset",
        "0.5",
        "--output-dir",
        tmp_path / "run",
        "--metrics-json",
        tmp_path / "m.json",
        "--val-history",
        history,
    )
    assert proc.returncode == 0, show(proc)
    metrics = read_json(tmp_path / "m.json")
    assert metrics["steps"] == 2 * 5, metrics  # 36 of 72 images, -b 8: 5 steps per epoch (9 without the subset)
    assert "--train-subset 0.5: 36 of 72 training images" in proc.stdout
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1, 2] and [line["steps"] for line in lines] == [5, 10], lines
    assert lines[-1]["val_accuracy"] == metrics["val_accuracy"] and lines[-1]["val_images"] == 15, lines
    assert lines[0]["elapsed_s"] < lines[1]["elapsed_s"]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--train-subset", "0"], "--train-subset: must be > 0"),
        (["--train-subset", "2.5"], "--train-subset is a fraction"),
        (["--train-subset", "0.1", "--synthetic"], "--train-subset picks images"),
    ],
)
def test_train_subset_bad_values_are_one_line(run_inline, flags, needle):
    proc = run_inline(*SMALL, *flags)
    assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_usr2_and_no_requeue_stop_without_requeue(monkeypatch, capsys):
    import dlojz_lib.dist

    calls = []
    monkeypatch.setattr(
        dlojz_lib.dist.subprocess, "run", lambda args, **kw: calls.append(args) or subprocess.CompletedProcess(args, 0)
    )
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    ranks = SimpleNamespace(is_main=True)
    cfg = SimpleNamespace(test=False, requeue=True, output_dir="out")
    dlojz_lib.dist.requeue(cfg, cfg.test, ranks, "SIGUSR1")
    assert calls == [["scontrol", "requeue", "42"]]
    dlojz_lib.dist.requeue(cfg, cfg.test, ranks, "SIGUSR2")
    dlojz_lib.dist.requeue(SimpleNamespace(**{**vars(cfg), "requeue": False}), cfg.test, ranks, "SIGUSR1")
    assert len(calls) == 1, calls
    assert capsys.readouterr().out.count("stopped cleanly; continue with --resume auto") == 2
    saved = signal.getsignal(signal.SIGUSR2)
    try:
        stop = dlojz_lib.dist.StopSignal().install()
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_for(lambda: stop.name is not None, 5, "SIGUSR2 not received")
        assert stop.name == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR2, saved)


def test_dataloader_workers_survive_usr2():
    # srun passes a signal to every process of the step: a DataLoader worker must not die of the pruner's USR2.
    code = (
        "import os, signal, time, dlojz_lib.data.loaders; dlojz_lib.data.loaders._worker_init(0, os.getppid()); os.kill(os.getpid(), signal.SIGUSR2); "
        "time.sleep(0.2); print('alive')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env()
    )
    assert proc.stdout.strip() == "alive", proc.stderr


def test_wandb_group_reaches_wandb_init(monkeypatch, tmp_path):
    import dlojz_lib.log

    seen = {}
    fake = SimpleNamespace(init=lambda **kwargs: seen.update(kwargs) or SimpleNamespace(id="x"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = SimpleNamespace(
        wandb=True,
        test=False,
        eval_only=False,
        findlr=False,
        wandb_mode="offline",
        wandb_project="p",
        output_dir=str(tmp_path),
        wandb_group="study-7",
    )
    dlojz_lib.log.start_wandb(cfg, {}, "trial-0003", None)
    assert seen["group"] == "study-7" and seen["name"] == "trial-0003", seen


def test_trial_energy_is_read_on_the_visible_gpus(monkeypatch):
    import dlojz_lib.hpo.search

    energy = {0: 1_000, 1: 20_000, 2: 300_000, 3: 4_000_000}  # mJ
    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetTotalEnergyConsumption=lambda handle: energy[handle],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert dlojz_lib.hpo.search.gpu_energy_mj() == 4_020_000
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert dlojz_lib.hpo.search.gpu_energy_mj() == 4_321_000
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: no figure, no failure
    assert dlojz_lib.hpo.search.gpu_energy_mj() is None


# ---------------------------------------------------------------- the search space and the shared flags
@pytest.mark.parametrize(
    "space, needle",
    [
        ("[lrr]\nlow = 0.1\nhigh = 1.0\n", "[lrr]: not a dlojz.py flag (did you mean [lr]?)"),
        ("[lr]\nlow = 0.5\nhigh = 0.5\n", "[lr]: empty range, low 0.5 must be below high 0.5"),
        ("[epochs]\nlow = 1.5\nhigh = 3\n", "[epochs] low must be an integer"),
        ("[lr]\nlow = 'a'\nhigh = 1.0\n", "[lr] low must be a number"),
        ("[optimizer]\nchoices = ['sgd', 'adamx']\n", "[optimizer] choice must be one of"),
        ("[optimizer]\nlow = 1\nhigh = 2\n", "[optimizer]: --optimizer is not a number: give choices"),
        ("[output-dir]\nchoices = ['a']\n", "[output-dir]: dlojz_hpo.py sets --output-dir for each trial itself"),
        ("lr = 0.1\n", "[lr] must be a table"),
        ("[wd]\nlow = 0.0\nhigh = 1.0\nlog = true\n", "[wd]: a log range needs low > 0"),
        ("[lr]\nlow = 0.0\nhigh = 1.0\n", "[lr] low must be > 0 (got 0.0)"),
        ("[lr]\nlow = 0.1\nhigh = 1.0\nstpe = 0.1\n", "[lr]: unknown or mixed keys ['stpe']"),
        ("[lr]\nchoices = []\n", "[lr]: choices must be a non-empty list"),
        (
            "[warmup-epochs]\nlow = -1.0\nhigh = 2.0\n",
            "[warmup-epochs] low must be >= 0 (got -1.0)",
        ),
        ("", "no flag to search"),
        ("[lr\n", "not valid TOML"),
    ],
)
def test_a_bad_search_space_is_one_line_naming_the_key(tmp_path, capsys, space, needle):
    import dlojz_hpo

    status = dlojz_hpo.main(
        [
            "search",
            "--study",
            "s",
            "--storage",
            str(tmp_path / "j.log"),
            "--space",
            str(write_space(tmp_path, space)),
            "--trials",
            "1",
            "--",
            *TRIAL,
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("dlojz_hpo.py: error: --space"), err
    assert needle in err, err
    assert not (tmp_path / "j.log").exists()  # nothing started


@pytest.mark.parametrize(
    "shared, needle",
    [
        (["--bogus"], "after --: unrecognized arguments: --bogus"),
        (["--metrics-json", "m.json"], "dlojz_hpo.py sets --metrics-json for each trial itself"),
        (["--lr", "0.1"], "--lr is also in --space"),
        (["--lr-scheduler", "nope"], "after --: argument --lr-scheduler: invalid choice"),
        (["--data-root", "/nonexistent/imagenet"], "after --: --data-root /nonexistent/imagenet: no such directory"),
    ],
)
def test_bad_shared_flags_are_one_line(tmp_path, capsys, shared, needle):
    import dlojz_hpo

    status = dlojz_hpo.main(
        [
            "search",
            "--study",
            "s",
            "--storage",
            str(tmp_path / "j.log"),
            "--space",
            str(write_space(tmp_path)),
            "--trials",
            "1",
            "--",
            *TRIAL,
            *shared,
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and needle in err, err


def test_a_database_without_its_driver_is_one_line_without_its_password(tmp_path, capsys):
    """--storage mysql://... where PyMySQL is not installed: one line saying so (Optuna's ImportError was a
    traceback), the password left out of it, nothing started."""
    import dlojz_hpo

    pytest.importorskip("sqlalchemy")
    if importlib.util.find_spec("pymysql") or importlib.util.find_spec("MySQLdb"):
        pytest.skip("a MySQL driver is installed here")  # (not in requirements.txt: the CI has none)
    argv = ["search", "--study", "s", "--storage", "mysql://dlojz:secret@db.example/hpo", "--space",
            str(write_space(tmp_path)), "--trials", "1", "--", *TRIAL]  # fmt: skip
    status = dlojz_hpo.main(argv)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "secret" not in err, err
    assert "--storage mysql://dlojz:***@db.example/hpo: the Python driver of this database is not installed" in err


@pytest.mark.parametrize(
    "options, needle",
    [
        (["--pruner", "threshold", "--prune-below", "1.5"], "argument --prune-below: must be in [0, 1] (got 1.5)"),
        (["--pruner", "median", "--prune-below", "0.5"], "--prune-below is the threshold pruner's: --pruner median"),
    ],
)
def test_a_prune_threshold_that_cannot_act_is_one_line(tmp_path, capsys, options, needle):
    """Every --objective is a share (a threshold above 1 prunes every trial at its first validation), and only the
    threshold pruner reads one."""
    import dlojz_hpo

    argv = ["search", "--study", "s", "--storage", str(tmp_path / "j.log"), "--space", str(write_space(tmp_path)),
            "--trials", "1", *options, "--", *TRIAL]  # fmt: skip
    try:
        status = dlojz_hpo.main(argv)
    except SystemExit as exit:  # (argparse's own line)
        status = exit.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "j.log").exists()  # nothing started


def test_minimize_needs_a_target(tmp_path, capsys):
    import dlojz_hpo

    status = dlojz_hpo.main(
        [
            "search",
            "--study",
            "s",
            "--storage",
            str(tmp_path / "j.log"),
            "--space",
            str(write_space(tmp_path)),
            "--trials",
            "1",
            "--direction",
            "minimize",
            "--",
            *TRIAL,
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "give --target-accuracy" in err, err


def test_flag_words():
    import dlojz_lib.hpo.space
    from dlojz_lib.settings.flags import get_args_parser

    actions = dlojz_lib.hpo.space.flag_actions(get_args_parser())
    assert dlojz_lib.hpo.space.flag_argv(actions["channels_last"], False) == ["--no-channels-last"]
    assert dlojz_lib.hpo.space.flag_argv(actions["blurpool"], True) == ["--blurpool"]
    assert dlojz_lib.hpo.space.flag_argv(actions["blurpool"], False) == ["--no-blurpool"]  # over a recipe too
    assert dlojz_lib.hpo.space.flag_argv(actions["batch_size"], 64) == ["--batch-size", "64"]


def test_a_beating_trial_is_left_alone_and_a_silent_one_is_failed_and_retried(tmp_path):
    import dlojz_lib.hpo.search

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "j.log")))
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    trial = study.ask({"lr": optuna.distributions.FloatDistribution(0.01, 1.0, log=True)})
    trial.report(0.3, step=1)
    heartbeat = dlojz_lib.hpo.search.Heartbeat(trial, interval=0.2)
    heartbeat.start()
    time.sleep(1.5)
    dlojz_lib.hpo.search.fail_stale_trials(study, stale_after=0.8)  # started 1.5 s ago, but beating
    assert [t.state.name for t in study.get_trials()] == ["RUNNING"]
    heartbeat.stopped.set()
    heartbeat.join()
    time.sleep(1.0)
    dlojz_lib.hpo.search.fail_stale_trials(study, stale_after=0.8)
    failed, retry = study.get_trials()
    assert (failed.state.name, retry.state.name) == ("FAIL", "WAITING")
    assert retry.params == failed.params and retry.system_attrs["failed_trial"] == 0
    assert retry.intermediate_values == {1: 0.3}  # the pruner keeps what it saw


# ---------------------------------------------------------------- searches
@pytest.mark.parametrize("kind", ["journal", "database"])
def test_a_pruner_that_prunes_everything_stops_trials_after_their_first_validation(
    tiny_data, tmp_path, kind, preloaded_launch
):
    """In a journal file, and in a database (Optuna's RDB storage, here SQLite) for sites that have one."""
    storage = tmp_path / "j.log" if kind == "journal" else f"sqlite:///{tmp_path / 'study.db'}"
    trials = 2 if kind == "journal" else 1
    proc = hpo(
        *search_args(
            tmp_path,
            tiny_data,
            "--trials",
            trials,
            "--pruner",
            "threshold",
            "--prune-below",
            "1",  # (a top-1 below 1: every trial on these 15 images after an epoch)
            trial_flags=("--epochs", "30"),
            storage=storage,
            launch=preloaded_launch,
            trial=TRIAL,  # (resnet18's epochs, long enough for the worker's verdict to come after the first)
        )
    )
    assert proc.returncode == 0, show(proc)
    study = load(storage, "s")
    assert [t.state.name for t in study.trials] == ["PRUNED"] * trials, show(proc)
    for trial in study.trials:
        folder = Path(trial.user_attrs["output_dir"])
        assert list(trial.intermediate_values) == [1], trial.intermediate_values
        metrics = read_json(folder / "metrics.json")
        assert metrics["stopped_by"] == "SIGUSR2" and metrics["epochs"] < 30, metrics  # stopped, not run out
        assert (folder / "latest").exists(), list(folder.iterdir())  # its checkpoint kept
        text = (folder / "dlojz.log").read_text()
        assert "stopped cleanly" in text
        # The trial's command: grouped in W&B by study, and the worker (not the trial) requeues.
        command = text.splitlines()[0]
        assert re.search(r"--wandb-group s( |$)", command) and "--no-requeue" in command, command
    assert proc.stdout.count("pruned at epoch 1") == trials, show(proc)


@pytest.mark.parametrize("how", ["killed", "preempted", "interrupted"])
def test_a_worker_lost_mid_trial_leaves_the_study_usable_and_the_trial_retried(
    tiny_data, tmp_path, how, preloaded_launch
):
    """killed: SIGKILL, no word (the heartbeat goes stale); preempted: Slurm's warning (SIGUSR1) to the worker;
    interrupted: Ctrl-C (SIGINT) to the worker: one line, exit 130, the trial failed and queued for its retry (never
    left running)."""
    args = search_args(
        tmp_path,
        tiny_data,
        "--trials",
        "1",
        "--heartbeat-interval",
        "0.5",
        "--stale-after",
        "3",
        trial_flags=("--epochs", "8", "--train-subset", "0.5"),  # (a trial still running when its worker goes)
        launch=preloaded_launch,
    )
    history = tmp_path / "out" / "s" / "trial-0000" / "val_history.jsonl"
    with open(tmp_path / "a.log", "w") as log:
        first = hpo_popen(*args, log=log)
        try:
            wait_for(
                lambda: history.exists() and history.read_text().count("\n") >= 1,
                300,
                "the first trial never validated",
            )
            first.send_signal(
                {"killed": signal.SIGKILL, "preempted": signal.SIGUSR1, "interrupted": signal.SIGINT}[how]
            )
            lost_at = time.monotonic()
            first.wait(timeout=120)
        finally:
            first.kill()
    trial_log = history.parent / "dlojz.log"
    # The trial stopped with a checkpoint: SIGUSR2 from its dying worker (PR_SET_PDEATHSIG) or passed on by it.
    wait_for(lambda: "stopped cleanly" in trial_log.read_text(), 120, "the trial did not stop")
    worker_a = (tmp_path / "a.log").read_text()
    if how == "preempted":
        assert first.returncode == 0, worker_a
        assert "SIGUSR1 received: stopped; run `search` again" in worker_a, worker_a
        assert [t.state.name for t in load(tmp_path / "j.log", "s").trials] == ["FAIL", "WAITING"]
    elif how == "interrupted":
        assert first.returncode == 130 and "Traceback" not in worker_a, worker_a
        assert (
            worker_a.strip().splitlines()[-1]
            == "dlojz_hpo.py: interrupted (Ctrl-C): stopped, nothing half-written left"
        )
        assert "trial 0: stopped by Ctrl-C, checkpoint kept: failed, to be retried from it" in worker_a, worker_a
        assert [t.state.name for t in load(tmp_path / "j.log", "s").trials] == ["FAIL", "WAITING"]
    else:
        time.sleep(max(0.0, lost_at + 3.5 - time.monotonic()))  # the heartbeat goes stale (--stale-after 3)
    second = hpo(*args)
    assert second.returncode == 0, show(second)
    study = load(tmp_path / "j.log", "s")
    failed, retried = study.trials
    assert (failed.state.name, retried.state.name) == ("FAIL", "COMPLETE"), show(second)
    assert retried.system_attrs["failed_trial"] == 0 and retried.params == failed.params
    assert retried.user_attrs["output_dir"] == str(history.parent)  # the same folder...
    assert "resumed from" in trial_log.read_text().split("==== trial 1")[1]  # ...and its checkpoint
    assert 1 in retried.intermediate_values  # the first validation, inherited
    assert read_json(history.parent / "metrics.json")["epochs"] == 8
    if how == "killed":
        assert "trial 0: no heartbeat" in second.stdout, show(second)


@pytest.fixture(scope="module")
def finished_study(tiny_data, tmp_path_factory, preloaded_launch):
    tmp_path = tmp_path_factory.mktemp("study")
    proc = hpo(
        *search_args(
            tmp_path,
            tiny_data,
            "--trials",
            "3",
            "--sampler",
            "random",
            "--sampler-seed",
            "3",
            "--pruner",
            "none",
            "--objective",
            "macro_f1",
            trial_flags=("--epochs", "1", "--train-subset", "0.5"),
            launch=preloaded_launch,
        )
    )
    assert proc.returncode == 0, show(proc)
    return tmp_path


def test_report_writes_plots_csv_and_a_recipe_that_dlojz_runs(finished_study, tmp_path, tiny_data):
    out = tmp_path / "report"
    proc = hpo("report", "--study", "s", "--storage", finished_study / "j.log", "--out", out)
    assert proc.returncode == 0, show(proc)
    study = load(finished_study / "j.log", "s")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    for name in ("history", "importances", "parallel_coordinate", "intermediate_values"):
        assert (out / f"{name}.png").stat().st_size > 5000, name
    with open(out / "trials.csv") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 3 and [r["number"] for r in rows] == ["0", "1", "2"], rows
    assert {"lr", "label-smoothing", "value", "wall_s", "gpu_hours", "energy_j"} <= set(rows[0]), rows[0]
    assert [float(r["lr"]) for r in rows] == [t.params["lr"] for t in study.trials]
    assert all(float(r["wall_s"]) > 0 for r in rows)
    best = study.best_trial
    assert f"1. trial {best.number}: macro-F1 {best.value:.4f}" in proc.stdout, show(proc)
    for trial in study.trials:  # --objective macro_f1: what the study maximised and its pruner saw
        folder = Path(trial.user_attrs["output_dir"])
        assert trial.value == read_json(folder / "metrics.json")["val_macro_f1"]
        history = [json.loads(line) for line in (folder / "val_history.jsonl").read_text().splitlines()]
        assert trial.intermediate_values == {1: history[0]["val_macro_f1"]}
    # The recipe: the best trial's flags, as dlojz.py --config reads them.
    from dlojz_lib.settings.flags import get_args_parser

    recipe = vars(get_args_parser().parse_args(["--config", str(out / "best.toml")]))
    assert recipe["lr"] == best.params["lr"] and recipe["label_smoothing"] == best.params["label_smoothing"]
    assert recipe["train_subset"] == 0.5 and recipe["image_size"] == 16 and recipe["arch"] == "timm:test_resnet"
    assert "output-dir" not in (out / "best.toml").read_text()
    run = run_dlojz(
        "--config", out / "best.toml", "--output-dir", tmp_path / "rerun", "--metrics-json", tmp_path / "m.json"
    )
    assert run.returncode == 0, show(run)
    assert read_json(tmp_path / "m.json")["steps"] == 5  # the recipe's subset and batch size


def test_report_of_a_missing_study_is_one_line(finished_study, tmp_path):
    proc = hpo("report", "--study", "nope", "--storage", finished_study / "j.log", "--out", tmp_path)
    assert proc.returncode == 2 and "--study nope: not in" in proc.stderr and "studies there: s" in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("damage", ["prefix", "append"])
def test_report_of_a_journal_that_is_not_utf_8_is_one_line(damage, tmp_path, capsys):
    import dlojz_hpo

    journal = tmp_path / "j.log"
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    optuna.create_study(study_name="s", storage=storage).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    text = journal.read_bytes()
    journal.write_bytes(b"\xff" + text if damage == "prefix" else text + b"\xff\xfe bad\n")
    status = dlojz_hpo.main(["report", "--study", "s", "--storage", str(journal), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert f"--storage {journal}: not an Optuna journal" in err


def test_report_of_a_file_that_is_not_a_journal_says_so(tmp_path, capsys):
    """A user's file given as --storage: named as not a journal (it read as a journal without studies)."""
    import dlojz_hpo

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    status = dlojz_hpo.main(["report", "--study", "s", "--storage", str(notes), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"--storage {notes}: not an Optuna journal (no study's operations in it)" in err, err


def test_a_study_keeps_its_shared_flags(finished_study, tiny_data, capsys):
    import dlojz_hpo

    status = dlojz_hpo.main(
        [
            "search",
            "--study",
            "s",
            "--storage",
            str(finished_study / "j.log"),
            "--space",
            str(finished_study / "space.toml"),
            "--trials",
            "1",
            "--",
            *TRIAL,
            "--data-root",
            str(tiny_data),
            "--epochs",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "--study s already runs with other dlojz flags" in err, err
    same_flags = search_args(
        finished_study,
        tiny_data,
        "--trials",
        "1",
        "--objective",
        "top1",
        trial_flags=("--epochs", "1", "--train-subset", "0.5"),
        trial=PRELOADED_TRIAL,  # (finished_study's)
    )
    status = dlojz_hpo.main([str(arg) for arg in same_flags])
    err = capsys.readouterr().err
    assert status == 2 and "--study s maximizes its macro_f1: --objective top1 does not match" in err, err


# ---------------------------------------------------------------- on Slurm: a job array of workers
HPO_SCRIPT = ROOT / "slurm" / "dlojz_hpo.slurm"


def test_hpo_script_directives():
    text = HPO_SCRIPT.read_text()
    subprocess.run(["bash", "-n", str(HPO_SCRIPT)], check=True, timeout=30)
    assert re.search(r"^#SBATCH --array=0-15\b", text, re.M)
    assert re.search(r"^#SBATCH --signal=B:USR1@\d+", text, re.M), "the warning goes to the worker (the batch process)"
    assert re.search(r"^#SBATCH --requeue\b", text, re.M) and re.search(r"^#SBATCH --output=%x_%A_%a\.out", text, re.M)
    assert re.search(r"^exec python -u dlojz_hpo.py search\b", text, re.M) and '"$@"' in text


def cpu_copy(script, folder):
    """The script without its site and GPU lines (this test cluster has neither), 1 CPU per task."""
    text = re.sub(r"^#SBATCH --(account|constraint|qos|gres)\b.*$", "", script.read_text(), flags=re.M)
    text = re.sub(r"^#SBATCH --cpus-per-task=\d+", "#SBATCH --cpus-per-task=1", text, flags=re.M)
    copy = folder / script.name
    copy.write_text(text)
    return copy


def test_a_job_array_of_workers_fills_one_study_and_a_preempted_worker_rejoins_it(slurm_cluster, tiny_data, tmp_path):
    from test_slurm import job_env

    job = slurm_cluster.submit(
        [
            f"--output={tmp_path}/%x_%A_%a.out",
            "--array=0-1",
            cpu_copy(HPO_SCRIPT, tmp_path),
            *search_args(
                tmp_path,
                tiny_data,
                "--trials",
                "2",
                "--pruner",
                "median",
                "--pruner-startup-trials",
                "1",
                trial_flags=("--epochs", "3"),
            )[1:],
        ],
        cwd=ROOT,
        env=job_env(slurm_cluster),
    )
    # Slurm's time-limit warning (--signal=B:USR1@T) to task 0's worker once its first trial has validated.
    log = tmp_path / f"dlojz_hpo_{job}_0.out"
    first = int(re.search(r"^trial (\d+):", slurm_cluster.wait_for_output(log, "-> ", 300, f"{job}_0"), re.M).group(1))
    history = tmp_path / "out" / "s" / f"trial-{first:04d}" / "val_history.jsonl"
    wait_for(lambda: history.exists() and history.read_text().count("\n") >= 1, 300, "no validation")
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", f"{job}_0"])
    results = [slurm_cluster.wait(f"{job}_{task}", timeout=600) for task in (0, 1)]
    logs = "\n".join(r.output_text()[-4000:] for r in results)
    assert [r.state for r in results] == ["COMPLETED"] * 2, logs
    assert results[0].restarts >= 1 and "requeue: scontrol requeue" in logs, logs  # the worker requeued its task
    study = load(tmp_path / "j.log", "s")
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    workers = sorted(t.user_attrs["worker"] for t in done)
    assert workers == [f"{job}_0", f"{job}_0", f"{job}_1", f"{job}_1"], workers  # 2 trials per array task
    failed = [t for t in study.trials if t.state.name == "FAIL"]
    assert [t.number for t in failed] == [first] and len(study.trials) == 5, [t.state for t in study.trials]
    retry = next(t for t in study.trials if t.system_attrs.get("failed_trial") == first)
    assert retry.state.name in ("COMPLETE", "PRUNED") and retry.params == failed[0].params
    assert "resumed from" in (history.parent / "dlojz.log").read_text()  # from the preempted trial's checkpoint
    # The requeued worker sampled new points (its seed moves with the study), not those of its first life.
    assert len({tuple(sorted(t.params.items())) for t in study.trials}) == 4, [t.params for t in study.trials]
    assert "Traceback" not in logs, logs
