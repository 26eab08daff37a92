"""Pause and resume a turn (`Turn.freeze`/`thaw`, `cgturn pause`/`resume`, the pressure guard).

Who froze a turn ("user" or "guard") and since when live on its record, so clocks that stop while a
turn is frozen can leave that time out and the guard never thaws what a user paused. Every freeze and
thaw is audited (`action: freeze|thaw`).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from . import audit
from .backends.base import Backend
from .errors import CgturnError, LockTimeout, NoSuchTurn, UnsafeOperation
from .killing import refuse_if_caller_inside
from .logfields import turn_fields
from .model import COMPLETED, RUNNING, TurnRecord

log = logging.getLogger("cgturn")


def live_record(backend: Backend, task_key: str, turn_key: str) -> TurnRecord:
    """The record of a running or completed turn. Raises NoSuchTurn otherwise."""
    rec = backend.load(task_key, turn_key)
    if rec is None or rec.state not in (RUNNING, COMPLETED):
        raise NoSuchTurn(f"no running or completed turn {turn_key!r} in task {task_key!r}")
    return rec


def freeze_turn(backend: Backend, state_dir: str, task_key: str, turn_key: str, by: str = "user") -> list[int]:
    """Freeze a running or completed turn's processes (`by`: "user" or "guard"); the pids reached.

    Raises:
        UnsafeOperation: the turn holds the caller, one of its ancestors or PID 1.
        NoSuchTurn: no such turn, or it was abandoned.
    """
    rec = live_record(backend, task_key, turn_key)
    refuse_if_caller_inside(backend, rec, "freeze")
    # Marked before the freeze is written: a native spawn reads the mark under the turn's lock
    # and leaves a marked turn to the shim, so it never clones a vfork child into a frozen
    # cgroup (its caller would wait for the thaw; backends/spawn_paths.py).
    marked, _ = backend.transition(task_key, turn_key, {RUNNING, COMPLETED}, rec.state,
                                   {"frozen_by": by, "frozen_at": time.time()},
                                   when=lambda r: r.frozen_by is None)
    try:
        pids = backend.freeze_members(rec, True)
    except (CgturnError, OSError) as failed:  # refused, or the write failed: not frozen, so not marked either
        if marked:
            _unmark(backend, rec, by, {"frozen_by": None, "frozen_at": None}, f"its freeze failed ({failed})")
        raise
    audit.record_action(state_dir, action="freeze", task=rec.task_id, turn=rec.turn_id, reason=by,
                        pids=pids, backend=backend.name)
    return pids


def thaw_turn(backend: Backend, state_dir: str, task_key: str, turn_key: str, by: str = "user") -> list[int]:
    """Thaw a frozen turn; the pids reached.

    Raises:
        UnsafeOperation: `by` is "guard" and a user paused the turn, or the turn holds the caller.
        NoSuchTurn: no such turn, or it was abandoned.
    """
    rec = live_record(backend, task_key, turn_key)
    if by == "guard" and rec.frozen_by == "user":
        raise UnsafeOperation(f"turn {rec.turn_id!r} of task {rec.task_id!r} was paused by a user")
    refuse_if_caller_inside(backend, rec, "thaw")
    pids = backend.freeze_members(rec, False)
    now = time.time()
    frozen_for = now - rec.frozen_at if rec.frozen_at is not None else 0.0
    _unmark(backend, rec, None, {"frozen_by": None, "frozen_at": None,
                                 "frozen_seconds": rec.frozen_seconds + max(0.0, frozen_for)}, "it was thawed")
    audit.record_action(state_dir, action="thaw", task=rec.task_id, turn=rec.turn_id, reason=by,
                        pids=pids, backend=backend.name)
    return pids


def _unmark(backend: Backend, rec: TurnRecord, by: str | None, updates: dict[str, Any], why: str) -> None:
    """Clear a turn's freeze mark (only `by`'s, unless None) once it is not frozen. The thaw (or the
    failed freeze) has happened whatever the lock does: while the turn's lock stays held past its
    bound (LockTimeout) the mark stays, with a warning; the next pause or resume of the turn sets it
    right, and until then its inactivity and deadline clocks stand still as for a frozen turn."""
    try:
        backend.transition(rec.task_key, rec.turn_key, {RUNNING, COMPLETED}, rec.state, updates,
                           when=None if by is None else (lambda r: r.frozen_by == by))
    except LockTimeout as busy:
        log.warning("cannot clear the freeze mark of turn %r of task %r, though %s: %s; a later resume clears it",
                    rec.turn_id, rec.task_id, why, busy, extra=turn_fields(rec.task_id, rec.turn_id))
