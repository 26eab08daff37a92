"""The kill sequence every abandon ends in, whoever decided it (owner, sentinel, CLI, recovery).

SIGTERM (when there is a grace), wait up to `grace` for the turn to empty, SIGKILL the rest
(cgroup.kill, or freeze + kill), wait event-driven until it is empty, remove it, write one audit
record. The turn is already marked abandoned by the caller (or could not be: its lock stayed held;
control.TurnControl.abandon_turn). A kill path finishes its kill whatever else fails: a removal the
registry's lock holds up is left to `reap`, and the audit log is written last and never raises.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from . import audit
from .backends.base import Backend
from .errors import LockTimeout, UnsafeOperation
from .kernel import procfs
from .limits import Usage
from .logfields import turn_fields
from .model import AbandonResult, TurnRecord

if TYPE_CHECKING:
    from .backends.capabilities import Limiter

# Called once a dying turn is empty, before its cgroup (and its counters) go: (task_key, turn_key, usage).
BeforeRemoval = Callable[[str, str, Usage], None]

log = logging.getLogger("cgturn")

# How long to wait for SIGKILLed processes to leave before killing again (a task in D state, or a
# spawn that slipped into the cgroup while it was being killed).
KILL_WAIT = 5.0
KILL_ATTEMPTS = 3


def refuse_if_caller_inside(backend: Backend, rec: TurnRecord, verb: str = "kill") -> None:
    """Raise UnsafeOperation when the turn at `rec` holds the caller, one of its ancestors or PID 1
    (read as procfs.protected: once per abandon inside procfs.protected_once)."""
    if backend.contains_caller(rec):
        raise UnsafeOperation(f"refusing to {verb} turn {rec.turn_id!r} of task {rec.task_id!r}: it contains "
                              f"the calling process, one of its ancestors or PID 1 (caller {os.getpid()})")


def kill_turn(backend: Backend, rec: TurnRecord, reason: str, grace: float, state_dir: str,
              before_removal: BeforeRemoval | None = None, limiter: "Limiter | None" = None,
              checked: list[int] | None = None) -> AbandonResult:
    """Kill everything the turn at `rec`'s directory holds, remove it, audit it.

    Args:
        rec: read from the turn's directory (its names are the directory's), already marked abandoned.
        before_removal: called once the turn is empty, with what it used, before its cgroup goes.
        limiter: the backend's limits capability: a dying turn's CPU quota is lifted through it.
        checked: the turn's members as Backend.checked_members_at read them for the refusal just
            before the mark: the check of a first kill that follows at once (grace 0). A SIGTERM, and
            every kill after a wait, reads and checks the members again.
    """
    with procfs.protected_once():
        return _kill_turn(backend, rec, reason, grace, state_dir, before_removal, limiter, checked)


def _kill_turn(backend: Backend, rec: TurnRecord, reason: str, grace: float, state_dir: str,
               before_removal: BeforeRemoval | None, limiter: "Limiter | None",
               checked: list[int] | None) -> AbandonResult:
    """kill_turn, its protected processes read once (procfs.protected_once) and again after every
    wait that did not end in an empty turn: a grace period, a kill that left something behind."""
    started = time.monotonic()
    killed: set[int] = set()
    signals: list[str] = []
    empty = False
    usage = None
    if grace > 0:
        checked = None  # the kill after the grace's wait reads the members again
        signalled_at = time.monotonic()
        hit = backend.signal_members(rec, signal.SIGTERM)
        if hit:
            killed.update(hit)
            signals.append("SIGTERM")
            empty = backend.wait_empty(rec, grace, signalled_at)
            procfs.reread_protected()
        else:
            empty = backend.wait_empty(rec, 0)
    for _ in range(KILL_ATTEMPTS):
        if not empty:
            signalled_at = time.monotonic()
            hit = backend.kill_members(rec, checked)
            checked = None  # a kill that left something is followed by one that reads them again
            if limiter is not None:
                limiter.unthrottle(rec)  # the dying processes may exit on every core, not within a quota
            killed.update(hit)
            if hit and "SIGKILL" not in signals:
                signals.append("SIGKILL")
            empty = backend.wait_empty(rec, KILL_WAIT, signalled_at)
            if not empty:
                procfs.reread_protected()
        if empty and usage is None:
            usage = _final_usage(backend, rec, before_removal)
        if empty:
            try:
                if backend.remove(rec):
                    break
            except LockTimeout as busy:  # the registry's write lock: the turn is empty, only its row stays
                log.error("turn %r of task %r is empty but could not be removed (reap removes it): %s", rec.turn_id,
                          rec.task_id, busy, extra=turn_fields(rec.task_id, rec.turn_id, reason))
                break
        empty = False  # something slipped in between the wait and the rmdir: go again
    else:
        log.error("turn %r of task %r still holds processes after %d kills", rec.turn_id, rec.task_id,
                  KILL_ATTEMPTS, extra=turn_fields(rec.task_id, rec.turn_id, reason, pids=sorted(killed)))
    backend.remove_task(rec.task_key)
    duration_ms = (time.monotonic() - started) * 1000
    if killed:
        audit.record_kill(state_dir, task=rec.task_id, turn=rec.turn_id, reason=reason, pids=sorted(killed),
                          signals=signals, duration_ms=duration_ms, backend=backend.name,
                          usage=None if usage is None else usage.to_json())
    return AbandonResult(killed=sorted(killed), skipped=False, reason=reason, signals=signals,
                         duration_ms=duration_ms, usage=usage)


def _final_usage(backend: Backend, rec: TurnRecord, before_removal: BeforeRemoval | None) -> Usage | None:
    """What the emptied turn used (None if it cannot be read); hands it to `before_removal`."""
    try:
        usage = backend.turn_usage(rec)
    except Exception:  # noqa: BLE001 - figures must never stop a kill
        log.exception("could not read the usage of turn %r of task %r", rec.turn_id, rec.task_id,
                      extra=turn_fields(rec.task_id, rec.turn_id, rec.reason))
        return None
    if before_removal is not None:
        before_removal(rec.task_key, rec.turn_key, usage)
    return usage


# Turns of one task whose graces run side by side in end_task (a thread each, while it runs).
END_TASK_THREADS = 8

_T = TypeVar("_T")
_R = TypeVar("_R")


def side_by_side(fn: Callable[[_T], _R], items: list[_T], parallel: bool) -> list[_R]:
    """[fn(item) for item in items], in up to END_TASK_THREADS threads when `parallel` and there are
    several (each waits out its own grace: waiting side by side bounds the whole call by one grace)."""
    if not parallel or len(items) < 2:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(END_TASK_THREADS, len(items)), thread_name_prefix="cgturn-end") as pool:
        return list(pool.map(fn, items))
