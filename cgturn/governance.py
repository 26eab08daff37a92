"""What the TurnManager does about resources, as a mixin of it: limits at the three levels, the audit of
limits the kernel enforced, pause and resume, leases for survivors, and one instance per key.

Ownership-level policy over the backend's primitives, like the rest of the manager; a module of its own
so that `manager.py` keeps to turns and their state changes.
"""
from __future__ import annotations

import logging
import subprocess
import time
from typing import TYPE_CHECKING, Any, Callable

from . import ids, keys, leases, reasons
from .backends.capabilities import limiter_of
from .errors import AlreadyRunning, CgturnError, NoSuchTurn, UnsafeOperation
from .logfields import turn_fields
from .kernel import procfs
from .limits import Limits, Usage, stored_limits
from .model import COMPLETED, CORRUPT, RUNNING, AbandonResult, TurnRecord

log = logging.getLogger("cgturn")


class GovernanceMixin:
    """Limits, pause/resume, leases and keys for TurnManager (uses its backend, state_dir, events)."""

    if TYPE_CHECKING:  # what TurnManager provides
        from .backends.base import Backend
        from .manager import Listeners

        backend: Backend
        state_dir: str
        events: Listeners

        def abandon_turn(self, task_key: str, turn_key: str, reason: str, grace: float, force: bool = False,
                         when: Callable[[TurnRecord], bool] | None = None) -> AbandonResult: ...
        def _refuse_if_caller_inside(self, rec: TurnRecord, verb: str = "kill") -> None: ...

    def set_limits(self, limits: Limits) -> None:
        """Set the budget of the managed root: all its turns together (None fields unchanged).

        This is the budget that keeps the gateway and the host alive when no single turn is over its
        own limit. Set only on cgroups cgturn created, never on the caller's own.
        Raises LimitsUnavailable when a limit cannot be enforced here.
        """
        limiter_of(self.backend).set_root_limits(limits)

    def limits(self) -> Limits:
        """The managed root's own limits (empty when none)."""
        return limiter_of(self.backend).root_limits()

    def usage(self) -> Usage:
        """What all turns together used, as the managed root's counters say."""
        return limiter_of(self.backend).root_usage()

    def set_task_limits(self, task_id: str, limits: Limits) -> None:
        """Set the budget of a task: all its turns together (None fields unchanged). A task with
        limits keeps its cgroup between turns, until `end_task`. Raises LimitsUnavailable."""
        ids.validate(task_id, "task")
        limiter_of(self.backend).set_task_limits(ids.encode(task_id), limits)

    def task_limits(self, task_id: str) -> Limits:
        """A task's own limits (empty when none). Raises NoSuchTurn when the task does not exist."""
        return limiter_of(self.backend).task_limits(self._existing_task(task_id))

    def task_usage(self, task_id: str) -> Usage:
        """What all turns of a task used together. Raises NoSuchTurn when the task does not exist."""
        return limiter_of(self.backend).task_usage(self._existing_task(task_id))

    def _existing_task(self, task_id: str) -> str:
        ids.validate(task_id, "task")
        key = ids.encode(task_id)
        if key not in self.backend.task_keys():
            raise NoSuchTurn(f"no task {task_id!r}")
        return key

    def limits_report(self) -> dict:
        """`{layout: "v2"|"v1-hybrid"|None, available: [...], problems: [...]}`: which limits this
        managed root can have, through which layout, and why any cannot."""
        return limiter_of(self.backend).report()

    def check_limits(self, task_key: str, turn_key: str, usage: Usage | None = None,
                     rec: TurnRecord | None = None) -> list[dict]:
        """Audit every limit event of a turn not audited yet (one `limit` record per counter
        increase, whichever process notices first: the counters audited so far live on the turn's
        record, changed under its lock). `usage` and `rec` (the record as just read or written at
        these names) spare the reads when the caller has them. Returns the records written."""
        rec = rec if rec is not None else self.backend.load(task_key, turn_key)
        if rec is None or rec.state == CORRUPT:
            return []
        usage = usage if usage is not None else limiter_of(self.backend).limit_counters(rec)
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

    def freeze_turn(self, task_key: str, turn_key: str, by: str = "user") -> list[int]:
        """Freeze a running or completed turn's processes (`by`: "user" or "guard"); pids reached.

        Raises:
            UnsafeOperation: the turn holds the caller, one of its ancestors or PID 1.
            NoSuchTurn: no such turn, or it was abandoned.
        """
        from . import audit

        rec = self._live_record(task_key, turn_key)
        self._refuse_if_caller_inside(rec, "freeze")
        # Marked before the freeze is written: a native spawn reads the mark under the turn's lock
        # and leaves a marked turn to the shim, so it never clones a vfork child into a frozen
        # cgroup (its caller would wait for the thaw; backends/spawn_paths.py).
        marked, _ = self.backend.transition(task_key, turn_key, {RUNNING, COMPLETED}, rec.state,
                                            {"frozen_by": by, "frozen_at": time.time()},
                                            when=lambda r: r.frozen_by is None)
        try:
            pids = self.backend.freeze_members(rec, True)
        except (CgturnError, OSError):  # refused, or the write failed: not frozen, so not marked either
            if marked:
                self.backend.transition(task_key, turn_key, {RUNNING, COMPLETED}, rec.state,
                                        {"frozen_by": None, "frozen_at": None}, when=lambda r: r.frozen_by == by)
            raise
        audit.record_action(self.state_dir, action="freeze", task=rec.task_id, turn=rec.turn_id, reason=by,
                            pids=pids, backend=self.backend.name)
        return pids

    def thaw_turn(self, task_key: str, turn_key: str, by: str = "user") -> list[int]:
        """Thaw a frozen turn. The guard never thaws a turn a user paused (UnsafeOperation)."""
        from . import audit

        rec = self._live_record(task_key, turn_key)
        if by == "guard" and rec.frozen_by == "user":
            raise UnsafeOperation(f"turn {rec.turn_id!r} of task {rec.task_id!r} was paused by a user")
        self._refuse_if_caller_inside(rec, "thaw")
        pids = self.backend.freeze_members(rec, False)
        now = time.time()
        frozen_for = now - rec.frozen_at if rec.frozen_at is not None else 0.0
        self.backend.transition(task_key, turn_key, {RUNNING, COMPLETED}, rec.state,
                                {"frozen_by": None, "frozen_at": None,
                                 "frozen_seconds": rec.frozen_seconds + max(0.0, frozen_for)})
        audit.record_action(self.state_dir, action="thaw", task=rec.task_id, turn=rec.turn_id, reason=by,
                            pids=pids, backend=self.backend.name)
        return pids

    def _live_record(self, task_key: str, turn_key: str) -> TurnRecord:
        rec = self.backend.load(task_key, turn_key)
        if rec is None or rec.state not in (RUNNING, COMPLETED):
            raise NoSuchTurn(f"no running or completed turn {turn_key!r} in task {task_key!r}")
        return rec

    def set_lease(self, task_key: str, turn_key: str, seconds: float | None) -> TurnRecord:
        """Lease a completed turn's survivors for `seconds` from now (None: until end_task); the
        record after. Raises NoSuchTurn when there is no completed turn here."""
        won, rec = self.backend.transition(task_key, turn_key, {COMPLETED}, COMPLETED,
                                           {"expires_at": leases.expires_at(time.time(), seconds)})
        if rec is None:
            raise NoSuchTurn(f"no turn {turn_key!r} in task {task_key!r}")
        if not won:
            raise NoSuchTurn(f"turn {rec.turn_id!r} of task {rec.task_id!r} is {rec.state}: only a completed "
                             "turn's survivors have a lease")
        self.events.emit("lease_set", rec)
        return rec

    def expire_lease(self, task_key: str, turn_key: str) -> AbandonResult:
        """Kill a completed turn's survivors if its lease has run out (reason `lease-expired`); checked
        under the turn's lock, so a lease extended meanwhile holds. skipped=True when it has not."""
        return self.abandon_turn(task_key, turn_key, reasons.LEASE_EXPIRED, 0.0, force=True,
                                 when=lambda rec: leases.expired(rec, time.time()))

    def spawn_keyed(self, rec: TurnRecord, argv, key: str, popen_kwargs: dict) -> subprocess.Popen[Any]:
        """Spawn into `rec`'s turn unless a live process spawned with `key` in its task holds the key
        (AlreadyRunning); check, spawn and record are one step under the task's lock."""
        keys.validate(key)
        with self.backend.task_lock(rec.task_key):
            for other in self.backend.records(rec.task_key):
                held = keys.parse(other.keys).get(key)
                if held is not None and keys.holds(*held):
                    raise AlreadyRunning(held[0], key, f"key {key!r} of task {rec.task_id!r} is held by process "
                                                       f"{held[0]} (turn {other.turn_id!r})")
            proc = self.backend.spawn(rec, argv, popen_kwargs)
            # Our unreaped child: its start time is its own (on cgroup2 the shim execs the target, same pid).
            started = procfs.start_time(proc.pid)
            if started is not None:  # None only once it is gone (and then it holds no key)
                self._note_key(rec, key, (proc.pid, started))
        return proc

    def _note_key(self, rec: TurnRecord, key: str, member: tuple[int, int]) -> None:
        """Record `key` -> member on the turn (dropping keys whose process is gone), under its lock."""
        for _ in range(3):  # the turn may complete between the load and the write
            current = self.backend.load(rec.task_key, rec.turn_key)
            if current is None or current.state not in (RUNNING, COMPLETED):
                return  # abandoned: its kill takes the process, and the key with it
            held = {k: v for k, v in keys.parse(current.keys).items() if keys.holds(*v)}
            held[key] = member
            won, _ = self.backend.transition(rec.task_key, rec.turn_key, {current.state}, current.state,
                                             {"keys": keys.dump(held)})
            if won:
                return

    def _audit_limits_quietly(self, task_key: str, turn_key: str, usage: Usage | None = None,
                              rec: TurnRecord | None = None) -> None:
        """check_limits on a path that must finish (a kill, a completion): never raises."""
        try:
            self.check_limits(task_key, turn_key, usage, rec)
        except Exception:  # noqa: BLE001 - the audit of a limit must not stop a kill
            log.exception("could not audit the limit events of turn %r of task %r", turn_key, task_key,
                          extra=turn_fields(ids.decode(task_key) or task_key, ids.decode(turn_key) or turn_key))
