"""Run dlojz.py for the tests in a process of its own, forked from a server that imported dlojz (and timm) once.

A test's `python dlojz.py` spends about 3.5 s of its 4-5 s importing torch, torchvision and dlojz (timm: 1 s more
for the tests' small model), and the suite starts some 80 of them. Here each run is still a separate process (its own
exit status, signal handlers, stdout and stderr, environment, working directory, DataLoader workers and atexit
handlers), but a fork of multiprocessing's fork server, which preloaded dlojz and timm: the imports are paid once per
test session. The server is started once, with no
thread running but the one `import torch` starts, so forking it is what forkserver is for.

What a fork cannot change is what the interpreter and torch read when they start: a run whose environment differs
from the server's in such a variable (PYTHON*, TORCH_*, ATEN_*, ...) runs as a fresh `python dlojz.py`
(`can_run` says which); so does a run under a launcher, and a test that is about the interpreter's start-up.
Two ranks are started as torchrun starts them on one node (its environment variables), each a fork of the server;
the tests that are about torchrun itself run it.
"""

import atexit
import contextlib
import gc
import json
import locale
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import select
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import reduction
from pathlib import Path

DLOJZ = Path(__file__).resolve().parent.parent / "dlojz.py"
# Read by the interpreter, torch or the libraries it loads when the process starts, not when dlojz runs.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "ATEN_", "LD_", "MKL_", "KMP_", "GOMP_", "CUDA_", "NCCL_", "GLOO_")
# Harmless to a fork: output is line-buffered here and flushed at exit; the thread count is set in the child
# (torch.set_num_threads sets MKL's with OpenMP's);
# inductor reads its cache folder when it compiles (and sets it in os.environ: a run after a compile sees it);
# torchrun's run id says "launched by torchrun" to idr_torch and torch.distributed when the run sets up its ranks
# (the ranks a test starts by hand, as torchrun would: rank_env).
RUN_TIME = (
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TORCHELASTIC_RUN_ID",
)

# The variable in which python_executable's stand-in names itself to the client, which takes it out of the run's
# environment and gives it to the run as its sys.executable.
STAND_IN = "PRELOADED_STAND_IN"

_context = multiprocessing.get_context("forkserver")
# dlojz, timm (the tests' small model, SMALL), and what a run imports when it gets there, here once and not in every
# run: the timeline plot's matplotlib (its pyplot and Agg), idr_torch (the ranks' set-up), the image loader's PIL
# plugins, the pipeline's and the FLOP counter's torch modules, and the sharded checkpoints' module (each rank of an
# --fsdp run imported it at its first checkpoint: 6 % of a 2-rank run's CPU). A forked test_vit run of 2 steps:
# 0.91 CPU s with dlojz and timm alone, 0.54 with these.
PRELOAD = (
    "dlojz",
    "timm",
    "matplotlib.pyplot",
    "matplotlib.backends.backend_agg",
    "idr_torch",
    "dlojz_lib.data.shards",
    "PIL.BmpImagePlugin",
    "PIL.GifImagePlugin",
    "PIL.JpegImagePlugin",
    "PIL.PngImagePlugin",
    "PIL.PpmImagePlugin",
    "numpy.ma",
    "multiprocessing.queues",
    "torch.utils.flop_counter",
    "torch.distributed.pipelining",
    "torch.distributed._composable.replicate_with_fsdp",
    "torch.nn.attention.flex_attention",
    "torch.distributed.checkpoint",
)
_context.set_forkserver_preload(list(PRELOAD))
_server_env = None  # the start-up variables of the server's environment, once it runs


def _startup_env(env):
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in RUN_TIME}


def _ensure_server(env):
    """Start the fork server under `env` (unless something else started it, then under this process's)."""
    global _server_env
    if _server_env is not None:
        return
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:  # started by another user of forkserver (a DataLoader, a Pool)
        _server_env = _startup_env(os.environ)
        return
    saved, cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    # Python 3.11's fork server imports its preload from its working directory (it ignores the sys.path it is
    # given, and an ImportError is silent): started in a test's tmp_path, it would preload nothing.
    os.chdir(DLOJZ.parent)
    try:
        server.ensure_running()
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
    _server_env = _startup_env(env)


def can_run(env):
    """Whether a run with this environment behaves in a fork of the server as in a fresh interpreter."""
    _ensure_server(env)
    return _startup_env(env) == _server_env


def _exit_status(code):
    """What the interpreter's exit makes of sys.exit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class _FdForChild:
    """A file descriptor of this process, given to the child as its own (multiprocessing passes it to the server)."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate):
    return duplicate.detach()


def _child(argv, env, cwd, out, err, affinity=None, script=None, executable=None):
    """The forked process: `out` and `err` are a path or a file descriptor; err None is stderr=STDOUT; `affinity`
    the CPUs it may run on (those of the process it stands for), by default the server's; `script` a file to run as
    __main__ (`python SCRIPT ARGV`: a benchmark's measuring run) in place of dlojz.py; `executable` the Python it
    was started as (a stand-in of python_executable's), its sys.executable as a fresh interpreter's would be: what
    it starts with sys.executable (a sweep task's dlojz.py, an HPO worker's trials) goes through that stand-in."""
    if affinity is not None:
        os.sched_setaffinity(0, affinity)
    if executable is not None:
        sys.executable = executable
    as_spawned(env)
    os.chdir(cwd)
    for fd, target in ((1, out), (2, out if err is None else err)):
        file_fd = target if isinstance(target, int) else os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file_fd, fd)
    for target in {out, err}:
        if isinstance(target, int):
            os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [str(script or DLOJZ), *argv]
    import dlojz

    try:
        if script:
            sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` puts its folder first
            runpy.run_path(script, run_name="__main__")
            status = 0
        else:
            status = _exit_status(dlojz.cli(argv))
    except SystemExit as err:
        status = _exit_status(err.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    _forget_operator_libraries()
    atexit._run_exitfuncs()  # as the interpreter's exit would
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _forget_operator_libraries():
    """The exit of a fork leaves torch's operator libraries registered: their finalizers unregister every operator
    from the dispatcher one by one (9 % of a 2-rank --fsdp run's CPU), which a process about to end does for nothing
    anyone sees; the run's own exit functions still run."""
    import weakref

    library = sys.modules.get("torch.library")
    if library is None:
        return
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        held = finalizer.peek()  # (the object, the function, its arguments), or None once it ran
        if held is not None and held[1] is library._del_library:
            finalizer.atexit = False


def fork_context():
    """The context whose processes are forks of the server (started with this process's environment if need be)."""
    _ensure_server(dict(os.environ))
    return _context


def spawned_context():
    """(a multiprocessing context, the environment to give as_spawned): forks of the server, set up as a spawned
    process starts, where the server can give this process's environment; else spawn's own processes (None: they
    need no setting up)."""
    env = dict(os.environ)
    if can_run(env):
        return fork_context(), env
    return multiprocessing.get_context("spawn"), None


def as_spawned(env):
    """Set up a fork of the server as a spawned process starts: the environment it is given (a fork has the
    server's), the platform's start method for its own children, torch's threads from OMP_NUM_THREADS.
    multiprocessing has already given it the parent's working directory and sys.path. (A Pool's initializer.) With
    env None (a spawned process): nothing to do."""
    if env is None:
        return
    # The server's objects (torch's, timm's and dlojz's, some 420,000) go to the collector's permanent
    # generation, which no collection walks: a collection that walked them would write to each one's page, a copy of
    # it for this process (measured: a forked ResNet's 5 steps and one collection, 32,000 page faults and 0.40 CPU
    # seconds; frozen, 6,000 and 0.12). The move links two lists: it writes to two objects, not to every one.
    gc.freeze()
    os.environ.clear()
    os.environ.update(env)
    # A child of the fork server inherits its start method: a fresh interpreter's is the platform's default, which
    # DataLoader workers use (with forkserver, each run would start a fork server of its own: 3-4 s per loader).
    multiprocessing.set_start_method(None, force=True)
    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def run_as_spawned(env, target, *args):
    """target(*args) in a fork of the server set up as_spawned(env)."""
    as_spawned(env)
    target(*args)


def _read(path):
    # as subprocess.run(text=True) decodes: the locale's encoding, universal newlines
    if not os.path.exists(path):  # the child died before it opened its output
        return ""
    with open(path, encoding=locale.getpreferredencoding(False)) as f:
        return f.read()


# What torchrun does when a rank ends on a refusal: the others are sent SIGTERM, then killed past its grace.
REFUSED_STATUS = 2
TORCHRUN_STOP_GRACE_S = 10


def _finish(processes, timeout):
    """Wait for every process, as torchrun waits for its ranks: once one ends on a refusal (exit status 2), the
    others are stopped (SIGTERM, then SIGKILL past TORCHRUN_STOP_GRACE_S); kill what is left at `timeout`.
    (whether the deadline passed, the processes in the order they ended)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    ended, stopped_at = [], None
    try:
        while True:
            ended += [p for p in processes if p.exitcode is not None and p not in ended]
            running = [p for p in processes if p.exitcode is None]
            now = time.monotonic()
            if not running or (deadline is not None and now > deadline):
                break
            if stopped_at is None and any(p.exitcode == REFUSED_STATUS for p in ended):
                for process in running:
                    process.terminate()
                stopped_at = now
            elif stopped_at is not None and now - stopped_at > TORCHRUN_STOP_GRACE_S:
                for process in running:
                    process.kill()
            multiprocessing.connection.wait([p.sentinel for p in running], timeout=0.2)
    finally:
        timed_out = any(process.exitcode is None for process in processes)  # or the test was interrupted
        for process in processes:
            if process.exitcode is None:
                process.kill()
                process.join()
        ended += [p for p in processes if p not in ended]
    return timed_out, ended


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The world sizes of the ranks started since conftest last cleared it (its guard of the `multirank` marker).
SEVERAL_RANKS = []


def rank_env(env, rank, world_size, port):
    """The variables torchrun gives each of its processes on one node (idr_torch reads them)."""
    if rank == 0 and world_size > 1:
        SEVERAL_RANKS.append(f"dlojz.py on {world_size} ranks")
    return {
        **env,
        "TORCHELASTIC_RUN_ID": "test",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def rank_processes(argv, env, cwd, world_size, outputs, affinity=None, script=None, executable=None):
    """`world_size` forks of the server running dlojz.py `argv` (not started yet), or `script`: one with `env`, or
    several given torchrun's variables on one node (rank_env); `outputs(rank)` gives a rank's (out, err) for _child."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        rank_environ = env if world_size == 1 else rank_env(env, rank, world_size, port)
        out, err = outputs(rank)
        processes.append(
            _context.Process(
                target=_child,
                args=(argv, rank_environ, str(cwd), out, err),
                kwargs={"affinity": affinity, "script": script, "executable": executable},
            )
        )
    return processes


def run_ranks(argv, env, cwd, timeout, world_size):
    """Like subprocess.run([python, dlojz.py, *argv], capture_output=True, text=True, ...), in forks of the server;
    with world_size > 1, that many ranks on this node, started as `torchrun --standalone --nproc-per-node N`
    starts them (and stops them at a refusal: _finish). The result is shaped like torchrun's: every rank's stdout
    (then stderr) in rank order, and exit status 0 if every rank ended with 0, else the status of the first rank to
    end with another."""
    cmd = [sys.executable, str(DLOJZ), *argv]
    with tempfile.TemporaryDirectory(prefix="dlojz-run-") as tmp:
        paths = [(os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")) for rank in range(world_size)]
        processes = rank_processes(argv, env, cwd, world_size, paths.__getitem__)
        for process in processes:
            process.start()
        timed_out, ended = _finish(processes, timeout)
        out = "".join(_read(path) for path, _ in paths)
        err = "".join(_read(path) for _, path in paths)
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
        status = next((p.exitcode for p in ended if p.exitcode != 0), 0)  # the first failure, as torchrun says it
        return subprocess.CompletedProcess(cmd, status, out, err)


class Started:
    """A dlojz.py run forked from the server, shaped like subprocess.Popen(cmd, stdout=PIPE, stderr=STDOUT,
    text=True): pid, stdout (read as it is written), send_signal, kill, poll, wait, communicate, returncode."""

    def __init__(self, argv, env, cwd):
        self.args = [sys.executable, str(DLOJZ), *argv]
        read_fd, write_fd = os.pipe()
        self._process = _context.Process(target=_child, args=(argv, env, str(cwd), _FdForChild(write_fd), None))
        try:
            self._process.start()
        finally:
            os.close(write_fd)  # the child holds the only writer: end of file when it (and its workers) end
        self.pid = self._process.pid
        self.stdout = open(read_fd, encoding=locale.getpreferredencoding(False))
        self._rest = None

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def send_signal(self, signum):
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def kill(self):
        self._process.kill()

    def terminate(self):
        self._process.terminate()

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def communicate(self, timeout=None):
        """(the rest of stdout, None), once the process has ended and its output is closed."""
        if self._rest is None:
            self._rest = {}
            threading.Thread(target=lambda: self._rest.setdefault("text", self.stdout.read()), daemon=True).start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while "text" not in self._rest or self._process.exitcode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        self._process.join()
        self.stdout.close()
        return self._rest["text"], None


# ---------------------------------------------------------------- for other processes: a launcher prefix
CLIENT = Path(__file__).resolve().parent / "preloaded_client.py"
SERVED = []  # the scripts (dlojz.py, bench/*.py) of the requests launch_prefix's clients made
_launch_socket = None  # where this process serves launch_prefix's clients, once it does


def launch_prefix(env):
    """A command prefix that runs `python -u dlojz.py ARGS` as a fork of this process's server, for the commands
    that start dlojz.py themselves (dlojz_hpo.py's trials, through its --launch). The prefix is a small Python
    (tests/preloaded_client.py, no torch) that hands its argv, environment, working directory, CPU affinity,
    stdout and stderr to a thread of this process over a Unix socket, passes on the signals it receives, and ends
    as the run ends. A run whose environment the server cannot give (can_run) is executed by the client as given.
    The server is started here, in the caller's thread, because starting it changes os.environ for a moment."""
    global _launch_socket
    _ensure_server(env)
    if _launch_socket is None:
        folder = tempfile.mkdtemp(prefix="dlojz-launch-")
        atexit.register(shutil.rmtree, folder, True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(os.path.join(folder, "sock"))
        listener.listen()
        threading.Thread(target=_accept, args=(listener,), daemon=True).start()
        _launch_socket = os.path.join(folder, "sock")
    return [sys.executable, str(CLIENT), _launch_socket]


def python_executable(folder, env):
    """An executable that stands for this Python where a tool runs `PYTHON dlojz.py ARGS` or `PYTHON bench/X.py
    ARGS` (the benches' --python): those run through launch_prefix, anything else in this Python; a run it serves
    has it as sys.executable, as a Python started by its path would (a sweep task's `srun sys.executable dlojz.py`
    is served too). Each call's arguments are appended to FOLDER/python.calls, one line each, for the test to see
    which runs it started."""
    path, calls = Path(folder) / "python", shlex.quote(str(Path(folder) / "python.calls"))
    prefix = f"{shlex.join(launch_prefix(env))} {shlex.quote(sys.executable)}"
    stand_in = f"export {STAND_IN}={shlex.quote(str(path))}"  # (the client's, not passed on to the run)
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\n{stand_in}\nexec {prefix} "$@"\n')
    path.chmod(0o755)
    return path


def _accept(listener):
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=_serve, args=(connection,), daemon=True).start()


def _serve(connection):
    """One client: its request (argv, ranks, env, cwd, with its stdout and stderr), the runs' pids, then the exit
    code. Several ranks are started as torchrun starts them on one node and ended as it ends them: when one fails,
    the others get SIGTERM, and the exit code is 1. The runs are killed if the client goes away first, as a fresh
    interpreter would be with it."""
    with connection:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
        request = json.loads(message)
        SERVED.append(request.get("script") or str(DLOJZ))
        ranks = request.get("ranks", 1)
        try:
            if not can_run(request["env"]):
                connection.send(json.dumps({"fresh": True}).encode())
                return
            processes = rank_processes(
                request["argv"], request["env"], request["cwd"], ranks,
                lambda rank: (_FdForChild(fds[0]), _FdForChild(fds[1])), request["affinity"], request.get("script"),
                request.get("executable"),
            )  # fmt: skip
            for process in processes:
                process.start()
        finally:
            for fd in fds:
                os.close(fd)
        connection.send(json.dumps({"pids": [process.pid for process in processes]}).encode())
        ending = None  # when the others were asked to end
        while any(process.exitcode is None for process in processes):
            waiting = [process.sentinel for process in processes if process.exitcode is None]
            ready, _, _ = select.select([connection, *waiting], [], [], None if ending is None else 1.0)
            if connection in ready and not connection.recv(1):  # the client is gone
                for process in processes:
                    process.kill()
            for process in processes:
                process.join(0)
            failed = any(process.exitcode not in (None, 0) for process in processes)
            if failed and ending is None:  # torchrun ends the other workers when one fails
                ending = time.monotonic()
                for process in processes:
                    if process.exitcode is None:
                        process.terminate()
            elif ending is not None and time.monotonic() - ending > 30:
                for process in processes:
                    process.kill()
        for process in processes:
            process.join()
        codes = [process.exitcode for process in processes]
        code = codes[0] if ranks == 1 else int(any(codes))
        with contextlib.suppress(OSError):
            connection.send(json.dumps({"exitcode": code}).encode())
