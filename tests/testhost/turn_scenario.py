"""Run inside a delegated systemd unit: a turn starts a setsid daemon, abandoning the turn kills it.

    python3 turn_scenario.py STATE_DIR

Uses only the public API. The managed root is `<the unit's cgroup>/turns` (the unit puts this process
in its `supervisor` leaf with DelegateSubgroup=). Prints one JSON object: where this process, the turn
and the daemon were, what abandon killed, and whether the daemon outlived it.
"""
import json
import os
import subprocess
import sys
import time

from cgturn import TurnManager

MOUNT = "/sys/fs/cgroup"
# Forks twice with a setsid in between, so the daemon is no descendant of the spawned process: a
# process-tree kill misses it, a cgroup kill does not. Prints the daemon's pid.
DAEMON = ("import os, sys, time\n"
          "if os.fork() == 0:\n"
          "    os.setsid()\n"
          "    if os.fork() == 0:\n"
          "        print(os.getpid(), flush=True)\n"
          "        time.sleep(300)\n"
          "    os._exit(0)\n"
          "os.wait()\n"
          "time.sleep(300)\n")


def cgroup_of(pid) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line[3:].strip() for line in f if line.startswith("0::"))


def main() -> int:
    state_dir = sys.argv[1]
    own = cgroup_of("self")
    unit_cgroup = os.path.dirname(own) if own.endswith("/supervisor") else own
    root = MOUNT + unit_cgroup + "/turns"
    mgr = TurnManager(root=root, backend="cgroup2", state_dir=state_dir)
    turn = mgr.begin_turn("chat", "t1")
    proc = turn.spawn([sys.executable, "-c", DAEMON], stdout=subprocess.PIPE, text=True)
    daemon = int(proc.stdout.readline())
    daemon_cgroup = cgroup_of(daemon)
    result = turn.abandon("testhost", grace=0)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{daemon}") and time.monotonic() < deadline:
        time.sleep(0.01)  # the daemon's parent (PID 1) reaps it; bounded wait for /proc to drop it
    print(json.dumps({
        "uid": os.getuid(), "own_cgroup": own, "unit_cgroup": unit_cgroup, "root": root,
        "daemon": daemon, "daemon_cgroup": daemon_cgroup, "killed": sorted(result.killed),
        "daemon_gone": not os.path.exists(f"/proc/{daemon}"),
        "daemon_cgroup_gone": not os.path.isdir(MOUNT + daemon_cgroup),
    }))
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
