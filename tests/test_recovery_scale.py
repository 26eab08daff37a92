"""`reap` over many turns costs what it must read: each turn's record once, each owner's /proc entry
once per pass (a gateway owns all its turns), while it still abandons the turns of an owner that died
and leaves those of a live owner alone — on the real kernel, with real owners.

The counting wraps the real reads (nothing is mocked away): a pass that read a record twice, or looked
at the same live owner once per turn, is what made `cgturn reap` with nothing to do cost seconds over
10,000 turns (scripts/bench_many.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from cgturn import TurnManager
from cgturn.kernel import procfs
from conftest import alive, cgturn_env, wait_until

LIVE = ["sleep", "120"]
MINE = 12  # turns this (live) process owns
THEIRS = 3  # turns of an owner that dies without ending them


def _turns_of_a_dead_owner(root: str, state_dir: str) -> list[int]:
    """Begin THEIRS turns from a child process that then dies by SIGKILL with them running (no sentinel):
    the pids of their processes."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from cgturn import TurnManager
        mgr = TurnManager(root={root!r}, backend="cgroup2", state_dir={state_dir!r})
        pids = [mgr.begin_turn("gone", f"g{{i}}").spawn({LIVE!r}).pid for i in range({THEIRS})]
        with open(sys.argv[1], "w") as f:
            f.write(" ".join(map(str, pids)))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = cgturn_env({"CGTURN_SENTINEL": "0"})
    # No pipes: the turns' processes would hold them open, and the run would wait for them.
    with tempfile.TemporaryDirectory() as tmp:
        pids_file, log = os.path.join(tmp, "pids"), os.path.join(tmp, "stderr")
        with open(log, "wb") as err:
            code = subprocess.run([sys.executable, "-c", script, pids_file], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=err, timeout=60, env=env).returncode
        with open(log, encoding="utf-8", errors="replace") as f:
            assert code == -9, f.read()
        with open(pids_file, encoding="ascii") as f:
            return [int(p) for p in f.read().split()]


def test_reap_reads_each_record_once_and_each_owner_once(cgroup2_root, state_dir, monkeypatch):
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
    try:
        mine = [mgr.begin_turn(f"task-{i % 3}", f"t{i}").spawn(LIVE) for i in range(MINE)]
        theirs = _turns_of_a_dead_owner(cgroup2_root, state_dir)
        reaper = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
        try:
            looked: list[int] = []
            real_is_alive = procfs.is_alive

            def counted_is_alive(pid, started, *rest):
                looked.append(pid)
                return real_is_alive(pid, started, *rest)

            monkeypatch.setattr(procfs, "is_alive", counted_is_alive)
            loads: list[str] = []
            real_load = reaper.backend.load

            def counted_load(task_key, turn_key):
                loads.append(turn_key)
                return real_load(task_key, turn_key)

            monkeypatch.setattr(reaper.backend, "load", counted_load)
            actions = reaper.recover()
            monkeypatch.undo()
        finally:
            reaper.close()
        assert sorted((a.action, a.turn) for a in actions) == [("abandoned", f"g{i}") for i in range(THEIRS)]
        assert wait_until(lambda: not any(alive(pid) for pid in theirs), timeout=30)
        assert all(p.poll() is None for p in mine)  # a live owner's turns are never touched
        # The live owner (this process) was looked at once, not once per turn: one look per owner.
        assert looked.count(os.getpid()) == 1, looked
        # The running turns' records were read once, by the pass itself: no second read per turn for
        # the limit audit (any load is an abandon's own, of a dead owner's turn; an abandon on cgroup2
        # may read its record under the lock instead, through no load at all).
        assert set(loads) <= {f"g{i}" for i in range(THEIRS)}, loads
    finally:
        for task in ("task-0", "task-1", "task-2", "gone"):
            mgr.end_task(task, grace=0)
        mgr.close()


@pytest.mark.parametrize("owner_gone_midway", [False, True])
def test_an_owner_seen_alive_once_is_judged_per_pass(cgroup2_root, state_dir, owner_gone_midway):
    """The one look per owner is per pass: after the owner died, the next pass abandons its turns."""
    theirs_root = cgroup2_root
    mgr = TurnManager(root=theirs_root, backend="cgroup2", state_dir=state_dir)
    try:
        mgr.begin_turn("mine", "m").spawn(LIVE)
        reaper = TurnManager(root=theirs_root, backend="cgroup2", state_dir=state_dir)
        try:
            assert reaper.recover() == []
            if owner_gone_midway:
                pids = _turns_of_a_dead_owner(theirs_root, state_dir)
                assert [a.action for a in reaper.recover()] == ["abandoned"] * THEIRS
                assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=30)
            assert reaper.recover() == []
        finally:
            reaper.close()
    finally:
        for task in ("mine", "gone"):
            mgr.end_task(task, grace=0)
        mgr.close()
