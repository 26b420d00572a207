"""dlojz under a real Slurm: the slurm/ scripts submitted with sbatch to a one-node test cluster.

The cluster (munged + slurmctld + slurmd on localhost) comes from the ``slurm_cluster`` fixture of
tests/slurm_cluster.py; without Slurm or root every test here is skipped with the reason (under CI=true: fails).
Run only these tests:  python -m pytest tests/system/test_slurm.py -v -rs   (about 3 minutes on 2 cores)
"""

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster as cluster_module
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

from dlojz_lib.data.embedded import EMBEDDED_NAME

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "slurm"
CPU_SCRIPT = SLURM_DIR / "dlojz_cpu.slurm"
GPU_SCRIPTS = [
    "dlojz_1gpu.slurm",
    "dlojz_1node.slurm",
    "dlojz_multinode.slurm",
    "dlojz_test.slurm",
    "dlojz_fsdp.slurm",
    "dlojz_tp.slurm",
]
RESTARTS = ["dlojz_cpu.slurm", "dlojz_1node.slurm", "dlojz_multinode.slurm", "dlojz_fsdp.slurm", "dlojz_tp.slurm"]
LONG_JOBS = [
    "dlojz_cpu.slurm", "dlojz_1gpu.slurm", "dlojz_1node.slurm", "dlojz_multinode.slurm", "dlojz_fsdp.slurm", "dlojz_tp.slurm"
]  # fmt: skip


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), (None, pytest.skip.Exception)])
def test_a_cluster_that_cannot_start_fails_under_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(BaseException) as raised:
        cluster_module.unavailable("slurmctld did not start (log tail)")
    assert raised.type is outcome and "slurmctld did not start" in str(raised.value)


def directives(script: Path) -> dict:
    """The active ``#SBATCH --key=value`` lines of a script (``##SBATCH`` is commented out)."""
    found = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+(--?[\w-]+)(?:[=\s]([^\s#]+))?", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def job_env(cluster, fresh_interpreters=False):
    """The cluster's environment plus this interpreter's venv, which slurm/dlojz_env.sh activates (sbatch exports
    the submitting environment to the job). The job's `python` is served_python's (its dlojz.py, sibling commands
    and benches forks of the tests' preloaded server), unless `fresh_interpreters` asks for this Python as a
    user's job has it."""
    env = dict(cluster.env, PYTHONUNBUFFERED="1")
    for name in (
        "DLOJZ_DATA",
        "ALL_CCFRSCRATCH",
        "DSDIR",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(name, None)  # the embedded data set, and idr_torch reading Slurm, not a leaked launcher
    if not fresh_interpreters:
        env["DLOJZ_VENV"] = str(served_python(env))
    elif sys.prefix != sys.base_prefix:
        env["DLOJZ_VENV"] = sys.prefix
    else:  # not a venv: put this python first in PATH, and tell dlojz_env.sh an environment is active
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        env["VIRTUAL_ENV"] = sys.prefix
    return env


_served_python = None  # the folder served_python made, once this process made it


def served_python(env):
    """A folder that slurm/dlojz_env.sh activates as the job's venv: this Python's, then `python` first in PATH
    as preloaded.python_executable's stand-in, whose `python -u dlojz.py ARGS` (and sibling commands, benches) a
    job's task runs as a fork of this process's preloaded server, given the task's environment, CPUs, output and
    signals, and killed with it (the 4-5 s of imports a fresh interpreter pays, once a session); any other command
    runs in this Python. A task whose environment the server cannot give (GLOO_*, ...) runs as given. The calls are
    appended to FOLDER/bin/python.calls."""
    global _served_python
    if _served_python is None:
        import atexit
        import shutil
        import tempfile

        import preloaded

        folder = Path(tempfile.mkdtemp(prefix="dlojz-job-python-"))
        atexit.register(shutil.rmtree, folder, True)
        (folder / "bin").mkdir()
        preloaded.python_executable(folder / "bin", env)
        # what a venv's activate does for dlojz_env.sh (this Python first in PATH, an environment said active),
        # then the stand-in before it
        first = ":".join(shlex.quote(str(path)) for path in (folder / "bin", Path(sys.executable).parent))
        (folder / "bin" / "activate").write_text(
            f'VIRTUAL_ENV={shlex.quote(sys.prefix)}\nPATH={first}:"$PATH"\nexport VIRTUAL_ENV PATH\n'
        )
        _served_python = folder
    return _served_python


def submit_cpu_job(cluster, tmp_path, *dlojz_args, wandb=False, fresh_interpreters=False, **extra_env):
    """sbatch slurm/dlojz_cpu.slurm from the project directory (the script cds to the submit dir),
    its log in tmp_path instead of the project."""
    env = dict(job_env(cluster, fresh_interpreters), **{k: str(v) for k, v in extra_env.items()})
    return cluster.submit(
        [f"--output={tmp_path}/%x_%j.out", CPU_SCRIPT, *([] if wandb else ["--no-wandb"]), *dlojz_args],
        cwd=ROOT,
        env=env,
    )


def show(result):
    return f"job {result.job_id}: {result.state}, restarts {result.restarts}\n{result.output_text()[-5000:]}"


# ---------------------------------------------------------------- the scripts themselves (no cluster)


@pytest.mark.parametrize("name", GPU_SCRIPTS + ["dlojz_cpu.slurm"])
def test_script_directives(name):
    script = SLURM_DIR / name
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    d = directives(script)
    assert d.get("--output") == "%x_%j.out", "log named by job name and id"
    assert "--hint" in d and d["--hint"] == "nomultithread"
    assert "--cpus-per-task" in d
    assert 'cd "${SLURM_SUBMIT_DIR' in text and "source slurm/dlojz_env.sh" in text
    # a task that fails ends the others at once instead of leaving them in a collective (dlojz_srun's srun too)
    assert re.search(r"^(srun --kill-on-bad-exit=1|dlojz_srun) python -u dlojz\.py\b", text, re.M)
    assert '"$@"' in text, "extra sbatch arguments must reach dlojz.py"
    if name in GPU_SCRIPTS:
        gpus = int(d["--gres"].split(":")[-1])
        assert int(d["--ntasks-per-node"]) == gpus, "one task per GPU"
    if name in LONG_JOBS:
        assert re.fullmatch(r"USR1@\d+", d.get("--signal") or ""), "long jobs get SIGUSR1 before the time limit"
        assert "--requeue" in d and "--resume auto" in text
    if name in RESTARTS:  # a lost node or a hung rank: run again inside the allocation, on the nodes left
        assert "source slurm/dlojz_restart.sh" in text and "dlojz_srun python -u dlojz.py" in text
        assert "--no-kill" in d and "--keep-global-batch" in text


def test_env_script_names_a_missing_venv(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DLOJZ_VENV": str(tmp_path / "no-venv")}
    proc = subprocess.run(
        ["bash", "-c", "source slurm/dlojz_env.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "DLOJZ_VENV" in proc.stderr and "no-venv" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- on the test cluster

# What the controller of this GPU-less test cluster may answer to the GPU scripts once sbatch has
# parsed them: resources it lacks, not mistakes in the scripts.
NO_GPU_HERE = (
    "Invalid generic resource",
    "Invalid partition",
    "Invalid account",
    "Invalid qos",
    "Requested node configuration is not available",
    "Invalid feature specification",
)


@pytest.mark.parametrize("name", GPU_SCRIPTS + ["dlojz_hpo.slurm", "dlojz_cpu.slurm"])
def test_sbatch_accepts_the_script_options(slurm_cluster, name):
    """A misspelt #SBATCH option or value is otherwise noticed only at submission on the real machine.
    sbatch rejects those itself (before asking the controller); the controller then only lacks GPUs."""
    proc = slurm_cluster.run(["sbatch", "--test-only", SLURM_DIR / name], check=False, cwd=ROOT)
    answer = (proc.stderr + proc.stdout).strip()
    if name == "dlojz_cpu.slurm":
        assert proc.returncode == 0 and "to start at" in answer, answer
    else:
        assert proc.returncode != 0 and any(reason in answer for reason in NO_GPU_HERE), answer


@pytest.mark.parametrize("name", ["dlojz_1node.slurm", "dlojz_multinode.slurm"])
def test_sbatch_accepts_gpus_bound_per_task(slurm_cluster, name):
    """Sites (or users) that bind one GPU to each task: each rank then sees one GPU, and dlojz takes
    local_rank % (GPUs it sees). The scripts must take the option on the command line."""
    proc = slurm_cluster.run(
        ["sbatch", "--test-only", "--gpus-per-task=1", "--gpu-bind=single:1", SLURM_DIR / name], check=False, cwd=ROOT
    )
    answer = (proc.stderr + proc.stdout).strip()
    assert proc.returncode != 0 and any(reason in answer for reason in NO_GPU_HERE), answer


def test_script_refuses_a_wrong_submit_directory(slurm_cluster, tmp_path):
    job = slurm_cluster.submit([f"--output={tmp_path}/%x_%j.out", CPU_SCRIPT], cwd=tmp_path, env=job_env(slurm_cluster))
    result = slurm_cluster.wait(job, timeout=60)
    assert result.state == "FAILED", show(result)
    assert "dlojz.py not found" in result.output_text() and "submit from the project directory" in result.output_text()


def test_cluster_runs_a_two_task_job(slurm_cluster, tmp_path):
    job = slurm_cluster.submit(["-n", "2", f"--output={tmp_path}/%x_%j.out", "--wrap", "srun hostname"], cwd=tmp_path)
    result = slurm_cluster.wait(job, timeout=60)
    assert result.state == "COMPLETED", show(result)
    assert result.output_text().split() == [slurm_cluster.node_name] * 2, show(result)


def test_cpu_script_trains_with_two_ddp_ranks(slurm_cluster, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    # A fresh cache: a new user's first job, where both ranks find no embedded data set and make it at once; the
    # job's Pythons are fresh interpreters, as a user's are (the other jobs' are forks of the preloaded server).
    job = submit_cpu_job(
        slurm_cluster,
        tmp_path,
        "--epochs",
        "1",
        "--train-subset",
        "0.5",
        "--metrics-json",
        metrics_path,
        "--output-dir",
        tmp_path / "run",
        XDG_CACHE_HOME=tmp_path / "cache",
        fresh_interpreters=True,
    )
    result = slurm_cluster.wait(job, timeout=300)
    assert result.state == "COMPLETED", show(result)
    assert result.output_path.parent == tmp_path and result.output_path.name == f"dlojz_cpu_{job}.out"
    metrics = json.loads(metrics_path.read_text())
    assert metrics["world_size"] == 2, metrics  # both srun tasks joined one gloo process group
    assert metrics["global_batch_size"] == 2 * 16, metrics  # -b 16 per rank, from the script
    assert metrics["epochs"] == 1 and metrics["val_images"] > 0, metrics
    assert metrics["steps"] == 19, metrics  # --train-subset 0.5: 600 of the 1,200 images, 32 a step
    assert "Traceback" not in result.output_text(), show(result)
    assert (tmp_path / "cache" / "dlojz" / EMBEDDED_NAME / ".complete").exists(), show(result)


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    # Half the embedded data set at -b 16 on 2 ranks: 19 steps per epoch, so the signal, sent at the first "Epoch"
    # line (step 2), lands mid-epoch and the resumed run finishes the epoch. W&B on (offline), as a user runs it:
    # the requeue must come after the W&B run is closed, or Slurm kills rank 0 in the middle of it.
    epochs = 1
    metrics_path = tmp_path / "metrics.json"
    job = submit_cpu_job(
        slurm_cluster,
        tmp_path,
        "--epochs",
        epochs,
        "-b",
        16,
        "--train-subset",
        0.5,
        "--metrics-json",
        metrics_path,
        "--output-dir",
        tmp_path / "run",
        wandb=True,
        WANDB_MODE="offline",
    )
    log = tmp_path / f"dlojz_cpu_{job}.out"
    slurm_cluster.wait_for_output(log, "Epoch", timeout=180, job_id=job)  # training has started
    # What Slurm does before the time limit (--signal=USR1@60) or a preemption, sent now:
    slurm_cluster.run(["scancel", "--signal=USR1", job])
    result = slurm_cluster.wait(job, timeout=600)
    text = result.output_text()
    assert result.state == "COMPLETED", show(result)
    assert result.restarts >= 1, show(result)  # Slurm counted the requeue
    assert "requeue" in text, show(result)
    resumed = text[text.index("requeue") :]
    assert "resumed from" in resumed, show(result)  # the second start continued from the checkpoint
    assert list((tmp_path / "run").glob("*.pt")), "checkpoints in the output dir"
    metrics = json.loads(metrics_path.read_text())
    assert metrics["world_size"] == 2 and metrics["epochs"] == epochs and metrics["steps"] == 19, metrics
    assert "stopped_by" not in metrics, metrics  # written by the finished run, not the interrupted one
    for trace in ("Traceback", "Error", "failed"):  # e.g. wandb's MailboxClosedError, "dlojz: rank 0 failed"
        assert trace not in text, show(result)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({run.name.split("-")[-1] for run in runs}) == 1, runs  # one W&B run, continued
    # both starts of both ranks were the served Python's: forks of the preloaded server, requeued as a job's tasks
    calls = (served_python(None) / "bin" / "python.calls").read_text().splitlines()
    assert sum(call.startswith("-u dlojz.py ") and str(tmp_path) in call for call in calls) == 4, calls


# ---------------------------------------------------------------- dlojz_lab.py's sweeps as a job array
def test_a_slurm_sweep_is_one_job_array_whose_tasks_are_the_runs(slurm_cluster, tiny_data, tmp_path):
    from test_lab import RUN, lab, read_csv

    import dlojz_lib.lab.sweep as sweeps

    env = job_env(slurm_cluster)
    proc = lab(
        *("sweep", "--name", "arr", "--launch", "slurm", "--cpus-per-task", "1", "--time", "00:10:00"),
        *("--grid", "batch-size=4,8", "--grid", "channels-last=on,off", "--"),
        *RUN,
        "--data-root",
        tiny_data,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0 and "submitted job array" in proc.stdout, proc.stdout + proc.stderr
    sweep = tmp_path / "runs" / "arr"
    script = (sweep / "sweep.slurm").read_text()
    assert "#SBATCH --array=0-3" in script and "#SBATCH --cpus-per-task=1" in script
    assert "source slurm/dlojz_env.sh" in script
    runs = json.loads((sweep / "sweep.json").read_text())["runs"]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        states = [sweeps.read_status(sweep / run["name"]).get("state") for run in runs]
        if all(state in ("done", "failed") for state in states):
            break
        time.sleep(2)
    status = lab("status", "arr", cwd=tmp_path, env=env)
    assert states == ["done"] * 4, status.stdout + "".join(
        (sweep / r["name"] / "log.txt").read_text()[-1500:] for r in runs if (sweep / r["name"] / "log.txt").exists()
    )
    job = json.loads((sweep / "sweep.json").read_text())["job_id"]
    assert f"job array {job}" in status.stdout
    assert all(json.loads((sweep / r["name"] / "status.json").read_text())["job"] == job for r in runs)
    proc = lab("compare", "runs/arr", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_csv(sweep / "compare.csv")
    assert [row["state"] for row in rows] == ["done"] * 4
    for row in rows:
        metrics = json.loads((sweep / row["run"] / "metrics.json").read_text())
        assert float(row["img_s"]) == metrics["chrono"]["throughput_img_s"]
        assert metrics["global_batch_size"] == int(row["batch-size"])  # the grid's value reached the run
    # each task's `srun PYTHON -u dlojz.py` ran the Python the task was started as (sys.executable): the job's
    # venv's, here the served stand-in's, whose calls it writes down
    dlojz = f"-u {ROOT / 'dlojz.py'} "
    calls = (served_python(None) / "bin" / "python.calls").read_text().splitlines()
    assert sum(call.startswith(dlojz) and str(tmp_path) in call for call in calls) == 4, calls


# ---------------------------------------------------------------- dlojz_srun's restarts, with a stand-in srun
FAKE_SRUN = r"""#!/bin/bash
# A stand-in for srun: a node check (`... bash slurm/dlojz_node_check.sh`) does not answer when its node is in
# $DOWN, else runs the real check as on that node; a training step ends with the next status of $STATUSES, said as
# srun says it, and hangs after saying it when $HANG is set.
echo "$*" >> "$CALLS"
for arg in "$@"; do case "$arg" in --nodelist=*) nodelist="${arg#--nodelist=}" ;; esac; done
if [[ "${*: -1}" == */dlojz_node_check.sh ]]; then
    case ",$DOWN," in *",$nodelist,"*) exec sleep 60 ;; esac  # (exec: the process killed holds no pipe open)
    SLURMD_NODENAME="$nodelist" exec bash "${@: -1}"
fi
n=$(cat "$COUNT" 2>/dev/null || echo 0)
echo $(( n + 1 )) > "$COUNT"
read -ra statuses <<< "$STATUSES"
status="${statuses[$n]:-0}"
if [ "$status" -ne 0 ]; then
    echo "srun: error: n1: task 0: Exited with exit code $status" >&2
    [ -n "$HANG" ] && exec sleep 60
fi
exit "$status"
"""


# Stand-ins for a GPU node's nvidia-smi (2 GPUs; the old step's process listed on them for the first $HELD_QUERIES
# queries on the nodes of $HELD), and for the CUDA probe's Python (never done on the nodes of $HUNG: GPU 1 hangs).
FAKE_NVIDIA_SMI = r"""#!/bin/bash
echo "nvidia-smi $SLURMD_NODENAME $*" >> "$CALLS"
case "$*" in *query-gpu=index*) printf "0\n1\n"; exit 0 ;; esac
case ",$HELD," in *",$SLURMD_NODENAME,"*)
    n=$(cat "$CALLS.held.$SLURMD_NODENAME" 2>/dev/null || echo 0)
    echo $(( n + 1 )) > "$CALLS.held.$SLURMD_NODENAME"
    [ "$n" -lt "${HELD_QUERIES:-0}" ] && echo "4242, 00000000:1B:00.0" ;;
esac
exit 0
"""
FAKE_PROBE_PYTHON = r"""#!/bin/bash
echo "gpu 0 ok"
case ",$HUNG," in *",$SLURMD_NODENAME,"*) exec sleep 60 ;; esac
echo "gpu 1 ok"
"""


def dlojz_srun(tmp_path, statuses, down="", hang="", max_restarts="3", gpus=False, **more_env):
    """slurm/dlojz_restart.sh's dlojz_srun on a two-node job, srun and scontrol stood in for (and, `gpus`,
    nvidia-smi and the CUDA probe's Python): (status, stderr, the srun command lines of the training steps)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\nprintf "n1\\nn2\\n"\n')
    stand_ins = ["srun", "scontrol"]
    if gpus:
        (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
        (bin_dir / "probe-python").write_text(FAKE_PROBE_PYTHON)
        stand_ins += ["nvidia-smi", "probe-python"]
    for name in stand_ins:
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    (out / "latest").write_text("ckpt_e0001_s000000004.pt\n")
    calls, count = tmp_path / "calls", tmp_path / "count"
    env = dict(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_NTASKS="4",
        SLURM_JOB_NUM_NODES="2",
        DLOJZ_NODE_CHECK_S="2",
        DLOJZ_STEP_GRACE_S="1",
        DLOJZ_MAX_RESTARTS=max_restarts,
        CALLS=str(calls),
        COUNT=str(count),
        STATUSES=statuses,
        DOWN=down,
        HANG=hang,
        DLOJZ_PYTHON=str(bin_dir / "probe-python"),
    )
    env.update(more_env)
    script = f'source slurm/dlojz_restart.sh; dlojz_srun python -u dlojz.py --output-dir "{out}"'
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    said = calls.read_text().splitlines() if calls.exists() else []  # (no srun at all: no file)
    steps = [line for line in said if line.endswith(f"--output-dir {out}")]
    return proc.returncode, proc.stderr, steps


def restarts_said(stderr):
    return [line for line in stderr.splitlines() if line.startswith("dlojz_srun:")]


def test_a_hung_rank_s_step_runs_again_on_the_same_nodes(tmp_path):
    status, stderr, steps = dlojz_srun(tmp_path, "7 0")
    assert status == 0 and len(steps) == 2, stderr
    (said,) = restarts_said(stderr)
    assert said.startswith("dlojz_srun: restart 1/3 at ") and said.endswith(
        f"exit status 7; nodes left out: none; on n1,n2 from {tmp_path}/run/ckpt_e0001_s000000004.pt"
    ), said
    assert all("--nodes=2 --ntasks=4 --nodelist=n1,n2 python -u dlojz.py" in step for step in steps)


def test_a_node_that_does_not_answer_is_left_out_and_srun_waiting_for_it_is_stopped(tmp_path):
    status, stderr, steps = dlojz_srun(tmp_path, "4 0", down="n2", hang="1")  # srun waits on n2's task: stopped
    assert status == 0 and len(steps) == 2, stderr
    (said,) = restarts_said(stderr)
    assert "exit status 4; nodes left out: n2; on n1 from" in said, said
    assert "--nodes=1 --ntasks=2 --nodelist=n1 python -u dlojz.py" in steps[1]  # the tasks of the node left


def test_other_ends_are_not_restarted_and_restarts_are_bounded(tmp_path):
    status, stderr, steps = dlojz_srun(tmp_path, "2")  # bad input: nothing a restart mends
    assert status == 2 and len(steps) == 1 and not restarts_said(stderr), stderr
    (tmp_path / "again").mkdir()
    status, stderr, steps = dlojz_srun(tmp_path / "again", "4 4 4 4", max_restarts="2")
    said = restarts_said(stderr)
    assert status == 4 and len(steps) == 3 and len(said) == 3, stderr
    assert said[-1] == "dlojz_srun: exit status 4 after 2 restarts (DLOJZ_MAX_RESTARTS): the job ends"


def test_a_restart_waits_for_the_old_step_s_gpus_and_leaves_out_a_node_whose_gpu_hangs(tmp_path):
    """n1's GPUs held by the old step's process for 2 queries (then freed), n2's GPU 1 hung: n1 is checked once its
    GPUs are free and takes the restart, n2 is left out with a line saying why."""
    status, stderr, steps = dlojz_srun(
        tmp_path,
        "7 0",
        gpus=True,
        HELD="n1",
        HELD_QUERIES="2",
        HUNG="n2",
        DLOJZ_GPU_PROBE_S="2",
        DLOJZ_NODE_CHECK_S="10",
    )
    assert status == 0 and len(steps) == 2, stderr
    (said,) = restarts_said(stderr)
    assert "exit status 7; nodes left out: n2; on n1 from" in said, said
    assert "dlojz_node_check: n2: GPU 1 (of 2) does not run one operation (no answer in 2 s (hung or lost);" in stderr
    assert "--nodes=1 --ntasks=2 --nodelist=n1 python -u dlojz.py" in steps[1]
    calls = (tmp_path / "calls").read_text().splitlines()
    held_queries = [line for line in calls if line.startswith("nvidia-smi n1 --query-compute-apps")]
    assert len(held_queries) == 3  # held, held, free


def test_a_node_whose_gpu_stays_held_is_left_out(tmp_path):
    status, stderr, steps = dlojz_srun(
        tmp_path, "4 0", gpus=True, HELD="n2", HELD_QUERIES="1000", DLOJZ_GPU_FREE_S="2", DLOJZ_NODE_CHECK_S="10"
    )
    assert status == 0 and len(steps) == 2, stderr
    assert "dlojz_node_check: n2: processes still on its GPUs after 2 s (pid, GPU: 4242, 00000000:1B:00.0):" in stderr
    assert "nodes left out: n2; on n1 from" in restarts_said(stderr)[0]


@pytest.mark.parametrize("name, value", [("DLOJZ_MAX_RESTARTS", "three"), ("DLOJZ_NODE_CHECK_S", "-1"),
                                         ("DLOJZ_MAX_RESTARTS", "")])  # fmt: skip
def test_a_restart_setting_that_is_not_a_whole_number_is_one_line_before_any_step(name, value, tmp_path):
    status, stderr, steps = dlojz_srun(tmp_path, "4 4 4 4 4 4", **{name: value})
    assert status == 2 and steps == [], stderr  # before any step: a non-number once restarted forever
    assert stderr.strip() == (
        f"dlojz_srun: error: {name}='{value}' is not a whole number of "
        f"{'restarts' if name == 'DLOJZ_MAX_RESTARTS' else 'seconds'}; give one (e.g. {name}=3), or unset it for "
        "the default"
    )


@pytest.mark.parametrize("name", GPU_SCRIPTS + ["dlojz_cpu.slurm"])
def test_the_script_s_dlojz_flags_pass_dlojz_s_checks(name, monkeypatch):
    """The flags a script gives dlojz.py (--tp with --fsdp, a recipe's keys...) pass dlojz's own checks, as they
    would at the job's start, hours after submission (inside a Slurm job: the output folder is the job's)."""
    import shlex

    monkeypatch.setenv("SLURM_JOB_ID", "1")
    from dlojz_lib.settings.flag_checks import checked_values

    text = (SLURM_DIR / name).read_text()
    command = re.search(r"python -u dlojz\.py \\\n(.*?)\"\$@\"", text, re.S)
    assert command, name
    argv = [word for word in shlex.split(command.group(1).replace("\\\n", " ")) if not word.startswith("$")]
    checked_values(argv)  # one line (UserError) on a bad combination
