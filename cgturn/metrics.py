"""Prometheus exposition (a face): turns by state, per-turn processes/cpu/memory, and kills from the
audit log.

Kill counters and the abandon-latency histogram are derived from `<state_dir>/audit.jsonl`, not from
this process's own actions, so kills done by any process (owner, sentinel, CLI) count. The log is read
incrementally; counters only ever grow within one exporter's life (a rotated or truncated log is read
from its start and added on), as Prometheus counters must.

Read-only: collecting never recovers, kills or moves anything.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry

from . import audit
from .model import STATES, TurnInfo

# Upper bounds (seconds) of the abandon-latency histogram: a cgroup.kill lands in ms, a grace period
# adds seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AuditTail:
    """Kill counts and latencies from an audit log, read from where the last call stopped.

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
        self._inode: int | None = None
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()   # scrapes may run concurrently (threaded HTTP server)

    def update(self) -> None:
        """Fold in the records appended since the last call."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if st.st_ino != self._inode or st.st_size < self._offset:
                        # A new or truncated log: its records are new kills, read it from the start.
                        self._inode, self._offset, self._partial = st.st_ino, 0, b""
                    f.seek(self._offset)
                    data = f.read()
            except FileNotFoundError:
                return
            self._offset += len(data)
            data = self._partial + data
            # Writers append whole lines in one write; an unterminated tail is still being written.
            *lines, self._partial = data.split(b"\n")
            for line in lines:
                self._add(line)

    def _add(self, line: bytes) -> None:
        try:
            record = json.loads(line)
            reason = str(record.get("reason") or "unknown")
            pids = record.get("pids") or []
            seconds = float(record.get("duration_ms", 0.0)) / 1000.0
        except (ValueError, TypeError, AttributeError):
            return  # a damaged line must not break the exporter
        self.kills[reason] = self.kills.get(reason, 0) + 1
        self.killed_processes[reason] = self.killed_processes.get(reason, 0) + len(pids)
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


class TurnCollector:
    """A prometheus_client collector: asks for the turns at every scrape, reads the audit tail.

    Args:
        list_turns: returns the current turns (e.g. `TurnManager.turns`); called once per scrape.
        state_dir: where the audit log lives.
    """

    def __init__(self, list_turns: Callable[[], list[TurnInfo]], state_dir: str):
        self.list_turns = list_turns
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
        for info in turns:
            counts[info.state] = counts.get(info.state, 0) + 1
            procs.add_metric([info.task, info.turn, info.state], len(info.pids))
            cpu.add_metric([info.task, info.turn], info.cpu_seconds)
            if info.memory_bytes is not None:
                mem.add_metric([info.task, info.turn], info.memory_bytes)
            ports.add_metric([info.task, info.turn], len(info.ports))
        for state, n in counts.items():
            by_state.add_metric([state], n)
        yield from (by_state, procs, cpu, mem, ports)
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
        yield from (kills, killed, latency)


def make_registry(list_turns: Callable[[], list[TurnInfo]], state_dir: str) -> CollectorRegistry:
    """A fresh registry holding only cgturn's collector (no process/platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TurnCollector(list_turns, state_dir))
    return registry
