"""The sentinel: deadlines that hold when the owner is SIGSTOPped or SIGKILLed (both backends), and
`cgturn run` built on it. The owner runs in a real subprocess; every stopped process is killed at teardown."""
import json
import os
import signal
import subprocess
import textwrap
import uuid

import pytest

from cgturn import TurnManager
from cgturn.sentinel import attach as attach_sentinel
from cgturn import sentinel_protocol as protocol
from cgturn.errors import SentinelUnavailable
from cgturn.processes import start_time
from cgturn.sentinel import await_ready
from cgturn.sentinel_server import Sentinel
from conftest import (DAEMON_AND_WAIT, PY, alive, audit_reasons, audit_records, cgturn_env, cgturn_popen,
                      destroy_cgroup_tree, kill_scope, need_cgroup2, wait_until)

# How long a test waits for the sentinel to act: a bound, not a measurement (other runs share the cores).
BOUND = 20.0

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
    assert wait_until(lambda: not any(alive(pid) for pid in info["pids"]), timeout=BOUND)
    # The owner is stopped the whole time: the one kill, for inactivity, is the sentinel's.
    assert wait_until(lambda: audit_reasons(mgr.state_dir, "live") == ["timeout"])  # written after the kill
    assert alive(info["survivor"]) and alive(info["sentinel"])  # completed turn's survivor lives on
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: not alive(info["sentinel"]))  # nothing left to guard, owner gone
    mgr.close()


def test_sigkilled_owner_loses_its_running_turns_at_once(owner):
    p, info, mgr = owner()
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: not any(alive(pid) for pid in info["pids"]), timeout=BOUND)
    assert wait_until(lambda: not alive(info["sentinel"]))
    assert alive(info["survivor"])
    assert [i.state for i in mgr.turns("gw")] == ["completed"]
    assert wait_until(lambda: audit_reasons(mgr.state_dir, "live") == ["owner-died"])
    # At once: no grace (the timeout is 60 s away and no SIGTERM is sent first).
    [kill] = [r for r in audit_records(mgr.state_dir, "live") if r.get("action", "kill") == "kill"]
    assert kill["signals"] == ["SIGKILL"]
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



def _voluntary_switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))


def test_a_sentinel_that_has_read_is_woken_by_the_owners_close_not_by_each_datagram(manager, monkeypatch):
    """The sentinel's loop on a real socketpair: once a wait has read messages, the next one asks the
    channel for its end only (POLLRDHUP), so a datagram arriving meanwhile wakes no one (here the
    window is an hour); the owner's close wakes it at once, and what came before the close is read."""
    import socket
    import threading

    from cgturn import sentinel_server

    monkeypatch.setattr(sentinel_server, "BATCH_WINDOW", 3600.0)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    me = os.getpid()
    server = Sentinel(manager, theirs, me, start_time(me))
    turn = manager.begin_turn("w", "t")
    try:
        ours.send(protocol.encode(protocol.track(turn.task_id, turn.turn_id, None, None, 0.0, turn.last_activity)))
        server._wait_and_read(3600.0)  # a quiet channel: the first datagram wakes it
        assert list(server.tracked) == [turn.names]
        waiting = threading.Thread(target=server._wait_and_read, args=(3600.0,), daemon=True)
        waiting.start()
        ours.send(protocol.encode(protocol.untrack(*turn.names)))
        waiting.join(0.5)
        assert waiting.is_alive()  # the datagram woke no one
        ours.close()
        waiting.join(BOUND)
        assert not waiting.is_alive() and server.sock is None  # the close did, and was read as EOF
        assert server.tracked == {} and server.ended == {turn.names}  # after the datagram before it
    finally:
        ours.close()
        os.close(server.owner_pidfd)
        turn.abandon("test-done", grace=0)


def test_back_to_back_turns_do_not_wake_the_sentinel_for_every_message(cgroup2_manager):
    """A begin sends `track`, a completion `untrack`: each datagram used to wake a sleeping sentinel
    (a voluntary context switch of its own per message, 800 here on a quiet host; under load it
    reads several per wake-up anyway, and fewer show). Once a wake-up has read messages, it reads
    what comes during the next BATCH_WINDOW in one go. A count, not a time: the bound holds unless
    the host slows these turns to one wake-up window each."""
    client = attach_sentinel(cgroup2_manager)
    for _ in range(20):
        cgroup2_manager.begin_turn("burst").complete()
    turns = 400
    before = _voluntary_switches(client.pid)
    for _ in range(turns):
        cgroup2_manager.begin_turn("burst").complete()
    woken = _voluntary_switches(client.pid) - before
    assert woken < turns / 2, f"{woken} wake-ups of the sentinel for {turns} turns ({2 * turns} messages)"


LAST_TURN_OWNER = textwrap.dedent("""
    import json, os, signal, sys
    from cgturn import TurnManager
    from cgturn.sentinel import attach
    mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2], sentinel=True)
    client = attach(mgr)
    first = mgr.begin_turn("gw", "first")
    proc = first.spawn(["sleep", "300"])
    for _ in range(200):  # the sentinel now reads in windows: the last `track` is not read yet
        mgr.begin_turn("burst").complete()
    mgr.begin_turn("gw", "last")
    print(json.dumps({"pid": proc.pid, "sentinel": client.pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_an_owner_killed_right_after_a_burst_of_turns_loses_every_running_turn(cgroup2_root, state_dir):
    """What the sentinel is for holds while it reads in windows: the owner's death wakes it at once
    (its pidfd), and it reads everything the owner sent, the `track` of the turn begun just before the
    SIGKILL included, before it abandons the owner's running turns."""
    p = subprocess.Popen([PY, "-c", LAST_TURN_OWNER, cgroup2_root, state_dir], stdout=subprocess.PIPE, text=True,
                         env=cgturn_env())
    info = json.loads(p.stdout.readline())
    assert p.wait(timeout=BOUND) == -signal.SIGKILL
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        assert wait_until(lambda: not alive(info["pid"]) and not alive(info["sentinel"]), timeout=BOUND)
        assert mgr.turns("gw") == [] and mgr.turns("burst") == []  # both abandoned and removed
        assert audit_reasons(state_dir, "first") == ["owner-died"]
    finally:
        for rec in mgr.backend.records():
            mgr.end_task(rec.task_id)
        mgr.close()


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
        assert wait_until(lambda: not alive(daemon), timeout=BOUND)
        os.kill(p.pid, signal.SIGCONT)
        assert p.wait(timeout=30) == 124
        assert audit_reasons(state_dir)[-1] == "timeout"
    finally:
        p.kill()
        p.wait()


# --- the protocol's version: a sentinel or an owner of another version is refused, never half understood ---

@pytest.mark.parametrize("version, said", [(None, r"no version \(an older cgturn\)"), (0, "version 0"), (1, "version 1"),
                                           (3, "version 3"), (True, "version True"), ("2", "version '2'")])
def test_messages_of_another_version_are_refused(version, said):
    msg = protocol.track("t", "u", None, 5.0, 0.0, 1.0)
    assert protocol.parse_message(protocol.encode(msg))["op"] == "track"
    if version is None:
        del msg["v"]
    else:
        msg["v"] = version
    with pytest.raises(ValueError, match=f"protocol {said}, this cgturn speaks version {protocol.VERSION}"):
        protocol.parse_message(protocol.encode(msg))
    old = {"op": "guard", "key": msg["key"], "task": "t", "turn": "u"}  # what a sentinel before versions got
    with pytest.raises(ValueError, match="no version"):
        protocol.parse_message(protocol.encode(old))


def test_every_message_round_trips():
    for msg, op in ((protocol.track("t", "u", 3.0, None, 1.0, 2.0), "track"), (protocol.touch("t", "u", 4.0), "touch"),
                    (protocol.untrack("t", "u"), "untrack"), (protocol.lease("t", "u", None), "lease")):
        assert protocol.parse_message(protocol.encode(msg))["op"] == op
    assert protocol.parse_reply(protocol.encode(protocol.ready(None))) == {"op": "ready", "log_problem": None}
    assert protocol.parse_reply(protocol.encode(protocol.error("no", guard=True)))["guard"] is True


@pytest.mark.parametrize("reply, said", [({"op": "ready"}, "no version"), ({"op": "ready", "v": 1}, "version 1")])
def test_owner_refuses_a_ready_of_another_version(reply, said):
    """The owner's side of the handshake on a real socketpair, the sentinel's end written by the test."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        theirs.send(json.dumps(reply).encode())
        with pytest.raises(SentinelUnavailable, match=f"the sentinel speaks protocol {said}"):
            await_ready(ours, 10.0)
        theirs.send(protocol.encode(protocol.ready(None)))
        assert await_ready(ours, 10.0)["op"] == "ready"  # and one of its own version is taken


@pytest.mark.parametrize("args, said", [([], "no version"), (["--protocol", "0"], "version 0")])
def test_sentinel_refuses_an_owner_of_another_version(tmp_path, args, said):
    """A real sentinel process started the way an owner of another version (or one from before
    versions, which passes no --protocol) would start it: it answers `error` naming both and exits 1."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    me = os.getpid()
    argv = [PY, "-m", "cgturn.sentinel_main", "--fd", str(theirs.fileno()), *args, "--owner-pid", str(me),
            "--owner-start", str(start_time(me)), "--backend", "registry", "--state-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=cgturn_env(), stdin=subprocess.DEVNULL)
    theirs.close()
    with ours:
        assert proc.wait(timeout=60) == 1
        reply = protocol.parse_reply(ours.recv(protocol.MAX_MESSAGE))
    assert reply["op"] == "error" and f"the owner speaks protocol {said}" in reply["message"]
    assert f"this cgturn speaks version {protocol.VERSION}" in reply["message"]
    assert "refuses to start" in (tmp_path / "sentinel.log").read_text()


def test_sentinel_drops_a_message_of_another_version(manager, caplog):
    """The sentinel's loop on a real socketpair: a `track` of another version is dropped with its
    reason logged; the same message of its own version is tracked."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    me = os.getpid()
    server = Sentinel(manager, theirs, me, start_time(me))
    turn = manager.begin_turn("v", "t")
    msg = protocol.track(turn.task_id, turn.turn_id, None, 60.0, 0.0, turn.last_activity)
    with ours:
        ours.send(protocol.encode({**msg, "v": protocol.VERSION + 1}))
        server.drain()
        assert server.tracked == {}
        assert any(f"dropped a message from the owner: protocol version {protocol.VERSION + 1}" in r.getMessage()
                   for r in caplog.records)
        ours.send(protocol.encode(msg))
        server.drain()
        assert list(server.tracked) == [turn.names]
    theirs.close()
    os.close(server.owner_pidfd)
    turn.abandon("test-done", grace=0)
