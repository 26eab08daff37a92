"""The API of the registry cgturn replaces, on both backends: baselines of a task's process ids, and
killing what started since one (`TurnManager.snapshot_running_ids`, `kill_started_since`).

An id is opaque to callers: `<turn_key>/<pid>:<start time>`, so a reused pid never matches a baseline
taken before it was reused.
"""
from __future__ import annotations

from typing import Iterable

from . import ids
from .backends.base import Backend
from .model import ABANDONED, TurnRecord


def valid_id(value: str) -> bool:
    """A usable id (CONTRACT: a blank or invalid id matches nothing where processes are looked up)."""
    try:
        ids.validate(value, "task")
        return True
    except ValueError:
        return False


def snapshot_running_ids(backend: Backend, task_id: str) -> frozenset[str]:
    """Opaque ids of the task's live processes (abandoned turns' excluded). Blank task: empty."""
    if not valid_id(task_id):
        return frozenset()
    out: set[str] = set()
    for rec in backend.records(ids.encode(task_id)):
        if rec.state != ABANDONED:
            out.update(_process_id(rec, pid, start) for pid, start in backend.members(rec))
    return frozenset(out)


def kill_started_since(backend: Backend, baseline: Iterable[str], task_id: str) -> int:
    """Kill the task's processes whose ids are not in `baseline` (all of an abandoned turn's); how
    many were killed. Turns holding the caller are skipped. Blank task id: 0, nothing killed."""
    if not valid_id(task_id):
        return 0
    keep = frozenset(baseline)
    count = 0
    for rec in backend.records(ids.encode(task_id)):
        if backend.contains_caller(rec):
            continue
        if rec.state == ABANDONED:
            count += len(backend.kill_members(rec))
            continue
        count += len(backend.kill_where(
            rec, lambda pid, start: _process_id(rec, pid, start) not in keep))  # called right here
    return count


def _process_id(rec: TurnRecord, pid: int, start: int) -> str:
    return f"{rec.turn_key}/{pid}:{start}"
