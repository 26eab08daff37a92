"""Ownership: the TurnManager, what applications hold. It decides *what* a turn owns and its state;
backends do the owning.

The manager composes its parts and delegates: the state changes `Turn`, supervision and recovery use
are on its `TurnControl` (`manager._control`, cgturn.control), limits on its `Governance`
(cgturn.governance), listing in cgturn.listing, recovery in cgturn.recovery. What a turn is comes from
the directory (or registry row) it was resolved to, never from a record's claims: a record that does
not agree with its directory reads as a CORRUPT turn, which any abandon kills.
"""
# size: a little over the limit: the API applications call, each method with its documentation; the work is in the modules it composes.
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Iterable

from . import admission, compat, ids, killing, leases, listing, reasons
from .backends.base import Backend
from .control import TurnControl
from .errors import NoSuchTurn, UnsafeOperation
from .events import Listeners, ManagerAddOn
from .governance import Governance
from .host import choose_backend, default_state_dir, discover_host, sentinel_setting, wanted_backend
from .limits import Limits, Usage
from .model import NETWORKS, AbandonResult, TurnInfo
from .turn import Turn, make_turn

if TYPE_CHECKING:
    from .recovery import RecoveryAction


class TurnManager:
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
        ValueError: unknown backend name, an explicit root that is not a usable path, a state
            directory that is not an absolute path, a bad lease.
        CgroupUnavailable: backend="cgroup2" (or an explicit root) and cgroup v2 cannot be used.
        GuardUnavailable: the guard could not arm its trigger (the reason is in the message).
    """

    def __init__(self, root: str | None = None, backend: str | Backend | None = None,
                 state_dir: str | None = None, recover: bool = False, sentinel: bool | None = None,
                 guard: ManagerAddOn | None = None, lease: float | None = None) -> None:
        self.lease = leases.default_lease(lease)
        self.state_dir = state_dir or os.environ.get("CGTURN_STATE_DIR") or default_state_dir()
        if not os.path.isabs(self.state_dir):  # as a relative root is refused: it would follow the cwd
            raise ValueError(f"state directory {os.fspath(self.state_dir)!r} is not an absolute path")
        if isinstance(backend, Backend):
            self.backend = backend
        else:
            self.backend = choose_backend(discover_host(root), wanted_backend(backend), self.state_dir)
        self.sentinel_enabled = sentinel_setting(sentinel)
        self.events = Listeners()
        self._governance = Governance(self.backend, self.state_dir, self.backend.limiter)
        self._control = TurnControl(self.backend, self.state_dir, self.events, self._governance)
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

        Turns are left as they are: running turns stay guarded by the sentinel while it lives.
        """
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
        """Register an observer of this manager's turns.

        Args:
            listener: any object with some of the hooks of `cgturn.TurnListener` (turn_begun,
                turn_touched, turn_ended, lease_set, manager_closed). Hooks run synchronously in the
                thread that caused the event and must be cheap; an exception from one is logged
                (logger `cgturn`) and never reaches the caller. See docs/events.md.
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
            seal: no way out of the turn for its processes, root too: each spawn execs bubblewrap
                after joining the turn (its own PID namespace, the host read-only but for the paths it
                may write, five capabilities, a syscall filter; docs/security.md). Processes adopted or
                entered are not sealed.
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
        admission.admit(self.backend, admit_timeout)
        turn = make_turn(self, self._control, self._control.create_turn(task_id, turn_id, limits, seal, network))
        self.events.emit("turn_begun", turn)
        return turn

    async def abegin_turn(self, task_id: str, turn_id: str | None = None, *, limits: Limits | None = None,
                          admit_timeout: float | None = None, seal: bool = False, network: str = "host") -> Turn:
        """`begin_turn` for asyncio: admission waits with asyncio.sleep and the turn is made in a worker
        thread, so the loop never blocks. Raises as `begin_turn`."""
        import asyncio

        ids.validate(task_id, "task")
        await admission.aadmit(self.backend, admit_timeout)
        return await asyncio.to_thread(self.begin_turn, task_id, turn_id, limits=limits, seal=seal, network=network)

    def turn(self, task_id: str, turn_id: str) -> Turn:
        """The existing turn with these ids.

        Raises:
            NoSuchTurn: there is none.
            ValueError: an invalid id.
        """
        ids.validate(task_id, "task")
        ids.validate(turn_id, "turn")
        record = self.backend.load(ids.encode(task_id), ids.encode(turn_id))
        if record is None:
            raise NoSuchTurn(f"no turn {turn_id!r} in task {task_id!r}")
        return make_turn(self, self._control, record)

    def turns(self, task_id: str | None = None, *, detail: bool = False) -> list[TurnInfo]:
        """What `cgturn ps` shows: every existing turn (of one task), with its live processes.

        A turn whose record cannot be trusted is listed with state "corrupt". A completed turn this
        process owns whose survivors have all exited is removed here, not listed.

        Args:
            task_id: only this task's turns (a blank or invalid id lists nothing).
            detail: also read every turn's usage figures, pressure and frozen state (as `cgturn ps`).
        """
        if task_id is not None and not compat.valid_id(task_id):
            return []
        return listing.without_own_emptied(self._control, listing.list_turns(
            self.backend, self._governance.limiter, None if task_id is None else ids.encode(task_id), detail))

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
        if not compat.valid_id(task_id):
            result.skipped = True
            return result
        task_key = ids.encode(task_id)
        doomed = []
        for rec in self.backend.records(task_key):
            try:
                self._control.refuse_if_caller_inside(rec)
            except UnsafeOperation as err:
                result.refused.append({"turn": rec.turn_id, "error": str(err)})
            else:
                doomed.append(rec)
        abandon = self._control.abandon_turn
        for one in killing.side_by_side(lambda rec: abandon(rec.task_key, rec.turn_key, reason, grace, force=True),
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

    # --- compatibility with the registry cgturn replaces (cgturn.compat) --------------------------

    def snapshot_running_ids(self, task_id: str) -> frozenset[str]:
        """Opaque ids of the task's live processes (abandoned turns' excluded). Blank task: empty."""
        return compat.snapshot_running_ids(self.backend, task_id)

    def kill_started_since(self, baseline: Iterable[str], task_id: str) -> int:
        """Kill the task's processes whose ids are not in `baseline`; returns how many were killed.

        Processes of abandoned turns are killed whatever the baseline says, so a reap that was
        skipped never lets them slip into a newer turn's baseline. Blank task id: 0, nothing killed.
        """
        return compat.kill_started_since(self.backend, baseline, task_id)

    # --- recovery ---------------------------------------------------------------------------------

    def recover(self) -> list[RecoveryAction]:
        """Crash recovery: abandon running turns whose owner is gone, finish interrupted kills, kill
        turns without a trustworthy record, kill processes that left their turn, remove completed
        turns with nothing left.

        Returns:
            One `cgturn.RecoveryAction` per turn acted on (or that could not be handled).
        """
        from . import recovery  # loaded by the processes that recover, not by every listing

        return recovery.recover(self._control)

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

    # --- limits (cgturn.governance) ---------------------------------------------------------------

    def set_limits(self, limits: Limits) -> None:
        """Set the budget of the managed root: all its turns together (None fields unchanged).

        This is the budget that keeps the gateway and the host alive when no single turn is over its
        own limit. Set only on cgroups cgturn created, never on the caller's own.

        Raises:
            LimitsUnavailable: a limit cannot be enforced here (the registry enforces none).
            ValueError: a `memory_max` under one page (no turn could be made below it).
        """
        self._governance.set_limits(limits)

    def limits(self) -> Limits:
        """The managed root's own limits (empty when none)."""
        return self._governance.limits()

    def usage(self) -> Usage:
        """What all turns together used, as the managed root's counters say (empty on the registry)."""
        return self._governance.usage()

    def set_task_limits(self, task_id: str, limits: Limits) -> None:
        """Set the budget of a task: all its turns together (None fields unchanged).

        A task with limits keeps its cgroup between turns, until `end_task`.

        Raises:
            ValueError: an invalid task id, or a `memory_max` under one page (nothing made).
            LimitsUnavailable: a limit cannot be enforced here.
        """
        self._governance.set_task_limits(task_id, limits)

    def task_limits(self, task_id: str) -> Limits:
        """A task's own limits (empty when none). Raises NoSuchTurn when the task does not exist."""
        return self._governance.task_limits(task_id)

    def task_usage(self, task_id: str) -> Usage:
        """What all turns of a task used together. Raises NoSuchTurn when the task does not exist."""
        return self._governance.task_usage(task_id)

    def limits_report(self) -> dict[str, Any]:
        """Which limits this managed root can have, through which layout, and why any cannot.

        Returns:
            `{layout: "v2"|"v1-hybrid"|None, available: [...], problems: [...]}`.
        """
        return self._governance.report()
