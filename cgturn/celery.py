"""Every Celery task in its own turn: `cgturn.celery.setup(app)` (a face; the extra `cgturn[celery]`).

The pool process that runs a task begins a turn for that attempt and *enters* it for the task's
duration (`task_prerun`), so whatever the task's code starts — `subprocess`, `os.system`, a library —
is in the turn; it leaves again before the turn ends (`task_postrun`), because an abandon refuses a
turn that holds its caller. Who ends the turn depends on how the task ended (docs/celery.md has the
table); in short: the pool process after leaving (return, raise, soft time limit, SystemExit), the
worker's main process (hard time limit, revoke, cold shutdown), each pool process's sentinel (the
pool process or the whole worker died).

Celery's own signals and task options only (celery/signals.py): nothing in the worker is patched, no
signal handler is installed. Celery's dispatcher swallows exceptions raised by receivers, so a turn
that cannot be begun is logged (logger `cgturn.celery`) and the task runs outside any turn. Celery
terminates a task (revoke, cold shutdown, hard time limit) with SIGTERM to the pool process, which
billiard turns into a SystemExit that unwinds the task through `task_postrun`, *before* the main
process announces why; so the pool process leaves the turn there and waits (VERDICT_WAIT) for the
main process to abandon it with the reason, abandoning it as a revoke itself if none comes.

Celery is imported through importlib (`_celery`): Celery ships no type information, and the package
is type-checked without the extra installed.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import cgturn
from cgturn import reasons

log = logging.getLogger("cgturn.celery")

# Abandon reasons this integration writes (besides `owner-died` from the sentinel, `oom`, `error`).
REVOKED = "celery-revoked"          # revoke(terminate=True): Celery SIGTERMed the pool process
TIME_LIMIT = "celery-time-limit"    # the hard time limit, or the soft one when the task did not catch it
WORKER_LOST = "celery-worker-lost"  # the pool process exited mid-task (SystemExit), or died unguarded
SHUTDOWN = "celery-shutdown"        # cold shutdown (or a connection loss) cancelled the running task

OPTION = "cgturn"  # the task option: @app.task(cgturn={...})
LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(cgturn.Limits))
KEYS = LIMIT_KEYS + ("task", "keep_for", "on_error", "seal", "network", "grace", "sentinel")
ON_ERROR = ("abandon", "complete")
POOLS = ("prefork", "solo")
# How long a pool process that got SIGTERM mid-task waits for the main process to abandon the turn
# with the reason it knows (it does so right after its Redis write), before abandoning it itself.
VERDICT_WAIT = 5.0
VERDICT_POLL = 0.005


def _celery(name: str) -> Any:
    """A Celery module, untyped (the one place Celery is imported)."""
    return importlib.import_module(name)


@dataclass(frozen=True)
class Plan:
    """What every attempt of a task (by name) runs with: the worker-wide defaults overlaid with its own
    `cgturn={...}` option, checked and made into `Limits` once, not per attempt."""

    task: Any  # the cgturn task id: None (the Celery id), a string, or a callable of args and kwargs
    limits: "cgturn.Limits"
    seal: bool
    network: str
    keep_for: float | None
    on_error: str
    grace: float


@dataclass
class Attempt:
    """The turn of the task attempt a pool process is running now."""

    celery_id: str
    turn: "cgturn.Turn"
    plan: Plan
    inside: bool = True


@dataclass
class Integration:
    """What `setup` connected for one app, and this process's part in it (role, manager, attempt)."""

    app: Any
    defaults: dict[str, Any]
    role: str | None = None          # "main" (prefork main process), "pool" (a pool process), "solo"
    manager: "cgturn.TurnManager | None" = None
    attempt: Attempt | None = None
    per_task: dict[str, Plan] = field(default_factory=dict)

    # --- settings ---------------------------------------------------------------------------------

    def plan(self, task: Any) -> Plan:
        """The task's Plan, made (and its option checked) at the first attempt of that task name."""
        plan = self.per_task.get(task.name)
        if plan is None:
            merged = dict(self.defaults)
            merged.update(check_settings(getattr(task, OPTION, None) or {}, f"task {task.name}"))
            plan = self.per_task[task.name] = Plan(
                merged.get("task"), cgturn.Limits(**{k: merged[k] for k in LIMIT_KEYS if k in merged}),
                bool(merged.get("seal", False)), merged.get("network", "host"), merged.get("keep_for"),
                merged.get("on_error", "abandon"), float(merged.get("grace", 1.0)))
        return plan

    def ensure_manager(self) -> "cgturn.TurnManager":
        if self.manager is None:
            self.manager = cgturn.TurnManager(sentinel=self.defaults.get("sentinel", True))
        return self.manager

    # --- where tasks run (pool process, or the solo worker) ---------------------------------------

    def begin(self, task: Any, celery_id: str, args: Any, kwargs: Any) -> None:
        plan = self.plan(task)
        mgr = self.ensure_manager()
        task_id = _task_id(plan.task, celery_id, args, kwargs)
        retries = getattr(task.request, "retries", 0) or 0
        base = f"{celery_id}#{retries}"
        for n in range(100):  # a turn per attempt: a redelivered attempt whose turn still exists gets .1, .2 ...
            try:
                turn = mgr.begin_turn(task_id, base if n == 0 else f"{base}.{n}", limits=plan.limits,
                                      seal=plan.seal, network=plan.network)
                break
            except cgturn.TurnExists:
                continue
        else:
            raise cgturn.TurnExists(f"task {celery_id}: 100 turns of attempt {retries} exist")
        try:
            turn.enter()
        except BaseException:
            turn.abandon(reasons.ERROR, grace=0)  # not left running, guarded, for a task outside it
            raise
        self.attempt = Attempt(celery_id, turn, plan)

    def end(self, state: str, retval: Any) -> None:
        attempt, self.attempt = self.attempt, None
        if attempt is None:
            return
        self.leave(attempt)
        plan, turn = attempt.plan, attempt.turn
        if state == "SUCCESS":
            turn.complete(keep_for=plan.keep_for)
            return
        # SystemExit/KeyboardInterrupt leave the trace through task_postrun's `finally`, in flight.
        in_flight = sys.exc_info()[1]
        if isinstance(in_flight, SystemExit) and _terminated(in_flight):
            self.await_verdict(turn)
            return
        reason = _reason_for(in_flight if isinstance(in_flight, (SystemExit, KeyboardInterrupt)) else retval, turn)
        if reason == reasons.ERROR and plan.on_error == "complete":
            turn.complete(keep_for=plan.keep_for)
            return
        turn.abandon(reason, grace=plan.grace)

    def leave(self, attempt: Attempt) -> None:
        if attempt.inside:
            self.ensure_manager().leave_turn()
            attempt.inside = False

    def await_verdict(self, turn: "cgturn.Turn") -> None:
        """Celery terminated the task (SIGTERM to this pool process: revoke, cold shutdown, hard time
        limit) before saying why; the main process, which knows, abandons the turn right after. Wait
        for that (bounded), then abandon it here as a revoke."""
        deadline = time.monotonic() + VERDICT_WAIT
        while turn.state == cgturn.RUNNING and time.monotonic() < deadline:
            time.sleep(VERDICT_POLL)
        turn.abandon(REVOKED, grace=0)  # skipped when the main process got there first

    # --- the prefork main process -----------------------------------------------------------------

    def abandon_attempts(self, celery_id: str, reason: str) -> list[str]:
        """Abandon the running turns of every attempt of `celery_id` (main process: none holds it)."""
        mgr = self.ensure_manager()
        prefix = f"{celery_id}#"
        done = []
        for info in mgr.turns():
            if info.state == cgturn.RUNNING and info.turn.startswith(prefix):
                try:
                    if not mgr.turn(info.task, info.turn).abandon(reason, grace=0).skipped:
                        done.append(info.turn)
                except cgturn.NoSuchTurn:
                    pass
        return done


def _task_id(chosen: Any, celery_id: str, args: Any, kwargs: Any) -> str:
    if chosen is None:
        return celery_id
    if callable(chosen):
        return str(chosen(*(args or ()), **(kwargs or {})))
    return str(chosen)


def _terminated(exc: SystemExit) -> bool:
    """True when this SystemExit is billiard's answer to a terminating signal (its handler raises
    `SystemExit(signum - 256)` so that finally blocks run), not the task's own sys.exit()."""
    fired = getattr(_celery("billiard.common"), "terminate_handler_fired", None)
    if fired is not None:
        return bool(fired())
    return isinstance(exc.code, int) and exc.code + 256 in (signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)


def _reason_for(retval: Any, turn: "cgturn.Turn") -> str:
    """Why a task attempt that did not succeed ends its turn: the soft time limit, an OOM kill of one
    of the turn's processes, else a plain error (which `on_error` may turn into a completion)."""
    exceptions = _celery("celery.exceptions")
    if isinstance(retval, exceptions.SoftTimeLimitExceeded):
        return TIME_LIMIT
    if isinstance(retval, (SystemExit, KeyboardInterrupt)):
        return WORKER_LOST  # the pool process exits after this: Celery reports WorkerLostError
    try:
        if turn.usage().oom_kills:
            return reasons.OOM
    except cgturn.CgturnError:
        pass
    return reasons.ERROR


def check_settings(values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` if every key is known and the limits are valid; ValueError naming `where` otherwise."""
    if not isinstance(values, dict):
        raise ValueError(f"cgturn.celery: {where}: the cgturn option must be a dict, got {type(values).__name__}")
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise ValueError(f"cgturn.celery: {where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(KEYS)})")
    if values.get("on_error", "abandon") not in ON_ERROR:
        raise ValueError(f"cgturn.celery: {where}: on_error must be one of {ON_ERROR}, got {values['on_error']!r}")
    cgturn.Limits(**{k: values[k] for k in LIMIT_KEYS if k in values})  # raises ValueError on a bad value
    return values


def current_turn() -> "cgturn.Turn | None":
    """The turn of the task attempt running in this process (inside a task), or None."""
    for integration in _INTEGRATIONS:
        if integration.attempt is not None:
            return integration.attempt.turn
    return None


_INTEGRATIONS: list[Integration] = []


def setup(app: Any, **defaults: Any) -> None:
    """Run every task of `app` in its own turn, in the workers of this app.

    Args:
        app: the Celery app.
        **defaults: worker-wide settings, under every task's own `cgturn={...}` option: the `Limits`
            fields (memory_max, pids_max, cpus, ...), `task` (the cgturn task id: a string, or a
            callable of the task's args and kwargs; default the Celery task id), `keep_for`
            (seconds a completed task's survivors may live; default until `end_task`), `on_error`
            ("abandon", the default, or "complete"), `seal`, `network`, `grace` (seconds between
            SIGTERM and SIGKILL when the pool process abandons; default 1.0), `sentinel` (default
            True: each pool process starts a sentinel).

    Raises:
        ValueError: an unknown key or an invalid value.
    """
    integration = Integration(app, check_settings(dict(defaults), "setup()"))
    _INTEGRATIONS.append(integration)
    _connect(integration)


def _connect(it: Integration) -> None:
    signals = _celery("celery.signals")

    def ours(task: Any) -> bool:
        return getattr(task, "app", None) is it.app

    def worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not it.app:
            return
        pool = _pool_name(sender.pool_cls)
        if pool not in POOLS:
            raise SystemExit(
                f"cgturn.celery: the {pool!r} pool runs tasks as threads or greenlets of one process, and a "
                f"cgroup holds whole processes: a task cannot get a turn of its own there. Use "
                f"--pool prefork or --pool solo (docs/celery.md).")
        it.role = "solo" if pool == "solo" else "main"
        # Leftovers of an earlier worker on this root whose sentinels died too, and expired leases.
        it.manager = cgturn.TurnManager(recover=True, sentinel=it.defaults.get("sentinel", True))
        if it.role == "solo" and it.manager.sentinel_enabled:
            cgturn.Supervisor.start_sentinel(it.manager)

    def worker_process_init(**_: Any) -> None:
        if it.role != "main":
            return
        it.role = "pool"
        it.manager = cgturn.TurnManager(sentinel=it.defaults.get("sentinel", True))  # its own, after fork
        if it.manager.sentinel_enabled:
            cgturn.Supervisor.start_sentinel(it.manager)  # before any turn is entered, so it is in none

    def task_prerun(sender: Any = None, task_id: str = "", args: Any = None, kwargs: Any = None, **_: Any) -> None:
        if it.role in ("pool", "solo") and ours(sender):
            try:
                it.begin(sender, task_id, args, kwargs)
            except Exception:
                # Celery's dispatcher would swallow a raise here: say it loudly instead.
                log.exception("cgturn.celery: task %s[%s] runs outside any turn: its turn could not be begun",
                              getattr(sender, "name", "?"), task_id)

    def task_postrun(sender: Any = None, retval: Any = None, state: str = "", **_: Any) -> None:
        if it.role in ("pool", "solo") and ours(sender):
            it.end(state, retval)

    def worker_process_shutdown(**_: Any) -> None:
        if it.role == "pool" and it.attempt is not None:  # SystemExit raised mid-task
            attempt, it.attempt = it.attempt, None
            it.leave(attempt)
            attempt.turn.abandon(WORKER_LOST, grace=0)

    def task_revoked(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
        if it.role == "main" and terminated and ours(sender):
            it.abandon_attempts(request.id, REVOKED)

    def task_failure(sender: Any = None, task_id: str = "", exception: Any = None, **_: Any) -> None:
        if it.role != "main" or not ours(sender):
            return
        exceptions = _celery("billiard.exceptions")
        if isinstance(exception, exceptions.TimeLimitExceeded):
            it.abandon_attempts(task_id, TIME_LIMIT)  # sent before the pool process is killed
        elif isinstance(exception, exceptions.WorkerLostError):
            it.abandon_attempts(task_id, WORKER_LOST)  # the sentinel normally got there first: owner-died

    def task_retry(sender: Any = None, request: Any = None, einfo: Any = None, **_: Any) -> None:
        # In the main process a retry without einfo is Celery cancelling the task (cold shutdown, or a
        # lost broker connection with worker_cancel_long_running_tasks_on_connection_loss).
        if it.role == "main" and einfo is None and ours(sender):
            it.abandon_attempts(request.id, SHUTDOWN)

    def worker_shutdown(sender: Any = None, **_: Any) -> None:
        if it.manager is not None and it.role in ("main", "solo"):
            it.manager.close()

    for receiver in (worker_init, worker_process_init, task_prerun, task_postrun, worker_process_shutdown,
                     task_revoked, task_failure, task_retry, worker_shutdown):
        getattr(signals, receiver.__name__).connect(receiver, weak=False)


def _pool_name(pool_cls: Any) -> str:
    """'prefork', 'solo', 'threads', ... for a worker's pool (a name, an alias or a class)."""
    concurrency = _celery("celery.concurrency")
    cls = concurrency.get_implementation(pool_cls) if isinstance(pool_cls, str) else pool_cls
    module = getattr(cls, "__module__", "")
    return module.rpartition(".")[2] if module.startswith("celery.concurrency.") else getattr(cls, "__name__", str(cls))
