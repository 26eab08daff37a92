"""Ownership: TurnManager and Turn decide *what* a turn owns and its state; backends do the owning.

Abandon is one path for every cause: mark the turn abandoned (the first of complete/abandon wins,
atomically across processes), SIGTERM its processes, wait up to `grace` for them to leave, SIGKILL
the rest (cgroup.kill, or freeze + kill), wait event-driven until the turn is empty, remove it, and
write one audit record.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import time
from typing import Iterable

from . import audit, ids, reasons
from .kernel import observe
from .backends.base import Backend
from .errors import CgroupUnavailable, CgturnError, NoSuchTurn, UnsafeOperation
from .kernel import discovery, procfs
from .model import ABANDONED, COMPLETED, RUNNING, AbandonResult, TurnInfo, TurnRecord

log = logging.getLogger("cgturn")

BACKENDS = ("auto", "cgroup2", "registry")
# How long to wait for SIGKILLed processes to leave before killing again (a task in D state, or a
# spawn that slipped into the cgroup while it was being killed).
KILL_WAIT = 5.0
KILL_ATTEMPTS = 3


def default_state_dir() -> str:
    """`/run/cgturn` for root, `$XDG_RUNTIME_DIR/cgturn` (or a per-user /tmp dir) otherwise."""
    if os.geteuid() == 0:
        return "/run/cgturn"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "cgturn") if runtime else f"/tmp/cgturn-{os.geteuid()}"


class TurnManager:
    """Owns the turns of one managed root (cgroup v2) or one registry (fallback).

    Args:
        root: managed root on the cgroup2 mount (env CGTURN_ROOT; default `<own cgroup>/cgturn`).
        backend: "auto", "cgroup2" or "registry" (env CGTURN_BACKEND). "auto" uses cgroup2 when usable.
        state_dir: registry database, metadata fallback, audit log (env CGTURN_STATE_DIR).
        recover: apply the `reap` policy now: abandon running turns whose owner is gone.
        sentinel: allow a supervisor to start the out-of-process sentinel for this manager
            (env CGTURN_SENTINEL=0 turns it off; default on). See docs/supervision.md.

    Raises:
        ValueError: unknown backend name.
        CgroupUnavailable: backend="cgroup2" and cgroup v2 cannot be used (the message says why).
    """

    def __init__(self, root: str | None = None, backend: str | None = None, state_dir: str | None = None,
                 recover: bool = False, sentinel: bool | None = None):
        choice = backend or os.environ.get("CGTURN_BACKEND") or "auto"
        if choice not in BACKENDS:
            raise ValueError(f"unknown backend {choice!r} (expected one of {', '.join(BACKENDS)})")
        self.state_dir = state_dir or os.environ.get("CGTURN_STATE_DIR") or default_state_dir()
        self.host = discovery.discover(root)
        self.backend: Backend = self._make_backend(choice)
        self.sentinel_enabled = _sentinel_setting(sentinel)
        # Observers from the supervision layer (the sentinel client): a callback slot, so this layer
        # never imports the one above it.
        self._listeners: list = []
        if recover:
            self.reap()

    def _make_backend(self, choice: str) -> Backend:
        if choice != "registry" and self.host.usable:
            from .backends.cgroup2 import Cgroup2Backend
            mount, fsroot = discovery.find_cgroup2_mount()
            return Cgroup2Backend(self.host.managed_root, mount or self.host.cgroup2_mount,
                                  self.state_dir, fsroot or "/")
        if choice == "cgroup2":
            raise CgroupUnavailable("cgroup v2 is not usable: " + "; ".join(self.host.problems))
        if choice == "auto":
            log.info("cgroup v2 not usable (%s); using the registry fallback", "; ".join(self.host.problems))
        from .backends.registry import RegistryBackend
        return RegistryBackend(self.state_dir)

    def __repr__(self) -> str:
        return f"<TurnManager backend={self.backend.name} at {self.backend.location}>"

    def __enter__(self) -> "TurnManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._notify("manager_closed")
        self.backend.close()

    # --- hooks for the supervision layer ----------------------------------------------------------

    def add_listener(self, listener) -> None:
        """Register an observer; it may define turn_begun(turn), turn_touched(turn),
        turn_ended(task_key, turn_key) and manager_closed(). Called synchronously; must be cheap."""
        self._listeners.append(listener)

    @property
    def listeners(self) -> tuple:
        return tuple(self._listeners)

    def _notify(self, event: str, *args) -> None:
        for listener in self._listeners:
            hook = getattr(listener, event, None)
            if hook is not None:
                try:
                    hook(*args)
                except Exception:  # noqa: BLE001 - an observer must never break ownership
                    log.exception("cgturn listener %r failed on %s", listener, event)

    # --- turns ------------------------------------------------------------------------------------

    def begin_turn(self, task_id: str, turn_id: str | None = None) -> "Turn":
        """Start a turn owned by the calling process.

        Raises:
            ValueError: blank or invalid task/turn id.
            TurnExists: the turn id is taken (running, or completed with survivors).
        """
        ids.validate(task_id, "task")
        turn_id = ids.new_turn_id() if turn_id is None else ids.validate(turn_id, "turn")
        me = os.getpid()
        record = TurnRecord(task_id=task_id, turn_id=turn_id, task_key=ids.encode(task_id),
                            turn_key=ids.encode(turn_id), state=RUNNING, owner_pid=me,
                            owner_start=procfs.start_time(me), started_at=time.time())
        self.backend.create_turn(record)
        turn = Turn(self, record)
        self._notify("turn_begun", turn)
        return turn

    def turn(self, task_id: str, turn_id: str) -> "Turn":
        """The existing turn with these ids. Raises NoSuchTurn, or ValueError for invalid ids."""
        ids.validate(task_id, "task")
        ids.validate(turn_id, "turn")
        record = self.backend.load(ids.encode(task_id), ids.encode(turn_id))
        if record is None:
            raise NoSuchTurn(f"no turn {turn_id!r} in task {task_id!r}")
        return Turn(self, record)

    def turns(self, task_id: str | None = None) -> list[TurnInfo]:
        """What `cgturn ps` shows: every existing turn (of one task), with its live processes."""
        if task_id is not None and (ids.is_blank(task_id) or not _valid(task_id)):
            return []
        task_key = None if task_id is None else ids.encode(task_id)
        views = self.backend.views(task_key)
        sockets = self._listening_sockets() if any(v.cgroup_ids for v in views) else None
        if sockets is not None:
            sockets = observe.by_cgroup(sockets)
        out = []
        for view in views:
            rec = view.record
            mem = view.memory_bytes
            if mem is None:  # no memory controller on the turn: summed RSS is the next best answer
                mem = observe.rss_bytes(view.pids)
            if view.cgroup_ids and sockets is not None:
                ports = observe.ports_in_cgroups(sockets, view.cgroup_ids)
            else:
                ports = observe.ports_of_pids(view.pids)
            out.append(TurnInfo(task=rec.task_id, turn=rec.turn_id, state=rec.state, pids=view.pids,
                                owner_pid=rec.owner_pid, started_at=rec.started_at, reason=rec.reason,
                                cpu_seconds=view.cpu_seconds, memory_bytes=mem, ports=ports,
                                path=view.path))
        out.sort(key=lambda info: (info.started_at, info.task, info.turn))
        return out

    @staticmethod
    def _listening_sockets():
        """One sock_diag dump for a whole listing; None when unusable (ports then come from psutil)."""
        try:
            return observe.listening_sockets()
        except observe.DiagUnavailable as err:
            log.info("ports via psutil: %s", err)
            return None

    def end_task(self, task_id: str, reason: str = reasons.END_TASK) -> AbandonResult:
        """Kill everything the task owns, completed turns' survivors included, and remove its turns.

        A blank task id matches nothing. Raises UnsafeOperation if a turn contains the caller.
        """
        if ids.is_blank(task_id) or not _valid(task_id):
            return AbandonResult(skipped=True, reason=reason)
        task_key = ids.encode(task_id)
        records = self.backend.records(task_key)
        for rec in records:
            self._refuse_if_caller_inside(rec)
        result = AbandonResult(reason=reason)
        for rec in records:
            one = self._abandon(rec.task_key, rec.turn_key, reason, grace=0.0, force=True)
            result.killed.extend(one.killed)
            result.signals = sorted(set(result.signals) | set(one.signals))
        self.backend.remove_task(task_key)
        result.killed.sort()
        return result

    # --- compatibility with the registry cgturn replaces ----------------------------------------

    def snapshot_running_ids(self, task_id: str) -> frozenset[str]:
        """Opaque ids of the task's live processes (abandoned turns' excluded). Blank task: empty."""
        if ids.is_blank(task_id) or not _valid(task_id):
            return frozenset()
        out = set()
        for rec in self.backend.records(ids.encode(task_id)):
            if rec.state != ABANDONED:
                out.update(_process_id(rec, pid, start) for pid, start in self.backend.members(rec))
        return frozenset(out)

    def kill_started_since(self, baseline: Iterable[str], task_id: str) -> int:
        """Kill the task's processes whose ids are not in `baseline`; returns how many were killed.

        Processes of abandoned turns are killed whatever the baseline says, so a reap that was
        skipped never lets them slip into a newer turn's baseline. Blank task id: 0, nothing killed.
        """
        if ids.is_blank(task_id) or not _valid(task_id):
            return 0
        keep = frozenset(baseline)
        count = 0
        for rec in self.backend.records(ids.encode(task_id)):
            if self.backend.contains_caller(rec):
                continue
            if rec.state == ABANDONED:
                count += len(self.backend.kill_members(rec))
                continue
            count += len(self.backend.kill_where(
                rec, lambda pid, start, rec=rec: _process_id(rec, pid, start) not in keep))
        return count

    # --- recovery ---------------------------------------------------------------------------------

    def reap(self) -> list[dict]:
        """Crash recovery: abandon running turns whose owner is gone, finish interrupted kills,
        remove completed turns with nothing left. Returns one dict per action taken."""
        actions = []
        for rec in self.backend.records():
            try:
                actions.extend(self._reap_one(rec))
            except CgturnError as err:
                # One turn that cannot be handled (e.g. it holds the caller) must not stop the rest.
                actions.append({"action": "error", "task": rec.task_id, "turn": rec.turn_id, "error": str(err)})
        for task_key in self.backend.task_keys():  # tasks whose last turn went away
            if not self.backend.records(task_key):
                self.backend.remove_task(task_key)
        return actions

    def _reap_one(self, rec: TurnRecord) -> list[dict]:
        """The reap policy for one turn; returns the actions taken."""
        actions = []
        if rec.state == RUNNING and not self.owner_alive(rec):
            result = self._abandon(rec.task_key, rec.turn_key, reasons.OWNER_DIED, grace=0.0, force=False)
            if not result.skipped:
                actions.append({"action": "abandoned", "task": rec.task_id, "turn": rec.turn_id,
                                "reason": reasons.OWNER_DIED, "killed": result.killed})
        elif rec.state == ABANDONED and not procfs.is_alive(rec.killer_pid or 0, rec.killer_start or -1):
            # The process that was killing this turn died before it finished: finish for it.
            result = self._kill(rec, rec.reason or reasons.UNKNOWN, grace=0.0)
            actions.append({"action": "finished-kill", "task": rec.task_id, "turn": rec.turn_id,
                            "reason": rec.reason, "killed": result.killed})
        elif rec.state == COMPLETED and self.backend.wait_empty(rec, 0):
            if self.backend.remove(rec):
                actions.append({"action": "removed", "task": rec.task_id, "turn": rec.turn_id})
        if not self.backend.records(rec.task_key):
            self.backend.remove_task(rec.task_key)
        return actions

    def owner_alive(self, rec: TurnRecord) -> bool:
        """True if the turn's owner process (pid + start time, so no reused pid) still runs."""
        return procfs.is_alive(rec.owner_pid or 0, rec.owner_start if rec.owner_start is not None else -1)

    # --- internals shared by Turn and the CLI -----------------------------------------------------

    def _refuse_if_caller_inside(self, rec: TurnRecord) -> None:
        if self.backend.contains_caller(rec):
            raise UnsafeOperation(f"refusing to kill turn {rec.turn_id!r} of task {rec.task_id!r}: "
                                  f"it contains the calling process {os.getpid()}")

    def _abandon(self, task_key: str, turn_key: str, reason: str, grace: float, force: bool) -> AbandonResult:
        rec = self.backend.load(task_key, turn_key)
        if rec is None:
            return AbandonResult(skipped=True, reason=reason)
        self._refuse_if_caller_inside(rec)
        allowed = {RUNNING, COMPLETED, ABANDONED} if force else {RUNNING}
        me = os.getpid()
        won, rec = self.backend.transition(task_key, turn_key, allowed, ABANDONED, {
            "reason": reason, "ended_at": time.time(), "killer_pid": me, "killer_start": procfs.start_time(me)})
        if not won or rec is None:
            return AbandonResult(skipped=True, reason=(rec.reason if rec else None) or reason)
        self._notify("turn_ended", task_key, turn_key)
        return self._kill(rec, reason, grace)

    def _kill(self, rec: TurnRecord, reason: str, grace: float) -> AbandonResult:
        """SIGTERM, wait `grace`, SIGKILL, wait until empty, remove, audit. The turn is already marked."""
        started = time.monotonic()
        killed: set[int] = set()
        signals: list[str] = []
        empty = False
        if grace > 0:
            hit = self.backend.signal_members(rec, signal.SIGTERM)
            if hit:
                killed.update(hit)
                signals.append("SIGTERM")
                empty = self.backend.wait_empty(rec, grace)
            else:
                empty = self.backend.wait_empty(rec, 0)
        for _ in range(KILL_ATTEMPTS):
            if not empty:
                hit = self.backend.kill_members(rec)
                killed.update(hit)
                if hit and "SIGKILL" not in signals:
                    signals.append("SIGKILL")
                empty = self.backend.wait_empty(rec, KILL_WAIT)
            if empty and self.backend.remove(rec):
                break
            empty = False  # something slipped in between the wait and the rmdir: go again
        else:
            log.error("turn %r of task %r still holds processes after %d kills", rec.turn_id, rec.task_id,
                      KILL_ATTEMPTS)
        self.backend.remove_task(rec.task_key)
        duration_ms = (time.monotonic() - started) * 1000
        if killed:
            audit.record_kill(self.state_dir, task=rec.task_id, turn=rec.turn_id, reason=reason,
                              pids=sorted(killed), signals=signals, duration_ms=duration_ms,
                              backend=self.backend.name)
        return AbandonResult(killed=sorted(killed), skipped=False, reason=reason, signals=signals,
                             duration_ms=duration_ms)

    def _collect_if_finished(self, rec: TurnRecord) -> None:
        """Remove a completed turn once nothing is left in it (cgroup v2 has no auto-removal)."""
        if self.backend.wait_empty(rec, 0) and self.backend.remove(rec):
            self.backend.remove_task(rec.task_key)


class Turn:
    """One turn of a task. Made by `TurnManager.begin_turn` or `TurnManager.turn`, not by callers."""

    def __init__(self, manager: TurnManager, record: TurnRecord):
        self._manager = manager
        self._record = record
        self.last_activity = time.monotonic()

    @property
    def manager(self) -> TurnManager:
        """The TurnManager this turn belongs to."""
        return self._manager

    @property
    def task_id(self) -> str:
        return self._record.task_id

    @property
    def turn_id(self) -> str:
        return self._record.turn_id

    @property
    def record(self) -> TurnRecord:
        """The stored record, read fresh (another process may have changed the state)."""
        rec = self._manager.backend.load(self._record.task_key, self._record.turn_key)
        if rec is not None:
            self._record = rec
        return self._record if rec is not None else _gone(self._record)

    @property
    def state(self) -> str:
        return self.record.state

    def __repr__(self) -> str:
        rec = self.record
        return f"<Turn {rec.task_id!r}/{rec.turn_id!r} {rec.state} on {self._manager.backend.name}>"

    @property
    def environment(self) -> dict[str, str]:
        """The variables every process of the turn gets: CGTURN_TASK, CGTURN_TURN, CGTURN_SCOPE."""
        return self._manager.backend.env_for(self._record)

    def wait_empty(self, timeout: float) -> bool:
        """Wait until no process of the turn is left; True if that happened within `timeout` s.

        Event-driven on cgroup v2 (`populated 0` in cgroup.events): exact even when a grandchild
        still holds the stdout pipe that makes "has the command finished?" look false.
        """
        return self._manager.backend.wait_empty(self._record, timeout)

    def pids(self) -> list[int]:
        """Pids of the turn's live processes."""
        return sorted(pid for pid, _ in self._manager.backend.members(self._record))

    def spawn(self, argv, **popen_kwargs) -> subprocess.Popen:
        """Start `argv` inside the turn: it is in the turn before the program runs its first instruction.

        Accepts subprocess.Popen's keyword arguments (not `executable`). The environment gains
        CGTURN_TASK, CGTURN_TURN (encoded names) and CGTURN_SCOPE.

        Raises:
            NoSuchTurn: the turn is no longer running (completed or abandoned).
            FileNotFoundError / PermissionError: as Popen, for a missing or non-executable program.
        """
        # The backend checks that the turn is still running, at the moment that makes it race-free.
        return self._manager.backend.spawn(self._record, argv, popen_kwargs)

    def adopt(self, pid: int) -> None:
        """Move an existing process into the turn (its future children follow it)."""
        rec = self.record
        if rec.state != RUNNING:
            raise NoSuchTurn(f"turn {rec.turn_id!r} of task {rec.task_id!r} is {rec.state}; cannot adopt")
        self._manager.backend.adopt(rec, pid)

    def touch(self) -> None:
        """Report activity (resets the inactivity timeout of a supervised turn)."""
        self.last_activity = time.monotonic()
        if self._manager._listeners:
            self._manager._notify("turn_touched", self)

    def complete(self) -> bool:
        """Release ownership: what the turn left running survives every later (unforced) abandon.

        Returns True if this call completed the turn, False if it had already ended (e.g. abandoned).
        """
        won, rec = self._manager.backend.transition(self._record.task_key, self._record.turn_key,
                                                    {RUNNING}, COMPLETED, {"ended_at": time.time()})
        if rec is not None:
            self._record = rec
        if won:
            self._manager._notify("turn_ended", self._record.task_key, self._record.turn_key)
            self._manager._collect_if_finished(rec)
        return won

    def abandon(self, reason: str, grace: float = 2.0, force: bool = False) -> AbandonResult:
        """Kill everything the turn owns: SIGTERM, up to `grace` seconds, then SIGKILL.

        Idempotent: a second call, or a call on a completed turn, returns skipped=True and kills
        nothing, unless `force` (which also kills a completed turn's survivors). `grace=0` sends no
        SIGTERM.

        Raises:
            UnsafeOperation: the turn contains the calling process.
        """
        if grace < 0:
            raise ValueError("grace must be >= 0")
        result = self._manager._abandon(self._record.task_key, self._record.turn_key, reason, grace, force)
        if not result.skipped:
            # The turn's record is removed with it; keep what we know so .state/.reason stay true.
            self._record = dataclasses.replace(self._record, state=ABANDONED, reason=reason)
        return result


def _sentinel_setting(value: bool | None) -> bool:
    """The constructor keyword wins; else env CGTURN_SENTINEL ("0", "false", "no", "off" disable)."""
    if value is not None:
        return bool(value)
    return os.environ.get("CGTURN_SENTINEL", "1").strip().lower() not in ("0", "false", "no", "off")


def _valid(value: str) -> bool:
    try:
        ids.validate(value, "task")
        return True
    except ValueError:
        return False


def _process_id(rec: TurnRecord, pid: int, start: int) -> str:
    return f"{rec.turn_key}/{pid}:{start}"


def _gone(rec: TurnRecord) -> TurnRecord:
    """A removed turn reads as its last known state; a running one that vanished was abandoned."""
    if rec.state == RUNNING:
        return TurnRecord(**{**rec.to_json(), "state": ABANDONED})
    return rec
