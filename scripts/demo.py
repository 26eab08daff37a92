#!/usr/bin/env python3
"""A demo turn: start a daemon that double-forks and setsids away, abandon the turn, watch it die.

Uses its own managed root (`<cgroup2 mount>/cgturn-demo-<random>`) and removes it at the end.
"""
import os
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cgturn import TurnManager, discover_host  # noqa: E402

DAEMON = "setsid sh -c 'sleep 300 & echo $! > \"$0\"' \"$1\" &"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def main() -> int:
    info = discover_host()
    backend = "cgroup2" if info.usable else "registry"
    root = os.path.join(info.cgroup2_mount, f"cgturn-demo-{uuid.uuid4().hex[:8]}") if info.usable else None
    with tempfile.TemporaryDirectory() as state, TurnManager(root=root, backend=backend, state_dir=state) as mgr:
        print(f"backend: {mgr.backend_name} ({mgr.root or mgr.state_dir})")
        turn = mgr.begin_turn("demo-chat", "turn-1")
        pidfile = os.path.join(state, "daemon.pid")
        turn.spawn(["sh", "-c", DAEMON, "sh", pidfile]).wait()
        deadline = time.monotonic() + 5
        while not os.path.exists(pidfile) or not open(pidfile).read().strip():
            if time.monotonic() > deadline:
                print("the daemon never started", file=sys.stderr)
                return 1
            time.sleep(0.01)
        daemon = int(open(pidfile).read())
        print(f"turn {turn.turn_id!r} owns {turn.pids()}; the daemon {daemon} has left the process tree")
        result = turn.abandon("demo: /stop", grace=0.5)
        print(f"abandoned in {result.duration_ms:.1f} ms, killed {result.killed}, signals {result.signals}")
        print(f"daemon alive afterwards: {alive(daemon)}")
        mgr.remove_root()
        return 0 if not alive(daemon) else 1


if __name__ == "__main__":
    sys.exit(main())
