"""dlojz_lab.py's sweeps: plan a grid of dlojz.py runs (each command line checked by dlojz.py's own parser), run
them here or as one Slurm job array, follow their states (status.json, the queue, each log's last line), and load
finished sweeps for dlojz_lib/lab/report.py. The notebook notebooks/dlojz_lab.ipynb calls these functions; what a
sweep is and writes is said in dlojz_lab.py's docstring, the command's.
"""

from __future__ import annotations

import difflib
import io
import itertools
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

from dlojz_lib.checks import OneLineError, UserError, check_output_folder, ended_on_interrupt

ROOT = Path(__file__).resolve().parents[2]  # the project: dlojz.py, slurm/
RUNS = Path("runs")
OWN_FLAGS = ("--output-dir", "--metrics-json", "--val-history")  # each run's, set by the lab
SLURM_RESOURCES = (  # dlojz_lab.py's flag, its #SBATCH directive, and whether it is a count (at least 1)
    ("partition", "--partition", False),
    ("account", "--account", False),
    ("qos", "--qos", False),
    ("time", "--time", False),
    ("nodes", "--nodes", True),
    ("ntasks_per_node", "--ntasks-per-node", True),
    ("gpus_per_node", "--gres=gpu", True),
    ("cpus_per_task", "--cpus-per-task", True),
    ("constraint", "--constraint", False),
)


class LabError(OneLineError):
    """Bad input: one line, exit 2."""


# ------------------------------------------------------------------ the grid
def dlojz_flags():
    """dlojz.py's long flags: {name without dashes: (the argparse action, is a switch)}."""
    from dlojz_lib.settings.flags import get_args_parser

    flags = {}
    for action in get_args_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and not option.startswith("--no-") and option != "--help":
                flags[option[2:]] = (action, action.nargs == 0)
    return flags


def parse_grid(texts: list[str]) -> list[tuple[str, list[str]]]:
    """[(flag, values)] from `FLAG=V1,V2,...` texts; an unknown flag is refused with the nearest names."""
    flags = dlojz_flags()
    grid = []
    for text in texts:
        name, sep, values = text.partition("=")
        name = name.strip().lstrip("-")
        if not sep or not name or not values.strip(","):
            raise LabError(f"--grid {text!r}: give FLAG=V1,V2,... (e.g. --grid batch-size=128,256)")
        if name not in flags:
            near = difflib.get_close_matches(name, list(flags), n=2)
            hint = f"; did you mean {' or '.join(near)}?" if near else "; python dlojz.py --help lists them"
            raise LabError(f"--grid {text!r}: dlojz.py has no flag --{name}{hint}")
        if f"--{name}" in OWN_FLAGS:
            raise LabError(f"--grid {name}: each run's --{name} is the lab's (in runs/NAME/RUN)")
        if name in (flag for flag, _ in grid):
            raise LabError(f"--grid {name}: given twice; put all its values in one --grid {name}=V1,V2")
        values = [v.strip() for v in values.split(",") if v.strip()]
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:  # two runs of one name would write into one folder
            raise LabError(f"--grid {text!r}: {', '.join(twice)} given twice; give each value once")
        if flags[name][1] and any(v not in ("on", "off") for v in values):
            raise LabError(f"--grid {text!r}: --{name} is a switch: its values are on and off")
        grid.append((name, values))
    if not grid:
        raise LabError("sweep: give at least one --grid FLAG=V1,V2,...")
    return grid


def run_flags(settings: dict, flags: dict) -> list[str]:
    """dlojz.py's arguments for one run's settings (`flags`: dlojz_flags())."""
    out = []
    for name, value in settings.items():
        action, switch = flags[name]
        if not switch:
            out += [f"--{name}", *value.split()]  # a flag of several values: --grid "randaugment=2 9,3 9"
        elif value == "on":
            out.append(f"--{name}")
        elif f"--no-{name}" in action.option_strings:
            out.append(f"--no-{name}")
        # a plain store_true switch, off: nothing to give
    return out


def run_name(settings: dict) -> str:
    return "_".join(f"{name}={value.replace('/', '-').replace(' ', '-')}" for name, value in settings.items())


def check_command_line(name: str, argv: list[str]) -> None:
    """dlojz.py's own parser and flag checks on one run's command line (torch is not imported)."""
    from dlojz_lib.checks import UserError
    from dlojz_lib.settings.flag_checks import checked_values

    said = io.StringIO()
    try:
        with redirect_stderr(said):  # the parser's one line, said again with the run's name
            checked_values(argv)
    except SystemExit:
        message = said.getvalue().strip().splitlines()[-1] if said.getvalue().strip() else "refused"
        raise LabError(f"run {name}: {message.removeprefix('dlojz: error: ')}") from None
    except UserError as err:
        raise LabError(f"run {name}: {err}") from None


# ------------------------------------------------------------------ sweeps
def plan_sweep(name: str, grid, base: list[str]) -> dict:
    for flag in OWN_FLAGS:
        if any(arg == flag or arg.startswith(flag + "=") for arg in base):
            raise LabError(f"{flag} is set by the lab for each run (runs/{name}/RUN): drop it after --")
    folder = (RUNS / name).resolve()  # absolute: a run's paths mean the same from a Slurm task
    flags = dlojz_flags()
    runs = []
    for values in itertools.product(*(values for _, values in grid)):
        settings = dict(zip((flag for flag, _ in grid), values))
        run = run_name(settings)
        out = folder / run
        argv = [
            *base,
            *run_flags(settings, flags),
            *("--output-dir", str(out), "--metrics-json", str(out / "metrics.json")),
            *("--val-history", str(out / "val_history.jsonl")),
        ]
        check_command_line(run, argv)
        runs.append(dict(name=run, settings=settings, argv=argv))
    return dict(name=name, grid=[[flag, values] for flag, values in grid], base=base, runs=runs)


def write_status(run_dir: Path, **status) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "status.json.tmp"
    tmp.write_text(json.dumps(status))
    os.replace(tmp, run_dir / "status.json")


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def run_one(sweep_dir: Path, index: int) -> int:
    """One run of the sweep, as a local run or an array task does it: dlojz.py (through srun in a Slurm job), its
    output in RUN/log.txt, its state in RUN/status.json."""
    sweep = read_plan(sweep_dir)
    run = sweep["runs"][index]
    run_dir = Path(sweep_dir) / run["name"]
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")  # the array's id, in a task
    started = time.time()
    write_status(run_dir, state="running", started=started, job=job)
    python = sweep.get("python") or sys.executable
    command = [python, "-u", str(ROOT / "dlojz.py"), *run["argv"]]
    if os.environ.get("SLURM_JOB_ID"):
        command = ["srun", "--kill-on-bad-exit=1", *command]
    elif sweep.get("nproc_per_node", 1) > 1:  # the ranks on this machine, as torchrun starts them
        ranks = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(sweep["nproc_per_node"])]
        command = [python, "-u", *ranks, *command[2:]]
    with open(run_dir / "log.txt", "ab") as log:
        proc = subprocess.Popen(
            command,
            cwd=sweep.get("cwd") or None,  # where the sweep was asked: the flags' relative paths start there
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        # `status` tells a run whose process is gone (the sweep killed with it) from one that runs
        write_status(run_dir, state="running", started=started, job=job, pid=proc.pid, host=socket.gethostname())
        try:
            status = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C: the run (told too) checkpoints and stops; said stopped, not running
            stopped = ended_on_interrupt(proc)  # (checks: the one door for Ctrl-C)
            write_status(run_dir, state="stopped", exit=stopped, started=started, ended=time.time(), job=job)
            raise
    write_status(
        run_dir, state="done" if status == 0 else "failed", exit=status, started=started, ended=time.time(), job=job
    )
    return status


def running_here(status: dict) -> bool:
    """Whether the local run that wrote `status` still runs: its process is alive (on another host: assumed)."""
    if status.get("host") != socket.gethostname() or not status.get("pid"):
        return True
    try:
        os.kill(status["pid"], 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def last_line(run_dir: Path) -> str:
    try:
        with open(Path(run_dir) / "log.txt", "rb") as log:
            log.seek(max(0, log.seek(0, 2) - 4096))
            lines = log.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def sweep_locally(sweep_dir: Path, sweep: dict) -> None:
    failed = 0
    for index, run in enumerate(sweep["runs"]):
        print(f"[{index + 1}/{len(sweep['runs'])}] {run['name']} ...", end=" ", flush=True)
        started = time.perf_counter()
        status = run_one(sweep_dir, index)
        seconds = time.perf_counter() - started
        if status == 0:
            print(f"done in {seconds:.0f} s", flush=True)
        else:
            failed += 1
            print(f"FAILED (exit {status}) in {seconds:.0f} s: {last_line(sweep_dir / run['name'])}", flush=True)
    print(
        f"{len(sweep['runs']) - failed} of {len(sweep['runs'])} runs done; compare: python dlojz_lab.py compare {sweep_dir}"
    )


def array_script(sweep_dir: Path, sweep: dict, resources: dict) -> str:
    lines = [
        "#!/bin/bash",
        f"# dlojz_lab.py sweep {sweep['name']}: one array task per run (runs listed in sweep.json)",
        f"#SBATCH --job-name=lab_{sweep['name']}",
        f"#SBATCH --array=0-{len(sweep['runs']) - 1}",
        f"#SBATCH --output={sweep_dir.resolve()}/slurm_%A_%a.out",
        "#SBATCH --hint=nomultithread",
    ]
    for key, directive, _ in SLURM_RESOURCES:
        if resources.get(key) is not None:
            lines.append(f"#SBATCH {directive}{':' if directive.endswith('gpu') else '='}{resources[key]}")
    lines += [f"#SBATCH {extra}" for extra in resources.get("sbatch") or []]
    lines += [
        "set -eo pipefail",
        f"cd {shlex.quote(str(ROOT))}",
        "source slurm/dlojz_env.sh  # the Python environment of every dlojz job",
        f'python -u dlojz_lab.py run-task {shlex.quote(str(sweep_dir.resolve()))} "$SLURM_ARRAY_TASK_ID"',
        "",
    ]
    return "\n".join(lines)


def sweep_on_slurm(sweep_dir: Path, sweep: dict, resources: dict) -> None:
    script = sweep_dir / "sweep.slurm"
    script.write_text(array_script(sweep_dir, sweep, resources))
    proc = subprocess.run(["sbatch", "--parsable", str(script.resolve())], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        (sweep_dir / "sweep.json").unlink()  # nothing submitted: the same command can be given again
        raise LabError(f"sbatch {script} refused it: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    job_id = proc.stdout.strip().split(";")[0]
    sweep["job_id"] = job_id
    (sweep_dir / "sweep.json").write_text(json.dumps(sweep, indent=1))
    print(
        f"submitted job array {job_id}: {len(sweep['runs'])} runs; follow it: python dlojz_lab.py status {sweep['name']}"
    )


def sweep(
    name: str,
    grid: dict,
    dlojz_args: list[str],
    launch: str = "local",
    sbatch=(),
    python=None,
    nproc_per_node=1,
    **resources,
) -> Path:
    """The sweep as a Python call (what the notebook uses): `grid` {flag: [values]}, `resources` the Slurm flags'
    names (partition, account, qos, time, nodes, ntasks_per_node, gpus_per_node, cpus_per_task, constraint),
    `python` the Python that runs each dlojz.py (by default the one that runs the lab, or the job's);
    `nproc_per_node`: each local run as that many processes (torchrun --standalone).
    Runs it here or submits it; returns its folder. Raises LabError on bad input, before anything runs."""
    unknown = set(resources) - {key for key, _, _ in SLURM_RESOURCES}
    if unknown:
        raise LabError(f"unknown Slurm resources {sorted(unknown)}: give {[key for key, _, _ in SLURM_RESOURCES]}")
    if not name or "/" in name or name.startswith("."):
        raise LabError(f"--name {name!r}: a folder name under runs/ (letters, digits, - and _)")
    texts = (
        [f"{flag}={','.join(map(str, values))}" for flag, values in grid.items()] if isinstance(grid, dict) else grid
    )
    found = None if python is None else shutil.which(python)
    if python is not None and found is None:
        raise LabError(f"--python {python}: not an executable; give the path of the Python that runs dlojz.py")
    if nproc_per_node > 1 and launch != "local":
        raise LabError(
            f"--nproc-per-node {nproc_per_node} starts local runs' ranks; on Slurm the job's tasks are the ranks: "
            f"give --ntasks-per-node {nproc_per_node} (and --gpus-per-node)"
        )
    plan = plan_sweep(name, parse_grid(texts), list(map(str, dlojz_args)))
    plan["nproc_per_node"] = nproc_per_node
    sweep_dir = RUNS / name
    if (sweep_dir / "sweep.json").exists():
        raise LabError(f"{sweep_dir} holds a sweep already: choose another --name, or delete that folder")
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise LabError(f"--name {name}: {sweep_dir} is a file, not a folder; choose another --name")
    # The sweep's folder is its own: new, empty, or what a refused submission left (its script, rewritten).
    strangers = sorted(p.name for p in sweep_dir.iterdir() if p.name != "sweep.slurm") if sweep_dir.is_dir() else []
    if strangers:
        raise LabError(
            f"--name {name}: {sweep_dir} holds files that are not a sweep's ({', '.join(strangers[:3])}"
            f"{', ...' if len(strangers) > 3 else ''}); choose another --name, or move them away"
        )
    if launch == "slurm" and subprocess.run(["which", "sbatch"], capture_output=True).returncode != 0:
        raise LabError("--launch slurm: sbatch is not found here; run on a login node, or use --launch local")
    try:
        check_output_folder(sweep_dir, "--name")
    except UserError as err:
        raise LabError(str(err)) from None
    plan["launch"], plan["cwd"] = launch, os.getcwd()
    if python is not None:  # a path is kept absolute: the array tasks start elsewhere
        plan["python"] = os.path.abspath(found) if os.sep in str(python) else str(python)
    (sweep_dir / "sweep.json").write_text(json.dumps(plan, indent=1))
    print(f"sweep {name}: {len(plan['runs'])} runs in {sweep_dir}")
    if launch == "local":
        sweep_locally(sweep_dir, plan)
    else:
        sweep_on_slurm(sweep_dir, plan, dict(resources, sbatch=list(sbatch)))
    return sweep_dir


# ------------------------------------------------------------------ status
def read_plan(sweep_dir) -> dict:
    """A sweep's sweep.json (its name, runs and their command lines); LabError naming the file if it is damaged."""
    from dlojz_lib.checks import read_json

    path = Path(sweep_dir) / "sweep.json"
    fix = "dlojz_lab.py sweep writes it once: restore it, or start the sweep again under another --name"
    try:
        plan = read_json(path, "sweep plan", fix)
    except UserError as err:
        raise LabError(str(err)) from None
    runs = plan.get("runs")
    if (
        not isinstance(plan.get("name"), str)
        or not isinstance(runs, list)
        or not all(isinstance(run, dict) and isinstance(run.get("name"), str) for run in runs)
    ):
        raise LabError(f"sweep plan {path}: not a dlojz_lab sweep (no name, or runs without names); {fix}")
    return plan


def sweep_dir_of(name_or_dir: str) -> Path:
    for candidate in (Path(name_or_dir), RUNS / name_or_dir):
        if (candidate / "sweep.json").exists():
            return candidate
    raise LabError(f"{name_or_dir}: no sweep there (no sweep.json in it or in runs/{name_or_dir})")


def queue_states(job_id) -> dict:
    """{array index: (state, elapsed)} of the sweep's tasks still in Slurm's queue."""
    if not job_id:
        return {}
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-r", "-j", str(job_id), "-o", "%i %T %M"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and "_" in parts[0] and parts[0].split("_")[1].isdigit():
            states[int(parts[0].split("_")[1])] = (parts[1], parts[2])
    return states


def run_states(sweep_dir: Path, sweep: dict) -> list[tuple[dict, str]]:
    """Each run and its state: done, failed (exit N), running, or queued/pending as Slurm says."""
    queue = queue_states(sweep.get("job_id"))
    states = []
    for index, run in enumerate(sweep["runs"]):
        status = read_status(sweep_dir / run["name"])
        state = status.get("state")
        if state == "failed":
            state = f"failed (exit {status.get('exit')})"
        elif state == "stopped":
            state = "stopped (Ctrl-C; --resume auto goes on from its checkpoint)"
        elif state is None:
            if index in queue:
                state = queue[index][0].lower()
            elif sweep.get("job_id"):  # out of the queue before dlojz_lab wrote anything: its Slurm log says why
                state = f"never started (slurm_{sweep['job_id']}_{index}.out)"
            else:
                state = "not run"
        elif state == "running" and sweep.get("job_id") and index not in queue:
            state = "ended without a status (killed?)"
        elif state == "running" and not sweep.get("job_id") and not running_here(status):
            state = "interrupted (its process is gone)"
        states.append((run, state))
    return states


def states(name_or_dir) -> list[tuple[str, str]]:
    """[(run, state)] of a sweep, its state as `status` says it."""
    sweep_dir = sweep_dir_of(str(name_or_dir))
    plan = read_plan(sweep_dir)
    return [(run["name"], state) for run, state in run_states(sweep_dir, plan)]


def follow(name_or_dir, every: float = 10.0, timeout: float | None = None, say=print) -> list[tuple[str, str]]:
    """Wait for a sweep's runs to end (none queued, pending or running), saying each run's state when it changes;
    returns the last states. The course's display_slurm_queue, for one sweep."""
    deadline = None if timeout is None else time.monotonic() + timeout
    said = {}
    while True:
        now = states(name_or_dir)
        for run, state in now:
            if said.get(run) != state:
                say(f"{time.strftime('%H:%M:%S')}  {run}: {state}")
                said[run] = state
        if not any(state in ("pending", "running", "configuring", "completing", "requeued") for _, state in now):
            return now
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"sweep {name_or_dir}: runs still in the queue after {timeout:.0f} s")
        time.sleep(every)


def chrono_report(run_dir) -> str:
    """The chronometer's report in a run's log (its `=>>>` lines, without the raw JSON)."""
    try:
        text = (Path(run_dir) / "log.txt").read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(line for line in text.splitlines() if line.startswith("=>>>") and "JSON" not in line[:10])


def load(*names) -> list:
    """The sweeps as dlojz_lib.lab.report.rows() takes them: [(folder, sweep.json, [(run, state)])]."""
    out = []
    for name in names:
        sweep_dir = sweep_dir_of(str(name))
        plan = read_plan(sweep_dir)
        out.append((sweep_dir, plan, run_states(sweep_dir, plan)))
    return out
