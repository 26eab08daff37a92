"""Clocks that stop while a turn is frozen: the supervisor's watchdog and the sentinel leave frozen
time out of inactivity timeouts and deadlines (both backends), and the one pure clock behind both."""
import signal
import threading

import pytest

from cgturn import RUNNING, Supervisor
from cgturn.sentinel import attach as attach_sentinel
from cgturn.clocks import FROZEN_RECHECK, FrozenTime, due, due_after_look, frozen_state, frozen_total
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


def test_frozen_time_credits_only_frozen_time_after_the_last_activity():
    paused = FrozenTime(seen=1.0)  # frozen for 1 s before the clocks started: not theirs
    paused.look(total=3.0, last_activity=10.0, since_activity=5.0)
    assert (paused.deadline, paused.idle_credit(10.0)) == (2.0, 2.0)
    paused.look(total=4.0, last_activity=10.0, since_activity=6.0)
    assert (paused.deadline, paused.idle_credit(10.0)) == (3.0, 3.0)
    # new activity: at most the time since it counts, and the older credit is dropped
    paused.look(total=7.0, last_activity=20.0, since_activity=0.5)
    assert (paused.deadline, paused.idle_credit(20.0)) == (6.0, 0.5)
    assert paused.idle_credit(10.0) == 0.0


def frozen(deadline=0.0, idle=0.0, idle_since=None):
    f = FrozenTime()
    f.deadline, f.idle, f.idle_since = deadline, idle, idle_since
    return f


# (deadline_at, timeout, last activity, frozen time, slack) -> due
@pytest.mark.parametrize("deadline_at, timeout, last, fz, slack, expected", [
    (None, None, 10.0, frozen(), 0.0, None),                                  # no clock: only owner death
    (50.0, None, 10.0, frozen(), 0.0, (50.0, "deadline")),
    (None, 5.0, 10.0, frozen(), 0.0, (15.0, "timeout")),
    (50.0, 5.0, 10.0, frozen(), 0.0, (15.0, "timeout")),                      # the nearer wins
    (12.0, 5.0, 10.0, frozen(), 0.0, (12.0, "deadline")),
    (50.0, 5.0, 10.0, frozen(), 0.25, (15.25, "timeout")),                    # the sentinel's slack
    (50.0, None, 10.0, frozen(deadline=3.0), 0.0, (53.0, "deadline")),        # frozen time left out
    (None, 5.0, 10.0, frozen(idle=2.0, idle_since=10.0), 0.0, (17.0, "timeout")),
    (None, 5.0, 11.0, frozen(idle=2.0, idle_since=10.0), 0.0, (16.0, "timeout")),  # activity since: no credit
])
def test_due(deadline_at, timeout, last, fz, slack, expected):
    assert due(deadline_at, timeout, last, fz, slack) == expected


@pytest.mark.parametrize("state, now, expected", [
    ((0.0, False), 20.0, (15.0, "timeout")),                   # never frozen: due as it was
    ((4.0, False), 20.0, (19.0, "timeout")),                   # frozen 4 s, thawed: pushed back 4 s
    ((1.0, True), 20.0, (20.0 + FROZEN_RECHECK, "timeout")),   # still frozen: no sooner than a recheck
    ((9.0, True), 20.0, (24.0, "timeout")),                    # still frozen, later than a recheck
    ((30.0, True), 20.0, (25.0, "timeout")),                   # credit: at most the 10 s since the activity
])
def test_due_after_look(state, now, expected):
    assert due_after_look(None, 5.0, 10.0, FrozenTime(), state, now) == expected


def test_frozen_state():
    assert frozen_state(None, 100.0, otherwise=2.0) == (2.0, False)  # no record: what was known
    assert frozen_state(record(1.0, frozen_at=99.0), 100.0) == (2.0, True)
    assert frozen_state(record(1.0), 100.0) == (1.0, False)
