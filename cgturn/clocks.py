"""Clocks that stop while a turn is frozen: inactivity timeouts and deadlines leave paused time out;
lease clocks do not (a lease bounds how long survivors live, paused or not).

Pure arithmetic on what the turn's record says (`frozen_seconds`, `frozen_at`: wall clock). The
supervisor's watchdog and the sentinel read the record only when a due time arrives, never on every
wake-up, and push the due time back by the frozen seconds learnt since their last look.
"""
from __future__ import annotations

from .model import TurnRecord

# While a turn is frozen its clocks stand still: look again this often (the freeze may end any time).
FROZEN_RECHECK = 0.25


def frozen_total(rec: TurnRecord, now: float) -> float:
    """Seconds the turn has spent frozen so far (wall clock `now`), the current freeze included."""
    total = rec.frozen_seconds or 0.0
    if rec.frozen_at is not None:
        total += max(0.0, now - rec.frozen_at)
    return total


class PausedTime:
    """Frozen seconds a clock must leave out, learnt a look at a time.

    `deadline`: frozen seconds since the clock started. `idle`: frozen seconds since the activity
    `idle_since`. A look that finds new activity cannot tell whether the frozen time since the previous
    look came before or after it, so it credits at most the time since that activity: the timeout may
    fire late by a freeze that preceded the activity, never early because of one.
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
