"""Limits at the three levels (managed root, task, turn) and the audit of limits the kernel enforced.

An object the manager composes (`manager._governance`) over the backend's optional limits capability,
`backend.limiter` (None where the backend has no cgroups: the registry). Where there is no limiter, a
limit asked for raises LimitsUnavailable and what is read is empty (no limits, zero counters, no
pressure). The manager's public limit methods (`set_limits`, `task_usage`, ...) delegate here.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from . import ids, reasons
from .backends.capabilities import Limiter, no_limits_error
from .errors import NoSuchTurn
from .limits import Limits, Usage, stored_limits
from .logfields import turn_fields
from .model import CORRUPT, TurnRecord

if TYPE_CHECKING:
    from .backends.base import Backend

log = logging.getLogger("cgturn")


class Governance:
    """Limits and limit events of one manager's turns.

    Args:
        backend: the manager's backend (records, transitions, task names).
        state_dir: where the audit log is.
        limiter: the backend's limits capability, or None where it has none.
    """

    def __init__(self, backend: "Backend", state_dir: str, limiter: Limiter | None) -> None:
        self.backend = backend
        self.state_dir = state_dir
        self.limiter = limiter

    def _required(self) -> Limiter:
        if self.limiter is None:
            raise no_limits_error(self.backend.name)
        return self.limiter

    def set_limits(self, limits: Limits) -> None:
        """Set the managed root's budget (None fields unchanged). Raises LimitsUnavailable."""
        self._required().set_root_limits(limits)

    def limits(self) -> Limits:
        """The managed root's own limits (empty when none, or without a limiter)."""
        return Limits() if self.limiter is None else self.limiter.root_limits()

    def usage(self) -> Usage:
        """What all turns together used, as the managed root's counters say (empty without a limiter)."""
        return Usage() if self.limiter is None else self.limiter.root_usage()

    def set_task_limits(self, task_id: str, limits: Limits) -> None:
        """Set a task's budget. Raises ValueError for an invalid id, LimitsUnavailable."""
        ids.validate(task_id, "task")
        self._required().set_task_limits(ids.encode(task_id), limits)

    def task_limits(self, task_id: str) -> Limits:
        """A task's own limits (empty when none). Raises NoSuchTurn when the task does not exist."""
        key = self._existing_task(task_id)
        return Limits() if self.limiter is None else self.limiter.task_limits(key)

    def task_usage(self, task_id: str) -> Usage:
        """What a task's turns used together. Raises NoSuchTurn when the task does not exist."""
        key = self._existing_task(task_id)
        return Usage() if self.limiter is None else self.limiter.task_usage(key)

    def _existing_task(self, task_id: str) -> str:
        ids.validate(task_id, "task")
        key = ids.encode(task_id)
        if key not in self.backend.task_keys():
            raise NoSuchTurn(f"no task {task_id!r}")
        return key

    def report(self) -> dict[str, Any]:
        """`{layout, available, problems}`: which limits the managed root can have, and why not."""
        if self.limiter is None:
            return {"layout": None, "available": [], "problems": [str(no_limits_error(self.backend.name))]}
        return self.limiter.report()

    def set_turn_limits(self, rec: TurnRecord, limits: Limits) -> TurnRecord:
        """Change a turn's own limits; the record after. Raises LimitsUnavailable, NoSuchTurn."""
        return self._required().set_turn_limits(rec, limits)

    def check_limits(self, task_key: str, turn_key: str, usage: Usage | None = None,
                     rec: TurnRecord | None = None) -> list[dict[str, Any]]:
        """Audit every limit event of a turn not audited yet (one `limit` record per counter
        increase, whichever process notices first: the counters audited so far live on the turn's
        record, changed under its lock). `usage` and `rec` (the record as just read or written at
        these names) spare the reads when the caller has them. Returns the records written."""
        if self.limiter is None:
            return []  # no cgroups: the kernel enforces no limit
        rec = rec if rec is not None else self.backend.load(task_key, turn_key)
        if rec is None or rec.state == CORRUPT:
            return []
        usage = usage if usage is not None else self.limiter.limit_counters(rec)
        if usage.oom_kills <= rec.audited_oom_kills and usage.pids_max_hits <= rec.audited_pids_max_hits:
            return []
        from . import audit

        won, before = self._note_limit_counters(rec, usage)
        if not won or before is None:
            return []
        limits = stored_limits(before.limits)
        out = []
        for reason, now, seen, limit in ((reasons.OOM, usage.oom_kills, before.audited_oom_kills, limits.memory_max),
                                         (reasons.PIDS_MAX, usage.pids_max_hits, before.audited_pids_max_hits,
                                          limits.pids_max)):
            if now > seen:
                out.append(audit.record_limit(self.state_dir, task=rec.task_id, turn=rec.turn_id, reason=reason,
                                              count=now - seen, limit=limit, backend=self.backend.name))
        return out

    def _note_limit_counters(self, rec: TurnRecord, usage: Usage) -> tuple[bool, TurnRecord | None]:
        """Raise the audited counters on the record under its lock; (won, the record before)."""
        current = self.backend.load(rec.task_key, rec.turn_key)
        if current is None:
            return False, None
        updates = {"audited_oom_kills": max(usage.oom_kills, current.audited_oom_kills),
                   "audited_pids_max_hits": max(usage.pids_max_hits, current.audited_pids_max_hits)}
        seen = (current.audited_oom_kills, current.audited_pids_max_hits)
        won, after = self.backend.transition(
            rec.task_key, rec.turn_key, {current.state}, current.state, updates,
            when=lambda r: (r.audited_oom_kills, r.audited_pids_max_hits) == seen)
        if not won or after is None:
            return False, None  # another process audited these events first
        return True, current

    def audit_limits_quietly(self, task_key: str, turn_key: str, usage: Usage | None = None,
                             rec: TurnRecord | None = None) -> None:
        """`check_limits` on a path that must finish (a kill, a completion): never raises."""
        try:
            self.check_limits(task_key, turn_key, usage, rec)
        except Exception:  # noqa: BLE001 - the audit of a limit must not stop a kill
            log.exception("could not audit the limit events of turn %r of task %r", turn_key, task_key,
                          extra=turn_fields(ids.decode(task_key) or task_key, ids.decode(turn_key) or turn_key))
