#!/usr/bin/env python3
"""Spawn cost of two source trees side by side: `bench.py --spawn-only` from each, alternating, in one run.

    python3 scripts/ab_spawn.py BEFORE_TREE AFTER_TREE [--rounds 5] [--spawns 200]

Each tree is a checkout of cgturn (e.g. `git archive <commit> | tar -x -C /tmp/before`). Rounds
alternate the order; the table gives medians over rounds of each round's median, and after/before.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def run(tree: str, spawns: int) -> dict:
    out = subprocess.run([sys.executable, os.path.join(tree, "scripts", "bench.py"), "--spawn-only",
                          "--spawns", str(spawns)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spawns", type=int, default=200)
    args = ap.parse_args()
    rows: dict[str, dict[str, list]] = {"before": {}, "after": {}}
    loads = [os.getloadavg()[0]]
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for which in order:
            loads.append(os.getloadavg()[0])
            for name, (call, cycle) in run(getattr(args, which), args.spawns).items():
                rows[which].setdefault(name, []).append((call, cycle))
    loads.append(os.getloadavg()[0])
    print(f"spawn A/B, {args.rounds} rounds x {args.spawns} spawns, alternating; median ms per process; "
          f"1-min load {min(loads):.1f}-{max(loads):.1f} over the run\n")
    print("| method | before: call | after: call | after/before | before: start to exit | after: start to exit "
          "| after/before | vs Popen before | vs Popen after |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    med = {w: {n: (statistics.median(c for c, _ in v), statistics.median(e for _, e in v))
               for n, v in rows[w].items()} for w in rows}
    for name in med["before"]:
        (bc, be), (ac, ae) = med["before"][name], med["after"][name]
        print(f"| {name} | {bc:.3f} | {ac:.3f} | {ac / bc:.2f}x | {be:.3f} | {ae:.3f} | {ae / be:.2f}x "
              f"| {bc / med['before']['Popen'][0]:.2f}x | {ac / med['after']['Popen'][0]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
