"""`preloaded_client.py SOCKET python [-u] dlojz.py ARGS`: run dlojz.py as a fork of the tests' preloaded server.

The launcher prefix of preloaded.launch_prefix: for the commands that start dlojz.py themselves (a search's trials,
a lab's runs), the 4-5 s of imports a fresh interpreter pays are paid once per test session. This process stands for
the run: the signals it receives go to the run, and it exits as the run exits (with its status, or killed by its
signal). `python [-u] -m torch.distributed.run --standalone --nproc-per-node N dlojz.py ARGS` (a lab's local
multi-rank run) is served as N forks given torchrun's variables (preloaded.rank_env), ended together as torchrun
ends its workers when one fails; `python [-u] bench/SCRIPT.py ARGS` (a benchmark's own measuring runs) and
`python [-u] dlojz_NAME.py ARGS` (the sibling commands: an HPO worker, a lab) as one fork running that script as
__main__, or as N such forks under that torchrun (a benchmark, or a lab's probe, on 2 ranks). It imports no torch.
A command that is none of these, or an environment the server cannot give, is executed as given.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT)


TORCHRUN = ("-m", "torch.distributed.run")
STAND_IN = "PRELOADED_STAND_IN"  # (preloaded.STAND_IN: this client imports no torch, and so not preloaded)
# The scripts the server runs: the benchmarks and the sibling commands, whose imports are dlojz's and torch's, which
# it preloaded (dlojz.py itself is served as ranks: dlojz_ranks).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def python_arguments(command):
    """What follows `python [-u]` in `command` (the unbuffered flag, which the server's forks do not need, left
    out), or None where `command` does not start with a Python."""
    words = list(command)
    if not words or not os.path.basename(words[0]).startswith("python"):
        return None
    return unbuffered_left_out(words[1:])


def unbuffered_left_out(words):
    while words and words[0] == "-u":
        words = words[1:]
    return words


def served_run(command):
    """(the script to run as __main__, or None for dlojz.py; its arguments; the number of ranks) of
    `python [-u] SCRIPT ARGS` (1 rank) or of `python [-u] -m torch.distributed.run --standalone --nproc-per-node N
    [-u] SCRIPT ARGS` (N), where SCRIPT is dlojz.py, a benchmark (bench/*.py) or a sibling command (dlojz_NAME.py);
    else None."""
    words, ranks = python_arguments(command), 1
    if words is None:
        return None
    if tuple(words[:2]) == TORCHRUN:
        words = words[2:]
        if words[:1] != ["--standalone"] or words[1:2] != ["--nproc-per-node"] or not words[2:3][0].isdigit():
            return None  # another torchrun: run as given
        ranks, words = int(words[2]), unbuffered_left_out(words[3:])
    if not words:
        return None
    if os.path.basename(words[0]) == "dlojz.py":
        return None, words[1:], ranks
    script = os.path.abspath(words[0])
    folder, name = os.path.split(script)
    served = script.endswith(".py") and (folder == BENCH or (folder == ROOT and name.startswith("dlojz_")))
    return (script, words[1:], ranks) if served and os.path.isfile(script) else None


def main(path, command):
    stand_in = os.environ.pop(STAND_IN, None)  # the stand-in Python that started this client, if one did
    run = served_run(command)
    if run is None:
        os.execvp(command[0], command)
    script, argv, ranks = run
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    request = {
        "argv": argv,
        "script": script,
        "ranks": ranks,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "executable": stand_in,
        "affinity": sorted(os.sched_getaffinity(0)),
    }
    socket.send_fds(connection, [json.dumps(request).encode()], [1, 2])
    reply = json.loads(connection.recv(1 << 16))
    if reply.get("fresh"):
        connection.close()
        os.execvp(command[0], command)
    pids = reply["pids"]

    def forward(signum, _frame):
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # that rank has just ended: the exit code follows
                pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    message = connection.recv(1 << 16)
    if not message:  # the server is gone: its run with it
        os._exit(1)
    code = json.loads(message)["exitcode"]
    if code < 0:  # killed by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 1
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
