#!/usr/bin/env python3
"""A whole asyncio turn against plain asyncio, side by side in one run (issue 15's joint target ≤ 1.5x).

Per round, in a fresh random order, each method runs `/bin/true` once and waits for it:
- asyncio: `asyncio.create_subprocess_exec` + `wait()` (the reference: no turn, no cgroup);
- spawn only: `Turn.create_subprocess_exec` + `wait()` in one long-lived turn;
- whole turn: `begin_turn` + `Turn.create_subprocess_exec` + `wait()` + `complete()`;
- supervised turn: the same inside `Supervisor(turn, timeout=300).run(worker)`.
Every turn is complete()d and its cgroup kept until the end, as a gateway's completed turns are.
Printed: median ms per method and its ratio to asyncio, for each spawn path this host has (the native
clone3 path and the shim). Sentinel off: it is one process per manager, not a per-turn cost.

Everything lives in one managed root `<own cgroup2>/cgturn-bench-<random>`, removed at the end, on errors
and on Ctrl-C/SIGTERM. Run as root: `python3 scripts/bench_aio.py [--rounds 300]`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import bench_root, destroy  # noqa: E402

from cgturn import Supervisor, TurnManager  # noqa: E402
from cgturn.testing import forced_spawn_path, spawn_paths_available  # noqa: E402

TRUE = "/bin/true"


async def measure(mgr: TurnManager, rounds: int, seed: int) -> dict[str, float]:
    """Median ms per method (module docstring), methods in a fresh random order every round."""
    long_lived = mgr.begin_turn("bench-aio", "long-lived")
    counter = iter(range(10 ** 9))

    async def plain():
        await (await asyncio.create_subprocess_exec(TRUE)).wait()

    async def spawn_only():
        await (await long_lived.create_subprocess_exec(TRUE)).wait()

    async def whole_turn():
        turn = mgr.begin_turn("bench-aio", f"t{next(counter)}")
        await (await turn.create_subprocess_exec(TRUE)).wait()
        turn.complete()

    async def supervised_turn():
        turn = mgr.begin_turn("bench-aio", f"t{next(counter)}")

        async def worker():
            return await (await turn.create_subprocess_exec(TRUE)).wait()

        await Supervisor(turn, timeout=300, use_sentinel=False).run(worker)

    methods = {"asyncio.create_subprocess_exec + wait": plain,
               "Turn.create_subprocess_exec + wait (one turn)": spawn_only,
               "begin + create_subprocess_exec + wait + complete": whole_turn,
               "... under Supervisor(timeout=300)": supervised_turn}
    times: dict[str, list[float]] = {name: [] for name in methods}
    rng = random.Random(seed)
    for name in methods:  # warm up: first imports, the root's directories
        await methods[name]()
    for _ in range(rounds):
        for name in rng.sample(list(methods), len(methods)):
            t0 = time.perf_counter()
            await methods[name]()
            times[name].append(time.perf_counter() - t0)
    long_lived.complete()
    return {name: statistics.median(values) * 1000 for name, values in times.items()}


def measure_paths(root: str, state: str, rounds: int) -> dict[str, dict[str, float]]:
    """{spawn path: {method: median ms}} for every spawn path this host has, in managed root `root`."""
    results = {}
    for path in spawn_paths_available():
        with forced_spawn_path(path), TurnManager(root=root, backend="cgroup2", state_dir=state,
                                                  sentinel=False) as mgr:
            results[path] = asyncio.run(measure(mgr, rounds, seed=15))
            mgr.end_task("bench-aio", grace=0)
    return results


PLAIN = "asyncio.create_subprocess_exec + wait"
WHOLE = "begin + create_subprocess_exec + wait + complete"


def print_results(results: dict[str, dict[str, float]], rounds: int) -> None:
    paths = list(results)
    print(f"\n## A whole asyncio turn (median ms, /bin/true, {rounds} rounds, random order)\n")
    print("| method | " + " | ".join(f"{p} path" for p in paths) + " | " +
          " | ".join(f"vs asyncio ({p})" for p in paths) + " |")
    print("|---|" + "---:|" * (2 * len(paths)))
    for name in results[paths[0]]:
        cells = [f"{results[p][name]:.2f}" for p in paths]
        ratios = [f"{results[p][name] / results[p][PLAIN]:.2f}x" for p in paths]
        print(f"| {name} | " + " | ".join(cells + ratios) + " |")


def print_target(results: dict[str, dict[str, float]]) -> None:
    best = next(iter(results))
    print(f"- whole asyncio turn on the {best} path: {results[best][WHOLE] / results[best][PLAIN]:.2f}x "
          "asyncio.create_subprocess_exec + wait (target <= 1.5x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    root = bench_root()
    if root is None:
        return 1
    try:
        with tempfile.TemporaryDirectory(prefix="cgturn-bench-") as state:
            results = measure_paths(root, state, args.rounds)
    finally:
        destroy(root)
    print_results(results, args.rounds)
    print()
    print_target(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
