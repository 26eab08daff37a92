#!/usr/bin/env python3
"""`cgturn reap` against `cgturn ps --json` over N idle turns of one task, side by side in one run.

Each turn is running, holds no process, and is owned by this script (alive), so reap has nothing to
do but look: its cost should be linear and close to a listing's. Target (issue 10, item 14): reap
within 2x ps at 2000 turns. Both commands run as real subprocesses (`python -m cgturn`), alternated,
medians printed with the reap/ps ratio.

Everything lives in a managed root `<cgroup2 mount>/cgturn-bench-<random>` and a temporary state
directory, removed at the end, on errors included. Run as root:

    python3 scripts/bench_reap.py [--sizes 250,1000,2000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import cgturn  # noqa: E402

TASK = "bench"


def timed(argv: list[str]) -> float:
    """Wall seconds of one run of `argv`, which must succeed."""
    started = time.perf_counter()
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          timeout=600)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[3:])} exited {proc.returncode}: {proc.stderr.decode()[-300:]}")
    return elapsed


def measure(root: str, state: str, n: int, rounds: int) -> tuple[float, float]:
    """(median reap seconds, median ps seconds) over `n` idle turns of one task."""
    cli = [sys.executable, "-m", "cgturn", "--root", root, "--backend", "cgroup2", "--state-dir", state]
    mgr = cgturn.TurnManager(root=root, backend="cgroup2", state_dir=state, sentinel=False)
    try:
        turns = [mgr.begin_turn(TASK, f"turn-{i}") for i in range(n)]
        reap, ps = [], []
        for _ in range(rounds):
            ps.append(timed([*cli, "ps", "--json"]))
            reap.append(timed([*cli, "reap", "--json"]))
        left = [t for t in turns if t.state != "running"]
        if left:
            raise RuntimeError(f"reap touched {len(left)} turns whose owner lives")
        return statistics.median(reap), statistics.median(ps)
    finally:
        mgr.end_task(TASK)
        mgr.remove_root()
        mgr.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="250,1000,2000", help="numbers of idle turns (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each command per size (median)")
    args = ap.parse_args()
    host = cgturn.discover_host(None)
    if host.cgroup2_mount is None:
        print("bench_reap: no cgroup2 mount here", file=sys.stderr)
        return 1
    root = os.path.join(host.cgroup2_mount, f"cgturn-bench-{uuid.uuid4().hex[:10]}")
    state = tempfile.mkdtemp(prefix="cgturn-bench-state-")
    print(f"{'turns':>6} {'reap s':>8} {'ps s':>8} {'reap/ps':>8}")
    try:
        for n in (int(s) for s in args.sizes.split(",")):
            reap, ps = measure(root, state, n, args.rounds)
            print(f"{n:>6} {reap:>8.3f} {ps:>8.3f} {reap / ps:>7.2f}x", flush=True)
    finally:
        with cgturn.TurnManager(root=root, backend="cgroup2", state_dir=state) as mgr:
            mgr.end_task(TASK)
            mgr.remove_root()
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
