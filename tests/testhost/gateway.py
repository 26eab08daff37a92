#!/usr/bin/python3
"""A minimal gateway for the contrib unit tests (installed as /usr/local/bin/my-gateway in the guest).

Recovers at start-up like a real gateway (`TurnManager(recover=True)`; CGTURN_* come from the unit),
begins one turn that runs a worker and a setsid daemon, writes what it started to
`$GATEWAY_STATUS_DIR/gateway-<pid>.json`, then waits to be stopped or killed. Public API only.
"""
import json
import os
import signal
import subprocess
import sys

from cgturn import TurnManager

# A daemon that leaves the spawned process's tree (fork, setsid, fork) and prints its pid.
DAEMON = ("import os, time\n"
          "if os.fork() == 0:\n"
          "    os.setsid()\n"
          "    if os.fork() == 0:\n"
          "        print(os.getpid(), flush=True)\n"
          "        time.sleep(600)\n"
          "    os._exit(0)\n"
          "os.wait()\n")


def cgroup_of(pid) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return next(line[3:].strip() for line in f if line.startswith("0::"))


def main() -> int:
    mgr = TurnManager(recover=True)
    turn = mgr.begin_turn("chat", f"turn-{os.getpid()}")
    starter = turn.spawn([sys.executable, "-c", DAEMON], stdout=subprocess.PIPE, text=True)
    daemon = int(starter.stdout.readline())
    starter.wait(timeout=60)
    worker = turn.spawn(["sleep", "600"])
    status = {"pid": os.getpid(), "uid": os.getuid(), "cgroup": cgroup_of("self"), "turn": f"turn-{os.getpid()}",
              "daemon": daemon, "daemon_cgroup": cgroup_of(daemon), "worker": worker.pid,
              "worker_cgroup": cgroup_of(worker.pid)}
    path = os.path.join(os.environ["GATEWAY_STATUS_DIR"], f"gateway-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(status, f)
    os.rename(path + ".tmp", path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
