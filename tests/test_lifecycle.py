"""Turn lifecycle on both backends (the `manager` fixture is parametrised): real processes throughout."""
import os
import signal
import subprocess

import pytest

from cgturn import ABANDONED, RUNNING, NoSuchTurn, Supervisor, TurnExists
from conftest import PY, alive, wait_until

SLEEP = ["sleep", "300"]


def test_spawned_process_gets_turn_environment(manager):
    turn = manager.begin_turn("task:env", "turn/1")
    out = turn.spawn([PY, "-c", "import os; print(os.environ['CGTURN_TASK'], os.environ['CGTURN_TURN'])"],
                     stdout=subprocess.PIPE, text=True).communicate(timeout=10)[0]
    assert out.split() == ["task:env", "turn%2F1"]
    turn.complete()


def test_abandon_kills_everything_and_is_idempotent(manager):
    turn = manager.begin_turn("t")
    procs = [turn.spawn(SLEEP) for _ in range(3)]
    shell = turn.spawn(["sh", "-c", "sleep 300 & sleep 300 & wait"])
    assert wait_until(lambda: len(turn.pids()) >= 6)
    pids = turn.pids()
    result = turn.abandon("test", grace=1.0)
    assert not result.skipped and result.reason == "test"
    assert set(pids) <= set(result.killed)
    for p in procs + [shell]:
        assert p.wait(timeout=10) == -signal.SIGTERM  # none handles it: the grace's SIGKILL finds nobody
    assert wait_until(lambda: not any(alive(pid) for pid in pids))
    again = turn.abandon("again")
    assert again.skipped and again.killed == []
    assert turn.state == "abandoned"
    assert manager.turns("t") == []


def test_predating_other_task_and_completed_survivors_stay_alive(manager, bystanders):
    before = bystanders(*SLEEP)
    other = manager.begin_turn("other")
    keeper = other.spawn(SLEEP)
    done = manager.begin_turn("mine", "done")
    survivor = done.spawn(SLEEP)
    done.complete()
    mine = manager.begin_turn("mine", "live")
    victim = mine.spawn(SLEEP)
    assert wait_until(lambda: mine.pids() == [victim.pid])
    assert mine.abandon("stop", grace=0).killed == [victim.pid]
    assert victim.wait(timeout=10) == -signal.SIGKILL
    assert before.poll() is None and keeper.poll() is None and survivor.poll() is None
    other.abandon("cleanup", grace=0)
    manager.end_task("mine", grace=0)
    assert keeper.wait(timeout=10) == survivor.wait(timeout=10) == -signal.SIGKILL


def test_completed_turn_survivors_live_until_forced(manager):
    turn = manager.begin_turn("dev", "serve")
    server = turn.spawn(SLEEP)
    assert turn.complete() is True
    assert turn.complete() is False
    skipped = turn.abandon("stop after completion")
    assert skipped.skipped and skipped.killed == []
    assert server.poll() is None
    info = manager.turns("dev")
    assert [(i.turn, i.state, i.pids) for i in info] == [("serve", "completed", [server.pid])]
    forced = turn.abandon("forced", grace=0, force=True)
    assert server.pid in forced.killed
    assert server.wait(timeout=10) == -signal.SIGKILL
    manager.begin_turn("dev", "serve").complete()  # nothing left: the id is free again


def test_first_transition_wins(manager):
    turn = manager.begin_turn("race")
    turn.abandon("first", grace=0)
    assert turn.complete() is False
    assert turn.state == "abandoned"
    other = manager.begin_turn("race2")
    assert other.complete() is True
    assert other.abandon("late").skipped


def test_sigterm_first_then_sigkill_after_grace(manager):
    """Told apart by how each process died, not by when a handler ran: a fatal signal decides the
    exit status when it is sent (kernel/signal.c complete_signal), so `obeying` (SIGTERM at its default
    action) dies of SIGTERM only if SIGTERM came first, and `stubborn` (SIGTERM ignored: discarded at
    sending) dies of SIGKILL only if the escalation came."""
    turn = manager.begin_turn("grace")
    stubborn = turn.spawn([PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                     "print('ready', flush=True); time.sleep(300)"],
                          stdout=subprocess.PIPE, text=True)
    obeying = turn.spawn(SLEEP)
    assert stubborn.stdout.readline().strip() == "ready"
    result = turn.abandon("timeout", grace=0.3)
    assert result.signals == ["SIGTERM", "SIGKILL"]
    assert obeying.wait(timeout=10) == -signal.SIGTERM
    assert stubborn.wait(timeout=10) == -signal.SIGKILL
    # a process that obeys SIGTERM within the grace never gets the SIGKILL
    polite = manager.begin_turn("grace", "polite")
    q = polite.spawn(SLEEP)
    result = polite.abandon("test", grace=5.0)
    assert result.signals == ["SIGTERM"] and q.wait(timeout=10) == -signal.SIGTERM


def test_grace_zero_sends_no_sigterm(manager):
    """A process at SIGTERM's default action dies of the first fatal signal it is sent: of SIGKILL
    only if no SIGTERM came before it (the exit status is decided at sending, not by scheduling)."""
    turn = manager.begin_turn("nograce")
    p = turn.spawn(SLEEP)
    assert wait_until(lambda: turn.pids() == [p.pid])
    result = turn.abandon("now", grace=0)
    assert result.signals == ["SIGKILL"]
    assert p.wait(timeout=10) == -signal.SIGKILL


def test_turn_ids_are_unique_while_the_turn_exists(manager):
    turn = manager.begin_turn("dup", "x")
    with pytest.raises(TurnExists):
        manager.begin_turn("dup", "x")
    survivor = turn.spawn(SLEEP)
    turn.complete()
    with pytest.raises(TurnExists):
        manager.begin_turn("dup", "x")  # completed, but with a survivor
    survivor.kill()
    survivor.wait()
    assert wait_until(lambda: not turn.pids())
    again = manager.begin_turn("dup", "x")  # completed and empty: the id is free again
    assert again.state == "running"
    again.complete()


@pytest.mark.parametrize("task, turn", [("", "x"), ("  ", "x"), ("t", "\t"), ("t\x00", "x"), ("t", "\ud800")])
def test_invalid_ids_touch_nothing(manager, task, turn):
    with pytest.raises(ValueError):
        manager.begin_turn(task, turn)
    assert manager.turns() == []


def test_spawn_reports_missing_and_non_executable_programs_like_popen(manager, tmp_path):
    turn = manager.begin_turn("errors")
    with pytest.raises(FileNotFoundError):
        turn.spawn(["cgturn-no-such-program-xyz"])
    script = tmp_path / "noexec.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        turn.spawn([str(script)])
    assert turn.pids() == []
    turn.complete()


def test_spawn_after_the_turn_ended_is_refused(manager):
    turn = manager.begin_turn("ended")
    turn.complete()
    with pytest.raises(NoSuchTurn):
        turn.spawn(SLEEP)


def test_end_task_kills_survivors_and_removes_every_turn(manager, bystanders):
    outside = bystanders(*SLEEP)
    done = manager.begin_turn("job", "a")
    survivor = done.spawn(SLEEP)
    done.complete()
    running = manager.begin_turn("job", "b")
    worker = running.spawn(SLEEP)
    keeper_turn = manager.begin_turn("other-job")
    keeper = keeper_turn.spawn(SLEEP)
    result = manager.end_task("job", grace=0)
    assert {survivor.pid, worker.pid} <= set(result.killed) and result.refused == []
    assert survivor.wait(timeout=10) == worker.wait(timeout=10) == -signal.SIGKILL  # grace=0: no SIGTERM
    assert manager.turns("job") == []
    assert outside.poll() is None and keeper.poll() is None
    keeper_turn.abandon("cleanup", grace=0)
    keeper.wait(timeout=10)


def test_blank_task_matches_nothing(manager):
    turn = manager.begin_turn("real")
    p = turn.spawn(SLEEP)
    assert manager.snapshot_running_ids("") == frozenset()
    assert manager.snapshot_running_ids("   ") == frozenset()
    assert manager.kill_started_since(frozenset(), "") == 0
    assert manager.kill_started_since(frozenset(), " \n") == 0
    assert manager.end_task("").killed == []
    assert manager.turns("") == []
    assert p.poll() is None
    turn.abandon("cleanup", grace=0)
    p.wait(timeout=10)


def test_kill_started_since_kills_only_what_is_new_in_that_task(manager):
    old_turn = manager.begin_turn("chat", "1")
    old = old_turn.spawn(SLEEP)
    old_turn.complete()
    elsewhere_turn = manager.begin_turn("other-chat")
    elsewhere = elsewhere_turn.spawn(SLEEP)
    assert wait_until(lambda: manager.snapshot_running_ids("chat"))
    baseline = manager.snapshot_running_ids("chat")
    assert len(baseline) == 1
    new_turn = manager.begin_turn("chat", "2")
    new = [new_turn.spawn(SLEEP) for _ in range(2)]
    assert wait_until(lambda: len(manager.snapshot_running_ids("chat")) == 3)
    assert manager.snapshot_running_ids("chat") > baseline
    assert manager.kill_started_since(baseline, "chat") == 2
    for p in new:
        assert p.wait(timeout=10) == -signal.SIGKILL
    assert old.poll() is None and elsewhere.poll() is None
    manager.end_task("chat")
    manager.end_task("other-chat")
    old.wait(timeout=10)
    elsewhere.wait(timeout=10)


def test_abandoned_turn_does_not_slip_into_a_later_baseline(manager):
    """A turn marked abandoned whose kill never ran: its processes are not protected by a baseline,
    not even one taken while it still ran; a newer turn's process in the baseline is."""
    stale = manager.begin_turn("session", "old")
    leaked = stale.spawn(SLEEP)
    assert wait_until(lambda: stale.pids())
    early = manager.snapshot_running_ids("session")  # taken while the turn still ran: names `leaked`
    assert len(early) == 1
    # Mark it abandoned without killing (the reaper that should have run was skipped).
    won, _ = manager.backend.transition(stale.record.task_key, stale.record.turn_key, {RUNNING},
                                        ABANDONED, {"reason": "skipped-reap"})
    assert won
    assert manager.snapshot_running_ids("session") == frozenset()
    newer = manager.begin_turn("session", "new")
    kept = newer.spawn(SLEEP)
    assert wait_until(lambda: len(manager.snapshot_running_ids("session")) == 1)
    baseline = manager.snapshot_running_ids("session")
    assert manager.kill_started_since(early | baseline, "session") == 1
    assert leaked.wait(timeout=10) == -signal.SIGKILL
    assert kept.poll() is None
    manager.end_task("session")


def test_spawn_refuses_arguments_that_would_defeat_ownership(manager):
    turn = manager.begin_turn("kwargs")
    with pytest.raises(ValueError, match="does not support executable="):
        turn.spawn(SLEEP, executable="/bin/sh")
    assert turn.pids() == []
    turn.complete()


def test_a_command_wrapped_in_setpriv_runs_unprivileged_inside_the_turn(manager):
    turn = manager.begin_turn("setpriv")
    out = turn.spawn(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "id", "-u"],
                     stdout=subprocess.PIPE, text=True).communicate(timeout=10)[0]
    assert out.strip() == "65534"
    turn.complete()


def test_wait_empty_answers_when_the_last_process_is_gone(manager):
    """Exact even when a grandchild outlives the command (the 'is it finished?' trap of pipes)."""
    turn = manager.begin_turn("wait-empty")
    p = turn.spawn(["sh", "-c", "sleep 300 & echo $!; exit 0"], stdout=subprocess.PIPE, text=True)
    grandchild = int(p.stdout.readline())
    assert p.wait(timeout=10) == 0                 # the command is done ...
    assert turn.pids() == [grandchild]             # ... but its grandchild is not, until we end it
    assert turn.wait_empty(0.05) is False          # it cannot be empty while that sleep lives
    os.kill(grandchild, signal.SIGKILL)            # alive (sleep 300): the pid is still its own
    assert turn.wait_empty(30) is True
    assert turn.pids() == []
    assert turn.environment["CGTURN_TURN"] == turn.record.turn_key
    turn.complete()


def test_spawns_racing_an_abandon_leave_nothing_running(manager):
    """A worker thread keeps spawning while the turn is abandoned: every process it got is killed,
    and once the turn is abandoned spawn refuses (NoSuchTurn), never runs outside it."""
    import threading

    turn = manager.begin_turn("race-spawn")
    started, errors, refused = [], [], threading.Event()

    def spawner():
        for _ in range(200):
            try:
                started.append(turn.spawn(SLEEP))
            except NoSuchTurn:
                refused.set()
                return
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)
                return

    worker = threading.Thread(target=spawner)
    worker.start()
    assert wait_until(lambda: len(started) >= 3)
    turn.abandon("race", grace=0)
    worker.join(60)
    assert not errors and refused.is_set()
    for p in started:
        assert p.wait(timeout=15) == -signal.SIGKILL


def test_a_turn_as_a_context_manager_completes_or_abandons(manager):
    with manager.begin_turn("ctx", "ok") as turn:
        survivor = turn.spawn(SLEEP)
    assert turn.state == "completed" and alive(survivor.pid)
    with pytest.raises(RuntimeError, match="worker failed"):
        with manager.begin_turn("ctx", "failed") as failed:
            victim = failed.spawn(SLEEP)
            raise RuntimeError("worker failed")
    assert failed.state == "abandoned" and failed.record.reason == "error"
    assert victim.wait(timeout=10) == -signal.SIGKILL
    manager.end_task("ctx", grace=0)
    assert survivor.wait(timeout=10) == -signal.SIGKILL


def test_a_supervisor_is_refused_on_a_turn_that_is_not_running(manager):
    turn = manager.begin_turn("sup", "done")
    turn.complete()
    with pytest.raises(NoSuchTurn, match="only a running turn"):
        Supervisor(turn, timeout=1)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        with manager.begin_turn("sup", "bad") as bad:  # the block's error abandons the new turn
            Supervisor(bad, timeout=-1)
    assert bad.state == "abandoned"
