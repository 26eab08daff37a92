"""Promises about state a user relies on, tried on the real kernel the way a race or a crash breaks them:
no spawn slips past a limit set while it runs, a crashed guard leaves no turn frozen, a lease holds
after `run` exits, `limits` shows what holds, an emptied completed turn does not linger, and a turn
ended by another process gives back its network namespace.

Every spawn storm is bounded in count and time; every wait has a deadline.
"""
from __future__ import annotations

import os
import subprocess
import threading

import pytest

from cgturn import Limits, NoSuchTurn
from conftest import PY, force_spawn_path, v1_mirrors

MiB = 2 ** 20
LIVE = ["sleep", "120"]  # spawned processes live long enough to be checked, and die with their turn


def _v1_hybrid(mgr) -> None:
    report = mgr.limits_report()
    if report["layout"] != "v1-hybrid" or "memory" not in report["available"]:
        pytest.skip(f"needs memory in a v1 hierarchy (a hybrid host); here: {report}")


@pytest.fixture
def hybrid(cgroup2_manager):
    """A manager on a hybrid host: memory in v1, so a limit set later gives a turn v1 directories."""
    _v1_hybrid(cgroup2_manager)
    return cgroup2_manager


def _v1_memory_of(pid: int) -> str | None:
    """The path of `pid`'s v1 memory cgroup (None once it has exited)."""
    from cgturn.kernel import controllers, parsers

    try:
        with open(f"/proc/{pid}/cgroup") as f:
            mine = parsers.parse_proc_cgroup_v1(f.read())
    except FileNotFoundError:
        return None
    with open("/proc/self/mountinfo") as f:
        mounts = controllers.v1_mounts(f.read())
    return os.path.normpath(os.path.join(mounts["memory"], mine["memory"].lstrip("/")))


def _spawn_while(turn, started: threading.Event, stop: threading.Event, out: list, limit: int) -> None:
    """Spawn into `turn` until `stop` (or `limit` spawns), recording the processes in `out`."""
    while not stop.is_set() and len(out) < limit:
        try:
            out.append(turn.spawn(LIVE))
        except NoSuchTurn:
            return
        started.set()


def _storm(turn, change, threads: int = 3, per_thread: int = 150) -> list[subprocess.Popen]:
    """Run `change()` while `threads` threads spawn into `turn`; returns every process spawned."""
    started, stop = threading.Event(), threading.Event()
    spawned: list[list[subprocess.Popen]] = [[] for _ in range(threads)]
    workers = [threading.Thread(target=_spawn_while, args=(turn, started, stop, spawned[i], per_thread))
               for i in range(threads)]
    for w in workers:
        w.start()
    try:
        assert started.wait(30), "no spawn went through"
        change()
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    return [p for procs in spawned for p in procs]


def _left_out(procs: list[subprocess.Popen], v1_dir: str) -> list[int]:
    """The pids of `procs` still alive outside the v1 memory directory `v1_dir`."""
    return [p.pid for p in procs if p.poll() is None and _v1_memory_of(p.pid) not in (None, v1_dir)]


# --- 1. a limit set while spawns run leaves none behind ---------------------------------------------


SPAWN_PATHS = ["clone3", "shim"]


@pytest.mark.parametrize("path", SPAWN_PATHS)
def test_set_limits_while_spawning_leaves_no_process_outside_the_turns_v1_dirs(hybrid, monkeypatch, path):
    """Every process spawned while Turn.set_limits gives a running turn its v1 directories ends up
    inside them (docs/limits.md: the turn is frozen while its processes move in)."""
    force_spawn_path(monkeypatch, path)
    for n in range(4):
        turn = hybrid.begin_turn("race", f"r{n}")
        memory_dir = os.path.join(v1_mirrors(hybrid.backend.root.path)["memory"], *turn.names)
        procs = _storm(turn, lambda: turn.set_limits(Limits(memory_max=512 * MiB)))
        try:
            assert _left_out(procs, memory_dir) == [], f"round {n}: of {len(procs)} spawned, these escaped"
        finally:
            turn.abandon("test over")
            for p in procs:
                p.wait(30)


@pytest.mark.parametrize("path", SPAWN_PATHS)
def test_task_limits_while_spawning_leave_no_process_outside_the_turns_v1_dirs(hybrid, monkeypatch, path):
    """The same for TurnManager.set_task_limits: the task's running turn gets v1 directories, and no
    process spawned meanwhile stays in the gateway's own memory cgroup."""
    force_spawn_path(monkeypatch, path)
    for n in range(3):
        turn = hybrid.begin_turn(f"budget{n}", "t1")
        memory_dir = os.path.join(v1_mirrors(hybrid.backend.root.path)["memory"], *turn.names)
        procs = _storm(turn, lambda: hybrid.set_task_limits(f"budget{n}", Limits(memory_max=512 * MiB)))
        try:
            assert _left_out(procs, memory_dir) == [], f"round {n}: of {len(procs)} spawned, these escaped"
        finally:
            turn.abandon("test over")
            for p in procs:
                p.wait(30)
