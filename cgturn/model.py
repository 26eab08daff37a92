"""Plain data shared by every layer: turn states, the turn record, results. No I/O here."""
from __future__ import annotations

import dataclasses
import functools
import operator
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence, Union

if TYPE_CHECKING:
    from .limits import Limits, Usage
    from .ports import Port as Port  # re-exported by __getattr__ below

RUNNING = "running"
COMPLETED = "completed"
ABANDONED = "abandoned"
STATES = (RUNNING, COMPLETED, ABANDONED)

# Not a state a turn moves through: what a turn directory reads as when its record is missing,
# unreadable, or disagrees with the directory it was read from. Such a turn is killed by any abandon
# (the kernel's view decides what it owns, not bytes someone else could have written).
CORRUPT = "corrupt"
# What Turn.spawn runs: an argv sequence, or one string (a shell command with shell=True, as Popen).
Argv = Union[str, Sequence[Union[str, "os.PathLike[str]"]]]
# A turn's network: the host's, or "none" (a namespace of its own with only loopback, up).
NETWORKS = ("host", "none")


@dataclass(slots=True)
class TurnRecord:
    """What is known about one turn, stored where any process can read it (xattr, file or SQLite).

    `task_key`/`turn_key` are the encoded directory names; `task_id`/`turn_id` the original ids.
    """

    task_id: str
    turn_id: str
    task_key: str
    turn_key: str
    state: str = RUNNING
    owner_pid: int | None = None
    owner_start: int | None = None
    reason: str | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    # The process carrying out an abandon (pid + start time), so `reap` can tell an interrupted kill
    # (killer gone) from one still under way.
    killer_pid: int | None = None
    killer_start: int | None = None
    # Limits set on the turn itself (cgturn.Limits.to_stored(), as JSON text), and whether the turn
    # has directories in v1 hierarchies (hybrid hosts: made when any limit applies to it).
    limits: str | None = None
    v1_dirs: bool = False
    # Limit counters already written to the audit log (each increase is audited exactly once).
    audited_oom_kills: int = 0
    audited_pids_max_hits: int = 0
    # Who froze the turn ("user": Turn.freeze/`cgturn pause`; "guard": the pressure guard) and since
    # when (wall clock); the seconds it spent frozen before, so clocks that stop while frozen can
    # leave them out.
    frozen_by: str | None = None
    frozen_at: float | None = None
    frozen_seconds: float = 0.0
    # When a completed turn's survivors are killed (wall clock; None: they live until end_task).
    expires_at: float | None = None
    # Processes spawned with a key (cgturn.keys): JSON {key: [pid, start time]}, written under the
    # task's lock; None when there are none.
    keys: str | None = None
    # Isolation every process of the turn shares (begin_turn): sealed in its cgroups, and its network
    # ("host", or "none": a namespace of its own with only loopback).
    sealed: bool = False
    network: str = "host"
    # Why the record could not be trusted (state CORRUPT); never stored.
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The stored fields by name (what the backends write; `problem` is never stored)."""
        # Every stored field is a str, a number, a bool or None: no deep copy needed (asdict's cost a
        # twentieth of a turn's churn); one attrgetter call reads them all (twice per small turn).
        return dict(zip(STORED_FIELDS, _stored_values(self)))

    def advance(self, allowed_from: Iterable[str], to_state: str, updates: dict[str, Any]) -> bool:
        """Apply a state change in place if the current state allows it (the caller holds the lock
        that makes read-check-write atomic). True if it was applied."""
        if self.state not in allowed_from:
            return False
        self.state = to_state
        for name, value in updates.items():
            setattr(self, name, value)
        return True

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TurnRecord":
        """Build from stored JSON, ignoring fields this version does not know."""
        if data.keys() <= _RECORD_FIELDS:  # the common case: written by this version
            return cls(**data)
        return cls(**{k: v for k, v in data.items() if k in _RECORD_FIELDS})


# The fields a record stores (`problem` is derived when reading, never stored).
STORED_FIELDS = tuple(f.name for f in dataclasses.fields(TurnRecord) if f.name != "problem")
_stored_values = operator.attrgetter(*STORED_FIELDS)
_RECORD_FIELDS = frozenset(STORED_FIELDS)


def corrupt_record(task_key: str, turn_key: str, problem: str, started_at: float = 0.0) -> TurnRecord:
    """What a turn directory without a trustworthy record reads as: its ids decoded from the
    directory names where possible (the names themselves otherwise), state CORRUPT."""
    from .ids import decode

    return TurnRecord(task_id=decode(task_key) or task_key, turn_id=decode(turn_key) or turn_key,
                      task_key=task_key, turn_key=turn_key, state=CORRUPT, started_at=started_at,
                      problem=problem)


@dataclass(slots=True)
class TurnView:
    """A turn observed at one moment: its record, live pids and resource use (what `ps` needs)."""

    record: TurnRecord
    pids: list[int]
    cpu_seconds: float = 0.0
    memory_bytes: int | None = None
    # Ids of the turn's cgroup and every cgroup below it (sock_diag reports these); empty without one.
    cgroup_ids: frozenset[int] = frozenset()
    path: str | None = None
    # Read in the same pass when the listing asked for detail (`Backend.views(detail=True)`); None:
    # not read there (the listing asks the backend for each turn's instead).
    usage: "Usage | None" = None
    pressure: dict[str, dict[str, float] | None] | None = None
    frozen: bool | None = None


@dataclass(slots=True)
class AbandonResult:
    """What `Turn.abandon` did. `skipped` is True when it killed nothing by rule (already ended)."""

    killed: list[int] = field(default_factory=list)
    skipped: bool = False
    reason: str = ""
    signals: list[str] = field(default_factory=list)
    duration_ms: float = 0.0
    # What the turn used and which limits the kernel enforced (read before its cgroup was removed);
    # None when nothing was killed by this call.
    usage: "Usage | None" = None
    # The pid of the process that carried out the kill (None: unknown, or nothing was done).
    killed_by: int | None = None
    # Turns `end_task` had to leave alone, and why: [{"turn": original id, "error": one line}].
    refused: list[dict[str, str]] = field(default_factory=list)
    # The record update this abandon could not make, in one line (its turn's lock stayed held by
    # another process, so the turn was killed without being marked abandoned first); None normally.
    unrecorded: str | None = None


@dataclass(slots=True)
class TurnInfo:
    """One row of `cgturn ps`: a turn as any process can see it."""

    task: str
    turn: str
    state: str
    pids: list[int]
    owner_pid: int | None
    started_at: float
    reason: str | None = None
    cpu_seconds: float = 0.0
    memory_bytes: int | None = None
    ports: list[Port] = field(default_factory=list)
    path: str | None = None
    # Limits set on the turn itself (None: none), what it used (None: not read), its pressure
    # ({resource: {some_avg10, full_avg10} or None}; None: not read) and whether it is frozen.
    limits: "Limits | None" = None
    usage: "Usage | None" = None
    pressure: dict[str, dict[str, float] | None] | None = None
    frozen: bool = False
    # When the survivors' lease expires (wall clock), or None; live keyed spawns {key: pid}.
    expires_at: float | None = None
    keys: dict[str, int] | None = None
    sealed: bool = False
    network: str = "host"

    @property
    def age_seconds(self) -> float:
        """Seconds since the turn began (wall clock, never negative)."""
        return max(0.0, time.time() - self.started_at)

    def to_json(self) -> dict[str, Any]:
        """The documented `cgturn ps --json` object."""
        # One literal, in the documented key order: `ps --json` makes 10,000 of these.
        usage = self.usage
        if usage is None:
            from .limits import Usage

            usage = Usage(cpu_seconds=self.cpu_seconds)
        limits = self.limits
        return {
            "task": self.task, "turn": self.turn, "state": self.state, "pids": self.pids,
            "owner_pid": self.owner_pid, "reason": self.reason, "cpu_seconds": self.cpu_seconds,
            "memory_bytes": self.memory_bytes, "ports": [port.to_json() for port in self.ports] if self.ports else [],
            "path": self.path, "frozen": self.frozen, "sealed": self.sealed, "network": self.network,
            "started_at": iso8601(self.started_at),
            "limits": dict(_no_limits_json()) if limits is None  # most turns
            else {k: v for k, v in limits.to_json().items() if k != "oom_group"},
            "oom_kills": usage.oom_kills, "pids_max_hits": usage.pids_max_hits,
            "memory_peak_bytes": usage.memory_peak_bytes, "cpu_throttled_seconds": usage.cpu_throttled_seconds,
            "pressure": self.pressure if self.pressure is not None else {r: None for r in ("cpu", "memory", "io")},
            "expires_at": None if self.expires_at is None else iso8601(self.expires_at),
            "keys": dict(self.keys or {}),
            "age_seconds": round(self.age_seconds, 3),
        }


@functools.lru_cache(maxsize=1)
def _no_limits_json() -> dict[str, Any]:
    """The `limits` of a turn without limits in `ps --json`, made once (not once per turn)."""
    from .limits import Limits

    return {k: v for k, v in Limits().to_json().items() if k != "oom_group"}


def iso8601(ts: float) -> str:
    import datetime  # only for printing: listing turns in process does not need it

    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="milliseconds")


def __getattr__(name: str) -> Any:
    """`cgturn.model.Port`, where it was first defined (cgturn.ports), loaded when asked for: listing
    names ports, most users of this module (`cgturn run`) never do."""
    if name == "Port":
        from .ports import Port

        return Port
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
