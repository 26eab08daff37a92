"""The operator commands through the real CLI in a subprocess: ps, stop, end, reap, watch; bad input."""
import datetime
import json
import os
import signal
import subprocess
import time

import pytest

from cgturn import RUNNING, TurnManager
from conftest import (DAEMON_AND_WAIT, alive, audit_reasons, cgturn_popen, cli, completed_turn, kill_scope,
                      wait_until)


def ps(root, state_dir, *args):
    out = cli(root, state_dir, "ps", "--json", *args)
    assert out.returncode == 0, out.stderr
    return {(row["task"], row["turn"]): row for row in json.loads(out.stdout)}


def test_ps_shows_every_field_and_filters_by_task(cgroup2_root, state_dir, runs):
    before = time.time()
    proc, daemon = runs("chat/1", "t-1")
    survivor = completed_turn(cgroup2_root, state_dir, "ci", "job")
    rows = ps(cgroup2_root, state_dir)
    after = time.time()
    running, completed = rows[("chat/1", "t-1")], rows[("ci", "job")]
    assert running["state"] == "running" and daemon in running["pids"] and len(running["pids"]) >= 2
    assert running["owner_pid"] == proc.pid
    assert completed["state"] == "completed" and completed["pids"] == [survivor]
    for row in rows.values():
        # each turn ran a shell (its CPU time stays counted) and still holds a sleep (resident memory)
        assert row["cpu_seconds"] > 0 and row["memory_bytes"] > 0
        assert row["ports"] == []
        assert row["started_at"].endswith("+00:00")
        started = datetime.datetime.fromisoformat(row["started_at"]).timestamp()
        assert before - 0.001 <= started <= after  # started during this test, listed after it started
        assert 0 <= row["age_seconds"] <= after - started + 0.001
    assert set(ps(cgroup2_root, state_dir, "--task", "ci")) == {("ci", "job")}
    table = cli(cgroup2_root, state_dir, "ps")
    assert table.returncode == 0 and "chat/1" in table.stdout and "completed" in table.stdout


def test_stop_abandons_a_running_turn_then_says_no_such_turn(cgroup2_root, state_dir, runs):
    proc, daemon = runs("chat", "t-1")
    out = cli(cgroup2_root, state_dir, "stop", "chat", "t-1", "--grace", "0.2", "--reason", "operator", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["skipped"] is False and daemon in data["killed"] and data["reason"] == "operator"
    assert wait_until(lambda: not alive(daemon))
    assert "operator" in audit_reasons(state_dir)
    proc.wait(timeout=30)  # its command died with the turn, so cgturn run exits (its status: the test below)
    again = cli(cgroup2_root, state_dir, "stop", "chat", "t-1")
    assert again.returncode == 1 and again.stderr.count("\n") == 1 and "no turn" in again.stderr


def test_run_stopped_by_someone_else_passes_the_commands_status_through(cgroup2_root, state_dir):
    """CONTRACT: when someone else abandons its turn, one stderr line names the reason and the status
    is the command's (128+N), not 124 (which means its own --timeout)."""
    proc = cgturn_popen(cgroup2_root, state_dir, "run", "--task", "chat", "--turn", "t-1", "--",
                        "sh", "-c", "echo up; exec sleep 300", stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "up\n"
        assert cli(cgroup2_root, state_dir, "stop", "chat", "t-1", "--grace", "5", "--reason", "operator").returncode == 0
        err = proc.stderr.read()
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # the sleep dies of the SIGTERM
        assert [line for line in err.splitlines() if "operator" in line], err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_leaves_a_completed_turns_survivors_unless_forced(cgroup2_root, state_dir):
    survivor = completed_turn(cgroup2_root, state_dir, "ci", "job")
    out = cli(cgroup2_root, state_dir, "stop", "ci", "job", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["skipped"] is True
    assert alive(survivor)
    forced = cli(cgroup2_root, state_dir, "stop", "ci", "job", "--force", "--grace", "0")
    assert forced.returncode == 0 and str(survivor) in forced.stdout
    assert wait_until(lambda: not alive(survivor))


def test_end_kills_everything_the_task_owns(cgroup2_root, state_dir, runs):
    _, daemon = runs("chat", "t-2")
    survivor = completed_turn(cgroup2_root, state_dir, "chat", "t-1")
    other = completed_turn(cgroup2_root, state_dir, "other", "t-1")
    out = cli(cgroup2_root, state_dir, "end", "chat", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {daemon, survivor} <= set(data["killed"]) and data["turns_left"] == []
    assert wait_until(lambda: not alive(daemon) and not alive(survivor))
    assert alive(other)  # another task's survivor is not touched
    assert not os.path.exists(os.path.join(cgroup2_root, "chat"))
    again = cli(cgroup2_root, state_dir, "end", "chat", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["killed"] == []


def test_reap_after_the_owner_was_sigkilled(cgroup2_root, state_dir, runs):
    """`cgturn run` dies mid-turn with no sentinel: reap abandons its turn, a live owner's is untouched."""
    env = {**os.environ, "CGTURN_SENTINEL": "0"}
    crashed, orphan = runs("gw", "crashed", env=env)
    live, live_daemon = runs("gw", "live", env=env)
    survivor = completed_turn(cgroup2_root, state_dir, "ci", "done")
    os.kill(crashed.pid, signal.SIGKILL)
    crashed.wait()
    assert alive(orphan)  # nobody else cleaned up: it is reap's work
    out = cli(cgroup2_root, state_dir, "reap", "--json", env=env)
    assert out.returncode == 0, out.stderr
    actions = json.loads(out.stdout)
    assert [(a["action"], a["turn"]) for a in actions] == [("abandoned", "crashed")]
    assert orphan in actions[0]["killed"] and actions[0]["reason"] == "owner-died"
    assert wait_until(lambda: not alive(orphan))
    assert not os.path.exists(os.path.join(cgroup2_root, "gw", "crashed"))
    assert "owner-died" in audit_reasons(state_dir)
    # beside a live gateway: its running turn and a completed turn's survivor are left alone
    rows = ps(cgroup2_root, state_dir)
    assert rows[("gw", "live")]["state"] == "running" and alive(live_daemon) and live.poll() is None
    assert rows[("ci", "done")]["pids"] == [survivor]
    second = cli(cgroup2_root, state_dir, "reap", "--json")
    assert second.returncode == 0 and json.loads(second.stdout) == []


def test_reap_removes_a_completed_turn_with_nothing_left(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "run", "--task", "ci", "--turn", "x", "--", "sh", "-c",
              "sleep 300 >/dev/null 2>&1 & echo $!")
    survivor = int(out.stdout.split()[-1])
    os.kill(survivor, signal.SIGKILL)
    assert wait_until(lambda: not alive(survivor))
    assert wait_until(lambda: cli(cgroup2_root, state_dir, "ps", "--json").stdout.count('"pids": []') == 1)
    reaped = cli(cgroup2_root, state_dir, "reap")
    assert reaped.returncode == 0 and "removed" in reaped.stdout
    assert ps(cgroup2_root, state_dir) == {}


def test_recover_true_treats_a_reused_owner_pid_as_dead(cgroup2_root, state_dir):
    """The owner pid is alive (it is us) but its start time differs: a reused pid, not the owner."""
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir) as mgr:
        turn = mgr.begin_turn("gw", "old")
        child = turn.spawn(["sleep", "300"])
        rec = turn.record
        won, _ = mgr.backend.transition(rec.task_key, rec.turn_key, {RUNNING}, RUNNING,
                                        {"owner_start": rec.owner_start - 1})
        assert won
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, recover=True) as mgr:
        assert mgr.turns() == []
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_watch_once_prints_one_frame(cgroup2_root, state_dir, runs):
    runs("chat", "t-1")
    out = cli(cgroup2_root, state_dir, "watch", "--once")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("cgturn watch") and "1 running" in out.stdout and "t-1" in out.stdout
    assert "\x1b" not in out.stdout


def test_bad_input_leaves_an_existing_turn_alone(cgroup2_root, state_dir, runs):
    _, daemon = runs("chat", "t-1")
    for args in (["stop", "chat", "t-1", "--grace", "-1"], ["end", " "], ["stop", "chat", "t-1", "x"]):
        out = cli(cgroup2_root, state_dir, *args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (args, out.stderr)
    assert alive(daemon) and ps(cgroup2_root, state_dir)[("chat", "t-1")]["state"] == "running"


def test_ps_and_reap_on_the_registry_backend(state_dir):
    """The same recovery where cgroup v2 is not used: owner SIGKILLed, reap finds its turn's daemon."""
    env = {**os.environ, "CGTURN_SENTINEL": "0"}
    owner = cgturn_popen(None, state_dir, "run", "--task", "gw", "--turn", "crashed", "--", "sh", "-c",
                         DAEMON_AND_WAIT, env=env, backend="registry")
    try:
        daemon = int(owner.stdout.readline())
        rows = json.loads(cli(None, state_dir, "ps", "--json", backend="registry").stdout)
        assert [(r["turn"], r["state"], daemon in r["pids"]) for r in rows] == [("crashed", "running", True)]
        owner.kill()
        assert owner.wait() == -signal.SIGKILL
        out = cli(None, state_dir, "reap", "--json", env=env, backend="registry")
        assert out.returncode == 0, out.stderr
        assert [(a["action"], daemon in a["killed"]) for a in json.loads(out.stdout)] == [("abandoned", True)]
        assert wait_until(lambda: not alive(daemon))
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        kill_scope(os.path.join(state_dir, "registry.sqlite3"))


def test_watch_redraws_until_ctrl_c(cgroup2_root, state_dir):
    p = cgturn_popen(cgroup2_root, state_dir, "watch", "--interval", "0.1")
    try:
        headers = 0
        while headers < 2:  # two frames drawn: it keeps refreshing
            line = p.stdout.readline()
            assert line, "watch exited early"
            headers += line.startswith("cgturn watch")
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
