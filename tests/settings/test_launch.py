"""Launch environments: a launcher's variables present but incomplete or inconsistent, or rank variables without a
launcher, are refused in one line before torch is imported, never run as one silent process."""

import subprocess
import sys

import pytest
from conftest import ROOT, clean_env

from dlojz_lib.settings.launch import launch_problem, most_tasks_per_node

SLURM = dict(
    SLURM_STEP_ID="0",
    SLURM_PROCID="1",
    SLURM_LOCALID="1",
    SLURM_STEP_NUM_TASKS="2",
    SLURM_STEP_TASKS_PER_NODE="2",
    SLURM_STEP_NUM_NODES="1",
    SLURM_STEP_NODELIST="node1",
    SLURM_JOB_ID="42",
)
TORCHRUN = dict(
    TORCHELASTIC_RUN_ID="x",
    RANK="1",
    LOCAL_RANK="1",
    WORLD_SIZE="2",
    LOCAL_WORLD_SIZE="2",
    MASTER_ADDR="node1",
    MASTER_PORT="29500",
)


def without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


@pytest.mark.parametrize(
    "env",
    [
        {},
        dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"),  # what idr_torch itself writes for one process
        dict(SLURM_PROCID="0", SLURM_JOB_ID="42"),  # a Slurm batch script running dlojz without srun
        SLURM,
        TORCHRUN,
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "1,2", "SLURM_STEP_NUM_NODES": "2"},  # uneven nodes
    ],
)
def test_whole_launch_environments_are_accepted(env):
    assert launch_problem(env) is None


@pytest.mark.parametrize(
    "env, fragments",
    [
        (dict(RANK="1", WORLD_SIZE="2"), ["RANK=1 WORLD_SIZE=2 but no launcher", "srun or torchrun"]),
        (dict(RANK="abc", WORLD_SIZE="2"), ["RANK=abc WORLD_SIZE=2 but no launcher"]),
        (dict(SLURM_PROCID="1"), ["SLURM_PROCID=1 but no launcher"]),
        (dict(WORLD_SIZE="4"), ["WORLD_SIZE=4 but no launcher"]),
        (dict(SLURM_STEP_ID="0", SLURM_PROCID="0"), ["SLURM_STEP_ID is set", "SLURM_STEP_NODELIST", "SLURM_LOCALID"]),
        (without(TORCHRUN, "MASTER_ADDR"), ["TORCHELASTIC_RUN_ID is set", "needs MASTER_ADDR"]),
        ({**TORCHRUN, "RANK": "2"}, ["RANK=2 is outside WORLD_SIZE=2"]),
        ({**TORCHRUN, "WORLD_SIZE": "two"}, ["WORLD_SIZE=two is not a whole number"]),
        ({**TORCHRUN, "LOCAL_RANK": "-1"}, ["LOCAL_RANK=-1 is not a whole number"]),
        ({**SLURM, "SLURM_PROCID": "2"}, ["SLURM_PROCID=2 is outside SLURM_STEP_NUM_TASKS=2"]),
        ({**SLURM, "SLURM_LOCALID": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, ["SLURM_LOCALID=3 is outside"]),
    ],
)
def test_half_set_launch_environments_are_refused(env, fragments):
    problem = launch_problem(env)
    assert problem is not None and "\n" not in problem
    for fragment in fragments:
        assert fragment in problem, problem


def test_slurm_s_compact_task_counts():
    assert [most_tasks_per_node(s) for s in ("4", "4(x2),3", "1,2(x3)", "")] == [4, 4, 2, 0]


@pytest.mark.parametrize(
    "env, fragment",
    [
        (dict(RANK="1", WORLD_SIZE="2"), "RANK=1 WORLD_SIZE=2 but no launcher"),
        (dict(SLURM_STEP_ID="0", SLURM_PROCID="0"), "needs SLURM_LOCALID"),
        (without(TORCHRUN, "MASTER_ADDR"), "needs MASTER_ADDR"),
        (dict(DLOJZ_DATA="/nonexistent"), "$DLOJZ_DATA=/nonexistent: no such folder"),
    ],
)
def test_dlojz_refuses_them_before_importing_torch(tmp_path, env, fragment):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "dlojz.py"), "--test", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(**env),
        cwd=tmp_path,
    )
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    stderr = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and "torch" not in imported, proc.stderr[-2000:]
    assert stderr == [f"dlojz: error: {stderr[0].removeprefix('dlojz: error: ')}"] and fragment in stderr[0], stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_missing_dlojz_data_is_fine_when_no_data_is_read(monkeypatch):
    from dlojz_lib.settings.flag_checks import check_data_variable

    monkeypatch.setenv("DLOJZ_DATA", "/nonexistent")
    check_data_variable(dict(data_root=None, synthetic=True))
    check_data_variable(dict(data_root="/data", synthetic=False))  # --data-root wins: the variable is not read
