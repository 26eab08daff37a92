"""Clocks that stop while a turn is frozen: the supervisor's watchdog and the sentinel leave paused
time out of inactivity timeouts and deadlines (both backends), and the pure accounting behind them."""
import signal
import threading

import pytest

from cgturn import RUNNING, Supervisor, attach_sentinel
from cgturn.clocks import FrozenTime, frozen_total
from cgturn.model import TurnRecord
from conftest import audit_records, wait_until

FROZEN_FOR = 2.0  # twice the clock: without the pause left out it would fire during the freeze
BOUND = 15.0      # generous: the abandon after the thaw, on a loaded 2-core host


@pytest.mark.parametrize("clock", ["timeout", "deadline"])
def test_watchdog_clock_stops_while_the_turn_is_frozen(manager, clock):
    turn = manager.begin_turn("clock", clock)
    proc = turn.spawn(["sleep", "300"])
    # Frozen before the clock starts, so the freeze surely covers the clock's first second.
    turn.freeze()
    fired = threading.Event()
    release = threading.Event()
    sup = Supervisor(turn, grace=0, use_sentinel=False, on_interrupt=lambda why: (fired.set(), release.set()),
                     **{clock: 1.0})
    outcomes = []
    runner = threading.Thread(target=lambda: outcomes.append(sup.run_blocking(release.wait)))
    runner.start()
    try:
        assert not fired.wait(FROZEN_FOR)  # twice its clock, frozen: not abandoned
        assert turn.state == RUNNING
        turn.thaw()
        assert fired.wait(BOUND)  # about one second of unfrozen time later
    finally:
        release.set()
        runner.join(BOUND)
    [outcome] = outcomes
    assert outcome.reason == clock and outcome.abandon.killed == [proc.pid]
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_sentinel_clock_stops_while_the_turn_is_frozen(manager):
    turn = manager.begin_turn("clock", "sentinel")
    proc = turn.spawn(["sleep", "300"])
    client = attach_sentinel(manager)
    turn.freeze()
    client.track(turn, inactivity=1.0, grace=0.0)
    # Frozen for twice its inactivity timeout (plus the sentinel's slack): still running.
    assert not wait_until(lambda: turn.state != RUNNING, timeout=FROZEN_FOR)
    turn.thaw()
    assert wait_until(lambda: turn.state != RUNNING, timeout=BOUND)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: [r["reason"] for r in audit_records(manager.state_dir, "sentinel")
                               if r.get("action", "kill") == "kill"] == ["timeout"])


def record(frozen_seconds=0.0, frozen_at=None):
    return TurnRecord("t", "u", "t", "u", frozen_seconds=frozen_seconds, frozen_at=frozen_at)


@pytest.mark.parametrize("rec, now, total", [
    (record(), 100.0, 0.0),
    (record(2.5), 100.0, 2.5),
    (record(2.5, frozen_at=99.0), 100.0, 3.5),
    (record(0.0, frozen_at=101.0), 100.0, 0.0),  # a wall clock stepped back never gives negative time
])
def test_frozen_total(rec, now, total):
    assert frozen_total(rec, now) == total


def test_paused_time_credits_only_frozen_time_after_the_last_activity():
    paused = FrozenTime(seen=1.0)  # frozen for 1 s before the clocks started: not theirs
    paused.look(total=3.0, last_activity=10.0, since_activity=5.0)
    assert (paused.deadline, paused.idle_credit(10.0)) == (2.0, 2.0)
    paused.look(total=4.0, last_activity=10.0, since_activity=6.0)
    assert (paused.deadline, paused.idle_credit(10.0)) == (3.0, 3.0)
    # new activity: at most the time since it counts, and the older credit is dropped
    paused.look(total=7.0, last_activity=20.0, since_activity=0.5)
    assert (paused.deadline, paused.idle_credit(20.0)) == (6.0, 0.5)
    assert paused.idle_credit(10.0) == 0.0
