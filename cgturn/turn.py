"""A Turn: one unit of work of a task, the handle its owner holds. Made by the TurnManager only.
"""
# size: a little over the limit, all of them the handle's public methods and their documentation; the work is in TurnControl and the backend.
from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import time
import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import leases, reasons
from .control import TurnControl
from .errors import NoSuchTurn
from .model import ABANDONED, COMPLETED, RUNNING, AbandonResult, Argv, TurnRecord

if TYPE_CHECKING:
    import asyncio

    from .limits import Limits, Usage

# Handed by the manager to the constructor: `Turn(...)` from anywhere else is refused.
_MADE_BY_MANAGER = object()


class Turn:
    """One turn of a task. Obtain it from `TurnManager.begin_turn` or `TurnManager.turn`.

    Its state changes go through the manager's `TurnControl` (`manager._control`); the turn never
    holds more of the manager than that, its `lease` default and the `manager` property.
    """

    def __init__(self, manager: Any, control: TurnControl, record: TurnRecord, _token: object = None):
        if _token is not _MADE_BY_MANAGER:
            raise TypeError("Turn objects are made by TurnManager.begin_turn() or TurnManager.turn()")
        self._manager = manager
        self._control = control
        self._backend = control.backend
        self._record = record
        self.last_activity = time.monotonic()

    @property
    def manager(self) -> Any:
        """The `cgturn.TurnManager` this turn belongs to.

        Typed `Any`: ownership's modules never import the manager module back, so that no import
        cycle exists at any level (docs/design.md); annotate it as `cgturn.TurnManager` where needed.
        """
        return self._manager

    @property
    def task_id(self) -> str:
        """The task's original id."""
        return self._record.task_id

    @property
    def turn_id(self) -> str:
        """The turn's original id."""
        return self._record.turn_id

    @property
    def started_at(self) -> float:
        """When the turn began (wall clock, seconds since the epoch)."""
        return self._record.started_at

    @property
    def names(self) -> tuple[str, str]:
        """(task_key, turn_key): the encoded directory names (what CGTURN_TASK/CGTURN_TURN hold)."""
        return self._record.task_key, self._record.turn_key

    @property
    def key(self) -> tuple[str, str]:
        """Deprecated alias of `names` ("key" is what `spawn(key=)` takes)."""
        warnings.warn("Turn.key is deprecated: use Turn.names", DeprecationWarning, stacklevel=2)
        return self.names

    @property
    def record(self) -> TurnRecord:
        """The stored record (`cgturn.TurnRecord`), read fresh: another process may have changed it.

        A turn whose directory is gone reads as its last known state (a running one as abandoned).
        A read that finds the turn ended lets go of what this process holds for it (a network
        namespace fd), so an owner without a Supervisor releases it as soon as it looks.
        """
        rec = self._backend.load(*self.names)
        if rec is None or rec.state != RUNNING:
            self._control.turn_ended_elsewhere(*self.names)
        if rec is None:
            return _gone(self._record)
        # Threads share this object (a watchdog reads while the worker completes): a read that
        # started before the turn ended must not replace the ended state it raced with.
        if not (rec.state == RUNNING and self._record.state in (COMPLETED, ABANDONED)):
            self._record = rec
        return rec

    @property
    def state(self) -> str:
        """"running", "completed", "abandoned" or "corrupt", read fresh from the record."""
        return self.record.state

    def __enter__(self) -> "Turn":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """`with mgr.begin_turn(...) as turn:` completes the turn when the block ends normally and
        abandons it (reason `error`, no grace) when it raises; a turn already ended is left alone."""
        if exc_type is None:
            self.complete()
        else:
            self.abandon(reasons.ERROR, grace=0)

    def __repr__(self) -> str:
        rec = self.record
        return f"<Turn {rec.task_id!r}/{rec.turn_id!r} {rec.state} on {self._backend.name}>"

    @property
    def environment(self) -> dict[str, str]:
        """The variables every process of the turn gets: CGTURN_TASK, CGTURN_TURN, CGTURN_SCOPE."""
        return self._backend.env_for(self._record)

    def wait_empty(self, timeout: float) -> bool:
        """Wait until no process of the turn is left; True if that happened within `timeout` s.

        Event-driven on cgroup v2 (`populated 0` in cgroup.events): exact even when a grandchild
        still holds the stdout pipe that makes "has the command finished?" look false.
        """
        return self._backend.wait_empty(self._record, timeout)

    async def await_empty(self, timeout: float) -> bool:
        """`wait_empty` for asyncio: the wait runs in a worker thread, never on the loop."""
        import asyncio

        return await asyncio.to_thread(self.wait_empty, timeout)

    def pids(self) -> list[int]:
        """Pids of the turn's live processes."""
        return sorted(pid for pid, _ in self._backend.members(self._record))

    def spawn(self, argv: Argv, *, key: str | None = None,
              **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside the turn: it is in the turn before the program runs its first instruction.

        `key`: one instance per key in the task. While the process spawned with this key (in any turn
        of the task, completed ones included) is alive, another spawn with it raises AlreadyRunning
        (`.pid`); atomic across processes (cgturn.keys). The key names that process, not its children.

        Accepts subprocess.Popen's keyword arguments except `executable`. `user`, `group` and
        `extra_groups` take effect after the process joined its turn (util-linux setpriv execs the
        target): `user` alone also gives the user's primary group and its groups from the group
        database; `group` alone clears supplementary groups. In a sealed turn, `writable` names the
        paths the process may write (default: its working directory; docs/security.md). The
        environment gains CGTURN_TASK, CGTURN_TURN (encoded names) and CGTURN_SCOPE.

        Raises:
            NoSuchTurn: the turn is no longer running (completed or abandoned).
            AlreadyRunning: a live process of the task holds `key`.
            ValueError: a refused keyword argument, an empty argv, a blank key, an unknown user or
                group (no process is started).
            IsolationUnavailable: setpriv is not installed.
            FileNotFoundError / PermissionError: as Popen, for a missing or non-executable program.
        """
        # The backend checks that the turn is still running, at the moment that makes it race-free.
        try:
            if key is not None:
                proc = self._control.spawn_keyed(self._record, argv, key, popen_kwargs)
            else:
                proc = self._backend.spawn(self._record, argv, popen_kwargs)
        except NoSuchTurn:
            self._control.turn_ended_elsewhere(*self.names)  # ended: what this process held for it goes
            raise
        proc.args = argv  # Popen's own rule: what the caller passed, not a shim's command line
        return proc

    async def create_subprocess_exec(self, program: str | os.PathLike[str], *args: str | os.PathLike[str],
                                     stdin: Any = None, stdout: Any = None, stderr: Any = None,
                                     limit: int = 2 ** 16, key: str | None = None, until_exit: bool = True,
                                     **kwds: Any) -> "asyncio.subprocess.Process":
        """`asyncio.create_subprocess_exec` in the turn: the process is in the turn before the program
        runs (as `spawn`, which starts it, on the loop thread as asyncio does: well under a millisecond).

        Its exit is watched through a pidfd on the loop, with no thread per child. `until_exit`: the
        pipes end when the command exits; what it wrote is delivered and `wait()`, `communicate()` and
        `async for line in proc.stdout` finish, even while a server it left running holds the pipes
        (whose later output is read and dropped). `until_exit=False` reads to end-of-file, as asyncio.
        `key`, the refused options and the errors are `spawn`'s; text mode and bufsize as asyncio's.
        """
        from .kernel.aioprocess import create_process

        return await create_process(functools.partial(self.spawn, key=key), [program, *args], shell=False,
                                    stdin=stdin, stdout=stdout, stderr=stderr, limit=limit,
                                    until_exit=until_exit, **kwds)

    async def create_subprocess_shell(self, cmd: str, stdin: Any = None, stdout: Any = None, stderr: Any = None,
                                      limit: int = 2 ** 16, key: str | None = None, until_exit: bool = True,
                                      **kwds: Any) -> "asyncio.subprocess.Process":
        """`asyncio.create_subprocess_shell` in the turn (`/bin/sh -c cmd`); as `create_subprocess_exec`."""
        from .kernel.aioprocess import create_process

        return await create_process(functools.partial(self.spawn, key=key), cmd, shell=True, stdin=stdin,
                                    stdout=stdout, stderr=stderr, limit=limit, until_exit=until_exit, **kwds)

    def adopt(self, pid: int) -> None:
        """Move an existing process into the turn (its future children follow it).

        Raises:
            NoSuchTurn: the turn is not running.
            NoSuchProcess: no process `pid`.
            UnsafeOperation: PID 1, a kernel thread, the caller (use `enter`), an ancestor of the
                caller, or a process of another task's or another manager's turn.
        """
        rec = self.record
        if rec.state != RUNNING:
            raise NoSuchTurn(f"turn {rec.turn_id!r} of task {rec.task_id!r} is {rec.state}; cannot adopt")
        self._control.adopt_into(rec, pid)

    def enter(self) -> None:
        """Make the calling process part of the turn: what it starts from now on belongs to it.

        On cgroup v2 the process moves into the turn's cgroup; on the registry it is recorded and
        its environment (os.environ) carries the turn. While inside, abandoning the turn is refused.
        `TurnManager.leave_turn()` takes it back to where it was before its first `enter`.
        """
        rec = self.record
        if rec.state != RUNNING:
            raise NoSuchTurn(f"turn {rec.turn_id!r} of task {rec.task_id!r} is {rec.state}; cannot enter")
        self._backend.enter(rec)

    def set_limits(self, limits: "Limits") -> None:
        """Change what the turn may use (fields left None stay as they are; "max" removes a limit).

        Lowering a memory limit below current use follows the kernel: it reclaims, then OOM-kills.
        On a hybrid host, a turn begun without limits first gets its v1 directories and its
        processes are moved in while the turn is frozen, so none forks past the move.

        Raises:
            LimitsUnavailable: a limit cannot be enforced here; nothing changed.
            NoSuchTurn: the turn is gone.
        """
        self._record = self._control.set_turn_limits(self.record, limits)

    def limits(self) -> "Limits":
        """The limits set on the turn itself (its task's and the root's apply too)."""
        from .limits import stored_limits

        return stored_limits(self.record.limits)

    def usage(self) -> "Usage":
        """What the turn used and which limits the kernel enforced on it: OOM kills, pids-limit hits,
        peak memory, CPU time and CPU throttled time. Readable while the turn's cgroup exists."""
        return self._backend.turn_usage(self.record)

    def freeze(self) -> list[int]:
        """Pause the turn: every process stops where it is (cgroup.freeze, 5.2+; SIGSTOP on the
        registry). Returns the pids reached. An abandon of a frozen turn still kills it.

        Raises UnsafeOperation when the turn holds the caller; NoSuchTurn when it has ended.
        """
        return self._control.freeze_turn(*self.names, by="user")

    def thaw(self) -> list[int]:
        """Resume a frozen turn (paused by a user or frozen by the pressure guard).

        Returns the pids reached. Raises UnsafeOperation when the turn holds the caller; NoSuchTurn
        when it has ended.
        """
        return self._control.thaw_turn(*self.names, by="user")

    def check_limits(self) -> list[dict[str, Any]]:
        """Audit the limits the kernel enforced on the turn since they were last audited.

        One `limit` audit record per increase of the turn's OOM-kill or pids-limit counters
        (`memory.events` oom_kill, `pids.events` max; `memory.oom_control` on v1), written by
        whichever process notices first: the counters audited so far live on the turn's record,
        raised under its lock. Nothing to do where the backend enforces no limits.

        Returns:
            The audit records this call wrote (empty when another process had written them).
        """
        return self._control.check_limits(*self.names)

    @property
    def frozen(self) -> bool:
        """True while the turn is frozen."""
        return self._backend.turn_frozen(self.record) or self.record.frozen_by is not None

    def touch(self) -> None:
        """Report activity (resets the inactivity timeout of a supervised turn)."""
        self.last_activity = time.monotonic()
        self._control.events.emit("turn_touched", self)

    def complete(self, keep_for: float | None = None) -> bool:
        """Release ownership: what the turn left running survives every later (unforced) abandon.

        Args:
            keep_for: seconds its survivors may live (a lease; reason `lease-expired` when it runs
                out, frozen or not). None: the manager's default lease (`TurnManager(lease=)`, env
                CGTURN_LEASE), which is none — until end_task — unless set; `math.inf`: no lease.

        Returns True if this call completed the turn, False if it had already ended (e.g. abandoned).
        Raises ValueError for a negative or non-numeric keep_for.
        """
        return self._complete(keep_for)[0]

    def _complete(self, keep_for: float | None = None, figures: bool = False) -> tuple[bool, "Usage | None"]:
        """`complete`, and with `figures` what the turn used, read in the same step (the supervisor's
        outcome): (won, usage or None)."""
        keep_for = leases.validate(keep_for)
        won, rec, usage = self._control.complete_turn(*self.names, self._manager.lease if keep_for is None else keep_for,
                                                      figures)
        if rec is not None:
            self._record = rec
        return won, usage

    def set_lease(self, seconds: float | None) -> None:
        """Let a completed turn's survivors live `seconds` from now (None or `math.inf`: until end_task).

        Raises NoSuchTurn when the turn is not completed (a running turn's processes are not
        survivors yet), ValueError for a negative or non-numeric value.
        """
        self._record = self._control.set_lease(*self.names, leases.validate(seconds, "seconds"))

    @property
    def expires_at(self) -> float | None:
        """When the survivors' lease expires (wall clock, time.time()), or None."""
        return self.record.expires_at

    def abandon(self, reason: str, grace: float = 2.0, force: bool = False) -> AbandonResult:
        """Kill everything the turn owns: SIGTERM, up to `grace` seconds, then SIGKILL.

        Idempotent: a second call, or a call on a completed turn, returns skipped=True and kills
        nothing, unless `force` (which also kills a completed turn's survivors). `grace=0` sends no
        SIGTERM. A turn whose record cannot be trusted is killed by any call.

        Raises:
            ValueError: a negative grace, or a reason that cannot be recorded (see cgturn.reasons).
            UnsafeOperation: the turn contains the calling process, one of its ancestors or PID 1.
        """
        if not grace >= 0:
            raise ValueError("grace must be >= 0")
        reasons.validate(reason)
        result = self._control.abandon_turn(*self.names, reason, grace, force)
        if not result.skipped:
            # The turn's record is removed with it; keep what we know so .state/.reason stay true.
            self._record = dataclasses.replace(self._record, state=ABANDONED, reason=reason)
        return result


    async def aabandon(self, reason: str, grace: float = 2.0, force: bool = False) -> AbandonResult:
        """`abandon` for asyncio: the kill (and its grace) runs in a worker thread, never on the loop.
        Raises as `abandon`."""
        import asyncio

        if not grace >= 0:
            raise ValueError("grace must be >= 0")
        reasons.validate(reason)  # bad input raises here, in the caller's frame
        return await asyncio.to_thread(self.abandon, reason, grace, force)


def make_turn(manager: Any, control: TurnControl, record: TurnRecord) -> Turn:
    """The manager's factory for Turn objects."""
    return Turn(manager, control, record, _MADE_BY_MANAGER)


def _gone(rec: TurnRecord) -> TurnRecord:
    """A removed turn reads as its last known state; a running one that vanished was abandoned."""
    if rec.state == RUNNING:
        return dataclasses.replace(rec, state=ABANDONED)
    return rec
