"""A turn process that moves itself out of its turn into the managed root or a task directory (what a
process running as the manager's user can do in a delegated tree) is noticed by `ps` and killed by
`reap`; the caller, its ancestors and PID 1 are never touched."""
import json
import os

from cgturn import UnsafeOperation
from conftest import PY, alive, cli, wait_until

import pytest


ESCAPE = 'import os, sys, time; open(sys.argv[1] + "/cgroup.procs", "w").write(str(os.getpid())); time.sleep(300)'


@pytest.mark.parametrize("where", ["task", "root"])
def test_a_process_that_left_its_turn_is_reported_and_reaped(cgroup2_manager, cgroup2_root, state_dir, where):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("chat", "t")
    target = os.path.join(cgroup2_root, "chat") if where == "task" else cgroup2_root
    escaper = turn.spawn([PY, "-c", ESCAPE, target])
    assert wait_until(lambda: escaper.pid in [pid for _, pid in mgr.strays()])
    assert turn.abandon("stop", grace=0).killed == []  # it is no longer in the turn
    assert alive(escaper.pid)
    listed = cli(cgroup2_root, state_dir, "ps", "--json")
    assert listed.returncode == 0 and f"process {escaper.pid}" in listed.stderr
    reaped = cli(cgroup2_root, state_dir, "reap", "--json")
    assert reaped.returncode == 0, reaped.stderr
    actions = json.loads(reaped.stdout)
    assert {"action": "killed-stray", "task": "chat" if where == "task" else "", "turn": "",
            "killed": [escaper.pid]} in actions
    assert escaper.wait(timeout=10) == -9
    assert mgr.strays() == []


def test_a_stray_that_is_the_caller_is_never_killed(cgroup2_manager, cgroup2_root):
    mgr = cgroup2_manager
    mgr.create_root()
    with pytest.raises(UnsafeOperation, match="the caller"):
        mgr.backend.kill_stray(cgroup2_root, os.getpid())
    with pytest.raises(UnsafeOperation, match="not the managed root"):
        mgr.backend.kill_stray(os.path.dirname(cgroup2_root), 12345)
