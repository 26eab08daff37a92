#!/usr/bin/env python3
"""What a seal costs: a sealed whole turn (begin_turn(seal=True), spawn /bin/true, wait, complete)
beside a plain one, on each way a sealed spawn can start, alternating rounds in one run, printed as
medians with the exec chain each pays, the ratio sealed / plain per path and the load average:

- clone3, native sandbox: the extension's child builds the sandbox itself (the default here);
- clone3, bubblewrap: the same clone, then bwrap exec'd (where the native sandbox cannot be built);
- shim: the gated /bin/sh shim, then bwrap (where the extension is not built).

Each row also gives the CPU time a turn costs (this process and its children, from getrusage: far less
sensitive to the load than wall time). Then the floor, subprocess.run outside any turn: /bin/true bare
and inside bubblewrap with the seal's namespaces and mounts.

Everything lives in one managed root `<own cgroup2>/cgturn-bench-<random>`, removed at the end, on
errors and on SIGTERM. The sealed spawns run in a temporary working directory (their writable path).
Run as root:

    python3 scripts/bench_seal.py [--rounds 5] [--turns 30]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchlib import bench_root, destroy  # noqa: E402

from cgturn import TurnManager, testing  # noqa: E402

NATIVE, BWRAP_CHAIN = "clone3, native sandbox", "clone3, bubblewrap"
CASES = {  # name: (spawn path, native sandbox allowed, exec chain of the sealed spawn)
    NATIVE: (testing.CLONE3, True, "clone3 → PID 1 (the child: mounts, then execs cgturn-init) → target"),
    BWRAP_CHAIN: (testing.CLONE3, False, "clone3 → bwrap (→ its init) → target"),
    "shim": (testing.SHIM, False, "shim sh → bwrap (→ its init) → target"),
}
# bubblewrap as the seal asks for it (backends/seal.py), without the writable paths, capabilities and
# filter: what the bubblewrap chain pays for bwrap itself.
BWRAP_FLOOR = ["bwrap", "--unshare-pid", "--unshare-cgroup", "--unshare-ipc", "--ro-bind", "/", "/", "--proc", "/proc",
               "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run", "--"]


def cpu_ms() -> float:
    """CPU time so far of this process and its reaped children, in ms."""
    return sum((r.ru_utime + r.ru_stime) * 1000 for r in
               (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def whole_turns_ms(mgr: TurnManager, sealed: bool, n: int, cwd: str) -> tuple[float, float]:
    """(median wall ms, mean CPU ms) of begin_turn + spawn(/bin/true) + wait + complete, n turns."""
    times = []
    cpu0 = cpu_ms()
    for _ in range(n):
        t0 = time.perf_counter()
        turn = mgr.begin_turn("bench-seal", seal=sealed)
        code = turn.spawn(["/bin/true"], cwd=cwd).wait()
        turn.complete()
        times.append((time.perf_counter() - t0) * 1000)
        if code != 0:
            raise RuntimeError(f"/bin/true exited {code} (sealed={sealed})")
    return statistics.median(times), (cpu_ms() - cpu0) / n


def floor(argv: list[str], n: int) -> tuple[float, float]:
    """(median wall ms, mean CPU ms) of subprocess.run(argv), n times, outside any turn."""
    times = []
    cpu0 = cpu_ms()
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), (cpu_ms() - cpu0) / n


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    root = bench_root()
    if root is None:
        return 2
    cases = {name: case for name, case in CASES.items() if testing.spawn_path_unavailable(case[0]) is None
             and (case[1] is False or testing.native_seal_works())}
    results: dict[tuple[str, bool], list[tuple[float, float]]] = {(name, s): [] for name in cases for s in (False, True)}
    floors = {"/bin/true": ["/bin/true"], "bwrap (the seal's namespaces and mounts) /bin/true": [*BWRAP_FLOOR, "/bin/true"]}
    floor_runs: dict[str, list[tuple[float, float]]] = {name: [] for name in floors}
    loads = [load()]
    mgr = None
    try:
        with tempfile.TemporaryDirectory() as state, tempfile.TemporaryDirectory() as work:
            mgr = TurnManager(root=root, backend="cgroup2", state_dir=state)
            for _ in range(args.rounds):  # alternating: the machine's noise hits every case alike
                for name, (path, allowed, _chain) in cases.items():
                    with testing.forced_spawn_path(path), \
                            (contextlib.nullcontext() if allowed else testing.forced_bubblewrap_seal()):
                        for sealed in (False, True):
                            results[(name, sealed)].append(whole_turns_ms(mgr, sealed, args.turns, work))
                for name, argv in floors.items():
                    floor_runs[name].append(floor(argv, args.turns))
                loads.append(load())
            mgr.end_task("bench-seal")
    finally:
        destroy(root, *([mgr] if mgr else []))
        if mgr:
            mgr.close()
    print(f"\n## A sealed whole turn (begin, spawn /bin/true, wait, complete; median of {args.rounds} round "
          f"medians of {args.turns} turns)\n")
    print(f"load average (1, 5, 15 min) before and after each round: {' | '.join(loads)}\n")
    print("| sealed spawn | plain turn | sealed turn | sealed / plain | CPU plain / sealed | exec chain (sealed) |\n"
          "|---|---|---|---|---|---|")
    for name, (_path, _allowed, chain) in cases.items():
        (plain, plain_cpu), (sealed, sealed_cpu) = (
            (statistics.median(r[0] for r in results[(name, s)]), statistics.median(r[1] for r in results[(name, s)]))
            for s in (False, True))
        print(f"| {name} | {plain:.2f} ms | {sealed:.2f} ms | {sealed / plain:.2f}x | "
              f"{plain_cpu:.2f} / {sealed_cpu:.2f} ms | {chain} |")
    print("\n## The floor: subprocess.run of /bin/true outside any turn (wall: median of round medians; CPU: "
          "this process and its children, per run)\n")
    print("| spawn | wall | CPU |\n|---|---|---|")
    for name, runs in floor_runs.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        print(f"| {name} | {wall:.2f} ms | {cpu:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
