"""The supervisor on both backends: watchdog on a blocked loop, race rules, stop causes, markers, guard."""
import asyncio
import random
import signal
import threading
import time

import pytest

from cgturn import Run, Supervisor, abandon_disconnected, watchdog
from conftest import alive, audit_records, wait_until

SLEEP = ["sleep", "300"]
# A daemon that leaves the process tree and the session: only the turn's ownership finds it.
DAEMON = ["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & exec sleep 300"]


def _pids(turn, count):
    assert wait_until(lambda: len(turn.pids()) >= count), turn.pids()
    return turn.pids()


def _audit(manager, turn_id):
    return audit_records(manager.state_dir, turn_id)


def test_watchdog_fires_while_the_event_loop_is_blocked(manager):
    """A coroutine blocking the loop in a blocking wait: processes dead within timeout + grace + 5 s,
    well before the 10 s the loop stays blocked (a loaded machine delays the kill, not the decision)."""
    turn = manager.begin_turn("gw", "blocked")
    turn.spawn(DAEMON)
    pids = _pids(turn, 2)
    timeout, grace = 0.5, 0.5
    unblock = threading.Event()
    dead_in_time = []

    def monitor(started):
        dead_in_time.append(wait_until(lambda: not any(alive(p) for p in pids),
                                       timeout=started + timeout + grace + 5 - time.monotonic()))
        unblock.set()

    async def worker():
        # A blocking wait blocks the event loop for up to 10 s; the monitor ends it once it has its answer.
        unblock.wait(10)
        return "late reply"

    async def main():
        # No sentinel: its copy of the timeout (0.25 s later) would kill the turn too, on a loaded host
        # first, and hide a watchdog that did not fire.
        sup = Supervisor(turn, timeout=timeout, grace=grace, use_sentinel=False)
        threading.Thread(target=monitor, args=(time.monotonic(),), daemon=True).start()
        return await sup.run(worker)

    outcome = asyncio.run(main())
    assert dead_in_time == [True]
    assert outcome.abandoned and outcome.reason == "timeout" and outcome.result is None
    assert turn.state == "abandoned" and _audit(manager, turn.turn_id)[-1]["reason"] == "timeout"
    assert len(_audit(manager, "blocked")) == 1


def test_completion_timeout_race(manager):
    """Timeout aimed at the worker's finish, 200 times: one outcome each, survivors of completed turns
    live, abandoned turns leave nothing."""
    rng = random.Random(3)
    seen = {"completed": 0, "abandoned": 0}
    survivors = {}  # turn id -> the process a completed turn left running

    async def one(i):
        turn = manager.begin_turn("race", f"r{i}")
        spawn = i % 10 == 0  # most iterations spawn nothing, to keep 200 rounds fast
        aim = 0.02
        timeout = aim + rng.uniform(-0.002, 0.002)

        def blocking():
            end = time.monotonic() + aim
            while time.monotonic() < end:
                pass
            if spawn:
                return turn.spawn(SLEEP)
            return "reply"

        async def coro():
            await asyncio.sleep(aim)
            return turn.spawn(SLEEP) if spawn else "reply"

        sup = Supervisor(turn, timeout=timeout, grace=0)
        outcome = await sup.run(blocking if i % 2 else coro)
        state = turn.record.state
        if outcome.completed:
            assert state == "completed" and outcome.reason is None
            if spawn:
                assert outcome.result.poll() is None, "a completed turn's survivor was killed"
                survivors[f"r{i}"] = outcome.result
        else:
            assert state == "abandoned" and outcome.reason == "timeout" and outcome.result is None
            assert turn.pids() == [], "an abandoned turn leaked"
        seen["completed" if outcome.completed else "abandoned"] += 1

    async def main():
        for i in range(200):
            await one(i)

    asyncio.run(main())
    # Aimed at the finish, either may win a round; the two forced rounds make sure both orders ran.
    seen["abandoned" if _forced_abandon_first(manager).abandoned else "completed"] += 1
    seen["completed" if _forced_completion_first(manager).completed else "abandoned"] += 1
    assert seen["completed"] >= 1 and seen["abandoned"] >= 1, seen
    for proc in survivors.values():
        assert proc.poll() is None
    # abandoned turns and completed empty ones are gone; exactly the turns with a survivor remain
    assert {i.turn for i in manager.turns("race")} == set(survivors)
    manager.end_task("race", grace=0)
    for proc in survivors.values():
        assert proc.wait(timeout=10) == -signal.SIGKILL


def _forced_abandon_first(manager):
    """The timeout is decided while the worker runs; the worker returns right after the decision, so
    its completion lands on an abandoned turn: the abandon stands, the result is discarded."""
    turn = manager.begin_turn("race", "forced-abandon")
    proc = turn.spawn(SLEEP)
    decided = threading.Event()
    sup = Supervisor(turn, timeout=0.05, grace=0, use_sentinel=False, on_interrupt=lambda why: decided.set())

    def worker():
        assert decided.wait(30)
        return "reply"

    outcome = sup.run_blocking(worker)
    assert outcome.abandoned and outcome.reason == "timeout" and outcome.result is None
    assert proc.wait(timeout=10) == -signal.SIGKILL and turn.state == "abandoned"
    return outcome


class _Stall:
    """A watchdog client that holds the process's watchdog thread until released."""

    finished = False

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def on_due(self, now):
        self.entered.set()
        self.release.wait(30)


def _forced_completion_first(manager):
    """The worker outlives its timeout while the watchdog thread is held, so the timeout is due but not
    yet decided when the worker returns: the completion wins and the turn is completed."""
    turn = manager.begin_turn("race", "forced-completion")
    stall = _Stall()
    watchdog.shared().schedule(stall, time.monotonic())
    try:
        assert stall.entered.wait(30)
        timeout = 0.05
        sup = Supervisor(turn, timeout=timeout, grace=0, use_sentinel=False)

        def worker():
            began = time.monotonic()
            assert wait_until(lambda: time.monotonic() >= began + 2 * timeout)  # due by now
            return "reply"

        outcome = sup.run_blocking(worker)
    finally:
        stall.release.set()
    assert outcome.completed and outcome.result == "reply" and turn.state == "completed"
    return outcome


def test_stop_after_completion_kills_nothing(manager):
    turn = manager.begin_turn("api", "done")
    run = Run("run-1")
    interrupts = []

    def worker():
        assert run.owned and run.task_id == "api"
        return turn.spawn(SLEEP)  # deliberately left running

    sup = Supervisor(turn, timeout=30, run=run, on_interrupt=interrupts.append)
    outcome = sup.run_blocking(worker)
    assert outcome.completed and not run.owned
    result = sup.stop("stop")
    assert result.skipped and result.killed == []
    assert abandon_disconnected(run) is None
    assert interrupts == [] and outcome.result.poll() is None
    assert turn.state == "completed"
    manager.end_task("api")
    outcome.result.wait(timeout=10)


@pytest.mark.parametrize("cause, reason", [
    (lambda sup, run: sup.new_session(), "new-session"),
    (lambda sup, run: sup.stop(), "stop"),
    (lambda sup, run: abandon_disconnected(run), "disconnect"),
])
def test_stop_causes_during_a_turn(manager, cause, reason):
    turn = manager.begin_turn("chat", "t")
    turn.spawn(DAEMON)
    pids = _pids(turn, 2)
    run = Run("r")
    interrupts = []

    async def main():
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        sup = Supervisor(turn, timeout=60, grace=0.2, run=run,
                         on_interrupt=lambda why: (interrupts.append(why), loop.call_soon_threadsafe(stopped.set)))

        async def agent():
            await stopped.wait()
            return "interrupted reply"

        running = asyncio.ensure_future(sup.run(agent))
        await asyncio.sleep(0)
        assert wait_until(lambda: run.owned)
        result = await asyncio.to_thread(cause, sup, run)
        return result, await running

    result, outcome = asyncio.run(main())
    assert not result.skipped and set(pids) <= set(result.killed)
    assert outcome.abandoned and outcome.reason == reason
    assert interrupts == [reason]
    assert _audit(manager, turn.turn_id)[-1]["reason"] == reason
    assert wait_until(lambda: not any(alive(p) for p in pids))
    assert not run.owned


def test_disconnect_without_markers_is_a_no_op(manager):
    turn = manager.begin_turn("chat", "bystander")
    proc = turn.spawn(SLEEP)
    assert abandon_disconnected(Run("never-started")) is None
    blank = Run("blank")
    blank.mark("   ", turn)  # a blank task id never reaps anything
    assert abandon_disconnected(blank) is None
    assert manager.kill_started_since(frozenset(), "") == 0
    assert proc.poll() is None and turn.state == "running"
    turn.abandon("cleanup", grace=0)
    proc.wait(timeout=10)


@pytest.mark.parametrize("guard, killed", [
    (lambda: False, False),
    (lambda: True, True),
    (lambda: 1 / 0, True),  # a guard that raises fails open: the turn is killed
], ids=["superseded", "current", "raising"])
def test_is_still_current_guard(manager, guard, killed):
    turn = manager.begin_turn("g", "t")
    proc = turn.spawn(SLEEP)
    interrupts = []
    release = threading.Event()
    sup = Supervisor(turn, timeout=0.2, grace=0, is_still_current=guard,
                     on_interrupt=lambda why: (interrupts.append(why), release.set()))
    outcome = sup.run_blocking(lambda: release.wait(30))
    assert outcome.abandoned and outcome.reason == "timeout"
    assert interrupts == ["timeout"]  # the interrupt fires even when the kill is skipped
    assert outcome.abandon.skipped is (not killed)
    if killed:
        assert proc.wait(timeout=10) == -signal.SIGKILL and turn.state == "abandoned"
    else:
        assert proc.poll() is None and turn.state == "running"
        turn.abandon("cleanup", grace=0)
        proc.wait(timeout=10)


def test_one_interrupt_one_kill_across_threads(manager):
    """The watchdog and several stoppers land together: one interrupt, one kill, one audit record."""
    turn = manager.begin_turn("many", "t")
    turn.spawn(DAEMON)
    _pids(turn, 2)
    interrupts = []
    release = threading.Event()
    sup = Supervisor(turn, timeout=0.3, grace=0,
                     on_interrupt=lambda why: (interrupts.append(why), release.set()))
    barrier = threading.Barrier(4)
    results = []

    def stopper(reason):
        barrier.wait()
        results.append(sup.stop(reason))

    threads = [threading.Thread(target=stopper, args=(f"stop-{i}",)) for i in range(4)]

    def worker():
        deadline = time.monotonic() + 0.3  # the stoppers start when the watchdog is due
        while time.monotonic() < deadline:
            pass
        for t in threads:
            t.start()
        release.wait(30)

    outcome = sup.run_blocking(worker)
    for t in threads:
        t.join(30)
    assert len(interrupts) == 1 and outcome.reason == interrupts[0]
    assert len(results) == 4 and all(r.killed == results[0].killed for r in results)
    assert len(_audit(manager, "t")) == 1
    assert _audit(manager, turn.turn_id)[-1]["reason"] == outcome.reason


def test_hard_deadline_holds_despite_activity(manager):
    turn = manager.begin_turn("dl", "t")
    proc = turn.spawn(SLEEP)
    stop = threading.Event()

    def busy():
        end = time.monotonic() + 60  # without a deadline the worker would return and the turn complete
        while not stop.wait(0.02) and time.monotonic() < end:
            turn.touch()

    # Always active (the activity callable says "now" at every look), however loaded the host: only
    # the deadline can end this turn.
    sup = Supervisor(turn, timeout=0.2, deadline=0.6, grace=0, activity=time.monotonic,
                     on_interrupt=lambda why: stop.set())
    outcome = sup.run_blocking(busy)
    assert outcome.reason == "deadline" and _audit(manager, turn.turn_id)[-1]["reason"] == "deadline"
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_activity_callable_and_worker_error(manager):
    turn = manager.begin_turn("err", "t")
    proc = turn.spawn(SLEEP)

    def failing():
        raise RuntimeError("agent crashed")

    outcome = Supervisor(turn, timeout=30, grace=0, activity=time.monotonic).run_blocking(failing)
    assert outcome.reason == "error" and outcome.abandoned and not outcome.interrupted
    assert type(outcome.error) is RuntimeError and str(outcome.error) == "agent crashed"
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_cancelling_run_abandons_the_turn(manager):
    turn = manager.begin_turn("cancel", "t")
    proc = turn.spawn(SLEEP)

    async def main():
        started = asyncio.Event()

        async def worker():
            started.set()
            await asyncio.sleep(300)

        task = asyncio.ensure_future(Supervisor(turn, grace=0).run(worker))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _audit(manager, turn.turn_id)[-1]["reason"] == "cancelled"
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_a_completed_outcome_has_the_figures_of_a_turn_its_completion_removed(cgroup2_manager):
    """The completion reads what the turn used before it removes the emptied cgroup (cpu.stat goes
    with it): the outcome's usage counts the CPU of a process that has already exited."""
    from conftest import PY

    turn = cgroup2_manager.begin_turn("gw", "figures")

    def worker():
        proc = turn.spawn([PY, "-c", "sum(range(3_000_000))"])
        assert proc.wait(60) == 0

    outcome = Supervisor(turn, timeout=60, use_sentinel=False).run_blocking(worker)
    assert outcome.completed is True and outcome.usage is not None
    assert outcome.usage.cpu_seconds > 0
    assert cgroup2_manager.turns("gw") == []  # nothing left: the completion removed it
