"""How a supervised turn ended (`Outcome`), and the figures of a kill another process did, read from
the note it left (cgturn.outcomes)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .model import AbandonResult

if TYPE_CHECKING:
    from .limits import Usage


@dataclasses.dataclass
class Outcome:
    """How a supervised turn ended. Exactly one of completed / abandoned (`reason` set) holds.

    Attributes:
        completed: the worker finished and the turn completed.
        result: the worker's return value (completed only).
        reason: why the turn was abandoned (`timeout`, `deadline`, `stop`, `error`, another
            process's reason, ...); None when completed.
        abandon: the kill's figures (AbandonResult), when abandoned.
        error: the worker's exception (reason `error`), or the kill's.
        interrupted: `on_interrupt` fired.
        external: abandoned by someone other than this supervisor (`cgturn stop`, end_task, the
            sentinel, the guard, another thread's Turn.abandon); `abandon` then holds that kill's figures.
            When this supervisor had decided first but the other hand marked the turn first, `reason`
            stays its own decision and `abandon.reason` is the recorded one.
        killed_by: the pid of the process that killed the turn (None when unknown).
        usage: what the turn used and which limits the kernel enforced on it (cgturn.Usage), read as
            the worker finished or by the abandon before the turn's cgroup was removed; None when unknown.
    """

    completed: bool
    result: Any = None
    reason: str | None = None
    abandon: AbandonResult | None = None
    error: BaseException | None = None
    interrupted: bool = False
    external: bool = False
    killed_by: int | None = None
    usage: "Usage | None" = None

    @property
    def abandoned(self) -> bool:
        """True when the turn was abandoned (`reason` says why)."""
        return not self.completed


def result_from_note(note: dict[str, Any], reason: str | None) -> AbandonResult:
    """The AbandonResult of another process's kill, from the note it left (cgturn.outcomes); fields of
    the wrong type are dropped, never trusted."""
    killed = [p for p in note.get("killed", []) if isinstance(p, int)]
    signals = [s for s in note.get("signals", []) if isinstance(s, str)]
    killed_by = note.get("killed_by")
    duration = note.get("duration_ms")
    return AbandonResult(killed=sorted(killed), skipped=False, reason=str(note.get("reason") or reason),
                         signals=signals, duration_ms=float(duration) if isinstance(duration, (int, float)) else 0.0,
                         killed_by=killed_by if isinstance(killed_by, int) else None,
                         usage=usage_from_note(note.get("usage")))


def usage_from_note(data: Any) -> "Usage | None":
    """The killed turn's figures as the killer read them before removing its cgroup (`Usage.to_json`
    in the note), or None when absent or not what cgturn writes (a field of the wrong type)."""
    from .limits import Usage

    if not isinstance(data, dict):
        return None
    ints = ("oom_kills", "pids_max_hits")
    optional: dict[str, Any] = {"memory_peak_bytes": int, "cpu_throttled_seconds": (int, float)}
    cpu = data.get("cpu_seconds")
    if any(isinstance(data.get(n), bool) or not isinstance(data.get(n), int) for n in ints) \
            or isinstance(cpu, bool) or not isinstance(cpu, (int, float)):
        return None
    for name, kind in optional.items():
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            return None
    peak, throttled = data.get("memory_peak_bytes"), data.get("cpu_throttled_seconds")
    return Usage(oom_kills=data["oom_kills"], pids_max_hits=data["pids_max_hits"], memory_peak_bytes=peak,
                 cpu_seconds=float(cpu), cpu_throttled_seconds=None if throttled is None else float(throttled))
