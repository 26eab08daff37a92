"""The public observation API on real turns: listener events (TurnManager.add_listener, cgturn.TurnListener)
and the structured fields of cgturn's log records. docs/events.md documents both."""
import json
import logging
import os
import signal
import subprocess

import cgturn
from cgturn import COMPLETED, ABANDONED, TurnEnded, TurnListener
from conftest import PY, cgturn_env

SLEEP = ["sleep", "300"]
# Ids whose encoded directory names differ from them: events must carry the originals.
TASK, TURN = "chat/42 ü", "turn #1"


class Recorder(TurnListener):
    """Implements only some hooks (the rest stay the protocol's no-ops) and records what it saw."""

    def __init__(self):
        self.seen = []

    def turn_begun(self, turn):
        self.seen.append(("begun", turn.task_id, turn.turn_id))

    def turn_touched(self, turn):
        self.seen.append(("touched", turn.task_id, turn.turn_id))

    def turn_ended(self, event):
        self.seen.append(("ended", event))

    def lease_set(self, record):
        self.seen.append(("lease", record.task_id, record.turn_id, record.expires_at))

    def ended(self) -> list[TurnEnded]:
        return [item[1] for item in self.seen if item[0] == "ended"]


def test_begin_touch_complete_and_lease_events_carry_the_original_ids(manager):
    rec = Recorder()
    manager.add_listener(rec)
    assert rec in manager.listeners
    turn = manager.begin_turn(TASK, TURN)
    survivor = turn.spawn(SLEEP)
    turn.touch()
    turn.complete(keep_for=600)
    [ended] = rec.ended()
    assert (ended.task_id, ended.turn_id, ended.state, ended.reason) == (TASK, TURN, COMPLETED, None)
    assert (ended.task_key, ended.turn_key) == turn.names and ended.names == turn.names
    assert (ended.killed, ended.killed_by, ended.signals) == ([], None, [])
    assert rec.seen[:2] == [("begun", TASK, TURN), ("touched", TASK, TURN)]
    [lease] = [item for item in rec.seen if item[0] == "lease"]
    assert lease[1:3] == (TASK, TURN) and lease[3] is not None
    manager.end_task(TASK, grace=0)
    assert survivor.wait(timeout=10) == -signal.SIGKILL


def test_every_abandon_path_reports_its_reason_and_figures(manager):
    """Turn.abandon, end_task (a running and a completed turn) and recovery of a turn whose owner died."""
    rec = Recorder()
    manager.add_listener(rec)
    me = os.getpid()

    turn = manager.begin_turn(TASK, "by-hand")
    worker = turn.spawn(SLEEP)
    result = turn.abandon("user-stop", grace=0)
    [event] = rec.ended()
    assert (event.task_id, event.turn_id, event.state, event.reason) == (TASK, "by-hand", ABANDONED, "user-stop")
    assert event.killed == result.killed == [worker.pid]
    assert event.killed_by == me and event.signals == result.signals == ["SIGKILL"]
    assert event.duration_ms == result.duration_ms > 0
    worker.wait(timeout=10)

    running = manager.begin_turn(TASK, "running")
    a = running.spawn(SLEEP)
    done = manager.begin_turn(TASK, "done")
    b = done.spawn(SLEEP)
    done.complete()
    manager.end_task(TASK, reason="session-over", grace=0)
    by_turn = {e.turn_id: e for e in rec.ended() if e.state == ABANDONED and e.turn_id != "by-hand"}
    assert set(by_turn) == {"running", "done"}
    assert by_turn["running"].killed == [a.pid] and by_turn["done"].killed == [b.pid]
    assert {e.reason for e in by_turn.values()} == {"session-over"}
    assert {e.killed_by for e in by_turn.values()} == {me}
    a.wait(timeout=10)
    b.wait(timeout=10)

    # Another process begins a turn, starts a sleep in it and dies: recovery abandons it here.
    backend = manager.backend_name
    root = manager.root
    code = (f"import os, subprocess, cgturn; m = cgturn.TurnManager(root={root!r}, backend={backend!r}, "
            f"state_dir={manager.state_dir!r}, sentinel=False); t = m.begin_turn('ghost', 'g'); "
            f"p = t.spawn({SLEEP!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            f"print(p.pid, flush=True); os._exit(0)")
    out = subprocess.run([PY, "-c", code], env=cgturn_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    orphan = int(out.stdout)
    manager.recover()
    [ghost] = [e for e in rec.ended() if e.task_id == "ghost"]
    assert (ghost.turn_id, ghost.state, ghost.reason) == ("g", ABANDONED, cgturn.reasons.OWNER_DIED)
    assert ghost.killed == [orphan] and ghost.killed_by == me


def test_a_failing_listener_is_logged_and_never_reaches_the_caller(manager, caplog):
    class Broken(TurnListener):
        def turn_begun(self, turn):
            raise RuntimeError("listener bug")

    manager.add_listener(Broken())
    with caplog.at_level(logging.ERROR, logger="cgturn"):
        turn = manager.begin_turn(TASK, TURN)
    assert turn.state == "running"
    assert [r.exc_info[1].args for r in caplog.records if r.exc_info] == [("listener bug",)]
    turn.abandon("cleanup", grace=0)


def test_an_abandon_logs_structured_fields_on_the_audit_record(manager, caplog):
    turn = manager.begin_turn(TASK, TURN)
    worker = turn.spawn(SLEEP)
    with caplog.at_level(logging.INFO, logger="cgturn.audit"):
        turn.abandon("client-gone", grace=0)
    [record] = [r for r in caplog.records if r.name == "cgturn.audit"]
    assert (record.cgturn_task, record.cgturn_turn, record.cgturn_reason) == (TASK, TURN, "client-gone")
    assert (record.cgturn_action, record.cgturn_pids) == ("kill", [worker.pid])
    assert json.loads(record.getMessage()) == record.cgturn_record  # the JSON message users grep, unchanged
    assert record.cgturn_record["task"] == TASK and record.cgturn_record["reason"] == "client-gone"
    worker.wait(timeout=10)


def test_supervisor_log_lines_about_a_turn_carry_its_fields(manager, caplog):
    """A line of the `cgturn.supervisor` logger: a kill skipped because a newer turn superseded this one."""
    turn = manager.begin_turn(TASK, TURN)
    sup = cgturn.Supervisor(turn, timeout=600, is_still_current=lambda: False, use_sentinel=False)
    with caplog.at_level(logging.INFO, logger="cgturn.supervisor"):
        result = sup._kill("timeout", 0.0)
    assert result.skipped
    [record] = [r for r in caplog.records if r.name == "cgturn.supervisor"]
    assert (record.cgturn_task, record.cgturn_turn, record.cgturn_reason) == (TASK, TURN, "timeout")
    turn.abandon("cleanup", grace=0)
