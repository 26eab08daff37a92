"""Ownership: the TurnManager decides *what* a turn owns and its state; backends do the owning.

Abandon is one path for every cause: mark the turn abandoned (the first of complete/abandon wins,
atomically across processes), then the kill sequence (cgturn.killing). What a turn is comes from the
directory (or registry row) it was resolved to, never from a record's claims: a record that does not
agree with its directory reads as a CORRUPT turn, which any abandon kills.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

from . import admission, ids, leases, listing, reasons
from .backends.base import Backend
from .errors import AccessDenied, NoSuchProcess, NoSuchTurn, UnsafeOperation
from .host import choose_backend, discover_host, wanted_backend
from .kernel import procfs
from .limits import Limits, Usage
from .model import (ABANDONED, COMPLETED, CORRUPT, NETWORKS, RUNNING, AbandonResult, TurnEnded, TurnInfo,
                    TurnRecord)
from .control import TurnControl
from .governance import GovernanceMixin
from .turn import Turn, make_turn

if TYPE_CHECKING:
    from .guard import PressureGuard
    from .recovery import RecoveryAction

log = logging.getLogger("cgturn")

# The turn states an unforced abandon may start from: a corrupt turn is killed like a running one.
_ABANDONABLE = frozenset({RUNNING, CORRUPT})
_ABANDONABLE_FORCED = frozenset({RUNNING, COMPLETED, ABANDONED, CORRUPT})


def default_state_dir() -> str:
    """`/run/cgturn` for root, `$XDG_RUNTIME_DIR/cgturn` (or a per-user /tmp dir) otherwise."""
    if os.geteuid() == 0:
        return "/run/cgturn"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "cgturn") if runtime else f"/tmp/cgturn-{os.geteuid()}"


class Listeners:
    """Observers of a manager's turns (the sentinel client, a gateway's hooks): see
    `cgturn.TurnListener` and docs/events.md for the hooks. Each is called synchronously and must be
    cheap. A failing observer is logged and never breaks ownership.
    """

    def __init__(self) -> None:
        self._items: list[object] = []

    def add(self, listener: object) -> None:
        self._items.append(listener)

    def __iter__(self) -> Iterator[object]:
        return iter(tuple(self._items))

    def emit(self, event: str, *args: Any) -> None:
        for listener in tuple(self._items):
            hook = getattr(listener, event, None)
            if hook is not None:
                try:
                    hook(*args)
                except Exception:  # noqa: BLE001 - an observer must never break ownership
                    log.exception("cgturn listener %r failed on %s", listener, event)


class TurnManager(GovernanceMixin):
    """Owns the turns of one managed root (cgroup v2) or one registry (fallback).

    Args:
        root: managed root on the cgroup2 mount (env CGTURN_ROOT; default `<own cgroup>/cgturn`).
        backend: "auto", "cgroup2" or "registry" (env CGTURN_BACKEND), or a Backend object.
            "auto" uses cgroup2 when usable.
        state_dir: registry database, metadata fallback, audit log (env CGTURN_STATE_DIR).
        recover: apply the recovery policy now (`recover()`): for a gateway that will own turns.
        sentinel: allow a supervisor to start the out-of-process sentinel for this manager
            (env CGTURN_SENTINEL=0 turns it off; default on). See docs/supervision.md.
        guard: a `cgturn.PressureGuard`: armed now, in the sentinel (see docs/guard.md).
        lease: default seconds a completed turn's survivors may live, for `Turn.complete()`
            without `keep_for` (env CGTURN_LEASE when not given; default None: until end_task).

    Constructing a manager creates nothing; the first turn creates the managed root.

    Raises:
        ValueError: unknown backend name, an explicit root that is not a usable path, a bad lease.
        CgroupUnavailable: backend="cgroup2" (or an explicit root) and cgroup v2 cannot be used.
        GuardUnavailable: the guard could not arm its trigger (the reason is in the message).
    """

    def __init__(self, root: str | None = None, backend: str | Backend | None = None,
                 state_dir: str | None = None, recover: bool = False, sentinel: bool | None = None,
                 guard: PressureGuard | None = None, lease: float | None = None) -> None:
        self.lease = leases.default_lease(lease)
        self.state_dir = state_dir or os.environ.get("CGTURN_STATE_DIR") or default_state_dir()
        if isinstance(backend, Backend):
            self.backend = backend
        else:
            self.backend = choose_backend(discover_host(root), wanted_backend(backend), self.state_dir)
        self.sentinel_enabled = _sentinel_setting(sentinel)
        self.events = Listeners()
        self._control = TurnControl(self)
        self.guard = guard
        if recover:
            self.recover()
        if guard is not None:
            guard.attach(self)  # a callback, so ownership never imports the supervision layer

    def __repr__(self) -> str:
        return f"<TurnManager backend={self.backend.name} at {self.backend.location}>"

    def __enter__(self) -> "TurnManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "TurnManager":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """`close` for asyncio (it waits up to 2 s for an idle sentinel to exit): in a worker thread."""
        import asyncio

        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop observers (the sentinel channel closes), release the backend's threads and files.
        Turns are left as they are: running turns stay guarded by the sentinel while it lives."""
        self.events.emit("manager_closed")
        self.backend.close()

    @property
    def backend_name(self) -> str:
        """"cgroup2" or "registry"."""
        return self.backend.name

    @property
    def root(self) -> str | None:
        """The managed root (cgroup v2), or None on the registry."""
        return self.backend.scope if self.backend.name == "cgroup2" else None

    def add_listener(self, listener: object) -> None:
        """Register an observer of this manager's turns: any object with some of the hooks of
        `cgturn.TurnListener` (turn_begun, turn_touched, turn_ended, lease_set, manager_closed).

        Hooks run synchronously in the thread that caused the event and must be cheap; an exception
        from one is logged (logger `cgturn`) and never reaches the caller. See docs/events.md.
        """
        self.events.add(listener)

    @property
    def listeners(self) -> tuple[object, ...]:
        """The registered observers, in the order they were added."""
        return tuple(self.events)

    # --- turns ------------------------------------------------------------------------------------

    def begin_turn(self, task_id: str, turn_id: str | None = None, *, limits: Limits | None = None,
                   admit_timeout: float | None = None, seal: bool = False, network: str = "host") -> Turn:
        """Start a turn owned by the calling process.

        Args:
            limits: what the turn may use (cgturn.Limits); its processes are inside them before
                their target program runs. On cgroup v2 an OOM kills the whole turn unless
                `oom_group=False`.
            admit_timeout: while the managed root's pressure guard reports pressure, wait up to this
                many seconds for it to clear (None: start at once, as with no guard armed).
            seal: no way out of the turn for its processes, root too: each spawn gets private mount
                and cgroup namespaces (the cgroup namespace rooted at the turn) with every cgroup mount
                read-only, and loses CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SYS_MODULE before its target
                runs. Processes adopted or entered are not sealed.
            network: "host" (the host's network) or "none": one network namespace shared by every
                process of the turn, with only loopback, up; spawns enter it before the target runs.

        Raises:
            Overloaded: the guard still reported pressure after `admit_timeout` s; nothing was created.
            ValueError: blank or invalid task/turn id.
            TurnExists: the turn id is taken (running, or completed with survivors).
            LimitsUnavailable: a limit cannot be enforced here; nothing was created.
            IsolationUnavailable: the kernel refused a namespace, a helper binary is missing, or the
                backend cannot isolate turns; nothing was created.
        """
        ids.validate(task_id, "task")
        turn_id = ids.new_turn_id() if turn_id is None else ids.validate(turn_id, "turn")
        if network not in NETWORKS:
            raise ValueError(f"network must be one of {', '.join(NETWORKS)}: {network!r}")
        if admit_timeout is not None:
            deadline = admission.deadline(admit_timeout)
            while (pause := admission.wait_time(self.backend, deadline)) is not None:
                time.sleep(pause)
        me = os.getpid()
        record = TurnRecord(task_id=task_id, turn_id=turn_id, task_key=ids.encode(task_id),
                            turn_key=ids.encode(turn_id), state=RUNNING, owner_pid=me,
                            owner_start=procfs.own_start_time(), started_at=time.time(),
                            sealed=bool(seal), network=network)
        self.backend.create_turn(record, limits)
        turn = make_turn(self, record)
        self.events.emit("turn_begun", turn)
        return turn

    async def abegin_turn(self, task_id: str, turn_id: str | None = None, *, limits: Limits | None = None,
                          admit_timeout: float | None = None, seal: bool = False, network: str = "host") -> Turn:
        """`begin_turn` for asyncio: admission waits with asyncio.sleep and the turn is made in a worker
        thread, so the loop never blocks. Raises as `begin_turn`."""
        import asyncio

        ids.validate(task_id, "task")
        if admit_timeout is not None:
            deadline = admission.deadline(admit_timeout)
            while (pause := admission.wait_time(self.backend, deadline)) is not None:  # one getxattr
                await asyncio.sleep(pause)
        return await asyncio.to_thread(self.begin_turn, task_id, turn_id, limits=limits, seal=seal, network=network)

    def turn(self, task_id: str, turn_id: str) -> Turn:
        """The existing turn with these ids. Raises NoSuchTurn, or ValueError for invalid ids."""
        ids.validate(task_id, "task")
        ids.validate(turn_id, "turn")
        record = self.backend.load(ids.encode(task_id), ids.encode(turn_id))
        if record is None:
            raise NoSuchTurn(f"no turn {turn_id!r} in task {task_id!r}")
        return make_turn(self, record)

    def turns(self, task_id: str | None = None, *, detail: bool = False) -> list[TurnInfo]:
        """What `cgturn ps` shows: every existing turn (of one task), with its live processes.
        A turn whose record cannot be trusted is listed with state "corrupt". `detail` also reads
        every turn's usage figures, pressure and frozen state (as `cgturn ps` does)."""
        if task_id is not None and not _valid(task_id):
            return []
        return listing.list_turns(self.backend, None if task_id is None else ids.encode(task_id), detail)

    async def aturns(self, task_id: str | None = None, *, detail: bool = False) -> list[TurnInfo]:
        """`turns` for asyncio (a listing of thousands of turns takes tens of ms): in a worker thread."""
        import asyncio

        return await asyncio.to_thread(self.turns, task_id, detail=detail)

    def create_root(self) -> bool:
        """Create the managed root now (the first turn would); True if this call created it."""
        return self.backend.ensure_root()

    def remove_root(self) -> bool:
        """Remove the managed root if no turn is left in it; True when it is gone."""
        return self.backend.remove_root()

    def leave_turn(self) -> None:
        """Take the calling process back to where it was before its first `Turn.enter()`."""
        self.backend.leave()

    def end_task(self, task_id: str, reason: str = reasons.END_TASK, grace: float = 2.0) -> AbandonResult:
        """Kill everything the task owns, completed turns' survivors included, and remove its turns.

        Every turn gets SIGTERM, then up to `grace` seconds (the turns' graces run side by side), then
        SIGKILL; `grace=0` sends no SIGTERM. A turn that must not be killed (it holds the caller, one
        of its ancestors or PID 1) is left alone and listed in `refused`; every other turn is ended.

        Returns:
            An AbandonResult: `killed` (every turn's pids), `signals`, `duration_ms` (the whole call),
            `refused` ([{"turn": id, "error": why}]), `killed_by` (this process). A blank task id
            matches nothing.

        Raises:
            ValueError: a negative grace or a reason that cannot be recorded.
        """
        reasons.validate(reason)
        if not grace >= 0:
            raise ValueError(f"grace must be >= 0, got {grace!r}")
        started = time.monotonic()
        result = AbandonResult(reason=reason, killed_by=os.getpid())
        if not _valid(task_id):
            result.skipped = True
            return result
        task_key = ids.encode(task_id)
        doomed = []
        for rec in self.backend.records(task_key):
            try:
                self._refuse_if_caller_inside(rec)
            except UnsafeOperation as err:
                result.refused.append({"turn": rec.turn_id, "error": str(err)})
            else:
                doomed.append(rec)
        for one in _map(lambda rec: self.abandon_turn(rec.task_key, rec.turn_key, reason, grace, force=True),
                        doomed, parallel=grace > 0):
            result.killed.extend(one.killed)
            result.signals = sorted(set(result.signals) | set(one.signals))
        if not result.refused:
            self.backend.remove_task(task_key, force=True)  # its budget, if any, ends with it
        result.killed.sort()
        result.duration_ms = (time.monotonic() - started) * 1000
        return result

    async def aend_task(self, task_id: str, reason: str = reasons.END_TASK, grace: float = 2.0) -> AbandonResult:
        """`end_task` for asyncio: runs in a worker thread, so the grace never blocks the loop."""
        import asyncio

        return await asyncio.to_thread(self.end_task, task_id, reason, grace)

    # --- compatibility with the registry cgturn replaces ----------------------------------------

    def snapshot_running_ids(self, task_id: str) -> frozenset[str]:
        """Opaque ids of the task's live processes (abandoned turns' excluded). Blank task: empty."""
        if not _valid(task_id):
            return frozenset()
        out: set[str] = set()
        for rec in self.backend.records(ids.encode(task_id)):
            if rec.state != ABANDONED:
                out.update(_process_id(rec, pid, start) for pid, start in self.backend.members(rec))
        return frozenset(out)

    def kill_started_since(self, baseline: Iterable[str], task_id: str) -> int:
        """Kill the task's processes whose ids are not in `baseline`; returns how many were killed.

        Processes of abandoned turns are killed whatever the baseline says, so a reap that was
        skipped never lets them slip into a newer turn's baseline. Blank task id: 0, nothing killed.
        """
        if not _valid(task_id):
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
                rec, lambda pid, start: _process_id(rec, pid, start) not in keep))  # called right here
        return count

    # --- recovery ---------------------------------------------------------------------------------

    def recover(self) -> list[RecoveryAction]:
        """Crash recovery: abandon running turns whose owner is gone, finish interrupted kills, kill
        turns without a trustworthy record, kill processes that left their turn, remove completed
        turns with nothing left. Returns `cgturn.RecoveryAction`s."""
        from . import recovery  # loaded by the processes that recover, not by every listing

        return recovery.recover(self)

    reap = recover  # the name `cgturn reap` and earlier versions use

    async def arecover(self) -> list[RecoveryAction]:
        """`recover` for asyncio (it may kill turns, each with its grace): in a worker thread."""
        import asyncio

        return await asyncio.to_thread(self.recover)

    def strays(self) -> list[tuple[str, int]]:
        """(cgroup, pid) of processes in the managed root or a task directory, in no turn: they
        escaped a turn by moving themselves, which a turn process running as the manager's user can
        (see docs/design.md#security). `cgturn ps` warns about them and recovery kills them."""
        return self.backend.strays()

    def owner_alive(self, rec: TurnRecord) -> bool:
        """True if the turn's owner process (pid + start time, so no reused pid) still runs.

        Raises AccessDenied when the owner cannot be looked at: never read that as "dead".
        """
        return procfs.is_alive(rec.owner_pid or 0, rec.owner_start if rec.owner_start is not None else -1)

    def turn_state(self, task_key: str, turn_key: str) -> str | None:
        """The state of the turn at these encoded names; None when it does not exist."""
        rec = self.backend.load(task_key, turn_key)
        return None if rec is None else rec.state

    def running_turns_of_caller(self) -> list[tuple[str, str]]:
        """(task id, turn id) of the running turns the calling process began."""
        me = os.getpid()
        start = procfs.own_start_time()
        return [(rec.task_id, rec.turn_id) for rec in self.backend.records()
                if rec.state == RUNNING and rec.owner_pid == me and rec.owner_start == start]

    # --- the state changes, shared by Turn, the supervision layer and the CLI ----------------------

    def complete_turn(self, task_key: str, turn_key: str, keep_for: float | None = None,
                      figures: bool = False) -> tuple[bool, TurnRecord | None, Usage | None]:
        """Move a running turn to completed, its survivors leased for `keep_for` seconds (None: until
        end_task); (won, record after, usage). Removes it if nothing is left. With `figures`, what the
        turn used is read once it is completed, before any removal (else usage is None)."""
        now = time.time()
        won, rec = self.backend.transition(task_key, turn_key, {RUNNING}, COMPLETED,
                                           {"ended_at": now, "expires_at": leases.expires_at(now, keep_for)})
        usage = None
        if won and rec is not None:
            self.events.emit("turn_ended", TurnEnded(rec.task_id, rec.turn_id, task_key, turn_key, COMPLETED))
            if rec.expires_at is not None:
                self.events.emit("lease_set", rec)
            if figures:
                usage = self.turn_usage_quietly(rec)
            # Nothing left: audit its limit counters (they go with its cgroup; `rec` is the record
            # just written under the lock), then remove it. The rmdir is the atomic check: a spawn
            # that slipped in meanwhile (it finds the turn completed and kills its shim) is waited
            # for, and whatever stays keeps the turn, completed.
            if self.backend.wait_empty(rec, 0):
                self._audit_limits_quietly(task_key, turn_key, usage, rec)
                if self.backend.remove(rec):
                    self.backend.remove_task(task_key)
        return won, rec, usage

    def turn_usage_quietly(self, rec: TurnRecord) -> Usage | None:
        """What the turn at `rec` used; None when it cannot be read (figures never decide an outcome)."""
        try:
            return self.backend.turn_usage(rec)
        except Exception:  # noqa: BLE001 - figures never decide an outcome
            log.debug("cannot read the usage of turn %r", rec.turn_id, exc_info=True)
            return None

    def abandon_turn(self, task_key: str, turn_key: str, reason: str, grace: float,
                     force: bool = False, when: Callable[[TurnRecord], bool] | None = None) -> AbandonResult:
        """Mark the turn at this directory abandoned (first transition wins) and kill it. `when(record)`,
        if given, must also hold under the turn's lock (the guard: "still frozen by me"; a lease: "still
        run out")."""
        rec = self.backend.load(task_key, turn_key)
        if rec is None:
            return AbandonResult(skipped=True, reason=reason)
        self._refuse_if_caller_inside(rec)
        me = os.getpid()
        won, rec = self.backend.transition(
            task_key, turn_key, _ABANDONABLE_FORCED if force else _ABANDONABLE, ABANDONED,
            {"reason": reason, "ended_at": time.time(), "killer_pid": me, "killer_start": procfs.own_start_time()},
            when=when)
        if not won or rec is None:
            return AbandonResult(skipped=True, reason=(rec.reason if rec else None) or reason)
        from . import killing

        result = killing.kill_turn(self.backend, rec, reason, grace, self.state_dir,
                                   before_removal=self._audit_limits_quietly)
        self._ended(rec, result)
        return result

    def finish_kill(self, rec: TurnRecord) -> AbandonResult:
        """Kill a turn already marked abandoned whose killer died midway."""
        from . import killing

        result = killing.kill_turn(self.backend, rec, rec.reason or reasons.UNKNOWN, 0.0, self.state_dir)
        self._ended(rec, result)
        return result

    def _ended(self, rec: TurnRecord, result: AbandonResult) -> None:
        """An abandon this process carried out is done: leave the owner its note when the owner is
        another live process (cgturn.outcomes), then tell this process's listeners."""
        result.killed_by = os.getpid()
        event = TurnEnded(rec.task_id, rec.turn_id, rec.task_key, rec.turn_key, ABANDONED, result.reason,
                          list(result.killed), result.killed_by, list(result.signals), result.duration_ms,
                          result.usage)
        if rec.owner_pid is not None and rec.owner_pid != result.killed_by and _owner_may_read(rec):
            from . import outcomes

            outcomes.write_note(self.state_dir, {
                "task_key": rec.task_key, "turn_key": rec.turn_key, "task": rec.task_id, "turn": rec.turn_id,
                "started_at": rec.started_at, "owner_pid": rec.owner_pid, "owner_start": rec.owner_start,
                "reason": result.reason, "killed_by": result.killed_by, "killed": result.killed,
                "signals": result.signals, "duration_ms": round(result.duration_ms, 3), "time": time.time()})
        self.events.emit("turn_ended", event)

    def take_abandon_note(self, task_key: str, turn_key: str, started_at: float) -> dict[str, Any] | None:
        """Take (read and delete) the note another process left for the owner of the turn at these
        names that began at `started_at` (see cgturn.outcomes); None when there is none (yet)."""
        from . import outcomes

        return outcomes.take_note(self.state_dir, task_key, turn_key, started_at)

    def adopt_into(self, rec: TurnRecord, pid: int) -> None:
        """Move process `pid` into the turn `rec`, refusing what must never be moved (Turn.adopt)."""
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

    def _refuse_if_caller_inside(self, rec: TurnRecord, verb: str = "kill") -> None:
        if self.backend.contains_caller(rec):
            raise UnsafeOperation(f"refusing to {verb} turn {rec.turn_id!r} of task {rec.task_id!r}: it contains "
                                  f"the calling process, one of its ancestors or PID 1 (caller {os.getpid()})")


def _sentinel_setting(value: bool | None) -> bool:
    """The constructor keyword wins; else env CGTURN_SENTINEL ("0", "false", "no", "off" disable)."""
    if value is not None:
        return bool(value)
    return os.environ.get("CGTURN_SENTINEL", "1").strip().lower() not in ("0", "false", "no", "off")


# Turns of one task whose graces run side by side in end_task (a thread each, while it runs).
END_TASK_THREADS = 8


_T = TypeVar("_T")
_R = TypeVar("_R")


def _map(fn: Callable[[_T], _R], items: list[_T], parallel: bool) -> list[_R]:
    """[fn(item) for item in items], in up to END_TASK_THREADS threads when `parallel` and there are
    several (each waits out its own grace: waiting side by side bounds the whole call by one grace)."""
    if not parallel or len(items) < 2:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(END_TASK_THREADS, len(items)), thread_name_prefix="cgturn-end") as pool:
        return list(pool.map(fn, items))


def _owner_may_read(rec: TurnRecord) -> bool:
    """True when the turn's owner (pid + start time) still runs, or cannot be looked at."""
    return procfs.alive_or_unknown(rec.owner_pid, rec.owner_start)


def _valid(value: str) -> bool:
    """A usable id (CONTRACT: a blank or invalid id matches nothing where processes are looked up)."""
    try:
        ids.validate(value, "task")
        return True
    except ValueError:
        return False


def _process_id(rec: TurnRecord, pid: int, start: int) -> str:
    return f"{rec.turn_key}/{pid}:{start}"
