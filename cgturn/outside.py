"""Noticing that someone else abandoned a supervised turn, and learning that kill's figures.

Another process (`cgturn stop`, the sentinel, the pressure guard, `end_task` elsewhere) may abandon a
turn while its worker runs on. The supervisor's watchdog reads the turn's record once per STATE_POLL:
state `abandoned` (with the killer's pid) or no record at all (already removed). That killer writes a
note when its kill is done (cgturn.outcomes); the owner waits for it while the killer runs
(EXTERNAL_WAIT), or briefly when the killer is unknown (UNKNOWN_KILLER_WAIT), so the outcome carries
the real pids, signals and duration. An abandon by another thread of this process arrives as a
listener event instead (cgturn.wakeups), with its figures.

The decision itself (who won) is the supervisor's, under its lock; this module only looks and waits.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from . import processes, reasons
from .logfields import turn_fields
from .model import ABANDONED, AbandonResult
from .outcome import result_from_note

log = logging.getLogger("cgturn.supervisor")

# How long an owner waits for another process's kill of its turn to finish (its note, see
# cgturn.outcomes) while that killer runs; and, when the killer is unknown, at all.
EXTERNAL_WAIT = 60.0
UNKNOWN_KILLER_WAIT = 2.0
# How often a wait for the killer's note looks again.
NOTE_POLL = 0.005

# What a look found: (reason, the record as read or None, the kill's figures or None).
Noticed = tuple[str, Any, "AbandonResult | None"]


class OutsideAbandon:
    """What one supervisor learns of an abandon of its turn by someone else.

    Args:
        control: the manager's TurnControl (`manager._control`).
        names: the turn's encoded names (task_key, turn_key).
        started_at: the turn's start (wall clock): a note older than the turn is not its kill's.
        task_id, turn_id: the original ids, for log lines.
    """

    def __init__(self, control: Any, names: tuple[str, str], started_at: float, task_id: str, turn_id: str):
        self._control = control
        self._names = names
        self._started_at = started_at
        self._log = turn_fields(task_id, turn_id, None)
        self.killed_by: int | None = None
        self.result: AbandonResult | None = None
        self._killer: tuple[int, int] | None = None  # pid + start time, to wait only while it runs
        self._resolved = threading.Event()
        self._gone_since: float | None = None

    def take_note(self) -> dict[str, Any] | None:
        """The note the turn's killer left (consumed), or None."""
        note: dict[str, Any] | None = self._control.take_abandon_note(*self._names, self._started_at)
        return note

    def poll(self) -> Noticed | None:
        """One look at the turn's record (the watchdog's, once per STATE_POLL): what an abandon by
        someone else left, or None while the turn is not known to be abandoned."""
        try:
            rec = self._control.record(*self._names)
        except Exception:  # noqa: BLE001 - a failed read decides nothing
            log.exception("cannot read the state of turn %r", self._names, extra=self._log)
            return None
        if rec is not None:
            return (rec.reason or reasons.UNRECORDED, rec, None) if rec.state == ABANDONED else None
        # Removed: its killer writes the note right after the removal. Look again at the next polls
        # rather than block the watchdog; after UNKNOWN_KILLER_WAIT decide without it.
        note = self.take_note()
        if note is not None:
            return str(note.get("reason") or reasons.UNRECORDED), None, result_from_note(note, None)
        now = time.monotonic()
        if self._gone_since is None:
            self._gone_since = now
        elif now - self._gone_since >= UNKNOWN_KILLER_WAIT:
            return reasons.UNRECORDED, None, None
        return None

    def after_worker(self, rec: Any) -> Noticed | None:
        """The worker finished but its completion did not win: why, from `rec` (the record just read;
        None when the turn is gone, then from the killer's note, waited for a moment). None when the
        turn is not abandoned (it is still this supervisor's to abandon)."""
        if rec is not None:
            return (rec.reason or reasons.UNRECORDED, rec, None) if rec.state == ABANDONED else None
        deadline = time.monotonic() + UNKNOWN_KILLER_WAIT
        while (note := self.take_note()) is None and time.monotonic() < deadline and not self._resolved.is_set():
            self._resolved.wait(NOTE_POLL)
        if note is not None:
            return str(note.get("reason") or reasons.UNRECORDED), None, result_from_note(note, None)
        return reasons.UNRECORDED, None, None

    def learn(self, rec: Any, result: AbandonResult | None) -> None:
        """Keep who killed the turn (from its record) and the kill's figures when known already; let go
        of what this process holds for the ended turn (its network namespace)."""
        self._control.turn_ended_elsewhere(*self._names)
        if rec is not None and rec.killer_pid is not None:
            self.killed_by = rec.killer_pid
            if rec.killer_start is not None:
                self._killer = (rec.killer_pid, rec.killer_start)
        if result is not None:
            self.resolve(result)

    def resolve(self, result: AbandonResult) -> None:
        """The kill's figures arrived (a listener event, or a note): the first ones stand."""
        if self.result is None:
            self.result, self.killed_by = result, result.killed_by
        self._resolved.set()

    def figures(self, reason: str | None) -> AbandonResult:
        """The kill's figures: known already, else from the killer's note, waited for while the killer
        runs (EXTERNAL_WAIT; UNKNOWN_KILLER_WAIT when the killer is unknown).

        Returns:
            The AbandonResult; without a note (the killer died, or could not write one), what the
            record said: the reason and the killer's pid, no pids.
        """
        started = time.monotonic()
        while not self._resolved.is_set():
            note = self.take_note()
            if note is not None:
                self.resolve(result_from_note(note, reason))
                break
            if self._killer is not None and self._killer[0] == os.getpid():
                bound = EXTERNAL_WAIT  # another thread of ours is killing: its listener event resolves it
            elif self._killer is not None:
                bound = EXTERNAL_WAIT if processes.alive_or_unknown(*self._killer) else 0.0
            else:
                bound = UNKNOWN_KILLER_WAIT
            if time.monotonic() - started >= bound:
                break
            self._resolved.wait(NOTE_POLL)
        if self.result is None:
            self.result = AbandonResult(skipped=False, reason=reason or reasons.UNRECORDED, killed_by=self.killed_by)
        self._resolved.set()  # final: a second look (the owner's settle after the kill's own) waits no more
        return self.result
