"""Run dlojz.py for the tests in a process of its own, forked from a server that imported dlojz once.

A test's `python dlojz.py` spends about 2.5 s of its 3-4 s importing torch, torchvision and dlojz, and the suite
starts some 80 of them. Here each run is still a separate process (its own exit status, signal handlers, stdout and
stderr, environment, working directory, DataLoader workers and atexit handlers), but a fork of multiprocessing's
fork server, which preloaded dlojz: the import is paid once per test session. The server is started once, with no
thread running but the one `import torch` starts, so forking it is what forkserver is for.

What a fork cannot change is what the interpreter and torch read when they start: a run whose environment differs
from the server's in such a variable (PYTHON*, TORCH_*, ATEN_*, ...) runs as a fresh `python dlojz.py`
(`can_run` says which); so does a run under a launcher, and a test that is about the interpreter's start-up.
"""
import atexit
import locale
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

DLOJZ = Path(__file__).resolve().parent.parent / "dlojz.py"
# Read by the interpreter, torch or the libraries it loads when the process starts, not when dlojz runs.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "ATEN_", "LD_", "MKL_", "KMP_", "GOMP_", "CUDA_", "NCCL_", "GLOO_")
# Harmless to a fork: output is line-buffered here and flushed at exit; the thread count is set in the child;
# inductor reads its cache folder when it compiles (and sets it in os.environ: a run after a compile sees it).
RUN_TIME = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR",
            "TRITON_CACHE_DIR")

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["dlojz", "preloaded"])
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
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        server.ensure_running()
    finally:
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


def _child(argv, env, cwd, out_path, err_path):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        file_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [str(DLOJZ), *argv]
    import torch
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    import dlojz
    try:
        status = _exit_status(dlojz.cli(argv))
    except SystemExit as err:
        status = _exit_status(err.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # as the interpreter's exit would
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _read(path):
    # as subprocess.run(text=True) decodes: the locale's encoding, universal newlines
    if not os.path.exists(path):  # the child died before it opened its output
        return ""
    with open(path, encoding=locale.getpreferredencoding(False), errors="strict") as f:
        return f.read()


def run(argv, env, cwd, timeout):
    """Like subprocess.run([python, dlojz.py, *argv], capture_output=True, text=True, ...), in a fork of the server."""
    cmd = [sys.executable, str(DLOJZ), *argv]
    with tempfile.TemporaryDirectory(prefix="dlojz-run-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = _context.Process(target=_child, args=(argv, env, str(cwd), out_path, err_path), daemon=False)
        process.start()
        timed_out = False
        try:
            process.join(timeout)
        finally:
            if process.exitcode is None:  # past its timeout, or the test was interrupted
                timed_out = True
                process.kill()
                process.join()
        out, err = _read(out_path), _read(err_path)
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(cmd, process.exitcode, out, err)
