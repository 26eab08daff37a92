"""Turn supervision for gateways: run one turn's worker under an inactivity timeout and a deadline.

Three things can end a supervised turn, and exactly one of them decides:

- the worker finishes: the supervisor clears the run's ownership markers (cgturn.runs) and completes
  the turn in the same locked step, so a stop that lands a moment later finds nothing to kill;
- the watchdog (a daemon thread, cgturn.watchdog, so it fires while the event loop is blocked) sees
  the inactivity timeout or the hard deadline pass (cgturn.clocks), or notices that someone else
  abandoned the turn (cgturn.outside);
- an explicit stop: `/stop`, `/new`, a client that disconnected (`stop(reason)`, `abandon_disconnected`).

Every abandon cause goes through `Supervisor.stop`, the one abandon path: decide once under a lock
(completion checked first, so a completed worker's result stands), fire `on_interrupt` once, ask the
optional `is_still_current()` check (False skips the kill, an exception kills: fail open), then
`Turn.abandon(reason)`, whose first-transition-wins state change is atomic across processes (the
sentinel, the CLI). The interrupt fires even when the kill is skipped.

The sentinel (cgturn.sentinel) holds the same deadlines outside the process, for an owner that is
stopped, wedged or dead.

This module keeps the decision and the ways of running a worker together, as they share one lock and
one outcome (over the house limit on purpose, a third of it docstrings: the race rules
between completion, the watchdog, a stop and an outside abandon are read in one file). What it only uses lives apart: the
outcome (cgturn.outcome), the run markers (cgturn.runs), the watcher of outside abandons
(cgturn.outside), the wake-up plumbing (cgturn.wakeups), the clocks (cgturn.clocks).
"""
# size: over the limit on purpose, a third of it docstrings: the race rules between completion, the watchdog, a stop and an outside abandon share one lock and one outcome and are read in one file.
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .limits import Usage
    from .turn import Turn

from . import clocks, reasons, sentinel, watchdog
from .errors import LockTimeout, NoSuchTurn, SentinelUnavailable
from .limits import cpu_time_problem
from .logfields import turn_fields
from .model import ABANDONED, COMPLETED, RUNNING, AbandonResult
from .outcome import Outcome
from .outside import EXTERNAL_WAIT, UNKNOWN_KILLER_WAIT, OutsideAbandon
from .runs import Run, aabandon_disconnected, abandon_disconnected, areap_disconnected, reap_disconnected
from .wakeups import Wake, dispatcher

# Re-exported: the package root and earlier callers import them from here.
__all__ = ["Supervisor", "Outcome", "Run", "abandon_disconnected", "aabandon_disconnected", "reap_disconnected",
           "areap_disconnected", "EXTERNAL_WAIT", "UNKNOWN_KILLER_WAIT"]

log = logging.getLogger("cgturn.supervisor")

# Kept under these names for callers of earlier versions; the vocabulary lives in cgturn.reasons.
REASON_TIMEOUT = reasons.TIMEOUT
REASON_DEADLINE = reasons.DEADLINE
REASON_STOP = reasons.STOP
REASON_NEW_SESSION = reasons.NEW_SESSION
REASON_DISCONNECT = reasons.DISCONNECT
REASON_ERROR = reasons.ERROR
REASON_CANCELLED = reasons.CANCELLED
# How often the watchdog polls an `activity` callable (a touch has its own push path).
ACTIVITY_POLL = 0.1
# How long run() waits for a cancelled coroutine worker to unwind after an abandon.
CANCEL_WAIT = 1.0
# How often the watchdog reads a supervised turn's state, to notice an abandon by another process
# (`cgturn stop`, the sentinel, the guard) while the worker runs on: one record read (a getxattr on
# cgroup v2) per turn and second.
STATE_POLL = 1.0


class Supervisor:
    """Runs one turn's worker with an inactivity timeout, an optional deadline and stop causes.

    Args:
        turn: the running Turn to supervise (from TurnManager.begin_turn).
        timeout: inactivity timeout in seconds (reason `timeout`): activity is `turn.touch()` and, if
            given, the `activity` callable; with neither, wall-clock time since start. None: no timeout.
        deadline: hard limit in seconds since start (reason `deadline`), whatever the activity.
        grace: seconds between SIGTERM and SIGKILL when the turn is abandoned.
        on_interrupt: called once, with the reason, when the turn is being abandoned (before the
            kill; also when the kill is skipped). Runs in the thread that decided (often the
            watchdog thread): make it thread-safe, e.g. `loop.call_soon_threadsafe(...)`.
        activity: callable returning the monotonic time of the last activity (or None).
        is_still_current: guard asked before a kill; False (a newer turn claimed the task) skips the
            kill, an exception kills anyway (fail open).
        run: API-server markers to set while the worker runs and clear the instant it finishes.
        use_sentinel: also register the deadlines with the manager's sentinel (when enabled there).
        cpu_time: abandon the turn once its cgroup's CPU use passes this many seconds (reason
            `cpu-time`, with `grace`); the sentinel watches it, so it needs one.
        oom_kills_turn: abandon the whole turn at its first OOM kill (reason `oom`, no grace), for
            layouts without a group OOM kill (v1); watched by the sentinel too.

    Raises:
        ValueError: timeout or deadline not > 0, grace < 0, cpu_time not in (0, MAX_CPU_TIME].
        SentinelUnavailable: (at start) cpu_time or oom_kills_turn with the sentinel switched off.
        NoSuchTurn: the turn is not running.
    """

    def __init__(self, turn: Turn, *, timeout: float | None = None, deadline: float | None = None, grace: float = 2.0,
                 on_interrupt: Callable[[str], Any] | None = None, activity: Callable[[], float | None] | None = None,
                 is_still_current: Callable[[], bool] | None = None, run: Run | None = None,
                 use_sentinel: bool = True, cpu_time: float | None = None, oom_kills_turn: bool = False) -> None:
        for name, value in (("timeout", timeout), ("deadline", deadline)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if cpu_time is not None and (problem := cpu_time_problem(cpu_time)):
            raise ValueError(f"cpu_time {problem}, got {cpu_time!r}")
        self.cpu_time, self.oom_kills_turn = cpu_time, oom_kills_turn
        if not grace >= 0:
            raise ValueError(f"grace must be >= 0, got {grace!r}")
        state = turn.state
        if state != RUNNING:
            raise NoSuchTurn(f"turn {turn.turn_id!r} of task {turn.task_id!r} is {state}: only a running "
                             "turn can be supervised")
        self.turn = turn
        self.names: tuple[str, str] = turn.names  # the encoded names the manager addresses it by
        self._control = turn.manager._control
        self.timeout, self.deadline, self.grace = timeout, deadline, grace
        self.on_interrupt, self.activity, self.is_still_current, self.run_markers = (
            on_interrupt, activity, is_still_current, run)
        self._use_sentinel = use_sentinel
        self._lock = threading.Lock()
        self._started_at: float | None = None
        self._worker_begun = False
        self._completed = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._reason: str | None = None          # set once: the abandon decision
        self._abandon_result: AbandonResult | None = None
        self._usage: Usage | None = None          # read as the worker finished
        self._interrupted = False
        self._settled = threading.Event()        # the outcome is final (kill finished, or completed)
        self._fired: Callable[[], object] = lambda: None  # wakes an async run() from another thread
        self._sentinel: sentinel.SentinelClient | None = None
        self._frozen = clocks.FrozenTime()  # frozen time the clocks leave out (cgturn.clocks)
        self._next_poll = 0.0
        # An abandon by someone else: noticed by the watchdog or a listener event (cgturn.outside).
        self._external = False
        self._outside = OutsideAbandon(self._control, self.names, turn.started_at, turn.task_id, turn.turn_id)

    def __repr__(self) -> str:
        state = "completed" if self._completed else (f"abandoned ({self._reason})" if self._reason else "running")
        return f"<Supervisor {self.turn.task_id!r}/{self.turn.turn_id!r} {state}>"

    # --- running the worker ---------------------------------------------------------------------

    async def run(self, worker: Any, *args: Any) -> Outcome:
        """Run the worker on the event loop until it finishes or the turn is abandoned.

        Args:
            worker: a coroutine function (or an awaitable), or a blocking callable, run in the loop's
                default executor.
            *args: its arguments.

        Returns:
            The Outcome. A worker exception abandons the turn (reason `error`) and is in
            `Outcome.error`.

        Raises:
            asyncio.CancelledError: run() was cancelled; the turn is abandoned (reason `cancelled`) first.
            SentinelUnavailable: the manager's sentinel could not start (the worker never ran).
            RuntimeError: this supervisor already ran a worker.
        """
        import asyncio  # here, not at the top: a blocking run (`cgturn run`) never pays for asyncio
        import inspect

        loop = asyncio.get_running_loop()
        wake = Wake(loop)
        self._fired = wake.set_threadsafe
        self._begin_worker()
        if self._reason is not None:  # stopped before it started: the worker never runs
            if inspect.iscoroutine(worker):
                worker.close()
            await asyncio.to_thread(self._settle)
            return self._finish_run()
        if inspect.iscoroutinefunction(worker) or inspect.isawaitable(worker):
            coro = worker if inspect.isawaitable(worker) else worker(*args)
            task = asyncio.ensure_future(self._wrap_async(coro))
        else:
            task = asyncio.ensure_future(loop.run_in_executor(None, self._wrap_blocking, worker, args))
        task.add_done_callback(wake.set)
        try:
            # The poll loop: worker completion is checked before the abandon flag, so when both land
            # in the same window the completed result stands.
            while not task.done() and not self._settled.is_set():
                await wake.wait()
        except asyncio.CancelledError:
            await asyncio.to_thread(self.stop, REASON_CANCELLED)
            task.cancel()
            raise
        if not task.done():
            task.cancel()  # abandoned: stop the coroutine too (a blocking callable cannot be stopped)
            await asyncio.wait({task}, timeout=CANCEL_WAIT)
        if not self._settled.is_set() or self._external:
            await asyncio.to_thread(self._settle)  # a kill under way, or another process's figures
        return self._finish_run()

    def run_blocking(self, worker: Callable[..., Any], *args: Any) -> Outcome:
        """Run the worker in the calling thread (plain threads, no event loop) until it returns.

        The watchdog thread abandons the turn on time while it runs; `on_interrupt` is how the worker
        learns to return early.

        Args:
            worker: a blocking callable.
            *args: its arguments.

        Returns:
            The Outcome, once the worker has returned and the outcome is final.

        Raises:
            SentinelUnavailable: the manager's sentinel could not start (the worker never ran).
            RuntimeError: this supervisor already ran a worker.
        """
        self._begin_worker()
        if self._reason is None:
            self._wrap_blocking(worker, args)
        self._settle()
        return self._finish_run()

    async def _wrap_async(self, coro):
        import asyncio

        try:
            result = await coro
        except asyncio.CancelledError:
            if self._reason is None:
                self._worker_done(None, asyncio.CancelledError())
            raise
        except BaseException as err:  # noqa: BLE001 - recorded on the outcome
            self._worker_done(None, err)
            return None
        self._worker_done(result, None)
        return result

    def _wrap_blocking(self, worker: Callable, args: tuple):
        try:
            result = worker(*args)
        except BaseException as err:  # noqa: BLE001 - recorded on the outcome
            self._worker_done(None, err)
            return None
        self._worker_done(result, None)
        return result

    def start(self) -> None:
        """Start the clocks (the watchdog, and the sentinel's copy of the deadlines) now, before the worker.

        For a caller that starts the turn's first process itself, so that the deadlines hold from that
        moment even if the caller is stopped before it calls `run`. A second call does nothing.

        Raises:
            SentinelUnavailable: the manager's sentinel could not start.
        """
        if self._started_at is None:
            self._start()

    def _begin_worker(self) -> None:
        if self._worker_begun:
            raise RuntimeError("a Supervisor runs one worker once")
        self._worker_begun = True
        if self._started_at is None:
            self._start()

    def _start(self) -> None:
        # Attached before the clocks start: the first attach waits for the sentinel to report ready
        # (an interpreter start), which must not count as the worker's time.
        client = sentinel.attach(self.turn.manager) if self._use_sentinel else None
        watched = self.cpu_time is not None or self.oom_kills_turn
        if watched and client is None:
            raise SentinelUnavailable("a CPU-time limit and oom_kills_turn are enforced by the sentinel, "
                                      "which is switched off (use_sentinel=False, CGTURN_SENTINEL=0)")
        # Before anything is set up here: a failure leaves the turn unsupervised, as it was.
        if watched and client is not None and not client.watch(self.turn, self.cpu_time, self.oom_kills_turn,
                                                               self.grace):
            raise SentinelUnavailable("the sentinel could not be told the turn's CPU-time or OOM watch")
        self._started_at = time.monotonic()
        # Inactivity counts from the later of the turn's last touch and now (wall clock since start
        # when nothing touches it); the sentinel gets the same base.
        self.turn.last_activity = max(self.turn.last_activity, self._started_at)
        if self.run_markers is not None:
            self.run_markers.mark(self.turn.task_id, self.turn, self)
        dispatcher(self.turn.manager).watch(self)
        if client is not None:
            self._sentinel = client
            client.track(self.turn, deadline=self._deadline_at(), inactivity=self.timeout, grace=self.grace)
        if self.timeout is not None or self.deadline is not None:
            self._frozen = clocks.FrozenTime(self._frozen_state()[0])
        self._next_poll = self._started_at + STATE_POLL
        watchdog.shared().schedule(self, self._next_due(self._started_at))

    def _settle(self) -> None:
        """Wait until the outcome is final; for an abandon by another process, until its figures
        are known (its note), while that process is still killing."""
        self._settled.wait()
        if self._external:
            self._abandon_result = self._outside.figures(self._reason)

    def _finish_run(self) -> Outcome:
        dispatcher(self.turn.manager).forget(self)
        if self.run_markers is not None:
            self.run_markers.clear()
        if self._sentinel is not None and not self._completed and self.turn.state == RUNNING:
            # is_still_current() skipped the kill: the turn stays running, tracked for owner death only.
            self._sentinel.track(self.turn, grace=0.0)
        if self._completed:
            return Outcome(completed=True, result=self._result, usage=self._usage)
        usage = self._abandon_result.usage if self._abandon_result is not None else None
        killed_by = self._abandon_result.killed_by if self._abandon_result is not None else None
        return Outcome(completed=False, reason=self._reason, abandon=self._abandon_result,
                       error=self._error, interrupted=self._interrupted, usage=usage or self._usage,
                       external=self._external, killed_by=killed_by if killed_by is not None else self._outside.killed_by)

    # --- the decision ---------------------------------------------------------------------------

    def _worker_done(self, result: Any, error: BaseException | None) -> None:
        """The worker finished: clear markers and complete the turn in one locked step. If someone
        else abandoned the turn first, that outcome stands (with its reason, killer and kill)."""
        with self._lock:
            if self._reason is not None:
                return  # abandoned first: this result is discarded
            if error is None:
                if self.run_markers is not None:
                    self.run_markers.clear()
                # Read by the completion itself, before it may remove the turn, figures and all.
                try:
                    won, self._usage = self.turn._complete(figures=True)
                except LockTimeout as busy:
                    # Completion never proceeds without the turn's lock; a supervised turn is never
                    # left running unsupervised either: it is abandoned (the kill needs no lock).
                    log.warning("cannot complete turn %r of task %r after its worker returned, so it is "
                                "abandoned: %s", self.turn.turn_id, self.turn.task_id, busy,
                                extra=turn_fields(self.turn.task_id, self.turn.turn_id, REASON_ERROR))
                    error = busy
            if error is not None:
                self._error, won = error, False
            rec = None if won else self._control.record(*self.names)
            if error is None and not won and rec is not None:
                self._usage = self._control.turn_usage_quietly(rec)  # ended by another hand
            if won or (error is None and rec is not None and rec.state == COMPLETED):
                # Completed (by this call, or by another hand: Turn.complete): it stands.
                self._completed, self._result = True, result
                self._settled.set()
                return
        noticed = self._outside.after_worker(rec)  # gone: waits a moment for the killer's note
        if noticed is not None:
            self._abandoned_elsewhere(*noticed)
        else:
            self.stop(REASON_ERROR, interrupt=False)  # the worker raised: the turn is still ours to abandon

    def _abandoned_elsewhere(self, reason: str, rec=None, result: AbandonResult | None = None) -> None:
        """Someone else abandoned the turn: that decision stands; fire `on_interrupt` with its reason.

        `rec` is the turn's record as last read (its killer), `result` the kill's figures when this
        process did the kill (a listener event); otherwise they come from the killer's note.
        """
        with self._lock:
            if self._completed or self._reason is not None:
                if result is not None and self._abandon_result is None:
                    # The figures of a kill already noticed, or of one by another thread that won the
                    # mark over this supervisor's own abandon (_lost_mark), which may not know it yet.
                    self._outside.resolve(result)
                return
            self._reason, self._external = reason, True
            self._outside.learn(rec, result)
            if result is not None:
                self._abandon_result = result
        try:
            self._interrupt(reason)
        finally:
            self._settled.set()
            self._fired()

    @staticmethod
    def start_sentinel(manager: Any, wait: bool = True) -> int | None:
        """Start the sentinel of `manager` now, before any turn exists; its pid, or None when the
        manager's sentinel is switched off (`TurnManager(sentinel=False)`, env CGTURN_SENTINEL=0).

        A Supervisor starts it on first use; a process that must not run a turn's first command
        unguarded (`cgturn run`: a SIGKILLed owner's turn is abandoned at once) starts it first, and
        every turn the manager begins afterwards is tracked from its first moment. `wait=False`
        returns while the sentinel starts (what it is told meanwhile waits in its channel; a
        sentinel that finds its owner dead at its start abandons the turns it was told of): the
        next Supervisor's start waits for it to report ready, or raises as below.

        Raises:
            SentinelUnavailable: the sentinel did not report ready.
            GuardUnavailable: the sentinel could not arm the manager's pressure guard.
        """
        client = sentinel.attach(manager, wait=wait)
        return None if client is None else client.pid

    def stop(self, reason: str = REASON_STOP, grace: float | None = None, interrupt: bool = True) -> AbandonResult:
        """Abandon the supervised turn: the one abandon path for every cause. Thread-safe, idempotent.

        Args:
            reason: recorded on the turn (`stop`, `new-session`, `disconnect`, `timeout`, ...).
            grace: overrides the supervisor's grace for this kill.
            interrupt: fire `on_interrupt` (the worker is still running).

        Returns:
            The AbandonResult of the one kill. After completion: skipped=True, nothing killed, no
            interrupt. A second call returns the first call's result once it is done.

        Raises:
            UnsafeOperation: the turn contains the calling process.
        """
        with self._lock:
            if self._completed:
                return AbandonResult(skipped=True, reason=reason)
            first = self._reason is None
            if first:
                self._reason = reason
        if not first:
            self._settled.wait()
            return self._abandon_result or AbandonResult(skipped=True, reason=self._reason or reason)
        return self._carry_out(reason, grace, interrupt)

    def _carry_out(self, reason: str, grace: float | None, interrupt: bool) -> AbandonResult:
        """The decided abandon: the interrupt (unless fired already), then the one kill."""
        try:
            if interrupt:
                self._interrupt(reason)
            self._abandon_result = self._kill(reason, self.grace if grace is None else grace)
            return self._abandon_result
        except BaseException as err:
            self._error = self._error or err
            self._abandon_result = AbandonResult(skipped=True, reason=reason)
            raise
        finally:
            self._settled.set()
            self._fired()

    def new_session(self, grace: float | None = None) -> AbandonResult:
        """`/new`: abandon the turn with reason `new-session`.

        Args:
            grace: overrides the supervisor's grace for this kill.

        Returns:
            As `stop`.
        """
        return self.stop(REASON_NEW_SESSION, grace)

    def disconnect(self, grace: float | None = None) -> AbandonResult:
        """The client went away: abandon the turn with reason `disconnect`.

        Args:
            grace: overrides the supervisor's grace for this kill.

        Returns:
            As `stop`.
        """
        return self.stop(REASON_DISCONNECT, grace)

    async def astop(self, reason: str = REASON_STOP, grace: float | None = None) -> AbandonResult:
        """`stop` from a coroutine, without blocking the event loop for the grace period.

        Args:
            reason: as `stop`.
            grace: as `stop`.

        Returns:
            As `stop`.

        Raises:
            UnsafeOperation: the turn contains the calling process.
        """
        import asyncio

        return await asyncio.to_thread(self.stop, reason, grace)

    def _interrupt(self, reason: str) -> None:
        self._interrupted = True
        if self.on_interrupt is None:
            return
        try:
            self.on_interrupt(reason)
        except Exception:  # noqa: BLE001 - the kill must happen whatever the callback does
            log.exception("on_interrupt failed for turn %r", self.turn.turn_id, extra=self._log_fields(reason))

    def _kill(self, reason: str, grace: float) -> AbandonResult:
        if self.is_still_current is not None:
            try:
                current = bool(self.is_still_current())
            except Exception:  # noqa: BLE001 - fail open: a broken guard must not leak processes
                log.exception("is_still_current() raised; killing turn %r anyway", self.turn.turn_id,
                              extra=self._log_fields(reason))
                current = True
            if not current:
                log.info("turn %r superseded by a newer turn: kill skipped (%s)", self.turn.turn_id, reason,
                         extra=self._log_fields(reason))
                return AbandonResult(skipped=True, reason=reason)
        result = self.turn.abandon(reason, grace=grace)
        return self._lost_mark(reason, result) if result.skipped else result

    def _lost_mark(self, reason: str, skipped: AbandonResult) -> AbandonResult:
        """This abandon found the turn no longer running: another hand marked it first (the sentinel's
        copy of the same clock, `cgturn stop`, the guard) and may still be killing. Unless the turn
        completed, the outcome is that kill's, waited for as any abandon by someone else is
        (cgturn.outside): a skipped kill returned now would leave the turn's processes alive after it."""
        try:
            rec = self._control.record(*self.names)
        except Exception:  # noqa: BLE001 - an unreadable record: the skipped kill is all there is to tell
            log.exception("cannot read the state of turn %r", self.turn.turn_id, extra=self._log_fields(reason))
            return skipped
        if rec is not None and rec.state != ABANDONED:
            return skipped  # completed by another hand: its survivors stand
        with self._lock:
            self._external = True
        self._outside.learn(rec, None)
        return self._outside.figures(rec.reason if rec is not None and rec.reason else reason)

    def _log_fields(self, reason: str | None = None) -> dict[str, Any]:
        return turn_fields(self.turn.task_id, self.turn.turn_id, reason)

    # --- the watchdog (cgturn.watchdog: one thread for the process) -------------------------------

    def _deadline_at(self) -> float | None:
        if self.deadline is None or self._started_at is None:  # no deadline, or not started yet
            return None
        return self._started_at + self.deadline

    def _last_activity(self) -> float:
        last = max(self._started_at or 0.0, self.turn.last_activity)  # asked once started
        if self.activity is not None:
            try:
                seen = self.activity()
            except Exception:  # noqa: BLE001 - a broken activity source counts as no activity
                log.exception("activity() raised")
                seen = None
            if seen is not None and seen > last:
                self.turn.touch()  # forwards it to the sentinel (rate-limited)
                last = seen
        return last

    def _due(self) -> tuple[float, str]:
        """The nearest of the deadline and the inactivity timeout, with its reason (inf: neither)."""
        due = clocks.due(self._deadline_at(), self.timeout, self._last_activity(), self._frozen)
        return due if due is not None else (float("inf"), "")

    def _frozen_state(self) -> tuple[float, bool]:
        """(seconds the turn has spent frozen so far, frozen now), from its record."""
        try:
            rec = self._control.record(*self.names)
        except Exception:  # noqa: BLE001 - an unreadable record must not keep a turn alive
            log.exception("cannot read the frozen time of turn %r", self.turn.turn_id, extra=self._log_fields())
            return self._frozen.seen, False
        return clocks.frozen_state(rec, time.time(), self._frozen.seen)

    def _due_after_look(self, now: float) -> tuple[float, str]:
        """The due time once the frozen time since the last look is left out (the clocks stop while
        the turn is frozen). The record is read here only, when a due time has arrived."""
        due = clocks.due_after_look(self._deadline_at(), self.timeout, self._last_activity(), self._frozen,
                                    self._frozen_state(), now)
        return due if due is not None else (float("inf"), "")

    def _next_due(self, now: float) -> float:
        due = min(self._due()[0], self._next_poll)
        return min(due, now + ACTIVITY_POLL) if self.activity is not None else due

    @property
    def finished(self) -> bool:
        """The outcome is decided (completed or abandoned): the watchdog has nothing left to do."""
        return self._completed or self._reason is not None

    def on_due(self, now: float) -> float | None:
        """The watchdog's call: notice an abandon by another process, fire a due timeout or deadline.

        The decision and `on_interrupt` happen here, in the watchdog thread; the kill runs in the
        watchdog's kill pool (cgturn.watchdog).

        Args:
            now: the monotonic time the watchdog woke for.

        Returns:
            The next monotonic time to look, or None when the outcome is decided.
        """
        if self._reason is not None or self._completed:
            return None
        if now >= self._next_poll:
            self._next_poll = now + STATE_POLL
            self._poll_state()
            if self._reason is not None:
                return None
        due, reason = self._due()
        if not (reason and due <= now):
            return self._next_due(now)
        due, reason = self._due_after_look(now)  # the clocks stop while the turn is frozen
        if due > now:
            return min(due, self._next_poll)  # frozen meanwhile: pushed back, at least a recheck away
        with self._lock:
            if self._completed or self._reason is not None:
                return None
            self._reason = reason
        self._interrupt(reason)
        watchdog.shared().submit(self._carry_out, reason, None, False)
        return None

    def _poll_state(self) -> None:
        """Notice an abandon by another process: the turn's record says abandoned, or it is gone."""
        if self._reason is not None or self._completed:
            return
        noticed = self._outside.poll()
        if noticed is not None:
            self._abandoned_elsewhere(*noticed)
