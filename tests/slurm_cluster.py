"""A real one-node Slurm cluster on localhost, for tests.

API
---
``slurm_cluster`` (pytest fixture, session scope) -> :class:`SlurmCluster`
    Starts ``munged``, ``slurmctld`` and ``slurmd`` in a temporary directory with a
    ``slurm.conf`` written for this machine (CPUs, memory and host name from
    ``slurmd -C``), waits until ``sinfo`` shows the node idle, yields, and at the end
    stops the three daemons by their pids.  Where Slurm is not installed, we are not
    root, or a daemon does not start, every test using the fixture is SKIPPED with the
    reason (and the daemon's log tail) in the skip message, never silently; under CI
    (``CI=true``) it FAILS instead: CI must not go green on tests it did not run.

``SlurmCluster``
    ``env``                         environment for Slurm commands (``SLURM_CONF`` set)
    ``run(args, check=True, timeout=60, cwd=None, env=None) -> CompletedProcess``
                                    run a Slurm client command (``env`` defaults to ``self.env``)
    ``submit(args, cwd, env=None) -> int``
                                    ``sbatch --parsable *args`` run in ``cwd``; the job id.  sbatch
                                    exports ``env`` to the job (its default ``--export=ALL``).
    ``job_info(job_id, timeout=30) -> dict``
                                    ``scontrol show job -o`` as a dict (``{}`` once forgotten, or
                                    when ``scontrol`` does not answer within ``timeout`` seconds)
    ``wait(job_id, timeout, until=FINAL_STATES) -> JobResult``
                                    polls ``scontrol show job`` (``sacct`` needs accounting,
                                    which this cluster does not have) until the job reaches
                                    a state in ``until``; raises ``TimeoutError`` (after
                                    ``scancel``) when ``timeout`` seconds pass first.
    ``wait_for_output(path, needle, timeout, job_id=None) -> str``
                                    waits until the text file ``path`` contains ``needle``.

``JobResult(job_id, state, output_path, restarts, info)``
    ``state`` is Slurm's ``JobState`` (``COMPLETED``, ``FAILED``, ...), ``output_path`` the
    job's ``StdOut`` file (a ``pathlib.Path``), ``restarts`` Slurm's ``Restarts`` count,
    ``info`` the full ``scontrol show job`` dict; ``output_text()`` reads the output file.

The cluster uses its own munge key and socket (``AuthInfo=socket=...``), non-default
ports, ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroups
needed, so it runs in containers), no accounting, and ``JobRequeue=1``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

# Job states after which a job never runs again (a requeued job passes through
# REQUEUED/PENDING, which are deliberately not here).
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    }
)
PARTITION = "debug"
REQUIRED_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")


@dataclasses.dataclass
class JobResult:
    job_id: int
    state: str
    output_path: pathlib.Path | None
    restarts: int
    info: dict

    def output_text(self) -> str:
        if self.output_path is None or not self.output_path.exists():
            return ""
        return self.output_path.read_text(errors="replace")


def parse_scontrol_record(line: str) -> dict:
    """``scontrol show job -o`` prints ``Key=Value`` pairs separated by spaces; values
    may themselves contain spaces (Command, WorkDir, ...), so a token without ``=`` is
    glued to the previous value."""
    record: dict = {}
    last_key = None
    for token in line.strip().split(" "):
        key, sep, value = token.partition("=")
        if sep and key and " " not in key and (key[0].isupper() or key.startswith("Tres")):
            record[key] = value
            last_key = key
        elif last_key is not None:
            record[last_key] += " " + token
    return record


class SlurmCluster:
    def __init__(self, root: pathlib.Path):
        self.root = root
        self.conf_path = root / "etc" / "slurm.conf"
        self.log_dir = root / "log"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf_path))
        # Variables a surrounding Slurm job (CI running under Slurm) would leak into ours.
        for name in list(self.env):
            if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
                del self.env[name]
        self.node_name = ""
        self.pids: dict[str, int] = {}

    # -- client commands ---------------------------------------------------------------
    def run(self, args, check=True, timeout=60, cwd=None, env=None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            list(map(str, args)), env=env or self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(map(str, args))} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def submit(self, args, cwd, env=None) -> int:
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip()
        return int(out.split(";")[0])  # "<id>[;<cluster>]"

    def job_info(self, job_id: int, timeout: float = 30) -> dict:
        try:
            proc = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {}  # a controller that does not answer: the caller's own deadline reports it, with the logs
        if proc.returncode != 0 or not proc.stdout.strip():
            return {}  # unknown: purged after MinJobAge
        return parse_scontrol_record(proc.stdout.splitlines()[0])

    def wait(self, job_id: int, timeout: float, until=FINAL_STATES) -> JobResult:
        deadline = time.monotonic() + timeout
        info: dict = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id, timeout=_left(deadline)) or info
            if info.get("JobState") in until:
                return self._result(job_id, info)
            time.sleep(0.25)  # a poll: scontrol answers in milliseconds, a job ends any time
        try:
            self.run(["scancel", str(job_id)], check=False, timeout=30)
        except subprocess.TimeoutExpired:
            pass  # the fixture's stop() cancels every job and stops the daemons anyway
        result = self._result(job_id, info)
        raise TimeoutError(
            f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s; "
            f"output:\n{result.output_text()[-3000:]}\n{self.log_tail()}"
        )

    def wait_for_output(self, path: pathlib.Path, needle: str, timeout: float, job_id=None) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = path.read_text(errors="replace") if path.exists() else ""
            if needle in text:
                return text
            if job_id is not None and self.job_info(job_id, timeout=_left(deadline)).get("JobState") in FINAL_STATES:
                break
            time.sleep(0.25)  # a poll: scontrol answers in milliseconds, a job ends any time
        state = self.job_info(job_id, timeout=10).get("JobState") if job_id else "-"
        raise TimeoutError(
            f"{needle!r} not found in {path} within {timeout:.0f} s (job {job_id}: {state});"
            f" output:\n{text[-3000:]}\n{self.log_tail()}"
        )

    def _result(self, job_id: int, info: dict) -> JobResult:
        out = info.get("StdOut")
        return JobResult(
            job_id=job_id,
            state=info.get("JobState", "UNKNOWN"),
            output_path=pathlib.Path(out) if out else None,
            restarts=int(info.get("Restarts", 0) or 0),
            info=info,
        )

    def log_tail(self, lines=15) -> str:
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- start / stop -------------------------------------------------------------------
    def start(self) -> None:
        for sub in ("etc", "log", "state", "spool", "run", "munge"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        munge_socket = self._start_munged()
        self.node_name, node_line = _node_description()
        ctld_port, slurmd_port = _free_port(), _free_port()
        self.conf_path.write_text(
            _slurm_conf(self.root, self.node_name, node_line, munge_socket, ctld_port, slurmd_port)
        )
        self._start_daemon(
            "slurmctld",
            [program("slurmctld"), "-f", self.conf_path, "-L", self.log_dir / "slurmctld.log"],
            self.root / "run" / "slurmctld.pid",
        )
        self._start_daemon(
            "slurmd",
            [program("slurmd"), "-f", self.conf_path, "-N", self.node_name, "-L", self.log_dir / "slurmd.log"],
            self.root / "run" / "slurmd.pid",
        )
        self._wait_node_idle(timeout=60)

    def stop(self) -> None:
        # Jobs first (a test that timed out may leave one running: its processes must not outlive us),
        # then slurmd, the controller and munge, each by its pid. At most about 30 + 15 s, and the
        # daemons are stopped even when the controller no longer answers.
        try:
            if "slurmctld" in self.pids:
                deadline = time.monotonic() + 30
                self.run(["scancel", "--full", "--partition", PARTITION], check=False, timeout=_left(deadline))
                while time.monotonic() < deadline:
                    if not self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=_left(deadline)).stdout.strip():
                        break
                    time.sleep(1.0)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # all three at once: each takes about 2 s to exit after SIGTERM, none waits for another
            _terminate(
                [
                    pid
                    for pid in (self.pids.pop(name, None) for name in ("slurmd", "slurmctld", "munged"))
                    if pid is not None
                ]
            )

    def _start_munged(self) -> pathlib.Path:
        munge_dir = self.root / "munge"
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))  # a key of our own: never touches /etc/munge
        key.chmod(0o400)
        sock = munge_dir / "munge.socket"
        pid_file = munge_dir / "munged.pid"
        # --force: munged refuses a socket directory that others cannot enter (ours is 0700, and only
        # root, which runs everything here, talks to it).
        self._start_daemon(
            "munged",
            [
                program("munged"),
                "--force",
                "--key-file",
                key,
                "--socket",
                sock,
                "--pid-file",
                pid_file,
                "--seed-file",
                munge_dir / "munged.seed",
                "--log-file",
                self.log_dir / "munged.log",
            ],
            pid_file,
        )
        return sock

    def _start_daemon(self, name, argv, pid_file: pathlib.Path, timeout=20) -> None:
        # Each daemon forks into the background and writes its pid file: we stop it by that pid.
        try:
            proc = subprocess.run(list(map(str, argv)), env=self.env, capture_output=True, text=True, timeout=timeout)
            status, said = f"exit {proc.returncode}", (proc.stderr or proc.stdout).strip()
        except subprocess.TimeoutExpired as exc:
            # Still in the foreground (slurmctld retries an unreadable slurm.conf for 60 s), or its daemon
            # kept our pipes open: it may have written its pid file all the same, and is then recorded
            # below, so that stop() ends it. What it said so far comes as bytes.
            status, said = f"still running after {timeout} s", exc.stderr or exc.stdout or b""
            said = (said.decode(errors="replace") if isinstance(said, bytes) else said).strip()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = _read_pid(pid_file)
            if pid is not None and _alive(pid):
                self.pids[name] = pid
                if status != "exit 0":
                    break
                return
            if status != "exit 0":  # exited with an error, or still running after the timeout
                break
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not start ({status}): {said}\n{self.log_tail()}")

    def _wait_node_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            try:
                proc = self.run(
                    ["sinfo", "-h", "-N", "-o", "%T", "-n", self.node_name], check=False, timeout=_left(deadline)
                )
            except subprocess.TimeoutExpired:
                state = "sinfo did not answer"
                continue
            state = proc.stdout.strip() or proc.stderr.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"node {self.node_name} not idle after {timeout:.0f} s (sinfo: {state!r})\n{self.log_tail()}"
        )


def _node_description() -> tuple[str, str]:
    """``slurmd -C`` prints this machine's NodeName line (CPUs, sockets, memory)."""
    out = subprocess.run([program("slurmd"), "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    line = next(text for text in out.splitlines() if text.startswith("NodeName="))
    name = line.split()[0].split("=", 1)[1]
    return name, line


def _slurm_conf(root, node_name, node_line, munge_socket, ctld_port, slurmd_port) -> str:
    return f"""\
# Written by tests/slurm_cluster.py for a throw-away one-node cluster.
ClusterName=dlojztest
SlurmctldHost={node_name}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s; here a requeued
# job started again 5.5 s after its requeue).
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# No cgroups: works in containers and on machines without cgroup delegation.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# A requeued job, once eligible again, is started by the next scheduling pass: every second here, not every 30 s
# (the backfill scheduler's default), so that the requeue tests do not wait on the clock.
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
# Job ids from a random start: idr_torch derives the rendezvous port from the job id (10000 + id % 20000),
# so two test clusters on one machine (parallel test sessions) do not collide on job 1's port.
FirstJobId={random.randrange(1000, 900000)}
ReturnToService=2
# Keep finished jobs visible to `scontrol show job` long enough for the tests.
MinJobAge=600
MailProg=/bin/true
KillWait=10
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=120
SlurmctldDebug=info
SlurmdDebug=info
{node_line.split(" UpTime=")[0]} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName={PARTITION} Nodes={node_name} Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _left(deadline: float, least: float = 1.0) -> float:
    """Seconds until ``deadline`` (time.monotonic()), at least ``least``: a client command's timeout that does
    not carry a wait far past its own deadline."""
    return max(least, deadline - time.monotonic())


def _read_pid(pid_file: pathlib.Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not written yet, or half written
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _terminate(pids: list[int], timeout=15.0) -> None:
    """SIGTERM to each, then SIGKILL to those still alive after `timeout` seconds."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def program(name: str) -> str | None:
    """Full path of a Slurm/munge program; daemons live in /usr/sbin, often not in a user's PATH."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def why_slurm_unavailable() -> str | None:
    """The reason this machine cannot host the test cluster, or None."""
    missing = [p for p in REQUIRED_PROGRAMS if program(p) is None]
    if missing:
        return (
            f"Slurm not installed (missing {', '.join(missing)}): run .ci/install_slurm.sh "
            f"(apt-get install slurm-wlm munge)"
        )
    if os.geteuid() != 0:
        return "the test Slurm cluster needs root (slurmd launches jobs as their user)"
    return None


def unavailable(reason):
    """Skip with the reason on a developer's machine; fail under CI, where Slurm is installed by .ci/run."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and the test Slurm cluster is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = why_slurm_unavailable()
    if reason:
        unavailable(reason)
    root = tmp_path_factory.mktemp("slurm")  # kept by pytest for a few sessions: the daemons' logs stay readable
    if len(str(root / "munge" / "munge.socket")) > 100:  # a socket path must fit in sockaddr_un (108 bytes)
        root = pathlib.Path(tempfile.mkdtemp(prefix="dlojz-slurm-"))
    cluster = SlurmCluster(root)
    failure = None
    try:
        cluster.start()
    except Exception as exc:  # noqa: BLE001 - any start failure becomes a visible skip (a failure under CI)
        cluster.stop()
        failure = f"could not start the test Slurm cluster: {exc}"
    except BaseException:  # pytest-timeout's failure, Ctrl-C: the daemons started so far must not outlive us
        cluster.stop()
        raise
    if failure:
        unavailable(failure)  # outside the except clause: the reason is shown once, not twice as a chain
    try:
        yield cluster
    finally:
        cluster.stop()


# ------------------------------------------------------------------------------------------- two nodes
class TwoNodeCluster(SlurmCluster):
    """Two Slurm nodes on this one machine: a slurmd in each of two network namespaces of its own (an address each
    on a bridge that also carries the controller's), so that a job's tasks on "node 1" and "node 2" talk over a
    network as on a cluster. The slurmds are started with `nsenter --net` (not `ip netns exec`, which remounts
    /sys and hides the cgroup file system that slurmd 22.05 opens at start-up). The node names resolve through
    lines added to /etc/hosts (idr_torch takes the master address from the job's node list), removed at stop.
    Jobs must set GLOO_SOCKET_IFNAME=eth0: the host name of every namespace is still this machine's."""

    HOSTS_MARK = "# dlojz test two-node cluster"

    def __init__(self, root: pathlib.Path):
        super().__init__(root)
        tag = f"{os.getpid() % 100000}"
        subnet = random.randrange(16, 250)
        self.prefix = f"10.213.{subnet}"
        self.bridge = f"dlojzb{tag}"
        self.namespaces = [f"dlojz{tag}n{i}" for i in (1, 2)]
        self.nodes = [f"dlojz{tag}node{i}" for i in (1, 2)]
        self.addresses = [f"{self.prefix}.{11 + i}" for i in range(2)]
        self.node_name = ",".join(self.nodes)
        self._network_made = False

    def start(self) -> None:
        for sub in ("etc", "log", "state", "spool", "run", "munge"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(mode=0o700, exist_ok=True)
        munge_socket = self._start_munged()
        self._make_network()
        host = socket.gethostname().split(".")[0]
        cpus = len(os.sched_getaffinity(0))
        conf = _slurm_conf(self.root, host, "", munge_socket, _free_port(), _free_port())
        conf = conf.replace(f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldHost={host}({self.prefix}.1)")
        conf = conf.replace(f"SlurmdSpoolDir={self.root}/spool", f"SlurmdSpoolDir={self.root}/spool/%n")
        conf = conf.replace(f"SlurmdPidFile={self.root}/run/slurmd.pid", f"SlurmdPidFile={self.root}/run/slurmd.%n.pid")
        conf = conf.replace(f"SlurmdLogFile={self.root}/log/slurmd.log", f"SlurmdLogFile={self.root}/log/slurmd.%n.log")
        # A node that stops answering is declared DOWN after 10 s (its jobs end NODE_FAIL), not 120 s.
        conf = conf.replace("SlurmdTimeout=120", "SlurmdTimeout=10")
        lines = [line for line in conf.splitlines() if not line.startswith(("PartitionName=", " NodeAddr="))]
        lines += [
            f"NodeName={node} NodeAddr={address} CPUs={cpus} RealMemory=2000 State=UNKNOWN"
            for node, address in zip(self.nodes, self.addresses)
        ]
        lines.append(f"PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf_path.write_text("\n".join(lines) + "\n")
        self._start_daemon(
            "slurmctld",
            [program("slurmctld"), "-f", self.conf_path, "-L", self.log_dir / "slurmctld.log"],
            self.root / "run" / "slurmctld.pid",
        )
        for namespace, node in zip(self.namespaces, self.nodes):
            self._start_daemon(
                f"slurmd {node}",
                ["nsenter", f"--net=/run/netns/{namespace}", program("slurmd"), "-f", self.conf_path, "-N", node],
                self.root / "run" / f"slurmd.{node}.pid",
            )
        for node in self.nodes:
            self.node_name = node
            self._wait_node_idle(timeout=60)
        self.node_name = ",".join(self.nodes)

    def stop(self) -> None:
        try:
            slurmds = [self.pids.pop(f"slurmd {node}") for node in self.nodes if f"slurmd {node}" in self.pids]
            super().stop()  # the jobs, the controller and munge
            _terminate(slurmds)
        finally:
            if self._network_made:
                self._remove_network()

    def lose_node(self, index) -> str:
        """Node `index` as if it lost power: its slurmd and every process in its network namespace killed at once.
        Returns its name."""
        self.pids.pop(f"slurmd {self.nodes[index]}", None)
        pids = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[index]], capture_output=True, text=True, timeout=30
        ).stdout.split()
        for pid in map(int, pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.nodes[index]

    def restore_node(self, index) -> None:
        """Node `index`'s slurmd started again (ReturnToService=2 puts it back in service)."""
        node = self.nodes[index]
        (self.root / "run" / f"slurmd.{node}.pid").unlink(missing_ok=True)
        self._start_daemon(
            f"slurmd {node}",
            [
                "nsenter",
                f"--net=/run/netns/{self.namespaces[index]}",
                program("slurmd"),
                "-f",
                self.conf_path,
                "-N",
                node,
            ],
            self.root / "run" / f"slurmd.{node}.pid",
        )

    def _make_network(self) -> None:
        def ip(*args):
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

        self._network_made = True
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
            veth = f"{self.bridge}v{i}"
            ip("netns", "add", namespace)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", namespace, "link", "set", "eth0", "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        with open("/etc/hosts", "a") as hosts:
            hosts.writelines(f"{a} {n}  {self.HOSTS_MARK}\n" for a, n in zip(self.addresses, self.nodes))

    def _remove_network(self) -> None:
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        with open("/etc/hosts") as hosts:
            kept = [line for line in hosts if not any(f" {n} " in line for n in self.nodes)]
        with open("/etc/hosts", "w") as hosts:  # in place: /etc/hosts is often a bind mount in containers
            hosts.writelines(kept)
        self._network_made = False


def why_two_nodes_unavailable() -> str | None:
    reason = why_slurm_unavailable()
    if reason:
        return reason
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "the two-node test cluster needs `ip` (iproute2) and `nsenter` (util-linux)"
    return None


@pytest.fixture(scope="session")
def slurm_two_nodes(tmp_path_factory):
    reason = why_two_nodes_unavailable()
    if reason:
        unavailable(reason)
    root = tmp_path_factory.mktemp("slurm2")
    if len(str(root / "munge" / "munge.socket")) > 100:
        root = pathlib.Path(tempfile.mkdtemp(prefix="dlojz-slurm2-"))
    cluster = TwoNodeCluster(root)
    failure = None
    try:
        cluster.start()
    except Exception as exc:  # noqa: BLE001 - a visible skip here, a failure under CI
        cluster.stop()
        failure = f"could not start the two-node test Slurm cluster: {exc}"
    except BaseException:
        cluster.stop()
        raise
    if failure:
        unavailable(failure)
    try:
        yield cluster
    finally:
        cluster.stop()
