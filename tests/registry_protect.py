"""Protected pids under real SIGKILL: run in a private PID namespace, so "PID 1" is a shell we own.

Run by tests/test_registry.py as `unshare --pid --fork --mount-proc sh -c 'sh -c "python3 THIS ..; true"; true'`
with CGTURN_SCOPE/TASK/TURN of the turn below in the environment, so PID 1, our parent and this
process all *look* like members of the turn by their environment, and are also recorded in it.
The registry must still never signal them. Prints one JSON object.

Usage: registry_protect.py STATE_DIR
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cgturn import TurnManager  # noqa: E402
from cgturn.kernel import procfs  # noqa: E402
from conftest import alive, wait_until  # noqa: E402 - the suite's one liveness check


def main(state_dir: str) -> int:
    with TurnManager(backend="registry", state_dir=state_dir) as mgr:
        turn = mgr.begin_turn("protect", "t1")
        rec = turn.record
        victim = turn.spawn(["sleep", "300"], stdin=subprocess.DEVNULL)
        me, parent = os.getpid(), os.getppid()
        for pid in (1, parent, me):
            mgr.backend._record_process(rec, pid, procfs.start_time(pid), ["protected"])
        out = {"me": me, "parent": parent, "victim": victim.pid,
               "members": [pid for pid, _ in mgr.backend.members(rec)],
               "contains_caller": mgr.backend.contains_caller(rec),
               "signalled": mgr.backend.signal_members(rec, signal.SIGCONT),
               "frozen": mgr.backend.freeze_members(rec, True)}
        # the SIGSTOP pause reached the victim only: none of the protected processes is stopped
        wait_until(lambda: procfs.stat(victim.pid).state in ("T", "t"))
        out["stopped"] = {str(pid): procfs.stat(pid).state in ("T", "t") for pid in (1, parent, me, victim.pid)}
        out["thawed"] = mgr.backend.freeze_members(rec, False)
        out["killed"] = mgr.backend.kill_members(rec)
        victim.wait(timeout=5)
        out["victim_status"] = victim.returncode
        out["alive"] = {str(pid): alive(pid) for pid in (1, parent, me)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
