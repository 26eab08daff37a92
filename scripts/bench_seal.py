#!/usr/bin/env python3
"""What a seal costs: a sealed whole turn (begin_turn(seal=True), spawn /bin/true, wait, complete)
beside a plain one, on the native spawn path (clone3) and on the shim, alternating rounds in one run,
printed as medians, with the exec chain each pays and the ratio sealed / plain per path. Also the floor:
bubblewrap with the seal's namespaces and mounts around /bin/true, started by subprocess outside any
turn, beside a bare /bin/true.

Everything lives in one managed root `<own cgroup2>/cgturn-bench-<random>`, removed at the end, on
errors and on SIGTERM. The sealed spawns run in a temporary working directory (their writable path).
Run as root:

    python3 scripts/bench_seal.py [--rounds 5] [--turns 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchlib import bench_root, destroy  # noqa: E402

from cgturn import TurnManager, testing  # noqa: E402

CHAINS = {  # spawn path: what a sealed spawn execs before the target
    testing.CLONE3: "clone3 → bwrap (→ its init) → target",
    testing.SHIM: "shim sh → bwrap (→ its init) → target",
}


# bubblewrap's namespaces and mounts as the seal asks for them, without its binds of /proc/sys and the
# writable paths, its capabilities and its filter: what bubblewrap itself costs here.
BWRAP_FLOOR = ["bwrap", "--unshare-pid", "--unshare-cgroup", "--unshare-ipc", "--ro-bind", "/", "/", "--proc", "/proc",
               "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run", "--"]


def whole_turns_ms(mgr: TurnManager, sealed: bool, n: int, cwd: str) -> float:
    """Median ms of begin_turn + spawn(/bin/true) + wait + complete, n turns."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        turn = mgr.begin_turn("bench-seal", seal=sealed)
        code = turn.spawn(["/bin/true"], cwd=cwd).wait()
        turn.complete()
        times.append((time.perf_counter() - t0) * 1000)
        if code != 0:
            raise RuntimeError(f"/bin/true exited {code} (sealed={sealed})")
    return statistics.median(times)


def floor_ms(argv: list[str], n: int) -> float:
    """Median ms of subprocess.run(argv), n times, outside any turn."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    root = bench_root()
    if root is None:
        return 2
    paths = [p for p in (testing.CLONE3, testing.SHIM) if testing.spawn_path_unavailable(p) is None]
    results: dict[tuple[str, bool], list[float]] = {(p, s): [] for p in paths for s in (False, True)}
    floors: dict[str, list[float]] = {"/bin/true": [], "bwrap /bin/true": []}
    load_before = os.getloadavg()
    mgr = None
    try:
        with tempfile.TemporaryDirectory() as state, tempfile.TemporaryDirectory() as work:
            mgr = TurnManager(root=root, backend="cgroup2", state_dir=state)
            for _ in range(args.rounds):  # alternating: the machine's noise hits every case alike
                for path in paths:
                    with testing.forced_spawn_path(path):
                        for sealed in (False, True):
                            results[(path, sealed)].append(whole_turns_ms(mgr, sealed, args.turns, work))
                floors["/bin/true"].append(floor_ms(["/bin/true"], args.turns))
                floors["bwrap /bin/true"].append(floor_ms([*BWRAP_FLOOR, "/bin/true"], args.turns))
            mgr.end_task("bench-seal")
    finally:
        destroy(root, *([mgr] if mgr else []))
        if mgr:
            mgr.close()
    load_after = os.getloadavg()
    print(f"\n## A sealed whole turn (begin, spawn /bin/true, wait, complete; median of {args.rounds} round "
          f"medians of {args.turns} turns)\n")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
          f"after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}\n")
    print("| spawn path | plain turn | sealed turn | sealed / plain | exec chain (sealed) |\n|---|---|---|---|---|")
    for path in paths:
        plain, sealed = (statistics.median(results[(path, s)]) for s in (False, True))
        print(f"| {path} | {plain:.2f} ms | {sealed:.2f} ms | {sealed / plain:.2f}x | {CHAINS[path]} |")
    bare, wrapped = (statistics.median(floors[k]) for k in ("/bin/true", "bwrap /bin/true"))
    print("\n## The floor: subprocess.run outside any turn\n")
    print("| /bin/true | bwrap (the seal's namespaces and mounts) /bin/true | difference |\n|---|---|---|")
    print(f"| {bare:.2f} ms | {wrapped:.2f} ms | {wrapped - bare:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
