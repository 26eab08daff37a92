"""The state changes and look-ups that `Turn`, the supervision layer and recovery need from a manager,
kept off `TurnManager`'s public surface (which is what applications call).

A `TurnControl` is reached as `manager._control`: the underscore says it is not for applications; the
layers above ownership use it as their one door into a manager's turns (docs/design.md). It holds the
manager's narrow collaborators (its backend, state dir, listeners and governance), never the manager.

Abandon is one path for every cause: mark the turn abandoned (the first of complete/abandon wins,
atomically across processes), then the kill sequence (cgturn.killing). Pause and resume are
cgturn.freezing's, keyed spawns cgturn.keys'; the methods here are their doors.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from . import ids, killing, leases, reasons
from .backends.base import Backend
from .errors import AccessDenied, LockTimeout, NoSuchProcess, NoSuchTurn, RegistryUnavailable, UnsafeOperation
from .events import Listeners, TurnEnded
from .governance import Governance
from .kernel import procfs
from .limits import Limits, Usage
from .logfields import turn_fields
from .model import ABANDONED, COMPLETED, CORRUPT, RUNNING, AbandonResult, Argv, TurnRecord, TurnView

if TYPE_CHECKING:
    import subprocess

# What keeps an abandon from marking its turn, and must not keep it from killing: the turn's lock held
# past its bound, or a record store that cannot be written (ENOSPC, EROFS on the state directory's
# metadata files; the registry database on a full or read-only disk, whose every sqlite3.Error its
# RegistryDatabase raises as RegistryUnavailable).
_UNMARKABLE = (LockTimeout, OSError, RegistryUnavailable)


log = logging.getLogger("cgturn")
# Whether this process ever began a turn (through any manager): only create_turn makes a process a
# turn's owner, so until then it owns none, and a new sentinel need not read every record of the
# managed root to find them (`cgturn run` beside 10,000 turns). Stays True in a forked child, which
# then reads them and finds none of its own (its pid is not its parent's).
_began_turns = False

# The turn states an unforced abandon may start from: a corrupt turn is killed like a running one.
_ABANDONABLE = frozenset({RUNNING, CORRUPT})
_ABANDONABLE_FORCED = frozenset({RUNNING, COMPLETED, ABANDONED, CORRUPT})


class TurnControl:
    """Friend operations of one manager, addressed by encoded names (task_key, turn_key).

    Args:
        backend: the manager's backend.
        state_dir: the manager's state directory (audit log, abandon notes).
        events: the manager's listeners, told of what this process did.
        governance: the manager's limits and limit audit.
    """

    def __init__(self, backend: Backend, state_dir: str, events: Listeners, governance: Governance) -> None:
        self.backend = backend
        self.state_dir = state_dir
        self.events = events
        self.governance = governance

    def create_turn(self, task_id: str, turn_id: str, limits: Limits | None, seal: bool, network: str) -> TurnRecord:
        """Create the turn these (validated) ids name, owned by the calling process; its record.
        Raises as `TurnManager.begin_turn`."""
        global _began_turns
        _began_turns = True  # before the turn exists: a sentinel attached meanwhile must look
        record = TurnRecord(task_id=task_id, turn_id=turn_id, task_key=ids.encode(task_id),
                            turn_key=ids.encode(turn_id), state=RUNNING, owner_pid=os.getpid(),
                            owner_start=procfs.own_start_time(), started_at=time.time(),
                            sealed=bool(seal), network=network)
        self.backend.create_turn(record, limits)
        return record

    # --- look-ups ---------------------------------------------------------------------------------

    def record(self, task_key: str, turn_key: str) -> TurnRecord | None:
        """The stored record of the turn at these names, read fresh; None when it does not exist."""
        return self.backend.load(task_key, turn_key)

    def views(self) -> list[TurnView]:
        """Every existing turn with its live pids and usage (TurnView), as the backend sees them."""
        return self.backend.views()

    def turn_state(self, task_key: str, turn_key: str) -> str | None:
        """The state of the turn at these encoded names; None when it does not exist."""
        rec = self.backend.load(task_key, turn_key)
        return None if rec is None else rec.state

    def owner_alive(self, rec: TurnRecord) -> bool:
        """True if the turn's owner process (pid + start time, so no reused pid) still runs.

        Raises AccessDenied when the owner cannot be looked at: never read that as "dead".
        """
        return procfs.is_alive(rec.owner_pid or 0, rec.owner_start if rec.owner_start is not None else -1)

    def running_turns_of_caller(self) -> list[tuple[str, str]]:
        """(task id, turn id) of the running turns the calling process began."""
        if not _began_turns:
            return []
        me = os.getpid()
        start = procfs.own_start_time()
        return [(rec.task_id, rec.turn_id) for rec in self.backend.records()
                if rec.state == RUNNING and rec.owner_pid == me and rec.owner_start == start]

    def turn_usage_quietly(self, rec: TurnRecord) -> Usage | None:
        """What the turn at `rec` used; None when it cannot be read (figures never decide an outcome)."""
        try:
            return self.backend.turn_usage(rec)
        except Exception:  # noqa: BLE001 - figures never decide an outcome
            log.debug("cannot read the usage of turn %r", rec.turn_id, exc_info=True)
            return None

    def take_abandon_note(self, task_key: str, turn_key: str, started_at: float) -> dict[str, Any] | None:
        """Take (read and delete) the note another process left for the owner of the turn at these
        names that began at `started_at` (see cgturn.outcomes); None when there is none (yet)."""
        from . import outcomes

        return outcomes.take_note(self.state_dir, task_key, turn_key, started_at)

    # --- completion and abandon -------------------------------------------------------------------

    def complete_turn(self, task_key: str, turn_key: str, keep_for: float | None = None,
                      figures: bool = False) -> tuple[bool, TurnRecord | None, Usage | None]:
        """Move a running turn to completed, its survivors leased for `keep_for` seconds (None: until
        end_task); (won, record after, usage). Removes it if nothing is left. With `figures`, what the
        turn used is read once it is completed, before any removal (else usage is None)."""
        now = time.time()
        won, rec = self.backend.transition(task_key, turn_key, {RUNNING}, COMPLETED,
                                           {"ended_at": now, "expires_at": leases.expires_at(now, keep_for)},
                                           stamp_later=True)
        usage = None
        if won and rec is not None:
            self.events.emit("turn_ended", TurnEnded(rec.task_id, rec.turn_id, task_key, turn_key, COMPLETED))
            if rec.expires_at is not None:
                self.events.emit("lease_set", rec)
            if figures:
                usage = self.turn_usage_quietly(rec)
            # Audit its limit counters while they are there (they go with its cgroup; `rec` is the
            # record just written under the lock), then remove it if nothing is left. The removal is
            # the atomic check, and says at once when something is: survivors, or a spawn that
            # slipped in meanwhile (it finds the turn completed and kills its shim); either keeps the
            # turn, completed, for its lease, `turns()` or `reap` to remove once it has emptied.
            self.governance.audit_limits_quietly(task_key, turn_key, usage, rec)
            if self.backend.remove(rec):
                self.backend.remove_task(task_key)
        return won, rec, usage

    def abandon_turn(self, task_key: str, turn_key: str, reason: str, grace: float, force: bool = False,
                     when: Callable[[TurnRecord], bool] | None = None) -> AbandonResult:
        """Mark the turn at this directory abandoned (first transition wins) and kill it. `when(record)`,
        if given, must also hold under the turn's lock (the guard: "still frozen by me"; a lease: "still
        run out"). When the mark cannot be made — the lock stays held past its bound (LockTimeout), or
        the record store cannot be written (a full or read-only state directory: OSError, or the
        registry database's RegistryUnavailable) — the turn is killed all the same and the result's
        `unrecorded` says what its record lacks (_abandon_unmarked).

        Raises:
            UnsafeOperation: the turn holds the caller, one of its ancestors or PID 1.
        """
        with procfs.protected_once():  # the caller, its ancestors and PID 1: read once for the whole abandon
            return self._abandon_turn(task_key, turn_key, reason, grace, force, when)

    def _abandon_turn(self, task_key: str, turn_key: str, reason: str, grace: float, force: bool,
                      when: Callable[[TurnRecord], bool] | None) -> AbandonResult:
        # The refusal comes before the mark, so a refused abandon changes nothing. Where the backend
        # can answer from the names (a cgroup's member list) and the answer is no, the record is not
        # read first: the mark reads it under the lock, and a turn that is gone is skipped there.
        # The members read for it are the first kill's check, the mark (~0.07 ms) in between.
        checked = self.backend.checked_members_at(task_key, turn_key)
        if checked is None:
            rec = self.backend.load(task_key, turn_key)
            if rec is None:
                return AbandonResult(skipped=True, reason=reason)
            self.refuse_if_caller_inside(rec)
        allowed = _ABANDONABLE_FORCED if force else _ABANDONABLE
        updates = {"reason": reason, "ended_at": time.time(), "killer_pid": os.getpid(),
                   "killer_start": procfs.own_start_time()}
        try:
            # The kill follows at once: the listings' stamp waits for its first signal (stamp_later).
            won, rec = self.backend.transition(task_key, turn_key, allowed, ABANDONED, updates, when=when,
                                               stamp_later=True)
        except _UNMARKABLE as busy:
            return self._abandon_unmarked(task_key, turn_key, reason, grace, allowed, updates, when, busy)
        if not won or rec is None:
            return AbandonResult(skipped=True, reason=(rec.reason if rec else None) or reason)
        marked = rec  # as written under the lock: its audited limit counters are current

        def audit_limits(task: str, turn: str, usage: Usage) -> None:
            self.governance.audit_limits_quietly(task, turn, usage, marked)

        result = killing.kill_turn(self.backend, rec, reason, grace, self.state_dir, before_removal=audit_limits,
                                   limiter=self.governance.limiter, checked=checked)
        self._ended(rec, result)
        return result

    def _abandon_unmarked(self, task_key: str, turn_key: str, reason: str, grace: float, allowed: frozenset[str],
                          updates: dict[str, Any], when: Callable[[TurnRecord], bool] | None,
                          busy: Exception) -> AbandonResult:
        """The abandon whose mark could not be made (the turn's lock stayed held, or its store could
        not be written: `busy`) still kills:
        a kill path never waits on a lock. The record read without the lock decides, by the mark's
        own rules, and the kill runs; then the mark is tried once more, in case the turn outlived
        its kill. What was not written is the result's `unrecorded` (and an error in the log)."""
        rec = self.backend.load(task_key, turn_key)
        if rec is None or (when is not None and not when(rec)) or not rec.advance(allowed, ABANDONED, updates):
            return AbandonResult(skipped=True, reason=(rec.reason if rec else None) or reason)
        log.error("killing turn %r of task %r without marking it abandoned first: %s", rec.turn_id, rec.task_id,
                  busy, extra=turn_fields(rec.task_id, rec.turn_id, reason))
        result = killing.kill_turn(self.backend, rec, reason, grace, self.state_dir,
                                   before_removal=self.governance.audit_limits_quietly,
                                   limiter=self.governance.limiter)
        result.unrecorded = f"turn {rec.turn_id!r} of task {rec.task_id!r} was not marked abandoned before its kill ({busy})"
        if self.backend.load(task_key, turn_key) is not None:  # it outlived the kill: its record must say so
            try:
                self.backend.transition(task_key, turn_key, allowed, ABANDONED, updates, when=when)
            except _UNMARKABLE as still:
                result.unrecorded += f"; it is still there and still not marked ({still})"
        self._ended(rec, result)
        return result

    def finish_kill(self, rec: TurnRecord) -> AbandonResult:
        """Kill a turn already marked abandoned whose killer died midway."""
        result = killing.kill_turn(self.backend, rec, rec.reason or reasons.UNRECORDED, 0.0, self.state_dir,
                                   limiter=self.governance.limiter)
        self._ended(rec, result)
        return result

    def refuse_if_caller_inside(self, rec: TurnRecord, verb: str = "kill") -> None:
        """Raise UnsafeOperation when the turn at `rec` holds the caller, one of its ancestors or PID 1."""
        killing.refuse_if_caller_inside(self.backend, rec, verb)

    def _ended(self, rec: TurnRecord, result: AbandonResult) -> None:
        """An abandon this process carried out is done: leave the owner its note when the owner is
        another live process (cgturn.outcomes), then tell this process's listeners."""
        result.killed_by = os.getpid()
        event = TurnEnded(rec.task_id, rec.turn_id, rec.task_key, rec.turn_key, ABANDONED, result.reason,
                          list(result.killed), result.killed_by, list(result.signals), result.duration_ms,
                          result.usage)
        if rec.owner_pid is not None and rec.owner_pid != result.killed_by \
                and procfs.alive_or_unknown(rec.owner_pid, rec.owner_start):
            from . import outcomes

            outcomes.write_note(self.state_dir, {
                "task_key": rec.task_key, "turn_key": rec.turn_key, "task": rec.task_id, "turn": rec.turn_id,
                "started_at": rec.started_at, "owner_pid": rec.owner_pid, "owner_start": rec.owner_start,
                "reason": result.reason, "killed_by": result.killed_by, "killed": result.killed,
                "signals": result.signals, "duration_ms": round(result.duration_ms, 3), "time": time.time(),
                "usage": None if result.usage is None else result.usage.to_json()})
        self.events.emit("turn_ended", event)

    # --- what a turn holds ------------------------------------------------------------------------

    def adopt_into(self, rec: TurnRecord, pid: int) -> None:
        """Move process `pid` into the turn `rec`, refusing what must never be moved (Turn.adopt).

        Raises:
            ValueError: not a process id.
            NoSuchProcess: no process `pid`.
            UnsafeOperation: PID 1, the caller, an ancestor of the caller, a kernel thread, a process
                that cannot be looked at, or a member of another task's or manager's turn.
        """
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"not a process id: {pid!r}")
        me = os.getpid()
        if pid == 1:
            raise UnsafeOperation("refusing to adopt PID 1")
        if pid == me:
            raise UnsafeOperation(f"refusing to adopt the calling process {me}: use Turn.enter()")
        if pid in procfs.ancestors(me):
            raise UnsafeOperation(f"refusing to adopt process {pid}: it is an ancestor of the caller")
        try:
            st = procfs.stat(pid)
        except AccessDenied as err:
            raise UnsafeOperation(f"refusing to adopt process {pid}: {err}") from err
        if st is None or st.exited:
            raise NoSuchProcess(pid, f"cannot adopt process {pid}: it does not exist")
        if procfs.is_kernel_thread(st):
            raise UnsafeOperation(f"refusing to adopt process {pid}: it is a kernel thread")
        owner = self.backend.turn_of(pid)
        if owner is not None and owner != (self.backend.scope, rec.task_key):
            raise UnsafeOperation(f"refusing to adopt process {pid}: it belongs to a turn of "
                                  f"{'another task' if owner[0] == self.backend.scope else 'another manager'}")
        self.backend.adopt(rec, pid)

    def spawn_keyed(self, rec: TurnRecord, argv: Argv, key: str, popen_kwargs: dict[str, Any]) -> "subprocess.Popen[Any]":
        """Spawn into `rec`'s turn unless a live process of its task holds `key` (cgturn.keys).
        Raises AlreadyRunning (`.pid`), or as `Turn.spawn`."""
        from . import keys  # keyed spawns only: an ordinary start does not import it

        return keys.spawn_keyed(self.backend, rec, argv, key, popen_kwargs)

    def check_limits(self, task_key: str, turn_key: str, usage: Usage | None = None,
                     rec: TurnRecord | None = None) -> list[dict[str, Any]]:
        """Audit the turn's limit events not audited yet; the records written (cgturn.governance).
        While the turn's lock stays held (LockTimeout) none are written and a warning is logged: the
        events stay unaudited until the next look (the kernel's counters only grow), and the caller
        (`reap`, a turn's end) goes on."""
        try:
            return self.governance.check_limits(task_key, turn_key, usage, rec)
        except LockTimeout as busy:
            log.warning("limit events of turn %r of task %r not audited this time: %s", turn_key, task_key, busy)
            return []

    def set_turn_limits(self, rec: TurnRecord, limits: Limits) -> TurnRecord:
        """Change the turn's own limits; the record after. Raises LimitsUnavailable, NoSuchTurn."""
        return self.governance.set_turn_limits(rec, limits)

    def freeze_turn(self, task_key: str, turn_key: str, by: str = "user") -> list[int]:
        """Freeze the turn (cgturn.freezing); the pids reached. Raises UnsafeOperation, NoSuchTurn."""
        from . import freezing  # pause and the guard only

        return freezing.freeze_turn(self.backend, self.state_dir, task_key, turn_key, by)

    def thaw_turn(self, task_key: str, turn_key: str, by: str = "user") -> list[int]:
        """Thaw the turn (cgturn.freezing); the pids reached. Raises UnsafeOperation, NoSuchTurn."""
        from . import freezing

        return freezing.thaw_turn(self.backend, self.state_dir, task_key, turn_key, by)

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

    def turn_ended_elsewhere(self, task_key: str, turn_key: str) -> None:
        """Let go of what this process holds for the turn at these names now that another process ended
        it (a network namespace fd): what this process's own transition does when the end is its own."""
        isolation = getattr(self.backend, "isolation", None)  # the cgroup2 backend's; the registry holds nothing
        if isolation is not None:
            isolation.release(task_key, turn_key)
