"""Leases for survivors on both backends: the sentinel expires a lease while a survivor without one
lives; `cgturn reap` expires the lease of an owner that is gone; set_lease extends and clears; the
manager-wide default. Real processes throughout."""
import datetime
import json
import math
import signal
import subprocess
import textwrap
import time

import pytest

from cgturn import NoSuchTurn, TurnManager
from cgturn.sentinel import attach as attach_sentinel
from conftest import PY, alive, audit_records, cgturn_env, cli, wait_until

SLEEP = ["sleep", "300"]
BOUND = 15.0  # generous: an expiry on a loaded 2-core host


def kills(manager, turn_id):
    return [r for r in audit_records(manager.state_dir, turn_id) if r.get("action", "kill") == "kill"]


def test_a_lease_expires_and_its_survivor_dies_while_one_without_lives(manager):
    client = attach_sentinel(manager)
    leased = manager.begin_turn("dev", "leased")
    doomed = leased.spawn(SLEEP)
    kept_turn = manager.begin_turn("dev", "kept")
    kept = kept_turn.spawn(SLEEP)
    kept_turn.complete()
    before = time.time()
    leased.complete(keep_for=0.5)
    rows = {info.turn: info.to_json() for info in manager.turns("dev")}
    expires = datetime.datetime.fromisoformat(rows["leased"]["expires_at"]).timestamp()
    assert before + 0.5 - 0.001 <= expires <= time.time() + 0.5 + 0.001
    assert rows["kept"]["expires_at"] is None
    assert doomed.wait(timeout=BOUND) == -signal.SIGKILL
    assert wait_until(lambda: kills(manager, "leased"))  # written after the kill
    [record] = kills(manager, "leased")
    assert record["reason"] == "lease-expired" and record["pids"] == [doomed.pid]
    assert record["by_pid"] == client.pid  # the sentinel carried it out
    assert record["time"] >= expires
    assert kept.poll() is None and kills(manager, "kept") == []
    assert [info.turn for info in manager.turns("dev")] == ["kept"]
    manager.end_task("dev")


# The owner: two completed turns with survivors (one lease short, one long), then it exits.
OWNER = textwrap.dedent("""
    import json, subprocess, sys
    from cgturn import TurnManager
    root, backend, state = sys.argv[1] or None, sys.argv[2], sys.argv[3]
    with TurnManager(root=root, backend=backend, state_dir=state, sentinel=False) as mgr:
        out = {}
        for name, lease in (("short", 0.3), ("long", 3600)):
            turn = mgr.begin_turn("gone", name)
            p = turn.spawn(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE, text=True)
            out[name] = int(p.stdout.readline())
            p.wait()
            turn.complete(keep_for=lease)
            out[name + "_expires"] = turn.expires_at
    print(json.dumps(out))
""")


def test_reap_expires_the_lease_of_an_owner_that_is_gone(manager):
    owner = subprocess.run([PY, "-c", OWNER, manager.root or "", manager.backend_name, manager.state_dir],
                           capture_output=True, text=True, timeout=60, env=cgturn_env())
    assert owner.returncode == 0, owner.stderr
    info = json.loads(owner.stdout)
    assert alive(info["short"]) and alive(info["long"])
    assert wait_until(lambda: time.time() > info["short_expires"], timeout=BOUND)
    out = cli(manager.root, manager.state_dir, "reap", "--json", backend=manager.backend_name)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"action": "lease-expired", "task": "gone", "turn": "short",
                                       "reason": "lease-expired", "killed": [info["short"]]}]
    assert wait_until(lambda: not alive(info["short"]))
    assert alive(info["long"])
    [row] = json.loads(cli(manager.root, manager.state_dir, "ps", "--json", backend=manager.backend_name).stdout)
    assert row["turn"] == "long" and row["pids"] == [info["long"]]
    assert datetime.datetime.fromisoformat(row["expires_at"]).timestamp() == pytest.approx(info["long_expires"],
                                                                                          abs=0.001)
    manager.end_task("gone")


def test_set_lease_extends_clears_and_recover_expires(manager):
    turn = manager.begin_turn("lease", "t")
    survivor = turn.spawn(SLEEP)
    with pytest.raises(NoSuchTurn, match="running: only a completed"):
        turn.set_lease(10)
    turn.complete(keep_for=0)  # expired at once, but nobody has looked yet
    assert turn.expires_at <= time.time()
    turn.set_lease(3600)  # extended before anyone carried the expiry out
    assert turn.expires_at == pytest.approx(time.time() + 3600, abs=5)
    assert [a.action for a in manager.recover()] == []
    turn.set_lease(None)
    assert turn.expires_at is None
    assert manager.recover() == [] and survivor.poll() is None
    for bad in (-1, float("nan"), "10", True):
        with pytest.raises(ValueError):
            turn.set_lease(bad)
    turn.set_lease(0)
    # a second manager recovering at start-up (a gateway restart) carries it out
    with TurnManager(root=manager.root, backend=manager.backend_name, state_dir=manager.state_dir,
                     recover=True, sentinel=False):
        pass
    assert survivor.wait(timeout=BOUND) == -signal.SIGKILL
    assert [r["reason"] for r in kills(manager, "t")] == ["lease-expired"]
    with pytest.raises(NoSuchTurn):
        turn.set_lease(10)


def test_manager_wide_default_lease(manager, monkeypatch):
    kw = dict(root=manager.root, backend=manager.backend_name, state_dir=manager.state_dir, sentinel=False)
    monkeypatch.setenv("CGTURN_LEASE", "soon")
    with pytest.raises(ValueError, match="CGTURN_LEASE"):
        TurnManager(**kw)
    monkeypatch.setenv("CGTURN_LEASE", "120")
    with TurnManager(**kw) as by_env, TurnManager(**kw, lease=60) as by_keyword:
        assert (by_env.lease, by_keyword.lease) == (120.0, 60.0)
        # begin/complete only: two managers in one process cannot both spawn (gate names collide)
        turn = by_keyword.begin_turn("default", "kw")
        survivor = manager.turn("default", "kw").spawn(SLEEP)
        turn.complete()
        assert turn.expires_at == pytest.approx(turn.record.ended_at + 60)
        other = by_keyword.begin_turn("default", "forever")
        other_survivor = manager.turn("default", "forever").spawn(SLEEP)
        other.complete(keep_for=math.inf)
        assert other.expires_at is None
    monkeypatch.delenv("CGTURN_LEASE")
    with pytest.raises(ValueError):
        TurnManager(**kw, lease=-1)
    manager.end_task("default", grace=0)
    assert survivor.wait(timeout=10) == other_survivor.wait(timeout=10) == -signal.SIGKILL
