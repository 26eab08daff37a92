"""Spawn paths side by side (issue 16): Turn.spawn through clone3 (cgturn._spawn) and through the shim
against plain Popen, call-return and start-to-exit (/bin/true), interleaved in a fresh random order
every round; then turn churn (begin + spawn + wait + complete) per path; ratios against the targets.

Everything lives in one managed root `<own cgroup>/cgturn-bench-spawn-<random>`, removed at the end
(scripts/bench.py `destroy`). Run as root: python3 scripts/bench_spawn.py [--spawns N] [--seconds S]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from benchlib import churn, destroy, time_spawn  # noqa: E402

from cgturn import TurnManager, discover_host  # noqa: E402
from cgturn.testing import CLONE3, POSIX_SPAWN, SHIM, forced_spawn_path, spawn_path_unavailable  # noqa: E402


def paths_here() -> list[str]:
    """The native paths available here, then the shim."""
    return [path for path in (CLONE3, POSIX_SPAWN) if spawn_path_unavailable(path) is None] + [SHIM]


def spawn_rows(mgr: TurnManager, count: int) -> dict[str, tuple[float, float]]:
    """Median ms (call returns, start to exit) per method."""
    turn = mgr.begin_turn("bench-spawn")
    methods = {"Popen": (None, lambda: subprocess.Popen(["/bin/true"]))}
    for path in paths_here():
        methods[f"Turn.spawn {path}"] = (path, lambda: turn.spawn(["/bin/true"]))
    calls = {k: [] for k in methods}
    cycles = {k: [] for k in methods}
    rng = random.Random(7)
    for _ in range(count):
        for name in rng.sample(list(methods), len(methods)):
            path, start = methods[name]
            with forced_spawn_path(path) if path else contextlib.nullcontext():
                call, cycle = time_spawn(start)
            calls[name].append(call)
            cycles[name].append(cycle)
    turn.abandon("bench", grace=0)
    return {k: (statistics.median(calls[k]) * 1e3, statistics.median(cycles[k]) * 1e3) for k in methods}


def churn_on(mgr: TurnManager, path: str, seconds: float) -> float:
    with forced_spawn_path(path):
        return churn(mgr, seconds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spawns", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=3.0, help="per churn measurement")
    args = ap.parse_args()
    host = discover_host()
    if host.cgroup2_mount is None or os.geteuid() != 0:
        print("needs root and a cgroup2 mount", file=sys.stderr)
        return 1
    native = paths_here()[0]
    if native == SHIM:
        print("no native spawn path here (cgturn._spawn not built, glibc < 2.39)", file=sys.stderr)
        return 1
    root = os.path.join(host.own_cgroup or host.cgroup2_mount, f"cgturn-bench-spawn-{uuid.uuid4().hex[:8]}")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with tempfile.TemporaryDirectory() as state:
        try:
            with TurnManager(root=root, backend="cgroup2", state_dir=state) as mgr:
                rows = spawn_rows(mgr, args.spawns)
                rates = {}
                for path in (native, SHIM, native, SHIM):
                    rates.setdefault(path, []).append(churn_on(mgr, path, args.seconds / 2))
        except KeyboardInterrupt:
            print("interrupted: cleaning up", file=sys.stderr)
            return 130
        finally:
            destroy(root)
    print(f"cgturn spawn bench on {os.uname().release}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"{args.spawns} spawns per method")
    base_call, base_cycle = rows["Popen"]
    print("\n| method | call returns (ms) | start to exit (ms) | call vs Popen | exit vs Popen |")
    print("|---|---:|---:|---:|---:|")
    for name, (call, cycle) in rows.items():
        print(f"| {name} | {call:.3f} | {cycle:.3f} | {call / base_call:.2f}x | {cycle / base_cycle:.2f}x |")
    churn_rates = {path: statistics.mean(r) for path, r in rates.items()}
    print("\n| turn churn (begin + spawn + complete) | turns/s |")
    print("|---|---:|")
    for path, rate in churn_rates.items():
        print(f"| {path} | {rate:.0f} |")
    call, cycle = rows[f"Turn.spawn {native}"]
    print("\nAgainst the targets (issue 16):")
    print(f"- call-return: {native} {call / base_call:.2f}x Popen (target <= 1.15x)")
    print(f"- start-to-exit: {native} {cycle / base_cycle:.2f}x Popen (target <= 1.1x)")
    print(f"- churn: {native} {churn_rates[native]:.0f} turns/s (target >= 600; shim {churn_rates['shim']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
