"""The sentinel: deadlines that hold when the owner is SIGSTOPped or SIGKILLed (both backends), and
`cgturn run` built on it. The owner runs in a real subprocess; every stopped process is killed at teardown."""
import json
import os
import signal
import subprocess
import textwrap
import uuid

import pytest

from cgturn import TurnManager, attach_sentinel
from cgturn.sentinel_server import SLACK
from conftest import (DAEMON_AND_WAIT, PY, alive, audit_reasons, cgturn_env, cgturn_popen, destroy_cgroup_tree,
                      kill_scope, need_cgroup2, wait_until)

# The owner: begins turns, prints what the test needs as one JSON line, then blocks in a supervisor.
OWNER = textwrap.dedent("""
    import json, sys, threading, time
    from cgturn import Supervisor, TurnManager
    root, backend, state, timeout, touch_for = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
    mgr = TurnManager(root=root or None, backend=backend, state_dir=state)
    done = mgr.begin_turn("gw", "done")
    survivor = done.spawn(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], stdout=-1, text=True)
    survivor_pid = int(survivor.stdout.readline())
    survivor.wait()
    done.complete()
    turn = mgr.begin_turn("gw", "live")
    turn.spawn(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & exec sleep 300"])
    while len(turn.pids()) < 2:
        time.sleep(0.005)
    sup = Supervisor(turn, timeout=timeout, grace=0.2)

    def worker():
        end = time.monotonic() + touch_for
        while time.monotonic() < end:
            turn.touch()
            time.sleep(0.02)
        print(json.dumps({"pids": turn.pids(), "survivor": survivor_pid, "sentinel": sup._sentinel.pid}), flush=True)
        threading.Event().wait()

    sup.run_blocking(worker)
""")


@pytest.fixture(params=["cgroup2", "registry"])
def owner(request, tmp_path):
    """Start OWNER in a subprocess on one backend; kill it (stopped or not) and clean up at teardown."""
    state = str(tmp_path / "state")
    root = ""
    if request.param == "cgroup2":
        root = os.path.join(need_cgroup2(), f"cgturn-test-{uuid.uuid4().hex[:10]}")
    procs = []

    def start(timeout=60.0, touch_for=0.0):
        p = subprocess.Popen([PY, "-c", OWNER, root, request.param, state, str(timeout), str(touch_for)],
                             stdout=subprocess.PIPE, text=True, env=cgturn_env())
        procs.append(p)
        info = json.loads(p.stdout.readline())
        return p, info, TurnManager(root=root or None, backend=request.param, state_dir=state, sentinel=False)

    yield start
    for p in procs:
        p.kill()  # SIGKILL ends a stopped process too
        p.wait()
    mgr = TurnManager(root=root or None, backend=request.param, state_dir=state, sentinel=False)
    try:
        for rec in mgr.backend.records():
            mgr.end_task(rec.task_id)
        scope = mgr.backend.scope
    finally:
        mgr.close()
    if root:
        destroy_cgroup_tree(root)
    else:
        kill_scope(scope)


def test_sentinel_kills_a_stopped_owners_turn_on_time(owner):
    """The owner touches (activity reaches the sentinel), then is SIGSTOPped: its turn dies on time."""
    timeout = 0.5
    p, info, mgr = owner(timeout=timeout, touch_for=3 * timeout)
    # Touched for 3x the timeout: alive, so the touches reached the sentinel.
    assert all(alive(pid) for pid in info["pids"])
    os.kill(p.pid, signal.SIGSTOP)
    bound = timeout + SLACK + 0.2 + 1.0
    assert wait_until(lambda: not any(alive(pid) for pid in info["pids"]), timeout=bound)
    assert wait_until(lambda: "timeout" in audit_reasons(mgr.state_dir, "live"))  # written after the kill
    assert alive(info["survivor"]) and alive(info["sentinel"])  # completed turn's survivor lives on
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: not alive(info["sentinel"]))  # nothing left to guard, owner gone
    mgr.close()


def test_sigkilled_owner_loses_its_running_turns_at_once(owner):
    p, info, mgr = owner()
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: not any(alive(pid) for pid in info["pids"]), timeout=1.0)
    assert wait_until(lambda: not alive(info["sentinel"]))
    assert alive(info["survivor"])
    assert [i.state for i in mgr.turns("gw")] == ["completed"]
    assert wait_until(lambda: audit_reasons(mgr.state_dir, "live") == ["owner-died"])
    mgr.close()


def test_switched_off_sentinel(tmp_path, monkeypatch):
    mgr = TurnManager(backend="registry", state_dir=str(tmp_path), sentinel=False)
    assert attach_sentinel(mgr) is None
    mgr.close()
    monkeypatch.setenv("CGTURN_SENTINEL", "0")
    mgr = TurnManager(backend="registry", state_dir=str(tmp_path))
    assert mgr.sentinel_enabled is False and attach_sentinel(mgr) is None
    mgr.close()


def test_idle_sentinel_exits_when_its_manager_closes(manager):
    client = attach_sentinel(manager)
    assert attach_sentinel(manager) is client  # one per manager
    turn = manager.begin_turn("t")
    turn.complete()
    manager.close()
    assert client.process.wait(timeout=10) == 0  # it exits by itself, cleanly


def test_sentinel_runs_under_sched_batch(manager):
    """Its wake-ups (a message per begin and per completion) must not preempt the owner (sched(7):
    SCHED_BATCH tasks do not preempt on wake-up); it is set before `ready`, so attach sees it."""
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # what the owner passes on
    client = attach_sentinel(manager)
    assert os.sched_getscheduler(client.pid) == os.SCHED_BATCH
    turn = manager.begin_turn("t")
    assert turn.complete() is True
    manager.close()
    assert client.process.wait(timeout=10) == 0


# --- `cgturn run` on the supervisor ------------------------------------------------------------------

def _cgturn_run(root, state_dir, *args):
    return cgturn_popen(root, state_dir, "run", *args, "--", "sh", "-c", DAEMON_AND_WAIT)


def test_sigkill_to_cgturn_run_leaves_nothing_running(cgroup2_root, state_dir):
    p = _cgturn_run(cgroup2_root, state_dir)
    try:
        daemon = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(timeout=10) == -signal.SIGKILL
        assert wait_until(lambda: not alive(daemon), timeout=1.0)
    finally:
        p.kill()
        p.wait()


def test_sigstop_to_cgturn_run_does_not_stop_its_timeout(cgroup2_root, state_dir):
    p = _cgturn_run(cgroup2_root, state_dir, "--timeout", "0.5", "--grace", "0.2")
    try:
        daemon = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGSTOP)
        # Only the sentinel can kill it while `cgturn run` is stopped; the bound is generous because
        # a loaded machine delays the sentinel, and without it the daemon would live until SIGCONT.
        assert wait_until(lambda: not alive(daemon), timeout=0.5 + SLACK + 0.2 + 15.0)
        os.kill(p.pid, signal.SIGCONT)
        assert p.wait(timeout=30) == 124
        assert audit_reasons(state_dir)[-1] == "timeout"
    finally:
        p.kill()
        p.wait()
