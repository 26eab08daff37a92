"""The pressure guard (supervision): freeze or abandon the heaviest running turn when the watched
cgroup stalls, before the gateway starves; thaw when the pressure has stayed away.

It is driven by a kernel PSI trigger (poll(POLLPRI) on the watched pressure file, cgturn.kernel.psi),
not by sampling in the gateway: `TurnManager(guard=PressureGuard(...))` runs it in the sentinel process,
and `cgturn guard` runs it in the foreground for a unit of its own, so it acts precisely when the
gateway itself cannot run. Between triggers it wakes only to refresh the per-turn CPU (or io) figures
that "heaviest in the window" is measured against (once per window) and, while it holds frozen turns,
to watch the pressure fall (twice per window).

One guard per managed root: the first to arm it owns it (cgturn.backends.guard_state: xattr
`user.cgturn.guard` on the managed root, claimed under the root's flock, owner = pid + start time);
its state (`over`, `since`) is what admission in any process reads. See docs/guard.md.

Why one module of ~430 lines: arming, choosing the heaviest turn, and the hold times (thaw after,
abandon after) are one state machine driven by one trigger; the PSI files are kernel/psi.py and
the claim on the managed root backends/guard_state.py.
"""
from __future__ import annotations

import logging
import math
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any

from . import reasons
from .backends import guard_state
from .errors import GuardUnavailable, NoSuchTurn, UnsafeOperation
from .kernel import cgroupfiles, discovery, observe, procfs, psi
from .logfields import turn_fields
from .model import RUNNING

if TYPE_CHECKING:
    from .manager import TurnManager

log = logging.getLogger("cgturn.guard")

ACTIONS = ("freeze", "abandon")
WATCHES = ("owner", "root", "host")
# The nice level the guard's thread asks for (never lowers anything; needs CAP_SYS_NICE to go below 0).
GUARD_NICE = -10
# How often a guard that found another live guard on the root tries to take over (its owner may die).
STANDBY_RETRY = 2.0
BY = "guard"


class PressureGuard:
    """What the guard watches and does; validated at construction (ValueError names the rule).

    Args:
        resource: "memory", "cpu" or "io": the PSI file watched and what "heaviest" means (memory in
            use; CPU time in the last window; bytes read+written in the last window).
        trigger: `some|full <stall us> <window us>` (kernel PSI trigger syntax).
        watch: "owner" (the cgroup of the process that owns the manager: the gateway), "root" (the
            managed root: all turns together), "host" (/proc/pressure), or a cgroup directory.
        action: "freeze" the heaviest running turn, or "abandon" it (reason `pressure`).
        thaw_after: thaw guard-frozen turns once pressure stayed below the threshold this long (s).
        abandon_after: abandon a turn guard-frozen longer than this (s).
    """

    def __init__(self, resource: str = "memory", trigger: str = "some 150000 1000000", watch: str = "owner",
                 action: str = "freeze", thaw_after: float = 5.0, abandon_after: float = 60.0):
        if resource not in psi.RESOURCES:
            raise ValueError(f"unknown resource {resource!r} (expected one of {', '.join(psi.RESOURCES)})")
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r} (expected one of {', '.join(ACTIONS)})")
        if not isinstance(watch, str) or not (watch in WATCHES or os.path.isabs(watch)):
            raise ValueError(f"watch must be one of {', '.join(WATCHES)} or an absolute cgroup path, not {watch!r}")
        for name, value in (("thaw_after", thaw_after), ("abandon_after", abandon_after)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
        self.parsed = psi.parse_trigger(trigger)
        self.resource, self.trigger, self.watch, self.action = resource, str(self.parsed), watch, action
        self.thaw_after, self.abandon_after = float(thaw_after), float(abandon_after)

    def __repr__(self) -> str:
        return (f"PressureGuard(resource={self.resource!r}, trigger={self.trigger!r}, watch={self.watch!r}, "
                f"action={self.action!r}, thaw_after={self.thaw_after:g}, abandon_after={self.abandon_after:g})")

    def check(self) -> None:
        """Raise ValueError when this process may not arm the trigger here (CAP_SYS_RESOURCE rule)."""
        psi.check_privilege(self.parsed, psi.privileged(), psi.kernel_version())

    def to_json(self) -> dict[str, Any]:
        """The guard's settings as JSON (what the sentinel is started with)."""
        return {"resource": self.resource, "trigger": self.trigger, "watch": self.watch, "action": self.action,
                "thaw_after": self.thaw_after, "abandon_after": self.abandon_after}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PressureGuard":
        """The guard `to_json` describes."""
        return cls(**{k: data[k] for k in ("resource", "trigger", "watch", "action", "thaw_after", "abandon_after")})

    def runner(self, manager: TurnManager, owner_pid: int | None = None) -> "GuardRunner":
        """A GuardRunner of this guard for `manager` (not armed yet: `arm()`, then `run()`)."""
        return GuardRunner(self, manager, owner_pid)

    def attach(self, manager: TurnManager) -> None:
        """Start `manager`'s sentinel with this guard armed in it (what `TurnManager(guard=...)` calls).

        Raises:
            ValueError: the trigger is not allowed for this process, or the sentinel is switched off.
            GuardUnavailable: the sentinel could not arm the trigger (the reason is in the message).
        """
        self.check()
        if not manager.sentinel_enabled:
            raise ValueError("the pressure guard runs in the sentinel, which is switched off "
                             "(sentinel=False / CGTURN_SENTINEL=0): run `cgturn guard` instead")
        from . import sentinel

        sentinel.attach(manager)


def resolve_watch(watch: str, resource: str, owner_cgroup: str | None, managed_root: str | None) -> str:
    """The pressure file a guard watches.

    Args:
        watch: "owner", "root", "host" or a cgroup directory.
        owner_cgroup: the owner's cgroup directory on the cgroup2 mount (None: the root cgroup, or not
            visible).
        managed_root: the managed root directory (None: the registry fallback).

    An owner in the root cgroup (a host whose processes all sit in the v2 root), or in no visible
    cgroup, watches the host: /proc/pressure gives the same system-wide figures. Raises GuardUnavailable for "root" without one.
    """
    if watch == "host":
        return psi.pressure_file(resource, None)
    if watch == "root":
        if managed_root is None:
            raise GuardUnavailable("watch='root' needs the cgroup2 backend (the registry has no managed root)")
        return psi.pressure_file(resource, managed_root)
    if watch == "owner":
        return psi.pressure_file(resource, owner_cgroup)
    return psi.pressure_file(resource, watch)


def heaviest(now: dict, before: dict, cumulative: bool):
    """The key with the largest load: `now[key]` itself (memory) or its growth since `before[key]`
    (CPU time, io bytes; a turn not seen before counts all it has). None when `now` is empty."""
    best, best_load = None, -1.0
    for key, value in now.items():
        load = value - before.get(key, 0) if cumulative else value
        if load > best_load:
            best, best_load = key, load
    return best


class GuardRunner:
    """One armed guard: the loop that waits for the trigger and acts on the manager's turns.

    Args:
        guard: the configuration.
        manager: a TurnManager of the managed root (in the sentinel: the sentinel's own).
        owner_pid: the process whose cgroup `watch="owner"` means (default: this one).
    """

    def __init__(self, guard: PressureGuard, manager, owner_pid: int | None = None):
        self.guard = guard
        self.manager = manager
        self.owner_pid = owner_pid or os.getpid()
        self.trigger: psi.ArmedTrigger | None = None
        self.path: str | None = None
        self.state: dict[str, Any] = {}  # this guard's recorded state, once it claimed the root
        self.owned_by: dict | None = None   # the other live guard's state, while in standby
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._baseline: dict = {}
        self._cumulative = guard.resource != "memory"

    # --- arming ------------------------------------------------------------------------------------

    def arm(self, standby: bool = False) -> bool:
        """Claim the managed root and arm the trigger. True when armed; False when another live guard
        owns the root and `standby` (then `run` retries until it can take over).

        Raises:
            ValueError: the trigger is not allowed for this process.
            GuardUnavailable: no PSI file, no permission, the kernel refused, or (without `standby`)
                another live guard owns the managed root. The failure is recorded on the root, so
                `cgturn doctor` shows it.
        """
        self.guard.check()
        self.path = self._watched_file()
        me = os.getpid()
        self.state = {"owner_pid": me, "owner_start": procfs.start_time(me), "armed": True, "over": False,
                      "since": time.time(), "file": self.path, "frozen": [], **self.guard.to_json()}
        other = guard_state.claim(self.manager.backend, self.state)
        if other is not None:
            self.owned_by = other
            if standby:
                return False
            raise GuardUnavailable(f"a pressure guard is already armed on this managed root by process "
                                   f"{other['owner_pid']} (watching {other.get('file')})")
        self.owned_by = None
        try:
            self.trigger = psi.ArmedTrigger(self.path, self.guard.parsed)
        except OSError as err:
            problem = f"cannot arm the PSI trigger '{self.guard.trigger}' on {self.path}: {err.strerror or err}"
            self._publish(armed=False, problem=problem)
            raise GuardUnavailable(problem) from err
        log.info("pressure guard armed: %r on %s", self.guard, self.path)
        return True

    def _watched_file(self) -> str:
        backend = self.manager.backend
        root = self.manager.root
        if self.guard.watch == "root" and root is not None:
            self.manager.create_root()
        owner_dir = None
        mount, fsroot = discovery.find_cgroup2_mount()
        rel = procfs.cgroup_of(self.owner_pid) if self.guard.watch == "owner" else None
        if mount is not None and rel not in (None, "/"):
            owner_dir = discovery.own_cgroup_dir(mount, fsroot or "/", f"0::{rel}\n")
            if owner_dir == os.path.normpath(mount):
                owner_dir = None
        path = resolve_watch(self.guard.watch, self.guard.resource, owner_dir, root if backend.name == "cgroup2" else None)
        if not os.path.exists(path):
            raise GuardUnavailable(f"no PSI file {path}: the kernel has no pressure information there "
                                   f"(CONFIG_PSI, psi=1 on the kernel command line, or no such cgroup)")
        return path

    # --- the loop ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a daemon thread (the sentinel's way)."""
        self._thread = threading.Thread(target=self.run, name="cgturn-guard", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread `start` began (after `stop`: it thaws what it froze first)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """Ask the loop to end (from any thread or a signal handler)."""
        self._stopping = True
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass

    def run(self) -> None:
        """Wait for triggers and act until `stop`; then thaw what the guard froze and drop its claim."""
        _raise_priority()
        try:
            while self.trigger is None and not self._stopping:
                if self._idle(STANDBY_RETRY) or self.arm(standby=True):
                    break
            if self.trigger is not None and not self._stopping:
                self._loop()
        except Exception:  # noqa: BLE001 - logged; the guard's claim must still be dropped
            log.exception("pressure guard failed")
            self._publish(armed=False, problem="the guard's loop failed (see the log)")
        finally:
            self.close()

    def _idle(self, seconds: float) -> bool:
        """Sleep up to `seconds` unless stopped; True when stopped."""
        select.select([self._wake_r], [], [], seconds)
        return self._stopping

    def _loop(self) -> None:
        trig = self.trigger
        if trig is None:  # closed before the loop started
            return
        poller = select.poll()
        poller.register(trig.fd, select.POLLPRI)
        poller.register(self._wake_r, select.POLLIN)
        window = trig.trigger.window_us / 1e6
        threshold = trig.trigger.stall_us
        over, last_over = False, time.monotonic() - self.guard.thaw_after
        prev_t, prev_total = time.monotonic(), trig.total_us() or 0
        self._baseline = self._loads()[0] if self._cumulative else {}
        while not self._stopping:
            crossed = gone = False
            for fd, revents in poller.poll(self._timeout(over, window)):
                if fd == self._wake_r:
                    _drain(self._wake_r)
                elif revents & (select.POLLERR | select.POLLNVAL):
                    gone = True
                elif revents & select.POLLPRI:
                    crossed = True
            if self._stopping:
                return
            now = time.monotonic()
            total = None if gone else trig.total_us()
            if total is None:
                self._publish(armed=False, problem=f"the watched cgroup of {self.path} is gone")
                log.error("pressure guard: the watched cgroup of %s is gone; stopping", self.path)
                return
            elapsed = now - prev_t
            # The stall rate since the last wake-up, scaled to one window: above the threshold means
            # the pressure is still on (the kernel signals a crossing at most once per window).
            still = elapsed > 0 and (total - prev_total) / elapsed * window >= threshold
            prev_t, prev_total = now, total
            if crossed or (over and still):
                last_over = now
            if crossed:
                if not over:
                    over = True
                    self._publish(over=True, since=time.time())
                self._act()
            elif self._cumulative and not over:
                self._baseline = self._loads()[0]
            if over and now - last_over >= self.guard.thaw_after:
                over = False
                self._publish(over=False, since=time.time())
            if not over and now - last_over >= self.guard.thaw_after:
                self._thaw_all()
            self._abandon_frozen_too_long()

    def _timeout(self, over: bool, window: float) -> int | None:
        """poll() timeout (ms): half a window while anything is held; a window while idle on a
        cumulative resource (to refresh the CPU/io baselines); forever on memory."""
        if over or self.state["frozen"]:
            return max(50, int(window * 500))
        return int(window * 1000) if self._cumulative else None

    # --- acting ------------------------------------------------------------------------------------

    def _loads(self) -> tuple[dict, dict]:
        """({(task_key, turn_key): load}, {key: record}) of the running turns nobody froze."""
        loads, records = {}, {}
        for view in self.manager.backend.views():
            rec = view.record
            if rec.state != RUNNING or rec.frozen_by is not None or not view.pids:
                continue
            key = (rec.task_key, rec.turn_key)
            records[key] = rec
            if self.guard.resource == "memory":
                loads[key] = view.memory_bytes if view.memory_bytes is not None else (observe.rss_bytes(view.pids) or 0)
            elif self.guard.resource == "io" and view.path and (io := cgroupfiles.read_io_bytes(view.path)) is not None:
                loads[key] = io
            else:  # cpu; io without the io controller falls back to CPU time (documented)
                loads[key] = view.cpu_seconds
        return loads, records

    def _act(self) -> None:
        """Freeze (or abandon) the heaviest running turn nobody froze."""
        loads, records = self._loads()
        key = heaviest(loads, self._baseline, self._cumulative)
        self._baseline = loads if self._cumulative else {}
        if key is None:
            log.warning("pressure on %s, but no running turn to %s", self.path, self.guard.action)
            return
        rec = records[key]
        try:
            if self.guard.action == "freeze":
                pids = self.manager.freeze_turn(*key, by=BY)
                self.state["frozen"] = sorted({*map(tuple, self.state["frozen"]), key})
                self._publish()
                log.info("froze %r/%r under pressure (pids %s)", rec.task_id, rec.turn_id, pids,
                         extra=turn_fields(rec.task_id, rec.turn_id, reasons.PRESSURE, pids=pids))
            else:
                result = self.manager.abandon_turn(*key, reasons.PRESSURE, grace=0.0)
                log.info("abandoned %r/%r under pressure (killed %s)", rec.task_id, rec.turn_id, result.killed,
                         extra=turn_fields(rec.task_id, rec.turn_id, result.reason, pids=result.killed))
        except (NoSuchTurn, UnsafeOperation) as err:
            log.info("could not %s %r/%r: %s", self.guard.action, rec.task_id, rec.turn_id, err,
                     extra=turn_fields(rec.task_id, rec.turn_id, reasons.PRESSURE))

    def _guard_frozen(self) -> list:
        """Records of the turns the guard holds frozen (read fresh: a user may have thawed one)."""
        out = []
        for key in self.state["frozen"]:
            rec = self.manager.backend.load(*key)
            if rec is not None and rec.frozen_by == BY:
                out.append(rec)
        return out

    def _thaw_all(self) -> None:
        if not self.state["frozen"]:
            return
        for rec in self._guard_frozen():
            try:
                self.manager.thaw_turn(rec.task_key, rec.turn_key, by=BY)
                log.info("thawed %r/%r: pressure stayed below the threshold", rec.task_id, rec.turn_id,
                         extra=turn_fields(rec.task_id, rec.turn_id, reasons.PRESSURE))
            except (NoSuchTurn, UnsafeOperation) as err:
                log.info("left %r/%r frozen: %s", rec.task_id, rec.turn_id, err,
                         extra=turn_fields(rec.task_id, rec.turn_id, reasons.PRESSURE))
        self.state["frozen"] = []
        self._publish()

    def _abandon_frozen_too_long(self) -> None:
        if not self.state["frozen"]:
            return
        now = time.time()
        kept = []
        for rec in self._guard_frozen():
            if rec.frozen_at is not None and now - rec.frozen_at >= self.guard.abandon_after:
                # Only while it is still the guard's: a turn a user paused meanwhile is left alone.
                result = self.manager.abandon_turn(rec.task_key, rec.turn_key, reasons.PRESSURE, grace=0.0,
                                                   when=lambda r: r.frozen_by == BY)
                log.info("abandoned %r/%r: frozen by the guard for over %g s (killed %s)",
                         rec.task_id, rec.turn_id, self.guard.abandon_after, result.killed,
                         extra=turn_fields(rec.task_id, rec.turn_id, result.reason, pids=result.killed))
            else:
                kept.append((rec.task_key, rec.turn_key))
        if kept != [tuple(k) for k in self.state["frozen"]]:
            self.state["frozen"] = kept
            self._publish()

    # --- state -------------------------------------------------------------------------------------

    def _publish(self, **changes) -> None:
        """Update the state on the managed root (what admission and doctor read)."""
        if not self.state:
            return
        self.state.update(changes)
        try:
            guard_state.save(self.manager.backend, self.state)
        except OSError as err:
            log.error("cannot record the guard state: %s", err.strerror or err)

    def close(self) -> None:
        """Thaw what the guard froze, drop its claim, disarm the trigger. Idempotent."""
        if self.trigger is not None:
            try:
                self._thaw_all()
            finally:
                if self.state.get("armed"):
                    guard_state.release(self.manager.backend, self.state)
                self.trigger.close()
                self.trigger = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1


def _drain(fd: int) -> None:
    try:
        os.read(fd, 512)
    except BlockingIOError:
        pass


def _raise_priority() -> None:
    """Ask for nice GUARD_NICE for the calling thread (Linux: setpriority(PRIO_PROCESS, tid) is per
    thread), only ever raising its priority; refused without CAP_SYS_NICE (logged)."""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) > GUARD_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, GUARD_NICE)
    except OSError as err:
        log.info("pressure guard keeps its nice level: %s", err.strerror or err)
