"""The pressure guard's runner: arm the kernel's PSI trigger, wait for it, and act on the manager's
turns as cgturn.guard_policy decides (freeze or abandon the heaviest, thaw, abandon a turn frozen too
long), publishing the guard's state on the managed root for admission in any process.

Driven by the trigger (poll(POLLPRI) on the watched pressure file), not by sampling: between triggers
it wakes only to refresh the per-turn CPU (or io) figures that "heaviest in the window" is measured
against (once per window) and, while it holds frozen turns, to watch the pressure fall (twice per
window). The kernel reads (the trigger, loads, the guard's state) are cgturn.probes; the turns change
through `manager._control`.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any

from . import guard_policy, probes, processes, reasons
from .errors import GuardUnavailable, NoSuchTurn, UnsafeOperation
from .guard_policy import BY
from .logfields import turn_fields

if TYPE_CHECKING:
    from .manager import TurnManager

log = logging.getLogger("cgturn.guard")

# The nice level the guard's thread asks for (never lowers anything; needs CAP_SYS_NICE to go below 0).
GUARD_NICE = -10
# How often a guard that found another live guard on the root tries to take over (its owner may die).
STANDBY_RETRY = 2.0

Names = tuple[str, str]  # a turn's encoded names (task_key, turn_key)


class GuardRunner:
    """One armed guard: the loop that waits for the trigger and acts on the manager's turns.

    Args:
        guard: the settings (a cgturn.PressureGuard).
        manager: a TurnManager of the managed root (in the sentinel: the sentinel's own).
        owner_pid: the process whose cgroup `watch="owner"` means (default: this one).
    """

    def __init__(self, guard: guard_policy.Settings, manager: "TurnManager", owner_pid: int | None = None):
        self.guard = guard
        self.manager = manager
        self._control = manager._control
        self.owner_pid = owner_pid or os.getpid()
        self.trigger: Any = None  # the armed probes.ArmedTrigger
        self.path: str | None = None
        self.state: dict[str, Any] = {}  # this guard's recorded state, once it claimed the root
        self.owned_by: dict[str, Any] | None = None   # the other live guard's state, while in standby
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._baseline: dict[Names, float] = {}
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
        self.state = {"owner_pid": me, "owner_start": processes.start_time(me), "armed": True, "over": False,
                      "since": time.time(), "file": self.path, "frozen": [], **self.guard.to_json()}
        other = probes.claim_guard(self.manager, self.state)
        if other is not None:
            self.owned_by = other
            if standby:
                return False
            raise GuardUnavailable(f"a pressure guard is already armed on this managed root by process "
                                   f"{other['owner_pid']} (watching {other.get('file')})")
        self.owned_by = None
        # Turns a guard froze and can no longer thaw (it was SIGKILLed, or its host crashed): their
        # records say so, and their clocks stand still until someone does. This guard takes them on.
        self.state["frozen"] = self._left_frozen()
        try:
            self.trigger = probes.ArmedTrigger(self.path, self.guard.parsed)
        except OSError as err:
            problem = f"cannot arm the PSI trigger '{self.guard.trigger}' on {self.path}: {err.strerror or err}"
            self._publish(armed=False, problem=problem)
            raise GuardUnavailable(problem) from err
        log.info("pressure guard armed: %r on %s", self.guard, self.path)
        if self.state["frozen"]:
            log.info("pressure guard took on %d turn(s) an earlier guard left frozen", len(self.state["frozen"]))
            self._publish()
        return True

    def _left_frozen(self) -> list[Names]:
        """The turns whose record says a guard froze them: only a guard thaws those, and the one
        that froze them is gone (this guard owns the root now)."""
        return sorted((v.record.task_key, v.record.turn_key) for v in self._control.views()
                      if v.record.frozen_by == BY)

    def _watched_file(self) -> str:
        root = self.manager.root
        if self.guard.watch == "root" and root is not None:
            self.manager.create_root()
        owner_dir = probes.owner_cgroup_dir(self.owner_pid) if self.guard.watch == "owner" else None
        managed_root = root if self.manager.backend_name == "cgroup2" else None
        path = probes.pressure_file(self.guard.resource,
                                    guard_policy.watched_cgroup(self.guard.watch, owner_dir, managed_root))
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
        # Turns taken on from an earlier guard are held at least thaw_after from now: this guard has
        # not seen the pressure that froze them fall yet.
        quiet_since = time.monotonic() - (0.0 if self.state["frozen"] else self.guard.thaw_after)
        hold = guard_policy.Hold(self.guard.thaw_after, last_over=quiet_since)
        prev_t, prev_total = time.monotonic(), trig.total_us() or 0
        self._baseline = self._loads()[0] if self._cumulative else {}
        while not self._stopping:
            crossed = gone = False
            holding = hold.over or bool(self.state["frozen"])
            for fd, revents in poller.poll(guard_policy.poll_timeout_ms(holding, window, self._cumulative)):
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
            still = guard_policy.still_pressing(total, prev_total, now - prev_t, window, trig.trigger.stall_us)
            prev_t, prev_total = now, total
            step = hold.step(crossed, still, now, self._cumulative)
            if step.began:
                self._publish(over=True, since=time.time())
            if step.act:
                self._act()
            elif step.refresh:
                self._baseline = self._loads()[0]
            if step.ended:
                self._publish(over=False, since=time.time())
            if step.thaw:
                self._thaw_all()
            self._abandon_frozen_too_long()

    # --- acting ------------------------------------------------------------------------------------

    def _loads(self) -> tuple[dict[Names, float], dict[Names, Any]]:
        """({(task_key, turn_key): load}, {key: record}) of the turns the guard may pick."""
        loads: dict[Names, float] = {}
        records: dict[Names, Any] = {}
        for view in self._control.views():
            rec = view.record
            if not guard_policy.eligible(rec, view.pids):
                continue
            key: Names = (rec.task_key, rec.turn_key)
            records[key] = rec
            loads[key] = probes.turn_load(view, self.guard.resource)
        return loads, records

    def _act(self) -> None:
        """Freeze (or abandon) the heaviest running turn nobody froze."""
        loads, records = self._loads()
        key = guard_policy.heaviest(loads, self._baseline, self._cumulative)
        self._baseline = loads if self._cumulative else {}
        if key is None:
            log.warning("pressure on %s, but no running turn to %s", self.path, self.guard.action)
            return
        rec = records[key]
        try:
            if self.guard.action == "freeze":
                pids = self._control.freeze_turn(*key, by=BY)
                self.state["frozen"] = sorted({*map(tuple, self.state["frozen"]), key})
                self._publish()
                log.info("froze %r/%r under pressure (pids %s)", rec.task_id, rec.turn_id, pids,
                         extra=turn_fields(rec.task_id, rec.turn_id, reasons.PRESSURE, pids=pids))
            else:
                result = self._control.abandon_turn(*key, reasons.PRESSURE, grace=0.0)
                log.info("abandoned %r/%r under pressure (killed %s)", rec.task_id, rec.turn_id, result.killed,
                         extra=turn_fields(rec.task_id, rec.turn_id, result.reason, pids=result.killed))
        except (NoSuchTurn, UnsafeOperation) as err:
            log.info("could not %s %r/%r: %s", self.guard.action, rec.task_id, rec.turn_id, err,
                     extra=turn_fields(rec.task_id, rec.turn_id, reasons.PRESSURE))

    def _guard_frozen(self) -> list[Any]:
        """Records of the turns the guard holds frozen (read fresh: a user may have thawed one)."""
        out = []
        for key in self.state["frozen"]:
            rec = self._control.record(*key)
            if rec is not None and rec.frozen_by == BY:
                out.append(rec)
        return out

    def _thaw_all(self) -> None:
        if not self.state["frozen"]:
            return
        for rec in self._guard_frozen():
            try:
                self._control.thaw_turn(rec.task_key, rec.turn_key, by=BY)
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
            if guard_policy.frozen_too_long(rec.frozen_at, now, self.guard.abandon_after):
                # Only while it is still the guard's: a turn a user paused meanwhile is left alone.
                result = self._control.abandon_turn(rec.task_key, rec.turn_key, reasons.PRESSURE, grace=0.0,
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

    def _publish(self, **changes: Any) -> None:
        """Update the state on the managed root (what admission and doctor read)."""
        if not self.state:
            return
        self.state.update(changes)
        try:
            probes.save_guard(self.manager, self.state)
        except OSError as err:
            log.error("cannot record the guard state: %s", err.strerror or err)

    def close(self) -> None:
        """Thaw what the guard froze, drop its claim, disarm the trigger. Idempotent."""
        if self.trigger is not None:
            try:
                self._thaw_all()
            finally:
                if self.state.get("armed"):
                    probes.release_guard(self.manager, self.state)
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
