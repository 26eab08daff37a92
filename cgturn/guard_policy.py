"""The pressure guard's decisions as pure functions: which pressure file it watches, which turn is the
victim, when the pressure is on or off, when to thaw, when a frozen turn has waited too long.

No I/O and no clock of its own: the runner (cgturn.guard_runner) reads the kernel and the turns and
passes the figures and times in, so every rule here is table-tested without a kernel
(tests/test_guard.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Protocol, TypeVar

from .errors import GuardUnavailable
from .model import RUNNING

ACTIONS = ("freeze", "abandon")
WATCHES = ("owner", "root", "host")
# Who froze a turn the guard froze (`frozen_by` on the record; audit reason of its freeze/thaw).
BY = "guard"
# The shortest poll() timeout while the guard holds pressure or frozen turns (ms).
MIN_POLL_MS = 50

K = TypeVar("K", bound=Hashable)


class Settings(Protocol):
    """What the runner reads of a guard's settings (cgturn.PressureGuard)."""

    resource: str
    trigger: str
    watch: str
    action: str
    thaw_after: float
    abandon_after: float
    parsed: Any

    def check(self) -> None: ...

    def to_json(self) -> dict[str, Any]: ...


def watched_cgroup(watch: str, owner_cgroup: str | None, managed_root: str | None) -> str | None:
    """The cgroup directory whose pressure a guard watches; None means the host (/proc/pressure).

    Args:
        watch: "owner", "root", "host" or a cgroup directory.
        owner_cgroup: the owner's cgroup directory (None: the root cgroup, or not visible). An owner in
            the root cgroup watches the host: /proc/pressure gives the same system-wide figures.
        managed_root: the managed root directory (None: the registry fallback).

    Raises:
        GuardUnavailable: "root" without a managed root.
    """
    if watch == "host":
        return None
    if watch == "root":
        if managed_root is None:
            raise GuardUnavailable("watch='root' needs the cgroup2 backend (the registry has no managed root)")
        return managed_root
    if watch == "owner":
        return owner_cgroup
    return watch


def eligible(rec: Any, pids: list[int]) -> bool:
    """True for a turn the guard may pick: running, with processes, frozen by nobody (a user's pause
    is never the guard's to undo)."""
    return rec.state == RUNNING and rec.frozen_by is None and bool(pids)


def heaviest(now: dict[K, float], before: dict[K, float], cumulative: bool) -> K | None:
    """The key with the largest load: `now[key]` itself (memory) or its growth since `before[key]`
    (CPU time, io bytes; a turn not seen before counts all it has). None when `now` is empty."""
    best, best_load = None, -1.0
    for key, value in now.items():
        load = value - before.get(key, 0) if cumulative else value
        if load > best_load:
            best, best_load = key, load
    return best


def still_pressing(total: int, prev_total: int, elapsed: float, window: float, threshold: int) -> bool:
    """True when the stall rate since the last look, scaled to one window, is at or above the trigger's
    threshold: the pressure is still on (the kernel signals a crossing at most once per window)."""
    return elapsed > 0 and (total - prev_total) / elapsed * window >= threshold


@dataclass(frozen=True)
class Step:
    """What the runner does after one wake-up."""

    began: bool = False            # the pressure came on: publish `over`
    act: bool = False              # freeze (or abandon) the heaviest turn
    refresh: bool = False          # refresh the CPU/io baselines (a quiet window)
    ended: bool = False            # the pressure stayed away `thaw_after`: publish not `over`
    thaw: bool = False             # thaw the turns the guard froze


@dataclass
class Hold:
    """The guard's pressure state between wake-ups: over or not, and when it was last seen over.

    Args:
        thaw_after: seconds the pressure must stay away before the guard reports it off and thaws.
        last_over: monotonic time the pressure was last on (start a guard with now - thaw_after).
    """

    thaw_after: float
    last_over: float
    over: bool = False

    def step(self, crossed: bool, still: bool, now: float, cumulative: bool) -> Step:
        """Account one wake-up: `crossed` (the kernel signalled), `still` (`still_pressing`) at `now`."""
        if crossed or (self.over and still):
            self.last_over = now
        began = crossed and not self.over
        if began:
            self.over = True
        refresh = cumulative and not crossed and not self.over
        ended = self.over and now - self.last_over >= self.thaw_after
        if ended:
            self.over = False
        thaw = not self.over and now - self.last_over >= self.thaw_after
        return Step(began=began, act=crossed, refresh=refresh, ended=ended, thaw=thaw)


def frozen_too_long(frozen_at: float | None, now: float, abandon_after: float) -> bool:
    """True when a guard-frozen turn (frozen since wall clock `frozen_at`) has waited `abandon_after`."""
    return frozen_at is not None and now - frozen_at >= abandon_after


def poll_timeout_ms(holding: bool, window: float, cumulative: bool) -> int | None:
    """The runner's poll() timeout (ms): half a window while it holds pressure or frozen turns (to watch
    the pressure fall); a window while idle on a cumulative resource (to refresh the CPU/io baselines);
    forever on memory (only the trigger wakes it)."""
    if holding:
        return max(MIN_POLL_MS, int(window * 500))
    return int(window * 1000) if cumulative else None
