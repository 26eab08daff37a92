"""Torture: payloads that fight back against the kill (pid hoppers, escapers all at once, frozen and
threaded sub-cgroups, zombie holders) and escape by privilege. Real kernel, real processes, each test
in its own managed root (`cgroup2_root`, destroyed at teardown even on failure).

Bounds: every storm has a process cap and a deadline of its own (20 s), far below the test timeout.
"""
from __future__ import annotations

import os
import signal
import subprocess
import textwrap

import pytest

from conftest import PY, alive, launch_escaper, turn_dir, wait_until


@pytest.fixture
def mgr(cgroup2_manager):
    return cgroup2_manager


# Each process forks a child and exits at once, so no pid lives long: a tree walk chases ghosts.
# Up to 16 chains run at a time; all stop by themselves after 20 s.
PID_HOPPER = textwrap.dedent("""
    import os, sys, time
    deadline = time.monotonic() + 20
    for _ in range(16):
        if os.fork() == 0:
            while time.monotonic() < deadline:
                if os.fork():
                    os._exit(0)
            os._exit(0)
    print("go", flush=True)
    time.sleep(20)
""")


@pytest.mark.parametrize("use_cgroup_kill", [True, False], ids=["cgroup.kill", "freeze-fallback"])
def test_pid_hopping_chains_and_every_escaper_at_once_all_die(mgr, escapers, bystanders, use_cgroup_kill):
    mgr.backend.killer.cgroup_kill_works = use_cgroup_kill
    before = bystanders("sleep", "300")
    keep = mgr.begin_turn("keep")
    kept = keep.spawn(["sleep", "300"])
    turn = mgr.begin_turn("torture")
    escaped = [pid for recipe in escapers.values() for pid in launch_escaper(turn, recipe)]
    hopper = turn.spawn([PY, "-c", PID_HOPPER], stdout=subprocess.PIPE, text=True)
    assert hopper.stdout.readline() == "go\n"
    assert all(pid in turn.pids() for pid in escaped)
    result = turn.abandon("torture", grace=0)
    assert set(escaped) <= set(result.killed)
    assert not os.path.exists(turn_dir(mgr, turn))
    assert wait_until(lambda: not any(alive(pid) for pid in escaped))
    assert hopper.wait(timeout=10) == -signal.SIGKILL
    assert before.poll() is None and kept.poll() is None
    keep.abandon("done", grace=0)


NESTED_FREEZER = textwrap.dedent("""
    import os, subprocess, sys, time
    me = open("/proc/self/cgroup").read().split("0::", 1)[1].strip()
    path = sys.argv[1] + me
    pids = []
    for depth in range(3):                      # three levels deep, each frozen and locked
        path = os.path.join(path, f"hide{depth}")
        os.mkdir(path)
        child = subprocess.Popen(["sleep", "300"])
        open(os.path.join(path, "cgroup.procs"), "w").write(str(child.pid))
        pids.append(child.pid)
    top = os.path.join(sys.argv[1] + me, "hide0")
    open(os.path.join(top, "cgroup.freeze"), "w").write("1")
    for dirpath, _, files in os.walk(top):
        for f in ("cgroup.procs", "cgroup.freeze", "cgroup.kill", "cgroup.subtree_control"):
            os.chmod(os.path.join(dirpath, f), 0)
        os.chmod(dirpath, 0o500)
    print(*pids, flush=True)
    time.sleep(300)
""")


def test_nested_frozen_locked_sub_cgroups_still_die_with_cgroup_kill(mgr):
    """test_cgroup2.py covers one frozen level on the fallback; here three levels, on cgroup.kill."""
    turn = mgr.begin_turn("freezer")
    p = turn.spawn([PY, "-c", NESTED_FREEZER, mgr.backend.mount], stdout=subprocess.PIPE, text=True)
    hidden = [int(x) for x in p.stdout.readline().split()]
    assert len(hidden) == 3 and set(hidden) <= set(turn.pids())
    result = turn.abandon("x", grace=0)
    assert set(hidden) | {p.pid} <= set(result.killed)
    assert wait_until(lambda: not any(alive(pid) for pid in hidden))
    assert not os.path.exists(turn_dir(mgr, turn))


# The payload makes a threaded sub-cgroup (the turn becomes its "domain threaded" root) and moves a
# thread of its own there.
THREADED = textwrap.dedent("""
    import os, sys, threading, time
    me = open("/proc/self/cgroup").read().split("0::", 1)[1].strip()
    turn = sys.argv[1] + me
    target = os.path.join(turn, "threads")
    os.mkdir(target)
    open(os.path.join(target, "cgroup.type"), "w").write("threaded")
    ready = threading.Event()
    def worker():
        open(os.path.join(target, "cgroup.threads"), "w").write(str(threading.get_native_id()))
        ready.set()
        time.sleep(300)
    threading.Thread(target=worker, daemon=True).start()
    ready.wait()
    print(open(os.path.join(target, "cgroup.type")).read().strip(), flush=True)
    time.sleep(300)
""")


@pytest.mark.parametrize("use_cgroup_kill", [True, False], ids=["cgroup.kill", "freeze-fallback"])
def test_threaded_sub_cgroup_in_a_turn_is_still_killed(mgr, use_cgroup_kill):
    """cgroup.procs of a threaded cgroup cannot be read (EOPNOTSUPP): membership comes from
    cgroup.threads; both kill paths must still empty the turn."""
    mgr.backend.killer.cgroup_kill_works = use_cgroup_kill
    turn = mgr.begin_turn("threaded")
    p = turn.spawn([PY, "-c", THREADED, mgr.backend.mount], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "threaded"
    result = turn.abandon("x", grace=0)
    assert p.pid in result.killed
    assert p.wait(timeout=10) == -9
    assert not os.path.exists(turn_dir(mgr, turn))


ZOMBIE_HOLDER = textwrap.dedent("""
    import os, time
    kids = []
    for _ in range(50):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        kids.append(pid)
    # never reaped: 50 zombies held by a live parent
    while not all(open(f"/proc/{k}/stat").read().rsplit(")", 1)[1].split()[0] == "Z" for k in kids):
        time.sleep(0.01)
    print(len(kids), flush=True)
    time.sleep(300)
""")


def test_parent_holding_zombies_dies_and_the_turn_empties(mgr):
    turn = mgr.begin_turn("zombies")
    p = turn.spawn([PY, "-c", ZOMBIE_HOLDER], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "50\n"
    assert turn.pids() == [p.pid]   # zombies have left the cgroup: only the holder is a member
    result = turn.abandon("x", grace=0.5)
    assert result.killed == [p.pid]
    assert p.wait(timeout=10) == -signal.SIGTERM  # within the grace: it does not handle SIGTERM
    assert not os.path.exists(turn_dir(mgr, turn))


ESCAPE = 'echo $$ > "$1" && echo escaped || echo refused; grep "^0::" /proc/$$/cgroup'


def _try_escape(turn, target: str, *prefix: str) -> tuple[str, str]:
    out = turn.spawn([*prefix, "sh", "-c", ESCAPE, "sh", target], stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, text=True).communicate(timeout=30)[0].split("\n")
    return out[0], out[1]


def test_unprivileged_turn_process_cannot_leave_but_root_can(mgr):
    """Escape by privilege: only a privileged process can write its pid into another cgroup."""
    elsewhere = mgr.begin_turn("elsewhere")
    turn = mgr.begin_turn("jail")
    inside = "0::" + turn_dir(mgr, turn)[len(mgr.backend.mount):]
    targets = [os.path.join(turn_dir(mgr, elsewhere), "cgroup.procs"),
               os.path.join(mgr.backend.root.path, "cgroup.procs")]
    for target in targets:
        verdict, where = _try_escape(turn, target, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
        assert (verdict, where) == ("refused", inside)
    # A root process inside a turn can move itself out (README: run turn processes as a user, or in
    # a cgroup namespace). It lands in another turn of ours, which is then cleaned up.
    verdict, where = _try_escape(turn, targets[0])
    assert verdict == "escaped" and where != inside
    turn.abandon("x", grace=0)
    elsewhere.abandon("x", grace=0)

