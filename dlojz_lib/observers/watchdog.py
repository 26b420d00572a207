"""A hung rank costs minutes, not the job: a watchdog thread on every rank.

Without it, a rank that hangs (stopped, its GPU stuck in a kernel, a collective it never enters) holds every other
rank in its collective until --dist-timeout, and nothing says which rank it was. Here every rank's watchdog thread
writes, every few seconds, through the job's key-value store (rank 0's TCPStore, or torchrun's), a heartbeat and
where its training loop is: how far it has got (the loop marks each optimizer step and validation batch), how many
times it has entered each of dlojz's collectives and the one it waits in. The loop's marks are Python attributes:
no device synchronisation, no collective. Each thread reads every rank's, and when no rank has moved on for
--hang-timeout seconds, the lowest rank that still answers prints one line naming the ranks that hold the others
and how, and the job ends with exit status 7 (HUNG_STATUS) on every backend, long before --dist-timeout:

- silent: its heartbeat stopped (the process is stopped or dead, or its node is gone);
- stuck: it beats, but is not in the collective the others wait in (in a kernel, the data loader or Python, or it
  skipped the collective);
- when every rank waits in the same collective, all of them (a kernel or a collective that never ends; on a GPU
  the host waits at the next log point whatever kernel hangs), and when they wait in different collectives, each
  with its own (one rank skipped or added one).

Progress is judged only between a rank's first mark in a loop and the loop's end: the first batch of a loop (where
torch.compile compiles and cuDNN autotunes), checkpoint writes and start-up are not timed. Silence is judged over
the whole run, from the watchdog's start (the process group formed) to the run's normal end (`finish()`, which says
so to the others): a rank stopped during start-up, while a checkpoint is written or after the last validation is
named silent as in a loop, with where it was (`phase`), instead of holding the others until --dist-timeout.

Stragglers: a slow rank makes every rank's step as long as its own (the gradient all-reduce waits for it), so it
shows in the part of a step before that all-reduce: the forward and the loss. Each rank times its own (host seconds
on a CPU; CUDA events on a GPU, read once complete: no wait), and the log point's all-reduce, which the ranks make
anyway, carries every rank's seconds since the last one. Under DDP with buffers the forward is timed from past
DDP's broadcast of them, where the others wait for a late rank. A rank slower than the median of the others by
--straggler-factor at STRAGGLER_POINTS log points in a row is named once in the log and in the metrics JSON.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import threading
import time
from datetime import timedelta

import torch

from dlojz_lib.torch_internals import default_store

HUNG_STATUS = 7  # exit status: a rank hung (beside 4, a rank lost)
STRAGGLER_POINTS = 3  # log points in a row a rank must be slow at to be named a straggler
_KEY = "dlojz/watchdog/{}"
_ABORT = "dlojz/watchdog/abort"


def continue_advice(latest, output_dir) -> str:
    """What a run stopped by a lost or stuck rank says to do next. Without a checkpoint there is nothing to continue
    (--resume auto would start afresh), and a rank's failure in the start-up (a setting its model or data refuses)
    repeats at every start: its own error first."""
    if latest is None:
        return "no checkpoint yet: if that rank's log ends with an error, mend what it names; then start the run again"
    return f"last checkpoint: {latest}; continue with --resume auto --output-dir {output_dir}"


class Watchdog:
    """This rank's marks (set by the loop) and the thread that publishes them and judges every rank's. With one
    rank or --hang-timeout 0 it is off: the marks cost an attribute write."""

    def __init__(self, ranks, hang_timeout: float, output_dir, latest_checkpoint=None, straggler_factor=0.0):
        self.enabled = ranks.enabled and hang_timeout > 0
        self.compares = ranks.enabled and straggler_factor > 0  # the ranks' forward times, at log points
        self.straggler_factor = straggler_factor
        self.stragglers = []  # the ranks named: dict(rank, host, step, ratio), once each
        self._slow_in_a_row = {}
        self._cuda = ranks.device.type == "cuda"
        self._forward_s = 0.0  # this rank's forward seconds since the last log point (CPU)
        self._events = []  # (start, end) CUDA events of the forwards not read yet
        self._open = None  # the timed forward's start (a clock reading, or a CUDA event) while one is open
        self.rank, self.world_size, self.hosts = ranks.rank, ranks.world_size, ranks.hosts
        self.hang_timeout = hang_timeout
        self.period = max(0.5, min(5.0, hang_timeout / 8))  # a beat every period; judged over hang_timeout
        self.output_dir = output_dir
        self.latest_checkpoint = latest_checkpoint  # () -> the newest checkpoint's path, for the message
        self.step = 0  # the optimizer step the loop is at
        self.progress = 0  # marks so far
        self.armed = False  # in a loop, past its first mark
        self.entered = {}  # collective -> times this rank entered it
        self.waiting = None  # the collective the loop waits in
        self.phase = "start-up"  # where the run is, for a verdict outside the loops
        self.done = False  # the run ended normally: its silence after that is no hang
        self._store = None

    @classmethod
    def for_run(cls, distribution, output_dir, ranks):
        """The run's watchdog: --hang-timeout, --straggler-factor, and the newest checkpoint of --output-dir named in
        its verdict."""
        from dlojz_lib.checkpoint import newest_checkpoint

        newest = functools.partial(newest_checkpoint, output_dir)
        return cls(ranks, distribution.hang_timeout, output_dir, newest, distribution.straggler_factor)

    # ---------------------------------------------------------------- the loop's marks (no sync, no collective)
    def mark(self, step=None):
        """A unit of work done: an optimizer step or a validation batch."""
        if step is not None:
            self.step = step
        self.progress += 1
        self.armed = True
        self.phase = "loop"

    def finish(self):
        """The run ended normally: said to the others at once, then no more beats."""
        self.done = True
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._publish(-1)

    def disarm(self, phase=None):
        """Leaving a loop, or entering one before its first mark: not timed. `phase`: where the run goes (a
        checkpoint write, the run's end), said in a verdict of silence."""
        self.armed = False
        if phase is not None:
            self.phase = phase

    @contextlib.contextmanager
    def collective(self, name, entered=True):
        """The loop waits in collective `name` (when `entered`)."""
        if not entered:
            yield
            return
        self.entered[name] = self.entered.get(name, 0) + 1
        self.waiting = name
        try:
            yield
        finally:
            self.waiting = None

    # ---------------------------------------------------------------- stragglers
    @contextlib.contextmanager
    def timing(self):
        """Around a micro-batch's forward and loss (not a loop's first: compilation, autotuning)."""
        if not (self.compares and self.armed):
            yield
            return
        self._start()
        try:
            yield
        finally:
            started, self._open = self._open, None
            if self._cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((started, end))
            else:
                self._forward_s += time.perf_counter() - started

    def _start(self):
        if self._cuda:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()
        else:
            self._open = time.perf_counter()

    def time_after_buffer_broadcast(self, net):
        """DDP broadcasts the model's buffers (BatchNorm's statistics) from rank 0 at the start of each training
        forward: the others wait there for a rank that comes late, and their forwards would take as long as its own
        (no straggler named). The timing of a forward restarts when the wrapped module starts, past that broadcast
        (a forward hook; under --compile the forward is one graph and the timing stays whole)."""
        ddp = isinstance(net, torch.nn.parallel.DistributedDataParallel)  # (compiled: an OptimizedModule)
        if self.compares and ddp and net.broadcast_buffers and any(True for _ in net.buffers()):

            def restart(module, args):
                if self._open is not None:
                    self._start()

            net.module.register_forward_pre_hook(restart)

    def forward_seconds(self):
        """This rank's forward seconds since the last call; on a GPU, of the forwards whose events are complete
        (query() does not wait: a forward still running counts at the next log point)."""
        seconds, self._forward_s = self._forward_s, 0.0
        while self._events and self._events[0][1].query():
            start, end = self._events.pop(0)
            seconds += start.elapsed_time(end) / 1000
        return seconds

    def compare(self, seconds):
        """Every rank's forward seconds since the last log point (0: none timed): the line naming the ranks that
        have been slower than the others' median by the factor at STRAGGLER_POINTS log points in a row, once."""
        named = []
        for rank, own in enumerate(seconds):
            others = [s for r, s in enumerate(seconds) if r != rank and s > 0]
            if own <= 0 or not others:
                continue  # nothing timed on this rank or the others since the last log point: no evidence
            ratio = own / statistics.median(others)
            slow = self._slow_in_a_row.get(rank, 0) + 1 if ratio >= self.straggler_factor else 0
            self._slow_in_a_row[rank] = slow
            if slow == STRAGGLER_POINTS and all(s["rank"] != rank for s in self.stragglers):
                self.stragglers.append(dict(rank=rank, host=self._host(rank), step=self.step, ratio=round(ratio, 2)))
                named.append(f"rank {rank} ({self._host(rank)}) takes {ratio:.1f}x")
        if not named:
            return None
        return (
            f"straggler: {', '.join(named)} the other ranks' median time in its forward, at {STRAGGLER_POINTS} log "
            f"points in a row (step {self.step}): every rank waits for it at each step (a slower or throttled GPU, "
            f"a busy node, CPU cores shared with another job, a slow file system under its data loader)"
        )

    # ---------------------------------------------------------------- the thread
    def start(self):
        if not self.enabled:
            return self
        self._store = store_client(max(2.0, 2 * self.period))
        self._publish(0)
        threading.Thread(target=self._watch, name="dlojz-watchdog", daemon=True).start()
        return self

    def _state(self, beat):
        return dict(
            beat=beat,
            progress=self.progress,
            armed=self.armed,
            step=self.step,
            entered=self.entered.copy(),  # (one C call: the loop may add a key meanwhile)
            waiting=self.waiting,
            phase=self.phase,
            done=self.done,
        )

    def _publish(self, beat):
        self._store.set(_KEY.format(self.rank), json.dumps(self._state(beat)))

    def _read(self):
        keys = [_KEY.format(r) for r in range(self.world_size)]
        if self._store.check(keys):
            return dict(enumerate(json.loads(v) for v in self._store.multi_get(keys)))
        return {r: json.loads(self._store.get(k)) for r, k in enumerate(keys) if self._store.check([k])}

    def _watch(self):
        judge = Judge(self.world_size, self.hang_timeout, self.period, time.monotonic())
        beat, unanswered_since = 0, None
        while not self.done:
            time.sleep(self.period)
            if self.done:
                return
            beat += 1
            now = time.monotonic()
            try:
                self._publish(beat)
                if self._store.check([_ABORT]):  # the reporting rank has said it: end with it
                    os._exit(HUNG_STATUS)
                states = self._read()
            except Exception:  # the store's host does not answer (stopped, dead, node lost)
                unanswered_since = unanswered_since or now
                if now - unanswered_since > self.hang_timeout:
                    if self.rank != 1:  # rank 1 says it; every rank ends
                        os._exit(HUNG_STATUS)
                    self._end(
                        f"rank 0 ({self._host(0)}) is silent: the job's store on its host has not answered for "
                        f"{now - unanswered_since:.0f} s (stopped or dead, or its node lost)"
                    )
                continue
            unanswered_since = None
            verdict = judge.update(states, now)
            if verdict is not None and verdict.reporter == self.rank:
                self._end(verdict.describe(self._host))

    def beating_before_first_step(self, ranks, wait_s=None) -> list:
        """Those of `ranks` whose heartbeat still moves (read twice, `wait_s` apart: a beat's period and a half) but
        whose loop has not marked its first step: alive, in start-up or their first step (where torch.compile
        compiles), not lost. [] with the watchdog off or the store unreachable."""
        if not self.enabled or self._store is None or not ranks:
            return []
        try:
            before = self._read()
            time.sleep(1.5 * self.period if wait_s is None else wait_s)
            after = self._read()
        except Exception:
            return []
        return [
            r
            for r in ranks
            if r in before and r in after and after[r]["beat"] > before[r]["beat"] and after[r]["progress"] == 0
        ]

    def _host(self, rank):
        return self.hosts[rank] if rank < len(self.hosts) else "?"

    def _end(self, what):
        latest = self.latest_checkpoint() if self.latest_checkpoint else None
        line = (
            f"dlojz: error: {what}; no rank has moved on for {self.hang_timeout:g} s (--hang-timeout); "
            f"{continue_advice(latest, self.output_dir)}\n"
        )
        os.write(2, line.encode())  # not print: the main thread may be in the middle of one
        with contextlib.suppress(Exception):
            self._store.set(_ABORT, str(self.rank))
            time.sleep(2 * self.period)  # the others read it at their next beat (rank 0's process holds the store)
        os._exit(HUNG_STATUS)  # the main thread waits in a collective that never ends


def store_client(timeout_s):
    """A connection of this thread's own to the job's store, with a short timeout: the main thread's may be in use,
    and the watchdog must not wait on a store whose host is stopped."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        with contextlib.suppress(Exception):
            return dist.TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
            )
    return default_store()


class Verdict:
    def __init__(self, kind, ranks, states, reporter):
        self.kind, self.ranks, self.states, self.reporter = kind, ranks, states, reporter

    def describe(self, host):
        def who(r):
            return f"rank {r} ({host(r)})"

        def at(r):
            if r not in self.states:
                return "before its first beat"
            state = self.states[r]
            phase = state.get("phase", "loop")
            if phase == "loop" or state["armed"]:
                return f"at step {state['step']}"
            if phase == "start-up":
                return "during start-up (data, model, before the first step)"
            return f"after step {state['step']}, {phase}"

        if self.kind == "silent":
            return "; ".join(f"{who(r)} is silent {at(r)} (stopped or dead: no heartbeat)" for r in self.ranks)
        if self.kind == "stuck":
            waiters = sorted({s["waiting"] for s in self.states.values() if s["waiting"]})
            return "; ".join(
                f"{who(r)} is stuck {at(r)}: alive, but not in {' or '.join(waiters)} that the others wait in (in a "
                f"kernel, the data loader or Python, or it skipped the collective)"
                for r in self.ranks
            )
        places = {self.states[r]["waiting"] for r in self.ranks}
        if places == {None}:
            return (
                f"every rank is stuck {at(self.ranks[0])} outside any collective "
                f"({', '.join(who(r) for r in self.ranks)}): in a kernel, the data loader or Python"
            )
        if len(places) == 1:
            (place,) = places
            return (
                f"every rank is stuck in {place} {at(self.ranks[0])} ({', '.join(who(r) for r in self.ranks)}): a "
                f"kernel or a collective that never ends"
            )

        def place(r):
            waiting = self.states[r]["waiting"]
            return f"in {waiting} #{self.states[r]['entered'].get(waiting, 0)}" if waiting else "in no collective"

        return "the ranks wait in different collectives, one skipped or added one: " + "; ".join(
            f"{who(r)} {place(r)} {at(r)}" for r in self.ranks
        )


class Judge:
    """Every rank's last state, when its heartbeat and its progress last changed (this rank's clock), and the
    verdict once no rank has moved on for `hang_timeout` seconds."""

    def __init__(self, world_size, hang_timeout, period, now):
        self.world_size, self.hang_timeout, self.period = world_size, hang_timeout, period
        self.states = {}
        self.beat_at = dict.fromkeys(range(world_size), now)  # a rank never heard from: silent after hang_timeout
        self.moved_at = dict.fromkeys(range(world_size), now)

    def update(self, states, now):
        for r, state in states.items():
            last = self.states.get(r)
            if last is None or state["beat"] != last["beat"]:
                self.beat_at[r] = now
            if last is None or state["progress"] != last["progress"] or not state["armed"]:
                self.moved_at[r] = now
            self.states[r] = state
        done = {r for r, state in self.states.items() if state.get("done")}  # ended normally: no more beats
        ranks = [r for r in range(self.world_size) if r not in done]
        silent = [r for r in ranks if now - self.beat_at[r] > self.hang_timeout]
        beating = [r for r in ranks if now - self.beat_at[r] <= 3 * self.period]
        if len(silent) + len(beating) < len(ranks):
            return None  # a rank neither beating nor silent yet: wait for it to be one or the other
        if not beating:
            return None  # no one left to report
        reporter = min(beating)
        if silent:  # stopped or dead, wherever the run is: the others will wait for it in their next collective
            return Verdict("silent", silent, self.states, reporter)
        if any(now - self.moved_at[r] <= self.hang_timeout for r in beating):
            return None  # some rank moves on
        waiting = {r: self.states[r]["waiting"] for r in beating}
        outside = [r for r in beating if waiting[r] is None]
        if outside and len(outside) < len(beating):
            return Verdict("stuck", outside, self.states, reporter)
        return Verdict("collective", list(beating), self.states, reporter)
