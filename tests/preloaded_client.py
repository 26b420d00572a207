"""`preloaded_client.py SOCKET python [-u] dlojz.py ARGS`: run dlojz.py as a fork of the tests' preloaded server.

The launcher prefix of preloaded.launch_prefix: for the commands that start dlojz.py themselves (a search's trials),
the 4-5 s of imports a fresh interpreter pays are paid once per test session. This process stands for the run: the
signals it receives go to the run, and it exits as the run exits (with its status, or killed by its signal). It
imports no torch. A command that is not dlojz.py, or an environment the server cannot give, is executed as given.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT)


def dlojz_argv(command):
    """The dlojz.py arguments of `python [-u] .../dlojz.py ARGS`, else None."""
    words = list(command)
    if words and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
        while words and words[0] == "-u":
            words = words[1:]
    if words and os.path.basename(words[0]) == "dlojz.py":
        return words[1:]
    return None


def main(path, command):
    argv = dlojz_argv(command)
    if argv is None:
        os.execvp(command[0], command)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "affinity": sorted(os.sched_getaffinity(0))}
    socket.send_fds(connection, [json.dumps(request).encode()], [1, 2])
    reply = json.loads(connection.recv(1 << 16))
    if reply.get("fresh"):
        connection.close()
        os.execvp(command[0], command)
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # the run has just ended: its exit code follows
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
