#!/usr/bin/env python3
"""What isolation costs per spawn: `Turn.spawn(/bin/true)` + wait in a plain turn, beside the same in a
turn with `user="nobody"`, `network="none"`, `seal=True` and all three, alternating rounds in one run,
printed as medians and ratios to plain. Also the cost of `begin_turn` + `complete` with and without
`network="none"` (the namespace is made at begin).

Everything lives in one managed root `<cgroup2 mount>/cgturn-bench-<random>`, removed at the end, on
errors and on Ctrl-C. Run as root:

    python3 scripts/bench_isolation.py [--rounds 5] [--spawns 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchlib import destroy  # noqa: E402

from cgturn import TurnManager, discover_host  # noqa: E402

CASES = {  # name: (begin_turn kwargs, spawn kwargs)
    "plain": ({}, {}),
    "user=nobody": ({}, {"user": "nobody"}),
    "network=none": ({"network": "none"}, {}),
    "seal": ({"seal": True}, {}),
    "all three": ({"seal": True, "network": "none"}, {"user": "nobody"}),
}


def spawn_ms(mgr: TurnManager, begin: dict, spawn: dict, n: int) -> float:
    """Median ms of spawn(/bin/true) + wait, n times in one turn."""
    turn = mgr.begin_turn("bench-isolation", **begin)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        code = turn.spawn(["/bin/true"], **spawn).wait()
        times.append((time.perf_counter() - t0) * 1000)
        if code != 0:
            raise RuntimeError(f"/bin/true exited {code} with {begin} {spawn}")
    turn.complete()
    return statistics.median(times)


def begin_ms(mgr: TurnManager, begin: dict, n: int) -> float:
    """Median ms of begin_turn + complete of an empty turn."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        mgr.begin_turn("bench-begin", **begin).complete()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spawns", type=int, default=40)
    args = parser.parse_args()
    mount = discover_host().cgroup2_mount
    if mount is None or os.geteuid() != 0:
        print("needs root and a writable cgroup v2 mount", file=sys.stderr)
        return 2
    root = os.path.join(mount, f"cgturn-bench-{uuid.uuid4().hex[:8]}")
    spawns = {name: [] for name in CASES}
    begins = {"host": [], "none": []}
    try:
        with tempfile.TemporaryDirectory() as state, TurnManager(root=root, backend="cgroup2", state_dir=state) as mgr:
            for _ in range(args.rounds):  # alternating: the machine's noise hits every case alike
                for name, (begin, spawn) in CASES.items():
                    spawns[name].append(spawn_ms(mgr, begin, spawn, args.spawns))
                for net in begins:
                    begins[net].append(begin_ms(mgr, {"network": net}, args.spawns))
            mgr.end_task("bench-isolation")
            mgr.end_task("bench-begin")
    finally:
        destroy(root)
    plain = statistics.median(spawns["plain"])
    print("\n## Spawn cost with isolation (spawn(/bin/true) + wait; median of round medians)\n")
    print("| case | ms | x plain |\n|---|---|---|")
    for name, values in spawns.items():
        ms = statistics.median(values)
        print(f"| {name} | {ms:.2f} | {ms / plain:.2f}x |")
    host, none = (statistics.median(begins[k]) for k in ("host", "none"))
    print("\n## begin_turn + complete (median ms)\n")
    print(f"| network=host | network=none | ratio |\n|---|---|---|\n| {host:.2f} | {none:.2f} | {none / host:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
