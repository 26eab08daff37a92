"""Prometheus exposition (a face): turns by state, per-turn processes/cpu/memory/limit figures/pressure,
and kills, limit events and guard actions from the audit log.

Kill counters, the abandon-latency histogram, limit events and guard actions are derived from
`<state_dir>/audit.jsonl`, not from this process's own actions, so what any process did (owner,
sentinel, CLI) counts. The log is read incrementally; counters only ever grow within one exporter's
life, as Prometheus counters must: when cgturn rotates the log (cgturn.audit renames it), the renamed
file is read to its end first and the new one from its start, so no record is lost or counted twice;
a log truncated in place is read from its start and added on.

Read-only: collecting never recovers, kills or moves anything.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import BinaryIO, Callable, Iterable

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry

from . import audit, sentinel_locks
from .model import RUNNING, STATES, TurnInfo

# Upper bounds (seconds) of the abandon-latency histogram: a cgroup.kill lands in ms, a grace period
# adds seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Longest audit line read (bytes): a record of 100,000 pids is ~0.8 MB; ids and reasons are bounded.
MAX_LINE = 4 * 1024 * 1024
# Leading bytes of an audit file that, with its inode, identify it across rotations.
IDENTITY_BYTES = 128
# Limit events (`action: limit` records) by reason; both series exist from the start.
LIMIT_REASONS = ("oom", "pids-max")
# The pressure guard's actions: its `freeze`/`thaw` records carry reason "guard" (a user's pause says
# "user"), and it abandons with reason "pressure" (issue 13). What anyone else does is not counted.
GUARD_BY = "guard"
GUARD_KILL_REASON = "pressure"
GUARD_ACTIONS = ("freeze", "thaw", "abandon")
PRESSURE_RESOURCES = ("cpu", "memory", "io")

log = logging.getLogger("cgturn")


class AuditTail:
    """Kill counts and latencies, limit events and guard actions from an audit log, read from where the
    last call stopped.

    The log is writable by others, so nothing in it is trusted: a line that is no record
    (`cgturn.audit.parse_line`), or is longer than MAX_LINE bytes, is skipped and counted in
    `malformed`; a log that is not a regular file (a FIFO, a symlink to /dev/zero) is not read at all
    (logged).

    Args:
        state_dir: the directory holding `audit.jsonl`.
    """

    def __init__(self, state_dir: str, buckets: Iterable[float] = LATENCY_BUCKETS):
        self.path = audit.audit_path(state_dir)
        self.buckets = tuple(buckets)
        self.kills: dict[str, int] = {}
        self.killed_processes: dict[str, int] = {}
        self.bucket_counts = [0] * (len(self.buckets) + 1)   # the last one is +Inf
        self.latency_sum = 0.0
        self.limit_events: dict[str, int] = dict.fromkeys(LIMIT_REASONS, 0)
        self.guard_actions: dict[str, int] = dict.fromkeys(GUARD_ACTIONS, 0)
        self.malformed = 0
        self._file: tuple[int, bytes] | None = None   # the file read so far (`_identity`), up to _offset
        self._done: set[tuple[int, bytes]] = set()    # rotated generations read to their end
        self._offset = 0
        self._partial = b""
        self._skipping = False   # inside a line already counted as too long
        self._refused: str | None = None  # why the log was last refused (logged once per reason)
        self._lock = threading.Lock()   # scrapes may run concurrently (threaded HTTP server)

    def update(self) -> None:
        """Fold in the records appended since the last call."""
        with self._lock:
            data = self._read_new()
            if data is None:
                return
            data = self._partial + data
            # Writers append whole lines in one write; an unterminated tail is still being written.
            *lines, self._partial = data.split(b"\n")
            for line in lines:
                if self._skipping:
                    self._skipping = False  # the end of an over-long line
                elif not line:
                    continue  # the newline a writer puts after half a line a full disk left
                elif len(line) > MAX_LINE:
                    self.malformed += 1
                else:
                    self._add(line)
            if len(self._partial) > MAX_LINE:
                if not self._skipping:
                    self.malformed += 1
                self._partial, self._skipping = b"", True

    def _read_new(self) -> bytes | None:
        """The bytes appended since the last call (at most what each file held at fstat), or None.

        The files are read oldest first: the rotated generations (cgturn.audit renames the log, never
        truncates it), then the log. The file read so far is known by `_identity`: once it is found
        rotated, its rest is read and it is done; files this tail never saw are read whole; files
        already done are skipped. So no record is lost or counted twice across rotations (unless more
        than KEEP rotations happen between two calls: the dropped generations are lost).
        """
        try:
            current = audit.open_log(self.path)
        except FileNotFoundError:
            current = None   # rotated away by the last record: only generations to read
        except OSError as err:
            reason = f"cannot read {self.path}: {err.strerror or err}"
            if reason != self._refused:
                log.warning("%s", reason)
                self._refused = reason
            return None
        self._refused = None
        chunks: list[bytes] = []
        seen: set[tuple[int, bytes]] = set()
        for generation in range(audit.KEEP, 0, -1):
            try:
                fd = audit.open_log(audit.rotated_path(self.path, generation))
            except OSError:
                continue
            with open(fd, "rb") as f:
                st, key = os.fstat(f.fileno()), _identity(f)
                seen.add(key)
                if any(_same(key, done) for done in self._done):
                    continue
                reading = _same(key, self._file)
                data = self._read_from(f, st) if reading else f.read(st.st_size)
            if reading:
                self._file, self._offset = None, 0
            self._done.add(key)
            # A rotated file is complete: a line it leaves unterminated ends there, not in the next file.
            pending = self._partial if not chunks else chunks[-1]
            chunks.append(data if data.endswith(b"\n") or not (pending + data) else data + b"\n")
        self._done = {done for done in self._done if any(_same(key, done) for key in seen)}  # at most KEEP
        if current is not None:
            with open(current, "rb") as f:
                st, key = os.fstat(f.fileno()), _identity(f)
                if not _same(key, self._file):
                    self._file, self._offset = key, 0   # a file this tail has not read
                elif len(key[1]) > len(self._file[1]):  # type: ignore[index]
                    self._file = key   # grown: a longer head tells it apart better
                elif st.st_size < self._offset:
                    # Truncated in place (logrotate's copytruncate): what was written past our offset
                    # before the truncate is lost to us; read what is there from the start.
                    self._offset, self._partial, self._skipping = 0, b"", False
                chunks.append(self._read_from(f, st))
        elif self._file is not None and not any(_same(key, self._file) for key in seen):
            self._file, self._offset = None, 0   # the file read so far is gone: its half line with it
            self._partial, self._skipping = b"", False
        return b"".join(chunks)

    def _read_from(self, f: BinaryIO, st: os.stat_result) -> bytes:
        """The bytes of the file read so far, from this tail's offset to its size at fstat."""
        f.seek(self._offset)
        data = f.read(max(0, st.st_size - self._offset))
        self._offset += len(data)
        return data

    def _add(self, line: bytes) -> None:
        record = audit.parse_line(line)
        if record is None:
            self.malformed += 1
            return
        action, reason = audit.action_of(record), record.get("reason", "")
        if action == audit.LIMIT:
            self.limit_events[reason] = self.limit_events.get(reason, 0) + audit.count_of(record)
        elif action in ("freeze", "thaw") and reason == GUARD_BY:
            self.guard_actions[action] += 1
        if action != audit.KILL:
            return
        npids, seconds = len(audit.pids_of(record)), audit.duration_of(record)
        if reason == GUARD_KILL_REASON:
            self.guard_actions["abandon"] += 1
        self.kills[reason] = self.kills.get(reason, 0) + 1
        self.killed_processes[reason] = self.killed_processes.get(reason, 0) + npids
        self.latency_sum += seconds
        for i, bound in enumerate(self.buckets):
            if seconds <= bound:
                self.bucket_counts[i] += 1
                break
        else:
            self.bucket_counts[-1] += 1

    def histogram_buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs as the exposition format wants them, +Inf last."""
        out, total = [], 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.bucket_counts):
            total += count
            out.append((bound, total))
        return out


def _identity(f: BinaryIO) -> tuple[int, bytes]:
    """What tells one audit file from another: its inode and first bytes (fewer while it is short).
    Not the inode alone: a filesystem reuses a dropped generation's inode for the next log at once
    (tmpfs does), while the first record of an append-only file never changes and carries its time
    to the microsecond."""
    return os.fstat(f.fileno()).st_ino, os.pread(f.fileno(), IDENTITY_BYTES, 0)


def _same(key: tuple[int, bytes], known: tuple[int, bytes] | None) -> bool:
    """Whether the file `key` is the file `known` was taken from (which may have grown since)."""
    return known is not None and key[0] == known[0] and key[1].startswith(known[1])


class TurnCollector:
    """A prometheus_client collector: asks for the turns at every scrape, reads the audit tail.

    Args:
        list_turns: returns the current turns (e.g. `TurnManager.turns`); called once per scrape.
        state_dir: where the audit log lives.
    """

    def __init__(self, list_turns: Callable[[], list[TurnInfo]], state_dir: str):
        self.list_turns = list_turns
        self.state_dir = state_dir
        self.audit = AuditTail(state_dir)

    def describe(self):
        return []  # metrics depend on what is running: collected at scrape time only

    def collect(self):
        turns = self.list_turns()
        by_state = GaugeMetricFamily("cgturn_turns", "Turns that exist now, by state.", labels=["state"])
        counts = {state: 0 for state in STATES}
        procs = GaugeMetricFamily("cgturn_turn_processes", "Live processes of a turn.",
                                  labels=["task", "turn", "state"])
        cpu = CounterMetricFamily("cgturn_turn_cpu_seconds", "CPU time used by a turn's processes.",
                                  labels=["task", "turn"])
        mem = GaugeMetricFamily("cgturn_turn_memory_bytes",
                                "Memory of a turn (memory.current, else summed RSS).", labels=["task", "turn"])
        ports = GaugeMetricFamily("cgturn_turn_listening_ports", "Listening sockets of a turn.",
                                  labels=["task", "turn"])
        lease = GaugeMetricFamily("cgturn_turn_lease_expiry_timestamp_seconds",
                                  "When a completed turn's survivors' lease expires (Unix time).",
                                  labels=["task", "turn"])
        owner_gone = GaugeMetricFamily("cgturn_turns_owner_gone",
                                       "Running turns whose owner process no longer exists: nobody (no "
                                       "sentinel) abandoned them.")
        unwatched = GaugeMetricFamily("cgturn_turns_unwatched",
                                      "Running turns whose owner lives but whose sentinel died (killed, "
                                      "OOM-killed): should the owner die now, nobody abandons them.")
        # Owners known to lack a live sentinel, read only when a turn runs (one directory listing and
        # one F_OFD_GETLK per sentinel: cgturn.sentinel_locks). A turn names its owner by pid: one whose
        # owner died and whose pid now names another unwatched owner counts here, not as owner_gone.
        lost = sentinel_locks.unwatched_owners(self.state_dir) if any(i.state == RUNNING for i in turns) else set()
        gone = unguarded = 0
        for info in turns:
            counts[info.state] = counts.get(info.state, 0) + 1
            if info.expires_at is not None:
                lease.add_metric([info.task, info.turn], info.expires_at)
            if info.state == RUNNING and info.owner_pid is not None and not psutil.pid_exists(info.owner_pid):
                gone += 1  # a reused pid counts as alive: the gauge can only under-report
            elif info.state == RUNNING and info.owner_pid in lost:
                unguarded += 1
            procs.add_metric([info.task, info.turn, info.state], len(info.pids))
            cpu.add_metric([info.task, info.turn], info.cpu_seconds)
            if info.memory_bytes is not None:
                mem.add_metric([info.task, info.turn], info.memory_bytes)
            ports.add_metric([info.task, info.turn], len(info.ports))
        for state, n in counts.items():
            by_state.add_metric([state], n)
        owner_gone.add_metric([], gone)
        unwatched.add_metric([], unguarded)
        yield from (by_state, procs, cpu, mem, ports, lease, owner_gone, unwatched)
        yield from _governance_metrics(turns)
        yield from self._audit_metrics()

    def _audit_metrics(self):
        self.audit.update()
        kills = CounterMetricFamily("cgturn_kills", "Turns killed (audit records), by reason.", labels=["reason"])
        killed = CounterMetricFamily("cgturn_killed_processes", "Processes killed, by reason.", labels=["reason"])
        for reason, n in sorted(self.audit.kills.items()):
            kills.add_metric([reason], n)
            killed.add_metric([reason], self.audit.killed_processes[reason])
        latency = HistogramMetricFamily("cgturn_abandon_duration_seconds",
                                        "Time from the first signal until the turn was empty and removed.")
        latency.add_metric([], self.audit.histogram_buckets(), sum_value=self.audit.latency_sum)
        malformed = CounterMetricFamily("cgturn_audit_malformed_lines",
                                        f"Audit log lines skipped: not a record, wrong field types, or over "
                                        f"{MAX_LINE} bytes.")
        malformed.add_metric([], self.audit.malformed)
        limits = CounterMetricFamily("cgturn_limit_events",
                                     "Limits the kernel enforced on turns (audit `limit` records: OOM kills, "
                                     "refused forks), by reason.", labels=["reason"])
        for reason, n in sorted(self.audit.limit_events.items()):
            limits.add_metric([reason], n)
        guard = CounterMetricFamily("cgturn_guard_actions", "What the pressure guard did to turns, by action.",
                                    labels=["action"])
        for action, n in self.audit.guard_actions.items():
            guard.add_metric([action], n)
        yield from (kills, killed, latency, malformed, limits, guard)


def _governance_metrics(turns: list[TurnInfo]):
    """Per-turn figures of resource governance: OOM kills, peak memory, pressure (absent when unknown)."""
    oom = CounterMetricFamily("cgturn_turn_oom_kills", "Processes of a turn the kernel OOM-killed.",
                              labels=["task", "turn"])
    peak = GaugeMetricFamily("cgturn_turn_memory_peak_bytes", "Peak memory of a turn (memory.peak, v1 "
                             "memory.max_usage_in_bytes).", labels=["task", "turn"])
    pressure = GaugeMetricFamily("cgturn_turn_pressure_some_avg10",
                                 "Share of the last 10 s some of a turn's processes stalled on a resource "
                                 "(PSI avg10, percent).", labels=["task", "turn", "resource"])
    for info in turns:
        if info.usage is not None:
            oom.add_metric([info.task, info.turn], info.usage.oom_kills)
            if info.usage.memory_peak_bytes is not None:
                peak.add_metric([info.task, info.turn], info.usage.memory_peak_bytes)
        for resource in PRESSURE_RESOURCES:
            figures = (info.pressure or {}).get(resource)
            if figures is not None:
                pressure.add_metric([info.task, info.turn, resource], figures["some_avg10"])
    yield from (oom, peak, pressure)


def make_registry(list_turns: Callable[[], list[TurnInfo]], state_dir: str) -> CollectorRegistry:
    """A fresh registry holding only cgturn's collector (no process/platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TurnCollector(list_turns, state_dir))
    return registry
