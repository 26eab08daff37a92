"""The clocks of a supervised turn: a hard deadline and an inactivity timeout, both stopping while the
turn is frozen; lease clocks do not (a lease bounds how long survivors live, frozen or not).

One implementation for the two places that keep these clocks: the supervisor's watchdog (in the owner)
and the sentinel (outside it). Pure arithmetic on what the turn's record says (`frozen_seconds`,
`frozen_at`: wall clock) and on monotonic times; the callers read the record, and only when a due time
has arrived (`due` first, then `due_after_look` with a fresh `frozen_state`), never on every wake-up.
"""
from __future__ import annotations

from typing import Protocol

from . import reasons

# While a turn is frozen its clocks stand still: look again this often (the freeze may end any time).
FROZEN_RECHECK = 0.25


class FrozenFields(Protocol):
    """What the clocks read of a turn's record (cgturn.model.TurnRecord has these)."""

    @property
    def frozen_seconds(self) -> float | None: ...  # read-only: a record's float satisfies it

    @property
    def frozen_at(self) -> float | None: ...


def frozen_total(rec: FrozenFields, now: float) -> float:
    """Seconds the turn has spent frozen so far, the current freeze included.

    Args:
        rec: the turn's record.
        now: the wall clock (time.time()) to measure a current freeze to.

    Returns:
        The frozen seconds; a wall clock stepped back never makes a freeze negative.
    """
    total = rec.frozen_seconds or 0.0
    if rec.frozen_at is not None:
        total += max(0.0, now - rec.frozen_at)
    return total


def frozen_state(rec: FrozenFields | None, now: float, otherwise: float = 0.0) -> tuple[float, bool]:
    """(frozen seconds so far, frozen now) of a turn's record; (`otherwise`, False) without a record."""
    if rec is None:
        return otherwise, False
    return frozen_total(rec, now), rec.frozen_at is not None


class FrozenTime:
    """Frozen seconds a clock must leave out, learnt a look at a time.

    `deadline`: frozen seconds since the clock started. `idle`: frozen seconds since the activity
    `idle_since`. A look that finds new activity cannot tell whether the frozen time since the previous
    look came before or after it, so it credits at most the time since that activity: the timeout may
    fire late by a freeze that preceded the activity, never early because of one.

    Args:
        seen: the turn's frozen total when the clocks started (a freeze before that is not theirs).
    """

    __slots__ = ("seen", "deadline", "idle", "idle_since")

    def __init__(self, seen: float = 0.0):
        self.seen = seen
        self.deadline = 0.0
        self.idle = 0.0
        self.idle_since: float | None = None

    def look(self, total: float, last_activity: float, since_activity: float) -> None:
        """Account a fresh `frozen_total`; `last_activity` is the activity the timeout runs from."""
        delta = max(0.0, total - self.seen)
        self.seen = total
        self.deadline += delta
        if last_activity != self.idle_since:
            self.idle = min(delta, max(0.0, since_activity))
            self.idle_since = last_activity
        else:
            self.idle += delta

    def idle_credit(self, last_activity: float) -> float:
        """Frozen seconds to add to an inactivity timeout running from `last_activity`."""
        return self.idle if last_activity == self.idle_since else 0.0


def due(deadline_at: float | None, timeout: float | None, last_activity: float, frozen: FrozenTime,
        slack: float = 0.0) -> tuple[float, str] | None:
    """The nearer of the deadline and the inactivity timeout, frozen time left out.

    Args:
        deadline_at: monotonic time of the hard deadline (None: none).
        timeout: inactivity timeout in seconds (None: none), running from `last_activity` (monotonic).
        frozen: the frozen time learnt so far.
        slack: added to both (the sentinel's margin, so the owner's own watchdog acts first).

    Returns:
        (monotonic due time, reason `deadline` or `timeout`), or None when neither clock is set.
    """
    options = []
    if deadline_at is not None:
        options.append((deadline_at + frozen.deadline + slack, reasons.DEADLINE))
    if timeout is not None:
        options.append((last_activity + timeout + frozen.idle_credit(last_activity) + slack, reasons.TIMEOUT))
    return min(options) if options else None


def due_after_look(deadline_at: float | None, timeout: float | None, last_activity: float, frozen: FrozenTime,
                   state: tuple[float, bool], now: float, slack: float = 0.0) -> tuple[float, str] | None:
    """`due` once a fresh look at the record is accounted: the frozen time since the last look is left
    out, and while the turn is still frozen the due time is at least a recheck away.

    Args:
        state: `frozen_state` of the record just read.
        now: the monotonic time of the look.
        (the others as for `due`).

    Returns:
        As `due`.
    """
    total, frozen_now = state
    frozen.look(total, last_activity, now - last_activity)
    when = due(deadline_at, timeout, last_activity, frozen, slack)
    if when is not None and frozen_now:
        when = (max(when[0], now + FROZEN_RECHECK), when[1])
    return when
