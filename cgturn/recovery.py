"""Crash recovery (`cgturn reap`, `TurnManager(recover=True)`): the policy for turns nobody tends.

One pass over every turn, each judged on its own:
- running, and its owner (pid + start time) is gone: abandon it (reason `owner-died`);
- abandoned, and the process that was killing it is gone: finish the kill;
- corrupt (no trustworthy record): kill it — the directory is a turn, whatever its record says;
- completed, and its survivors' lease has run out: kill them (reason `lease-expired`);
- completed with nothing left: remove it;
- frozen by the pressure guard while no guard is alive on the managed root (it was SIGKILLed, or the
  host crashed): thaw it — only a guard thaws what a guard froze, and a frozen turn's clocks stand
  still, so its timeouts would never fire (a live guard takes such turns on itself when it arms).
An owner that cannot be looked at (AccessDenied) is not gone: its turn is left alone and reported.
Then the task directories left empty are removed, and the abandon notes and sentinel lock files
(cgturn.sentinel_locks) of owners that are gone. Linear in the number of turns.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from . import leases, reasons, sentinel_locks
from .backends import guard_state
from .backends.base import Backend
from .control import TurnControl
from .errors import AccessDenied, CgturnError
from .kernel import procfs
from .model import ABANDONED, COMPLETED, CORRUPT, RUNNING, TurnRecord

GUARD = "guard"  # `frozen_by` of a turn the pressure guard froze (cgturn.guard_policy.BY)

# The actions a recovery pass reports.
ABANDONED_ACTION = "abandoned"          # a running turn whose owner died
FINISHED_KILL = "finished-kill"         # an abandon whose killer died midway
KILLED_CORRUPT = "killed-corrupt"       # a turn directory without a trustworthy record
REMOVED = "removed"                     # a completed turn with nothing left
KILLED_EXPIRED = "lease-expired"        # a completed turn whose survivors' lease ran out (reason LEASE_EXPIRED)
REMOVED_V1 = "removed-v1-dirs"          # v1 directories of a turn that is gone (`path`)
THAWED_ORPHAN = "thawed"              # a turn a guard froze, with no guard alive to thaw it
KILLED_STRAY = "killed-stray"           # a process outside every turn, in a task directory or the root
OWNER_UNKNOWN = "owner-unknown"         # the owner could not be looked at: left alone
ERROR = "error"                         # the turn could not be handled (e.g. it holds the caller)


@dataclasses.dataclass(slots=True)
class RecoveryAction:
    """One thing a recovery pass did (or could not do) to one turn."""

    action: str
    task: str
    turn: str
    reason: str | None = None
    killed: list[int] | None = None
    error: str | None = None
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The documented `cgturn reap --json` object: fields that do not apply are left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def recover(control: TurnControl) -> list[RecoveryAction]:
    """Apply the policy above to every turn of a manager (through its `manager._control`).

    Returns:
        What was done, one RecoveryAction per turn acted on (or that could not be handled).
    """
    actions: list[RecoveryAction] = []
    backend = control.backend
    guard_alive = guard_state.live(backend) is not None
    owners = _Owners(control)
    for rec in backend.records():
        if rec.state in (RUNNING, COMPLETED):
            # Limit kills nobody has audited yet; `rec` as just read, so the record is not read twice.
            control.check_limits(rec.task_key, rec.turn_key, rec=rec)
        try:
            action = _recover_one(control, rec, owners)
            if action is None and not guard_alive and rec.frozen_by == GUARD:
                action = _thaw_orphan(control, rec)
        except CgturnError as err:
            # One turn that cannot be handled (e.g. it holds the caller) must not stop the rest.
            action = RecoveryAction(ERROR, rec.task_id, rec.turn_id, error=str(err))
        if action is not None:
            actions.append(action)
    for where, pid in backend.strays():
        try:
            if backend.kill_stray(where, pid):
                actions.append(RecoveryAction(KILLED_STRAY, _task_of(backend, where), "", killed=[pid]))
        except CgturnError as err:
            actions.append(RecoveryAction(ERROR, _task_of(backend, where), "", error=str(err)))
    for task_key in backend.task_keys():
        backend.remove_task(task_key)  # refuses, harmlessly, while the task still has turns
    limiter = control.governance.limiter
    for path in limiter.sweep_v1_dirs() if limiter is not None else ():
        actions.append(RecoveryAction(REMOVED_V1, "", "", path=path))
    _sweep_notes(control.state_dir)
    sentinel_locks.sweep(control.state_dir)
    return actions


class _Owners:
    """Whether each owner (pid + start time) lives, looked at once per pass: a gateway owns all its
    turns, so one /proc read answers for thousands of them. An owner that dies during the pass is
    seen by the next one, as it would be had it died just after its look; one seen gone stays gone
    (a pid with the same start time does not come back)."""

    def __init__(self, control: TurnControl):
        self.control = control
        self.seen: dict[tuple[int | None, int | None], bool] = {}

    def alive(self, rec: TurnRecord) -> bool:
        """`control.owner_alive(rec)`, once per owner. Raises AccessDenied (not remembered: asked again)."""
        key = (rec.owner_pid, rec.owner_start)
        found = self.seen.get(key)
        if found is None:
            found = self.seen[key] = self.control.owner_alive(rec)
        return found


def _sweep_notes(state_dir: str) -> None:
    """Remove abandon notes (cgturn.outcomes) whose owner is gone: nobody will take them."""
    from . import outcomes

    def owner_lives(note: dict[str, Any]) -> bool:
        pid, start = note.get("owner_pid"), note.get("owner_start")
        if not isinstance(pid, int) or not isinstance(start, int):
            return False
        return procfs.alive_or_unknown(pid, start)

    outcomes.sweep(state_dir, owner_lives)


def _task_of(backend: Backend, where: str) -> str:
    """The task id a stray's directory belongs to ("" for the managed root itself)."""
    from . import ids

    name = os.path.relpath(where, backend.scope)
    return "" if name == "." else (ids.decode(name) or name)


def _thaw_orphan(control: TurnControl, rec: TurnRecord) -> RecoveryAction | None:
    """Thaw a turn the pressure guard froze when no guard is alive to (audited as `thaw`, reason
    `guard`); None when it is no longer the guard's (a user paused or thawed it meanwhile)."""
    current = control.record(rec.task_key, rec.turn_key)
    if current is None or current.frozen_by != GUARD or current.state not in (RUNNING, COMPLETED):
        return None
    control.thaw_turn(rec.task_key, rec.turn_key, by=GUARD)
    return RecoveryAction(THAWED_ORPHAN, rec.task_id, rec.turn_id, GUARD)


def _recover_one(control: TurnControl, rec: TurnRecord, owners: _Owners) -> RecoveryAction | None:
    if rec.state == RUNNING:
        try:
            alive = owners.alive(rec)
        except AccessDenied as err:
            return RecoveryAction(OWNER_UNKNOWN, rec.task_id, rec.turn_id, error=str(err))
        if alive:
            return None
        result = control.abandon_turn(rec.task_key, rec.turn_key, reasons.OWNER_DIED, grace=0.0)
        if result.skipped:
            return None
        return RecoveryAction(ABANDONED_ACTION, rec.task_id, rec.turn_id, reasons.OWNER_DIED, result.killed)
    if rec.state == ABANDONED:
        if procfs.alive_or_unknown(rec.killer_pid, rec.killer_start):
            return None
        # The process that was killing this turn died before it finished: finish for it.
        result = control.finish_kill(rec)
        return RecoveryAction(FINISHED_KILL, rec.task_id, rec.turn_id, rec.reason, result.killed)
    if rec.state == CORRUPT:
        result = control.abandon_turn(rec.task_key, rec.turn_key, reasons.CORRUPT_RECORD, grace=0.0)
        return RecoveryAction(KILLED_CORRUPT, rec.task_id, rec.turn_id, rec.problem, result.killed)
    if leases.expired(rec, time.time()):
        result = control.expire_lease(rec.task_key, rec.turn_key)
        if not result.skipped:
            return RecoveryAction(KILLED_EXPIRED, rec.task_id, rec.turn_id, reasons.LEASE_EXPIRED, result.killed)
        return None
    if remove_emptied(control, rec, remove_task=False):
        return RecoveryAction(REMOVED, rec.task_id, rec.turn_id)
    return None


def remove_emptied(control: TurnControl, rec: TurnRecord, remove_task: bool = True) -> bool:
    """Remove a completed turn with nothing left in it, as completion removes one that is empty at
    once (its limit counters are audited first; they go with its cgroup). The rmdir is the atomic
    check: a turn that still holds a process stays. True when it was removed.

    Args:
        remove_task: remove its task directory too when that was its last turn.
    """
    if rec.state != COMPLETED or not control.backend.wait_empty(rec, 0):
        return False
    control.check_limits(rec.task_key, rec.turn_key)
    if not control.backend.remove(rec):
        return False
    if remove_task:
        control.backend.remove_task(rec.task_key)
    return True
