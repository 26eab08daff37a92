"""Run as an unprivileged user in a login session (a root-owned session-N.scope): a gateway's turns.

    python3 user_scenario.py          a gateway that exits normally
    python3 user_scenario.py --die    a gateway that is SIGKILLed with a turn running

Public API only, no configuration: `TurnManager()` must find the user's systemd manager, make
cgturn.scope and move this process into it. One turn launches every escaper of tests/escapers.py
whose tools this host has, and is abandoned; a second turn starts a server and completes, and this
process exits leaving the server running. Prints one JSON object.

With `--die`: one turn launches the environment-clearing escaper (the one the registry misses), the
manager's sentinel is started (`Supervisor.start_sentinel`), and this process prints one JSON object
and SIGKILLs itself, so only the sentinel can abandon the turn.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: escapers

import escapers  # noqa: E402
from cgturn import Limits, Supervisor, TurnManager, doctor_report  # noqa: E402


def cgroup_of(pid) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line[3:].strip() for line in f if line.startswith("0::"))


def die() -> None:
    mgr = TurnManager()
    turn = mgr.begin_turn("killed", "t1")
    # After the first turn, so forked from this process inside the scope; it tracks the turn begun.
    sentinel = Supervisor.start_sentinel(mgr)
    escaper = escapers.recipes(tempfile.gettempdir())["env_cleared"]
    escaper.log = os.devnull  # this process leaves nothing to clean up: it is killed
    pids = escapers.launch(turn, escaper)
    print(json.dumps({"pid": os.getpid(), "own": cgroup_of("self"), "state_dir": mgr.state_dir,
                      "sentinel": sentinel, "sentinel_cgroup": cgroup_of(sentinel),
                      "marker": escaper.marker, "escaper_pids": pids,
                      "escaper_cgroups": sorted({cgroup_of(p) for p in pids})}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    if sys.argv[1:] == ["--die"]:
        die()
    before = doctor_report()
    own_before = cgroup_of("self")
    mgr = TurnManager()
    out = {"uid": os.getuid(), "doctor_before": before, "own_before": own_before, "backend": mgr.backend_name,
           "root": mgr.root}
    turn = mgr.begin_turn("chat", "t1")
    out["own_after"] = cgroup_of("self")
    with tempfile.TemporaryDirectory() as tmp:
        recipes = {name: esc for name, esc in escapers.recipes(tmp).items() if shutil.which(esc.argv[0])}
        launched = {}
        for name, esc in recipes.items():
            pids = escapers.launch(turn, esc)
            launched[name] = {"pids": pids, "cgroups": sorted({cgroup_of(p) for p in pids})}
        result = turn.abandon("testhost", grace=0)
        for name, esc in recipes.items():
            escapers.wait_for(lambda: not escapers.find_marked(esc.marker), 10)
            launched[name]["left"] = escapers.find_marked(esc.marker)
            if esc.cleanup:
                subprocess.run(esc.cleanup, capture_output=True, timeout=30)
    out["escapers"] = launched
    out["killed"] = sorted(result.killed)
    # v2 limits for what the user manager delegates (the scope's subtree_control is cgturn's to write)
    out["limits"] = mgr.limits_report()
    if "pids" in out["limits"]["available"]:
        limited = mgr.begin_turn("chat", "t3", limits=Limits(pids_max=7))
        with open(f"{mgr.root}/chat/t3/pids.max") as f:
            out["pids_max"] = f.read().strip()
        limited.abandon("testhost", grace=0)
    server_turn = mgr.begin_turn("chat", "t2")
    server = server_turn.spawn([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server_turn.complete()
    out["server"] = server.pid
    out["server_cgroup"] = cgroup_of(server.pid)
    mgr.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
