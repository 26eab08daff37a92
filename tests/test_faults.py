"""Faults injected on the real kernel, each made by the test on what it created: the state directory on
a full filesystem and read-only (a tmpfs mounted on the test's own state directory inside a child's
private mount namespace: root's DAC override makes chmod useless, and nothing is mounted over the real
/run/cgturn), EMFILE in the gateway (a child gateway with a low RLIMIT_NOFILE),
`cgroup.max.descendants` reached on a managed root the test made, the sentinel SIGKILLed by its
recorded pid again and again during churn, and the owner SIGSTOPped in the middle of its abandon.

For each: no wrong kill (a completed turn's survivor lives), no leak (every process of an abandoned
turn dies, every cgroup is removed or listed), a clear error where the operation cannot be done, and
the next operation after the fault is lifted works. The gateway side is tests/fault_gateway.py.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import REPO, alive, cgturn_env, kill_scope, need_cgroup2, wait_until

GATEWAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_gateway.py")

def run_gateway(scenario: str, private_mounts: bool, **args) -> dict:
    need_cgroup2()
    argv = [sys.executable, GATEWAY, scenario, json.dumps(args)]
    if private_mounts:
        if shutil.which("unshare") is None:
            pytest.skip("util-linux unshare is not installed")
        argv = ["unshare", "--mount", "--propagation", "private", *argv]
    env = cgturn_env()
    env["CGTURN_FAULT_PARENT_MNTNS"] = os.readlink("/proc/self/ns/mnt")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    report = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
    assert "crash" not in report, report.get("crash")
    assert out.returncode == 0, out.stderr
    return report


def all_dead(pids) -> bool:
    return wait_until(lambda: not any(alive(p) for p in pids), timeout=10)


def one_clear_line(error: str | None) -> None:
    """An error a user can act on: one line, saying which resource failed, never a traceback."""
    if error is not None:
        assert "\n" not in error.strip() and "Traceback" not in error, error


STATE_DIR_CASES = [
    pytest.param("cgroup2", "full", id="cgroup2-full"),
    pytest.param("cgroup2", "readonly", id="cgroup2-readonly"),
    pytest.param("cgroup2-files", "full", id="metadata-fallback-full"),
    pytest.param("cgroup2-files", "readonly", id="metadata-fallback-readonly"),
    # The registry's mark, kill bookkeeping and row removal all go through its database: the kill
    # must not wait on it (cgturn/backends/registry.py).
    pytest.param("registry", "full", id="registry-full"),
    pytest.param("registry", "readonly", id="registry-readonly"),
]


@pytest.mark.parametrize("backend,fault", STATE_DIR_CASES)
def test_a_full_or_read_only_state_dir_never_stops_a_kill(cgroup2_root, state_dir, backend, fault):
    report = {}
    try:
        report = run_gateway("state-dir", True, root=cgroup2_root, state_dir=state_dir, backend=backend,
                             fault=fault)
        # The kills happened: the owner's, and `cgturn stop`'s from another process (its audit record
        # and the owner's note could not be written: both said so, and it exited 0).
        assert all_dead(report["victim_pids"]) and report["victim_exited"], report["abandon_error"]
        assert report["abandon_error"] is None
        assert report["stop"]["rc"] == 0, report["stop"]["stderr"]
        assert all_dead(report["outside_pids"])
        for line in report["stop"]["stderr"].splitlines():   # warnings, no traceback
            assert line.startswith(("cannot ", "killing turn 'outside'")), report["stop"]["stderr"]
        if backend == "registry":   # its mark failed: the kill says what its record lacks
            assert "cannot record the abandon: turn 'outside'" in report["stop"]["stderr"]
        one_clear_line(report["begin_error"])
        # No wrong kill; what remains is listed.
        assert all(alive(p) for p in report["survivor_pids"])
        assert ["keep", "completed"] in report["turns_after"]
        if backend == "registry":
            # Killed by `cgturn stop` while the database refused writes: the row stays, listed as
            # running with no processes, until a stop once the fault is lifted removes it. The
            # owner's own kill is forgotten by its next write that works.
            assert {t for t, _ in report["turns_after"]} <= {"keep", "during", "outside"}
            assert report["restop"]["rc"] == 0, report["restop"]["stderr"]
            assert {t for t, _ in report["turns_after_restop"]} <= {"keep", "during"}
        else:
            assert {t for t, _ in report["turns_after"]} <= {"keep", "during"}
        # Lifted: the next turn is killed and audited, and the record cut short by the full disk did
        # not take this one with it.
        assert all_dead(report["after_pids"]) and sorted(report["after_abandon"]) == report["after_pids"]
        assert report["audit_kills"].get("after-lift") == 1
        assert report["audit_malformed"] <= 1
    finally:
        if report.get("scope") and backend == "registry":
            kill_scope(report["scope"])
        for pid in report.get("victim_pids", []) + report.get("outside_pids", []) + report.get("survivor_pids", []):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_emfile_in_the_gateway_is_a_clear_error_and_the_kill_works_once_lifted(cgroup2_root, state_dir):
    report = run_gateway("emfile", False, root=cgroup2_root, state_dir=state_dir)
    assert report["exhausted"] == "Too many open files"
    # Neither a begin nor an abandon can be done without an fd: each says so, nothing half-done.
    for error in (report["begin_error"], report["abandon_error"]):
        assert error is not None and "Too many open files" in error
        one_clear_line(error)
    assert ["victim", "running", 2] in report["turns_lifted"]   # still listed, still whole
    # Lifted: the abandon kills it; the survivor of the completed turn was never touched.
    assert report["second_abandon_error"] is None and report["recover_error"] is None
    assert all_dead(report["victim_pids"])
    assert all(alive(p) for p in report["survivor_pids"])
    assert all_dead(report["after_pids"]) and sorted(report["after_abandon"]) == report["after_pids"]
    assert {t for t, _ in report["turns_after"]} <= {"keep", "during"}


def test_max_descendants_reached_refuses_new_turns_clearly_and_kills_still_work(cgroup2_manager, cgroup2_root):
    from cgturn import CgturnError

    mgr = cgroup2_manager
    running = mgr.begin_turn("full", "running")
    proc = running.spawn(["sh", "-c", "sleep 300 & exec sleep 300"])
    assert wait_until(lambda: len(running.pids()) == 2)
    pids = running.pids()
    limit_file = os.path.join(cgroup2_root, "cgroup.max.descendants")
    live = sum(len(dirs) for _, dirs, _ in os.walk(cgroup2_root))
    with open(limit_file, "w") as f:
        f.write(str(live))
    before = sorted(dirpath for dirpath, _, _ in os.walk(cgroup2_root))
    try:
        for task in ("full", "other"):   # a new turn dir in a task that has one, and in a new task
            with pytest.raises((CgturnError, OSError)) as caught:
                mgr.begin_turn(task, "refused")
            text = str(caught.value)
            assert "\n" not in text and "Resource temporarily unavailable" in text, text
            assert sorted(dirpath for dirpath, _, _ in os.walk(cgroup2_root)) == before  # nothing left
        assert sorted(info.turn for info in mgr.turns()) == ["running"]
        assert running.abandon("limit", grace=0).killed == sorted(pids)
        proc.wait(timeout=30)
    finally:
        with open(limit_file, "w") as f:
            f.write("max")
    after = mgr.begin_turn("other", "after")
    after.spawn(["/bin/true"]).wait()
    assert after.complete() is not None
    assert not any(alive(p) for p in pids)


def test_the_sentinel_sigkilled_repeatedly_during_churn_kills_nothing_and_leaks_nothing(cgroup2_root, state_dir):
    from cgturn import Supervisor, TurnManager, audit
    from cgturn.sentinel import attach as attach_sentinel

    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=True)
    try:
        keep = mgr.begin_turn("keep", "keep")
        keep.spawn(["sh", "-c", "sleep 300 & exit 0"]).wait()
        assert wait_until(lambda: len(keep.pids()) == 1)
        survivor = keep.pids()[0]
        keep.complete()
        killed_sentinels: list[int] = []
        outcomes = []
        for i in range(60):
            if i % 5 == 0:   # by its recorded pid: the sentinel this manager's client started
                client = attach_sentinel(mgr)
                assert client is not None
                os.kill(client.pid, signal.SIGKILL)
                killed_sentinels.append(client.pid)
            turn = mgr.begin_turn("churn")
            outcomes.append(Supervisor(turn, timeout=60, deadline=60, grace=0).run_blocking(
                lambda: turn.spawn(["sh", "-c", "exit 0"]).wait()))
        assert all(o.completed for o in outcomes), [o for o in outcomes if not o.completed][:3]
        assert audit.read_records(state_dir) == []          # no kill at all: nothing wrong killed
        assert alive(survivor)
        assert not any(alive(p) for p in killed_sentinels)
        assert {info.turn for info in mgr.turns() if info.pids} == {"keep"}   # no leak
        # The fault lifted: a sentinel runs again and a supervised turn's deadline kills it on time.
        client = attach_sentinel(mgr)
        assert client is not None and client.pid not in killed_sentinels and alive(client.pid)
        turn = mgr.begin_turn("after")
        proc = turn.spawn(["sh", "-c", "sleep 300 & exec sleep 300"])
        assert wait_until(lambda: len(turn.pids()) == 2)
        pids = turn.pids()
        outcome = Supervisor(turn, deadline=0.5, grace=0).run_blocking(proc.wait)
        assert outcome.reason == "deadline" and all_dead(pids)
    finally:
        mgr.close()


OWNER = """
import json, sys
from cgturn import TurnManager
root, state_dir = sys.argv[1], sys.argv[2]
mgr = TurnManager(root=root, backend="cgroup2", state_dir=state_dir, sentinel=False)
turn = mgr.begin_turn("owner", "victim")
quiet = dict(stdin=-3, stdout=-3, stderr=-3)
turn.spawn(["sh", "-c", "trap '' TERM; sleep 300 & exec sleep 300"], **quiet)
while len(turn.pids()) < 2:
    pass
print(json.dumps(sorted(turn.pids())), flush=True)
result = turn.abandon("owner", grace=3)   # SIGTERM is ignored: the grace runs out, then SIGKILL
print(json.dumps({"killed": result.killed, "skipped": result.skipped, "signals": result.signals}), flush=True)
mgr.close()
"""


def test_sigstop_of_the_owner_mid_abandon_kills_nothing_wrong_and_the_kill_finishes(cgroup2_manager, cgroup2_root,
                                                                                     state_dir):
    from conftest import cli

    keep = cgroup2_manager.begin_turn("keep", "keep")
    keep.spawn(["sh", "-c", "sleep 300 & exit 0"]).wait()
    assert wait_until(lambda: len(keep.pids()) == 1)
    survivor = keep.pids()[0]
    keep.complete()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, cgroup2_root, state_dir], stdout=subprocess.PIPE,
                             text=True, env=cgturn_env())
    try:
        pids = json.loads(owner.stdout.readline())
        assert wait_until(lambda: [i.state for i in cgroup2_manager.turns("owner")] == ["abandoned"], timeout=30)
        owner.send_signal(signal.SIGSTOP)   # mid-abandon: in its grace, SIGTERM sent, SIGKILL not yet
        # Another process meanwhile: stop and reap answer at once and kill nothing wrong.
        stop = cli(cgroup2_root, state_dir, "stop", "owner", "victim", "--grace", "0")
        one_clear_line(stop.stderr.strip() or None)
        assert stop.returncode in (0, 1), stop.stderr
        reap = cli(cgroup2_root, state_dir, "reap")
        assert reap.returncode == 0, reap.stderr
        assert alive(survivor)
        owner.send_signal(signal.SIGCONT)
        result = json.loads(owner.stdout.readline())
        assert owner.wait(timeout=60) == 0
        assert all_dead(pids)
        # One kill, recorded once, whoever finished it; the turn is gone; the survivor lives.
        from cgturn import audit
        kills = [r for r in audit.read_records(state_dir) if r.get("turn") == "victim"]
        assert len(kills) == 1, kills
        assert cgroup2_manager.turns("owner") == []
        assert alive(survivor)
        assert result["skipped"] or sorted(result["killed"]) == pids
    finally:
        if owner.poll() is None:
            owner.send_signal(signal.SIGCONT)
            owner.kill()
            owner.wait()
