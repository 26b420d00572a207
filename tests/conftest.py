"""Shared fixtures: run dlojz.py as a user would (a subprocess), on small data the tests make themselves."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The bytecode of the test modules as pytest rewrites them, and of dlojz_lib, is written in their __pycache__ folders
# (ignored by git) whatever PYTHONDONTWRITEBYTECODE says: without it each xdist worker of each run rewrites the
# hundred test modules' asserts again (7 s of its 10 s collection here).
sys.dont_write_bytecode = False
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))  # in_process.synthetic_loop: dlojz's loop in-process, for tests and benches
# tests/ mirrors the package (its wings: data/, optim/, model/, parallelism/, settings/, observers/; commands/,
# system/; the rest beside it): a test file's
# helpers are imported by name from another folder's (`from test_dlojz import assert_one_line_error`), whichever
# folder pytest collected first.
TEST_FOLDERS = ("data", "optim", "model", "parallelism", "settings", "observers", "commands", "system")
sys.path[2:2] = [str(ROOT / "tests" / folder) for folder in TEST_FOLDERS]

# torch.compile compiles its kernels in the compiling process, with no pool of compile workers: the pool is a
# fresh interpreter importing torch, then its workers, 6 CPU seconds a --compile run here (its test's 21 s become
# 15), and it buys nothing on 2 cores that the suite's workers already fill. Set before torch, the fork server and
# the runs' environments read it; the test about that pool sets its own count.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import file_seconds  # noqa: E402
import preloaded  # noqa: E402  (after the path that finds dlojz)

# README's test command runs the suite in 2 xdist workers: each test's runs get their worker's share of the cores (a
# run with 2 threads next to another with 2 on 2 cores takes longer than both one after the other). Alone: up to 2.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = str(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, (os.cpu_count() or 1) // WORKERS))))

# Small and fast on 2 CPU cores: timm's test ResNet (370 k parameters, 1.5 MB checkpoints) at 32 px; a test about
# torchvision's ResNet (its layers, zero-init, BlurPool, fine-tuning) names --arch resnet18 after SMALL.
SMALL = [
    "--device",
    "cpu",
    "--arch",
    "timm:test_resnet",
    "--image-size",
    "32",
    "--val-resize-size",
    "36",
    "--val-crop-size",
    "32",
    "--num-workers",
    "1",
]
# SMALL at 16 px, batch 8 (9 steps an epoch on tiny_data), no W&B, no DataLoader worker: the runs in this process.
TINY = [*SMALL, "--image-size", "16", "--val-resize-size", "18", "--val-crop-size", "16", "-b", "8", "--no-wandb"]
TINY += ["--num-workers", "0"]


def importtime(stderr):
    """The stderr of `python -X importtime ...`, apart: (its other lines, the modules imported, in order)."""
    lines = stderr.splitlines()
    timed = [line for line in lines if line.startswith("import time:")]
    return [line for line in lines if line not in timed], [line.split("|")[-1].strip() for line in timed]


def clean_env(**extra):
    """The environment of a plain shell: no launcher variables (Slurm, torchrun), no data variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "DLOJZ_", "WANDB_"))
        and k not in ("ALL_CCFRSCRATCH", "DSDIR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", THREADS)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_dlojz(*args, env=None, timeout=600, launcher=None, cwd=None, ranks=1, fresh_interpreter=False):
    """Run dlojz.py in a process of its own (`ranks` of them, as torchrun starts them on one node, when ranks > 1);
    `launcher` e.g. ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]. Without a launcher,
    each process is a fork of a server that imported dlojz once (tests/preloaded.py), unless the environment asks
    for a fresh interpreter or `fresh_interpreter` does."""
    env = env or clean_env()
    argv = [str(a) for a in args]
    if not launcher and not fresh_interpreter and preloaded.can_run(env):
        return preloaded.run_ranks(argv, env, cwd or ROOT, timeout, world_size=ranks)
    if ranks > 1 and not launcher:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd = [sys.executable] + (launcher or []) + [str(ROOT / "dlojz.py")] + argv
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or ROOT)


def script_python(env=None):
    """What stands for `python` in a test's `python bench/SCRIPT.py ARGS` or `python dlojz_NAME.py ARGS` (a sibling
    command): tests/preloaded_client.py, which runs the script as a fork of the preloaded server (its imports of torch
    and dlojz paid once a session), or, in an environment the server cannot give, execs this Python."""
    return [*preloaded.launch_prefix(env or clean_env()), sys.executable]


def start_dlojz(*args, env=None, cwd=None):
    """dlojz.py started and not waited for, shaped like Popen(stdout=PIPE, stderr=STDOUT, text=True): a fork of
    the preloaded server where the environment allows, else a new interpreter."""
    env = env or clean_env()
    argv = [str(a) for a in args]
    if preloaded.can_run(env):
        return preloaded.Started(argv, env, cwd or ROOT)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "dlojz.py"), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd or ROOT,
    )


def spawn_ranks(target, world, tmp_path, *args, timeout=300):
    """Run target(rank, world, store_path, queue, *args) in `world` processes that meet through a FileStore under
    `tmp_path` (gloo); returns what they put in the queue, once every one has exited with status 0. Each process
    starts as a spawned one would (this process's environment and working directory, the platform's start method for
    its own children), but forked from the tests' preloaded server (tests/preloaded.py), which imported torch, dlojz
    and timm once, where that server can give this environment; else spawned (never fork a process that has threads).
    """
    note_ranks(world, getattr(target, "__name__", "a process group"))
    context, env = preloaded.spawned_context()
    queue = context.Queue()
    workers = [
        context.Process(
            target=preloaded.run_as_spawned, args=(env, target, rank, world, str(tmp_path / "store"), queue, *args)
        )
        for rank in range(world)
    ]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
    found = []
    while not queue.empty():
        found.append(queue.get())
    for worker in workers:
        if worker.exitcode is None:  # past the timeout: not left behind the test
            worker.kill()
            worker.join()
    assert all(worker.exitcode == 0 for worker in workers), ([worker.exitcode for worker in workers], found)
    return found


def counting_mode():
    """A dispatch mode that counts the collectives sent in it, DTensor's and FSDP's (by kind: all_reduce, all_gather,
    reduce_scatter, send...), without the module hooks of torch's CommDebugMode (whose view of a block's input breaks
    timm's in-place SiLU); in `sent`, each one's (ranks of its group, bytes this rank sends: bytes_sent); in
    `calls`, each one as called (namespace, op name, its ProcessGroup's ranks or None, its first tensor's dtype and
    elements)."""
    from collections import Counter

    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group as resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    def group_ranks(arg):  # a c10d op's ProcessGroup (a TorchScript object), or a functional op's group name
        group = resolve_process_group(arg) if isinstance(arg, str) else dist.ProcessGroup.unbox(arg)
        return frozenset(dist.get_process_group_ranks(group))

    kinds = {"all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather", "allreduce_": "all_reduce",
             "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter"}  # fmt: skip

    def call_ranks(args):  # the ranks of a c10d op's ProcessGroup argument (a TorchScript object), in its order
        for arg in args:
            if type(arg).__name__ == "ScriptObject":
                try:
                    return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(arg)))
                except RuntimeError:  # (another TorchScript object: a ReduceOp)
                    continue
        return None

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts, self.sent, self.calls = Counter(), [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(kind is DTensor for kind in types):
                return NotImplemented  # DTensor first turns its op into local ops and collectives, seen here
            name = func.__name__.split(".")[0]
            if func.namespace in ("_c10d_functional", "c10d") and not name.startswith(("wait", "_wrap")):
                first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                self.calls.append((func.namespace, name, call_ranks(args), str(first.dtype), first.numel()))
                self.counts[kinds.get(name, name)] += 1
                try:
                    found = bytes_sent(name, args, group_ranks)
                except Exception as error:  # (raising here would leave the other ranks waiting in the collective)
                    found = f"not counted: {func} ({error})", 0
                if found is not None:
                    self.sent.append(found)
            return func(*args, **(kwargs or {}))

    return Collectives()


def bytes_sent(name, args, group_ranks):
    """(the ranks of the group, bytes) this rank sends for one c10d op, by the ring algorithms the planner counts
    with (an all-gather sends n - 1 times this rank's input, a reduce-scatter n - 1 times its output, an all-reduce
    2 (n - 1) / n of the buffer, a send its tensors, a broadcast its tensors once); None for what sends nothing (a receive, a wait). `group_ranks`:
    the ranks of an op's group argument (a ProcessGroup, or a functional collective's group name), else None."""

    def nbytes(tensors):
        tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        return sum(t.numel() * t.element_size() for t in tensors)

    if name == "recv_" or name.startswith(("wait", "_wrap")):
        return None
    where = {"_allgather_base_": 2, "_reduce_scatter_base_": 2, "allreduce_": 1, "all_reduce": 2, "send": 1}
    where.update(broadcast_=1, all_gather_into_tensor=2)  # (tensors, group, root, ...), (input, n, group name)
    if name not in where:
        return f"not counted: {name}", 0  # (raising here would leave the other ranks waiting in the collective)
    ranks = group_ranks(args[where[name]])
    n = len(ranks)
    sent = {
        "_allgather_base_": lambda: (n - 1) * nbytes(args[1]),  # (output, input, group, ...)
        "_reduce_scatter_base_": lambda: (n - 1) * nbytes(args[0]),  # (output, input, group, ...)
        "allreduce_": lambda: 2 * (n - 1) / n * nbytes(args[0]),  # (tensors, group, ...)
        "all_reduce": lambda: 2 * (n - 1) / n * nbytes(args[0]),  # DTensor's: (tensor, op, group name)
        "send": lambda: nbytes(args[0]),  # (tensors, group, peer, tag)
        "broadcast_": lambda: nbytes(args[0]) if n > 1 else 0,  # a chain: every rank but the last passes it on
        "all_gather_into_tensor": lambda: (n - 1) * nbytes(args[0]),  # DTensor's
    }[name]()
    return ranks, sent


def read_json(path):
    return json.loads(Path(path).read_text())


def show(proc):
    """Context for a failed assertion."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """3 classes, 24 train images per class, 5 val per class: 15 val images, not divisible by 2."""
    from dlojz_lib.data.embedded import make_embedded_dataset

    return make_embedded_dataset(
        tmp_path_factory.mktemp("data") / "tiny", n_classes=3, train_per_class=24, val_per_class=5, size=(48, 40)
    )


# A trained model for the tests of what uses one (dlojz_predict.py, dlojz_export.py, --teacher): one epoch of a
# resnet18 with an EMA that differs from its weights.
TRAINED_RUN = [*TINY, "--arch", "resnet18", "--epochs", "1", "--model-ema", "--model-ema-decay", "0.5"]


@pytest.fixture(scope="session")
def trained_run(tiny_data, tmp_path_factory):
    """The output folder of TRAINED_RUN on tiny_data, trained once per test worker; read it, do not write in it."""
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = run_dlojz(*TRAINED_RUN, "--data-root", tiny_data, "--output-dir", out)
    assert proc.returncode == 0, show(proc)
    return out


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
    """An XDG cache in which dlojz generates its embedded data set (once for the session)."""
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(autouse=True)
def close_dataloaders(monkeypatch):
    """Stop the DataLoader workers a test opened through dlojz's make_loader and left open (a run's end closes its
    own): they ignore SIGTERM, and the interpreter's exit would wait for them forever. Only where the test's module
    has the loaders imported already: the others import no torch for it."""
    loaders = sys.modules.get("dlojz_lib.data.loaders")
    opened = []
    if loaders is not None:
        make_loader = loaders.make_loader

        def recorded(*args, **kwargs):
            opened.append(make_loader(*args, **kwargs))
            return opened[-1]

        monkeypatch.setattr(loaders, "make_loader", recorded)
    yield
    for loader in opened:
        loaders.close_loader(loader)


@pytest.fixture
def run_inline(capsys, monkeypatch):
    """Run dlojz.cli(argv) inside the test process (no interpreter start-up, torch already imported): for the
    runs that stop before training, i.e. the bad-input paths. Returns an object shaped like CompletedProcess."""
    import dlojz

    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_", "DLOJZ_", "WANDB_")) or key in ("ALL_CCFRSCRATCH", "DSDIR"):
            monkeypatch.delenv(key)

    def run(*args):
        saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)}
        try:
            status = dlojz.cli([str(a) for a in args])
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
        out = capsys.readouterr()
        return SimpleNamespace(returncode=status, stdout=out.out, stderr=out.err)

    return run


def pytest_configure(config):
    import torch

    # Under --dist loadfile, the files go to the workers in the order pytest_collection_modifyitems leaves them
    # (slowest first) rather than xdist's own (most tests first).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False

    torch.set_num_threads(int(THREADS))  # the tests that train in this process
    spawn = torch.multiprocessing.spawn

    def noted_spawn(fn, args=(), nprocs=1, *rest, **kwargs):  # torch.multiprocessing.spawn starting ranks
        note_ranks(nprocs, getattr(fn, "__name__", "torch.multiprocessing.spawn"))
        return spawn(fn, args, nprocs, *rest, **kwargs)

    torch.multiprocessing.spawn = noted_spawn
    config.pluginmanager.register(SharedFixtureSeconds(), "dlojz-shared-fixture-seconds")


def pytest_collection_modifyitems(config, items):
    """Markers the tests do not write themselves: `slurm` on the tests that start a Slurm cluster (one node or two),
    `slow` on those tests/file_seconds.json measured over file_seconds.SLOW_S (or that need a fixture over it). The
    files are ordered by their last measured seconds, slowest first: two xdist workers then end close together. A
    file not measured yet goes first (it may be slow); a file's tests keep their order."""
    figures = file_seconds.load()
    for item in items:
        if {"slurm_cluster", "slurm_two_nodes"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slurm)
        if file_seconds.is_slow(item.nodeid, fixture_keys(item), figures):
            item.add_marker(pytest.mark.slow)
    items.sort(
        key=lambda item: -figures["files"].get(item.path.relative_to(file_seconds.TESTS).as_posix(), float("inf"))
    )


def fixture_keys(item):
    """The keys (file_seconds.fixture_key) of the fixtures above function scope that a test needs."""
    info = getattr(item, "_fixtureinfo", None)
    keys = []
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        if definitions and definitions[-1].scope != "function":
            keys.append(file_seconds.fixture_key(definitions[-1]))
    return keys


class SharedFixtureSeconds:
    """The set-up seconds of each shared fixture, put in the report of the test whose set-up built it (a junit
    property that tests/file_seconds.py reads): that test's own seconds leave them out. A plugin, not conftest's
    hooks: pytest asks a conftest only about the nodes under its folder, and a session fixture's node is the
    session. Also notes the fixtures that started several ranks (RANK_FIXTURES)."""

    def __init__(self):
        self.built = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        started, ranks = time.perf_counter(), len(SEVERAL_RANKS)
        yield
        if fixturedef.scope != "function":
            self.built.append((file_seconds.fixture_key(fixturedef), time.perf_counter() - started))
            if len(SEVERAL_RANKS) > ranks:
                RANK_FIXTURES.add(file_seconds.fixture_key(fixturedef))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        self.built.clear()
        SEVERAL_RANKS.clear()  # before any fixture: a shared one that starts ranks is the test's too
        yield
        item.user_properties.extend(("fixture_seconds", f"{key}={seconds:.2f}") for key, seconds in self.built)
        self.built.clear()


# ------------------------------------------------------------------------------------ several ranks, one marker
# What the running test started with several ranks, its fixtures included: the `multirank` marker must say so (the
# guard below fails a test that starts ranks without it), so that `-m "not multirank"` leaves out every test that
# starts them. A shared fixture that started ranks (RANK_FIXTURES) counts for every test that needs it.
SEVERAL_RANKS = preloaded.SEVERAL_RANKS  # ranks started as torchrun starts them (preloaded.rank_env) land here too
RANK_FIXTURES = set()


def note_ranks(count, what):
    if int(count) > 1:
        SEVERAL_RANKS.append(f"{what} on {count} ranks")


def note_torchrun(args):
    """A command line that starts torchrun with several processes a node."""
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else str(args).split())]
    if any(a.endswith("torchrun") or a == "torch.distributed.run" for a in argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if flag in argv[:-1]:
                count = argv[argv.index(flag) + 1]
                note_ranks(count if count.isdigit() else 2, "torchrun")


class _WatchedPopen(subprocess.Popen):
    """subprocess.Popen noting torchrun's starts; every test's subprocesses go through it (set just below)."""

    def __init__(self, *args, **kwargs):
        note_torchrun(args[0] if args else kwargs.get("args", ()))
        super().__init__(*args, **kwargs)


subprocess.Popen = _WatchedPopen


def ranks_without_marker(node):
    """The guard's verdict on a test that has run: None, or the line that names what it started unmarked."""
    started = list(SEVERAL_RANKS) + sorted(RANK_FIXTURES & set(fixture_keys(node)))
    if started and node.get_closest_marker("multirank") is None:
        return f"{node.nodeid} starts {started[0]}: mark it @pytest.mark.multirank"
    return None


@pytest.fixture(autouse=True)
def several_ranks_carry_the_marker(request):
    yield
    if (verdict := ranks_without_marker(request.node)) is not None:
        pytest.fail(verdict, pytrace=False)


# ------------------------------------------------------------------------------------ state a test may change
@pytest.fixture(autouse=True)
def torch_state_restored():
    """Each test starts from the same torch: its thread count, default dtype, deterministic flags and random
    state, whatever the tests before it in the worker changed (a result must not depend on their order)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    saved = (
        torch.get_num_threads(),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_rng_state(),
    )
    yield
    threads, dtype, deterministic, warn_only, rng = saved
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    # only when changed: the call imports torch._dynamo the first time, which reads the working directory, and a
    # test's tmp_path (its working directory under monkeypatch.chdir) is already removed here
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
        deterministic,
        warn_only,
    ):
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_rng_state(rng)
