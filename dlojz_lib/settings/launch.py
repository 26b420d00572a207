"""Which launcher started this process, checked before torch is imported.

dlojz reads its rank, world size and rendezvous address through idr_torch, which picks Slurm when `SLURM_STEP_ID`
is set (a task of `srun`), torchrun when `TORCHELASTIC_RUN_ID` is set, and otherwise runs one process alone. Left to
idr_torch, a variable the launcher should have set and did not ends deep inside it (`KeyError`, `ValueError`), and
rank variables without either launcher are ignored, so that copies started by hand each train alone and overwrite
each other's checkpoints. `launch_problem(environ)` returns the one line saying what is missing or inconsistent, or
None (one process with no rank variables, or a launcher's whole and consistent set). `load_idr_torch()` imports
idr_torch itself, once, where dlojz reads the launch.
"""

import re
import warnings

# What idr_torch reads from each launcher: rank, local rank, world sizes, nodes, rendezvous address and port.
SLURM_TASK = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_ID",
)
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
NOT_COUNTS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "MASTER_ADDR")


def launch_problem(environ):
    """None when the launch variables are whole and consistent, else the line saying what is wrong."""
    if "SLURM_STEP_ID" in environ:
        launcher, names, marker = "a Slurm task", SLURM_TASK, "SLURM_STEP_ID"
        ranks = (("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"), ("SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"))
    elif "TORCHELASTIC_RUN_ID" in environ:
        launcher, names, marker = "a torchrun worker", TORCHRUN, "TORCHELASTIC_RUN_ID"
        ranks = (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    else:
        return stray_ranks(environ)
    where = f"{launcher} ({marker} is set)"
    absent = [name for name in names if not environ.get(name)]
    if absent:
        return (
            f"{where} needs {', '.join(absent)}, not set: start dlojz with its launcher, or unset {marker} "
            "to run one process"
        )
    for name in names:
        if name not in NOT_COUNTS and not environ[name].isdigit():
            return f"{where}: {name}={environ[name]} is not a whole number"
    for rank, size in ranks:
        count = most_tasks_per_node(environ[size]) if size == "SLURM_STEP_TASKS_PER_NODE" else int(environ[size])
        if not int(environ[rank]) < count:
            return f"{where}: {rank}={environ[rank]} is outside {size}={environ[size]} (ranks count from 0)"
    return None


def stray_ranks(environ):
    """No launcher: one process. Rank variables saying otherwise are copies started by hand."""
    tasks = environ.get("SLURM_NTASKS", "1")
    if tasks.isdigit() and int(tasks) > 1:  # a job of several tasks, dlojz started in its batch script without srun
        return (
            f"SLURM_NTASKS={tasks} but dlojz was not started by srun: one process would train alone while the job "
            f"holds {tasks} tasks; start it with srun python dlojz.py ... (or ask for --ntasks=1)"
        )
    given = {name: environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID") if name in environ}
    if all(value == ("1" if name == "WORLD_SIZE" else "0") for name, value in given.items()):
        return None
    return (
        f"{' '.join(f'{name}={value}' for name, value in given.items())} but no launcher: each copy would train "
        "alone and overwrite the others' checkpoints; start the ranks with srun or torchrun (dlojz takes its rank "
        "from them), or unset these variables to run one process"
    )


def most_tasks_per_node(tasks_per_node):
    """Slurm's compact counts, "4(x2),3" -> 4: the most tasks any node of the step holds."""
    return max((int(count) for count in re.findall(r"(\d+)(?:\(x\d+\))?", tasks_per_node)), default=0)


def launch_rank(environ):
    """This process's rank as its (whole) launch environment says: 0 without a launcher."""
    if "SLURM_STEP_ID" in environ:
        return int(environ["SLURM_PROCID"])
    return int(environ["RANK"]) if "TORCHELASTIC_RUN_ID" in environ else 0


def launch_world_size(environ):
    """The number of ranks the (whole) launch environment says: 1 without a launcher."""
    if "SLURM_STEP_ID" in environ:
        return int(environ["SLURM_STEP_NUM_TASKS"])
    return int(environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in environ else 1


def model_copy_problem(world_size, pp, tp, replicate=1):
    """The line saying that `world_size` ranks do not hold whole copies of a model cut by --pp and split by --tp, or
    that their data ranks do not make --fsdp-replicate's equal replicas, else None."""
    copy = pp * tp  # the ranks that hold one copy of the model
    if world_size % copy == 0:
        data = world_size // copy
        if data % replicate == 0:
            return None
        ranks = f"{data} data rank(s) ({world_size} / --pp x --tp)" if copy > 1 else f"{data} rank(s)"
        return (
            f"--fsdp-replicate {replicate}: this job's {ranks} do not make {replicate} equal replicas; give an R "
            f"that divides {data} (its number of nodes, usually)"
        )
    if pp > 1 and tp > 1:
        flag, what = f"--pp {pp} x --tp {tp} = {copy}", "a --pp and a --tp whose product divides it"
    else:
        name = "--pp" if pp > 1 else "--tp"
        flag, what = f"{name} {copy}", f"a {name} that divides it"
    return f"{flag}: this job has {world_size} rank(s), not a multiple of {copy}; give {what}"


def load_idr_torch():
    """idr_torch (rank, world size, CPUs per task from Slurm or torchrun), imported on first use (it imports torch), once per process (Python keeps the module).
    Its warning that no launcher was found is silenced: one process is a normal way to run dlojz."""
    import idr_torch

    warnings.filterwarnings("ignore", category=idr_torch.IdrTorchWarning)
    return idr_torch
