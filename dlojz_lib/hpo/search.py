"""dlojz_hpo.py's search with Optuna: the worker that runs trials as dlojz.py subprocesses, prunes them at their
validations, survives preemption and fails the trials of dead workers; the study's storage; and the report
command's reading of a study (its files are dlojz_lib/hpo/report.py's, the space file dlojz_lib/hpo/space.py's).
How it works and why is said in dlojz_hpo.py's docstring, the command's.
"""

import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from dlojz_lib.checks import claim_output, claim_outputs_in, ended_on_interrupt, fail, starts_with
from dlojz_lib.hpo.report import best_trial, claimed_files, write_csv, write_plots, write_recipe
from dlojz_lib.hpo.space import check_shared, flag_argv, read_space, split_shared
from dlojz_lib.settings.flags import VALIDATION_METRICS

DLOJZ = Path(__file__).resolve().parents[2] / "dlojz.py"  # the project's training script, beside dlojz_lib/


# ---------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------
# One trial
def gpu_energy_mj():
    """Energy counter (mJ) summed over this node's visible GPUs, or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        indices = (
            [int(i) for i in visible.split(",") if i.strip().isdigit()]
            if visible
            else range(pynvml.nvmlDeviceGetCount())
        )
        return sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices)
    except Exception:  # no NVML, no driver, no GPU: no figure
        return None


# The trial's command runs through this: SIGUSR2 (checkpoint and stop) when the worker dies, instead of an orphan
# training on (Linux's PR_SET_PDEATHSIG, kept across exec). Not Popen's preexec_fn: unsafe with the heartbeat thread.
DIE_WITH_WORKER = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, int(signal.SIGUSR2)); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])"
)


class Heartbeat(threading.Thread):
    """Writes the time into the running trial every `interval` s, for the other workers' stale-trial check."""

    def __init__(self, trial, interval):
        super().__init__(daemon=True)
        self.trial, self.interval, self.stopped = trial, interval, threading.Event()
        self.beat()

    def beat(self):
        self.trial.set_user_attr("heartbeat", time.time())

    def run(self):
        while not self.stopped.wait(self.interval):
            try:
                self.beat()
            except Exception:  # the trial was ended elsewhere (failed as stale by another worker): stop beating
                return


class Worker:
    """One `search` process: asks the study for trials and runs them one after the other."""

    # Its methods share one state (the study, the running trial's process, the signal received), so one class;
    # what needs none of it (the trial's command line, its costs) is in functions below.

    def __init__(self, args, study, space, shared, root, on_gpu):
        self.args, self.study, self.space, self.shared, self.root, self.on_gpu = (
            args,
            study,
            space,
            shared,
            root,
            on_gpu,
        )
        self.stop_signal = None
        self.process = None
        self.id = worker_id()

    # -- signals: Slurm's warning or SIGTERM stops the trial (checkpoint) and, after it, this worker
    def install(self):
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, self._receive)

    def _receive(self, signum, _frame):
        self.stop_signal = signal.Signals(signum).name
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR2)

    def trials_done(self):
        from optuna.trial import TrialState

        return sum(
            1
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            if t.user_attrs.get("worker") == self.id
        )

    def run(self):
        started = time.time()
        while self.stop_signal is None:
            done = self.trials_done()
            if done >= self.args.trials:
                print(f"worker {self.id}: {done} trials done (--trials {self.args.trials}): stopping", flush=True)
                break
            if self.args.timeout is not None and time.time() - started > self.args.timeout:
                print(f"worker {self.id}: --timeout {self.args.timeout:g} s passed: no new trial", flush=True)
                break
            fail_stale_trials(self.study, self.args.stale_after)
            self.run_trial()
        if self.stop_signal is not None:
            requeue_worker(self.stop_signal)

    def run_trial(self):
        trial = self.study.ask({dest: dist for dest, (_, dist) in self.space.items()})
        frozen = self.study._storage.get_trial(trial._trial_id)
        heartbeat = Heartbeat(trial, self.args.heartbeat_interval)
        heartbeat.start()
        # A retry runs in the folder of the trial it retries, and resumes from its checkpoint.
        first = frozen.system_attrs.get("failed_trial", trial.number)
        folder = self.root / f"trial-{first:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        trial.set_user_attr("worker", self.id)
        trial.set_user_attr("output_dir", str(folder))
        params = [word for dest, (action, _) in self.space.items() for word in flag_argv(action, trial.params[dest])]
        command = trial_command(self.args.launch, [*self.shared, *params], folder, self.study.study_name)
        retry = f" (retry of trial {first})" if first != trial.number else ""
        print(f"trial {trial.number}{retry}: {' '.join(params)} -> {folder}", flush=True)
        (folder / "metrics.json").unlink(missing_ok=True)
        energy_start, wall_start = gpu_energy_mj(), time.perf_counter()
        with open(folder / "dlojz.log", "a") as log:
            log.write(f"==== trial {trial.number}{retry}: {shlex.join(command)}\n")
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, "-c", DIE_WITH_WORKER, str(os.getpid()), *command],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            if self.stop_signal is not None:  # arrived while the trial was being set up
                self.process.send_signal(signal.SIGUSR2)
            try:
                pruned = self.follow(trial, folder / "val_history.jsonl")
            except KeyboardInterrupt:  # Ctrl-C: the trial checkpoints and stops, failed to be retried, not running
                self.stopped_by_interrupt(trial, heartbeat)
                raise
            status = self.process.returncode
        self.process = None
        heartbeat.stopped.set()
        heartbeat.join()
        wall = time.perf_counter() - wall_start
        energy_end = gpu_energy_mj()
        metrics = read_metrics(folder / "metrics.json")
        energy_j = None if energy_start is None or energy_end is None else (energy_end - energy_start) / 1000
        record_costs(trial, frozen.user_attrs, metrics, wall, energy_j, self.on_gpu)
        self.tell(trial, pruned, status, metrics, folder)

    def stopped_by_interrupt(self, trial, heartbeat):
        """Ctrl-C during a trial: its run told (ended_on_interrupt: it checkpoints), the trial failed in the study
        and queued to be retried from its checkpoint, as a stop signal's trial is (never left `running`)."""
        from optuna.trial import TrialState

        ended_on_interrupt(self.process)
        self.process = None
        heartbeat.stopped.set()
        heartbeat.join()
        trial.set_user_attr("error", "stopped by Ctrl-C (SIGINT)")
        self.study.tell(trial, state=TrialState.FAIL)
        retry_trial(self.study, trial._trial_id)
        print(f"trial {trial.number}: stopped by Ctrl-C, checkpoint kept: failed, to be retried from it", flush=True)

    def tell(self, trial, pruned, status, metrics, folder):
        """The trial's end to the study: pruned, complete with its objective, failed to be retried from its
        checkpoint (stopped by a signal), or failed with the last line of its log."""
        from optuna.trial import TrialState

        try:
            if pruned:
                self.study.tell(trial, state=TrialState.PRUNED)
                print(f"trial {trial.number}: pruned at epoch {pruned}", flush=True)
            elif status == 0 and metrics and "stopped_by" not in metrics:
                value = self.objective(metrics)
                if not isinstance(value, (int, float)) or math.isnan(value):  # a null top-1: no validation done
                    reason = f"its run gave no {self.objective_name()} ({value!r} in {folder / 'metrics.json'})"
                    trial.set_user_attr("error", reason)
                    self.study.tell(trial, state=TrialState.FAIL)
                    print(f"trial {trial.number}: failed: {reason}", flush=True)
                else:
                    self.study.tell(trial, value)
                    print(f"trial {trial.number}: {self.objective_name()} {value:.4f}", flush=True)
            elif self.stop_signal is not None or metrics.get("stopped_by"):
                self.study.tell(trial, state=TrialState.FAIL)
                retry_trial(self.study, trial._trial_id)
                print(
                    f"trial {trial.number}: stopped by {self.stop_signal or metrics.get('stopped_by')}, checkpoint "
                    f"kept: failed, to be retried from it",
                    flush=True,
                )
            else:  # bad flags (2), a diverged loss (3), a lost rank (4), ...: recorded with the run's last line
                last = last_error_line(folder / "dlojz.log")
                trial.set_user_attr("error", last)
                self.study.tell(trial, state=TrialState.FAIL)
                print(f"trial {trial.number}: failed (exit {status}): {last} (log: {folder / 'dlojz.log'})", flush=True)
        except Exception as err:  # e.g. failed as stale by another worker meanwhile
            print(f"trial {trial.number}: could not record its end ({type(err).__name__}: {err})", flush=True)

    def follow(self, trial, history):
        """Wait for the trial's process, reporting each new validation; SIGUSR2 when the pruner says so. Returns
        the epoch at which the trial was pruned, or None."""
        seen = set(self.study._storage.get_trial(trial._trial_id).intermediate_values)  # a retry inherits them
        offset, pruned = 0, None
        while True:
            running = self.process.poll() is None
            if history.exists():
                with open(history) as file:
                    file.seek(offset)
                    for line in iter(file.readline, ""):
                        if not line.endswith("\n"):  # being written: read it next time
                            break
                        offset += len(line)
                        record = json.loads(line)
                        epoch = record["epoch"]
                        if epoch in seen or pruned:
                            continue
                        seen.add(epoch)
                        if self.args.direction == "maximize":
                            trial.report(record[VALIDATION_METRICS[self.args.objective][0]], step=epoch)
                        else:
                            trial.report(1 - record["val_accuracy"], step=epoch)
                        if trial.should_prune() and running:
                            pruned = epoch
                            self.process.send_signal(signal.SIGUSR2)  # checkpoint, then stop
            if not running:
                return pruned
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=self.args.poll_interval)

    def objective(self, metrics):
        if self.args.direction == "maximize":
            return metrics.get(VALIDATION_METRICS[self.args.objective][0])
        return metrics["time_to_target_s"] if metrics.get("time_to_target_s") is not None else math.inf

    def objective_name(self):
        return objective_name(self.args.direction, self.args.objective)


def objective_name(direction, objective):
    """What a study's value is, in words."""
    return "time to target (s)" if direction == "minimize" else VALIDATION_METRICS[objective][1]


def trial_command(launch, flags, folder, study_name):
    """The command line of a trial: dlojz.py with the search's shared flags and the trial's, writing into `folder`,
    resuming from its checkpoint (a retry), not requeued by Slurm (the worker retries), under `launch`'s launcher."""
    return [
        *shlex.split(launch or ""),
        sys.executable,
        "-u",
        str(DLOJZ),
        *flags,
        "--output-dir",
        str(folder),
        "--metrics-json",
        str(folder / "metrics.json"),
        "--val-history",
        str(folder / "val_history.jsonl"),
        "--resume",
        "auto",
        "--no-requeue",
        "--wandb-group",
        study_name,
    ]


def record_costs(trial, before, metrics, wall, energy_j, on_gpu):
    """What the trial cost, added to what its earlier attempts cost (`before`: their user attributes): wall time,
    epochs, GPU-hours on GPUs, energy where NVML reads it."""
    trial.set_user_attr("wall_s", round(wall, 1) + (before.get("wall_s") or 0))
    trial.set_user_attr("epochs", metrics.get("epochs"))
    if on_gpu:
        gpu_hours = wall * (metrics.get("world_size") or 1) / 3600
        trial.set_user_attr("gpu_hours", gpu_hours + (before.get("gpu_hours") or 0))
    if energy_j is not None:
        trial.set_user_attr("energy_j", energy_j + (before.get("energy_j") or 0))


def worker_id():
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', 0)}"
    if os.environ.get("SLURM_JOB_ID"):
        return os.environ["SLURM_JOB_ID"]
    return f"{socket.gethostname()}:{os.getpid()}"


def read_metrics(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def last_error_line(log):
    try:
        lines = [line for line in Path(log).read_text(errors="replace").splitlines() if line.strip()]
    except OSError as err:
        return f"(its log {log} cannot be read: {err.strerror})"
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[-1][:300]


def retry_trial(study, trial_id):
    """Enqueue a copy of a failed trial (same parameters, its validations kept, its folder reused)."""
    import copy

    from optuna.storages import RetryFailedTrialCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental / deprecated-alias warnings
        RetryFailedTrialCallback(inherit_intermediate_values=True)(
            study, copy.deepcopy(study._storage.get_trial(trial_id))
        )


def fail_stale_trials(study, stale_after):
    """Fail and retry the running trials whose worker stopped beating (killed, node lost)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    now = time.time()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        last = max(
            trial.user_attrs.get("heartbeat", 0), trial.datetime_start.timestamp() if trial.datetime_start else 0
        )
        if now - last <= stale_after:
            continue
        try:
            if not study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                continue
        except UpdateFinishedTrialError:  # another worker got there first
            continue
        retry_trial(study, trial._trial_id)
        print(
            f"trial {trial.number}: no heartbeat for {now - last:.0f} s (its worker died): failed, retried as a new "
            f"trial that resumes from its checkpoint",
            flush=True,
        )


def requeue_worker(reason):
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id:
        print(f"worker: {reason} received: requeue: scontrol requeue {job_id}", flush=True)
        subprocess.run(["scontrol", "requeue", job_id], check=False)
    else:
        print(
            f"worker: {reason} received: stopped; run `search` again to go on (the stopped trial is retried)",
            flush=True,
        )


# ---------------------------------------------------------------------------------------------------------------
# The study: its storage, a worker's search, the report
def is_optuna_journal(path) -> bool:
    """Whether `path` is an Optuna journal: JSON lines, each an operation (`op_code`) of a worker."""
    try:
        with open(path, "rb") as file:
            first = file.readline(1 << 16)
        return "op_code" in json.loads(first)
    except (OSError, ValueError, TypeError):
        return False


def is_sqlite_database(path) -> bool:
    return starts_with(path, b"SQLite format 3\x00")


def check_storage(path):
    """--storage before any trial, by the one output rule (the study writes into it): a new file or an Optuna
    journal, or a SQLite database URL's file that is new or a database; never a file of another kind."""
    if path.startswith("sqlite:///"):
        claim_output(
            path.removeprefix("sqlite:///"), "--storage (its SQLite file)", "a SQLite database", is_sqlite_database,
            force_flag=None,
        )  # fmt: skip
    elif "://" not in path:  # other database URLs: the server says
        claim_output(path, "--storage", "an Optuna journal (a study's storage)", is_optuna_journal, force_flag=None)


def open_storage(path):
    import optuna

    if "://" in path:  # a database URL (sqlite:///..., postgresql://...): Optuna's RDB storage
        shown = redacted_url(path)
        try:
            return optuna.storages.RDBStorage(path)
        except ImportError:  # SQLAlchemy's dialect without its driver module (PyMySQL, psycopg2, ...)
            fail(
                f"--storage {shown}: the Python driver of this database is not installed here (pip install PyMySQL "
                "for mysql://, psycopg2-binary for postgresql://); or give a journal file path (shared file system)"
            )
        except Exception as err:  # SQLAlchemy's errors: a server that refuses, a name that does not resolve
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            fail(f"--storage {shown}: the database cannot be opened ({first[:200]}); check the URL and the server")
    Path(path).resolve().parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))


def redacted_url(url):
    """A database URL as said in a line: its password left out."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def make_sampler(args, n_trials):
    """The sampler, seeded by --sampler-seed and the study's size: a requeued worker does not draw again the
    points of its first life."""
    import optuna

    seed = None if args.sampler_seed is None else (args.sampler_seed * 1_000_003 + n_trials) % 2**32  # numpy's range
    if args.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant_liar: parallel workers do not all sample next to the same promising point
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


def make_pruner(args):
    import optuna

    if args.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=args.pruner_startup_trials, n_warmup_steps=args.pruner_warmup_epochs
        )
    if args.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, reduction_factor=3)
    if args.pruner == "threshold":
        if args.prune_below is None:
            fail("--pruner threshold needs --prune-below VALUE")
        if args.direction == "maximize":
            return optuna.pruners.ThresholdPruner(lower=args.prune_below, n_warmup_steps=args.pruner_warmup_epochs)
        return optuna.pruners.ThresholdPruner(upper=1 - args.prune_below, n_warmup_steps=args.pruner_warmup_epochs)
    return optuna.pruners.NopPruner()


def search(args, shared):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.direction == "minimize" and args.objective != "top1":
        fail(
            f"--objective {args.objective} is maximized; --direction minimize minimizes the time to "
            "--target-accuracy (a top-1): drop one of them"
        )
    if args.prune_below is not None and args.pruner != "threshold":
        fail(
            f"--prune-below is the threshold pruner's: --pruner {args.pruner} does not read it; add --pruner threshold, or drop it"
        )
    space = read_space(args.space)
    check_storage(args.storage)
    shared, output_dir = split_shared(shared)
    root = Path(output_dir or "runs") / args.study
    cfg = check_shared(shared, space, args.direction, root)
    study = optuna.create_study(
        study_name=args.study,
        storage=open_storage(args.storage),
        direction=args.direction,
        pruner=make_pruner(args),
        load_if_exists=True,
    )
    study.sampler = make_sampler(args, len(study.get_trials(deepcopy=False)))
    recorded = study.user_attrs.get("shared_flags")
    if recorded is None:
        study.set_user_attr("shared_flags", shared)
        study.set_user_attr("space", {dest: dist.__class__.__name__ for dest, (_, dist) in space.items()})
    elif recorded != shared:
        fail(
            f"--study {args.study} already runs with other dlojz flags ({shlex.join(recorded)}): use the same flags "
            f"after --, or another --study"
        )
    if study.direction.name.lower() != args.direction:
        fail(f"--study {args.study} {study.direction.name.lower()}s: --direction {args.direction} does not match")
    recorded_objective = study.user_attrs.get("objective", "top1")  # (a study made before --objective: top-1)
    if recorded is None:
        study.set_user_attr("objective", args.objective)
    elif recorded_objective != args.objective:
        fail(f"--study {args.study} maximizes its {recorded_objective}: --objective {args.objective} does not match")
    worker = Worker(args, study, space, shared, root, on_gpu=cfg.torch_device != "cpu")
    worker.install()
    print(
        f"worker {worker.id}: study {args.study} in {args.storage}, {args.direction} "
        f"{objective_name(args.direction, args.objective)}, {args.sampler} sampler, {args.pruner} "
        f"pruner; trials in {root}",
        flush=True,
    )
    worker.run()
    best = best_trial(study)
    if best is not None:
        print(f"best so far: trial {best.number}, {best.value:.4f}: {best.params}", flush=True)
    return 0


def report(args):
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if "://" not in args.storage and not Path(args.storage).is_file():
        fail(f"--storage {args.storage}: no such journal file")
    if "://" not in args.storage and Path(args.storage).stat().st_size and not is_optuna_journal(args.storage):
        fail(
            f"--storage {args.storage}: not an Optuna journal (no study's operations in it); give the study's journal file"
        )
    claim_outputs_in(args.out, claimed_files(), "--out", args.force, [args.storage])  # before the study is read
    try:  # a journal that is not Optuna's (another file, damaged bytes): one line, not its reader's traceback
        storage = open_storage(args.storage)
        names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    except (UnicodeDecodeError, ValueError, KeyError) as err:
        fail(
            f"--storage {args.storage}: not an Optuna journal this can read ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:100] if str(err) else ''}); give the study's journal file"
        )
    if args.study not in names:
        fail(f"--study {args.study}: not in {args.storage} (studies there: {', '.join(names) or 'none'})")
    study = optuna.load_study(study_name=args.study, storage=storage)
    trials = study.get_trials(deepcopy=False)
    states = {state.name.lower(): sum(t.state == state for t in trials) for state in TrialState}
    print(f"study {args.study}: {len(trials)} trials (" + ", ".join(f"{n} {s}" for s, n in states.items() if n) + ")")
    out = Path(args.out)
    objective = objective_name(study.direction.name.lower(), study.user_attrs.get("objective", "top1"))
    done = sorted(
        (t for t in trials if t.state == TrialState.COMPLETE),
        key=lambda t: t.value,
        reverse=study.direction.name == "MAXIMIZE",
    )
    for rank, t in enumerate(done[: args.top], 1):
        gpu = f", {t.user_attrs['gpu_hours']:.3f} GPU-h" if t.user_attrs.get("gpu_hours") else ""
        print(
            f"  {rank}. trial {t.number}: {objective} {t.value:.4f} in {t.user_attrs.get('wall_s', 0):.0f} s{gpu}  "
            + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items())
        )
    write_csv(out / "trials.csv", study)
    written = ["trials.csv", *write_plots(out, study)]
    if done:
        write_recipe(out / "best.toml", study, done[0], objective)
        written.append("best.toml")
    else:
        print("report: no finished trial yet: no best.toml")
    print(f"report: {', '.join(written)} in {out}")
    return 0
