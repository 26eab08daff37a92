#!/usr/bin/env python3
"""Small-turn costs of two source trees side by side: each tree's own `bench.py --per-turn-only` and
`--abandon-only`, alternating, in one run.

    python3 scripts/ab_small.py BEFORE_TREE AFTER_TREE [--rounds 3] [--per-turn 500] \
        [--sizes 1,10] [--abandon-rounds 10]

Each tree is a checkout of cgturn (e.g. `git archive <commit> | tar -x -C /tmp/before`, its C extension
built there). Rounds alternate the order (before first, then after first). The table gives, per figure,
each tree's median over rounds of each round's median, with its floor ratio from the same bench run
(begin + complete against a bare cgroup mkdir + rmdir; an abandon against the kernel's own kill of the
same tree), and the 1-minute load average seen before each bench run. It parses the benches' printed
tables, which both trees must print in the same form (they have since issue "Performance II").
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

PER_TURN_ROW = re.compile(r"^\| (sentinel off|sentinel on) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$")
FLOOR_ROW = re.compile(r"^\| floor: mkdir \+ rmdir of a cgroup \| \| \| ([\d.]+) \|")
ABANDON_ROW = re.compile(r"^- abandon (\d+): cgroup2 ([\d.]+) ms, floor ([\d.]+) ms")


def bench(tree: str, *args: str) -> str:
    """The output of `tree`'s own scripts/bench.py with `args`, importing `tree`'s cgturn."""
    out = subprocess.run([sys.executable, os.path.join(tree, "scripts", "bench.py"), *args], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
    return out.stdout


def per_turn(text: str) -> dict[str, tuple[float, float]]:
    """{variant: (begin + complete ms, ratio to the cgroup floor)} and {"floor": (ms, 1.0)}."""
    rows: dict[str, tuple[float, float]] = {}
    for line in text.splitlines():
        if m := PER_TURN_ROW.match(line):
            rows[m[1]] = (float(m[4]), float(m[5]))
        elif m := FLOOR_ROW.match(line):
            rows["floor"] = (float(m[1]), 1.0)
    return rows


def abandon(text: str) -> dict[str, tuple[float, float]]:
    """{"abandon N": (cgturn ms, floor ms)}."""
    return {f"abandon {m[1]}": (float(m[2]), float(m[3]))
            for line in text.splitlines() if (m := ABANDON_ROW.match(line))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-turn", type=int, default=500, help="rounds of each per-turn bench run (0: none)")
    ap.add_argument("--sizes", default="1,10", help="abandon sizes")
    ap.add_argument("--abandon-rounds", type=int, default=10, help="rounds of each abandon bench run (0: none)")
    args = ap.parse_args()
    got: dict[str, dict[str, list[tuple[float, float]]]] = {"before": {}, "after": {}}
    rows: dict[str, tuple[float, float]]
    loads = []
    for i in range(args.rounds):
        for which in (("before", "after") if i % 2 == 0 else ("after", "before")):
            tree = getattr(args, which)
            rows = {}
            if args.per_turn:
                loads.append(os.getloadavg()[0])
                rows.update(per_turn(bench(tree, "--per-turn-only", "--per-turn", str(args.per_turn))))
            if args.abandon_rounds:
                loads.append(os.getloadavg()[0])
                rows.update(abandon(bench(tree, "--abandon-only", "--sizes", args.sizes,
                                          "--rounds", str(args.abandon_rounds))))
            for name, value in rows.items():
                got[which].setdefault(name, []).append(value)
            print(f"  round {i + 1} {which} done (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    print(f"small turns A/B, {args.rounds} rounds alternating; begin + complete: {args.per_turn} turns a run; "
          f"abandon: {args.abandon_rounds} a size a run; medians of the runs' medians, ms; "
          f"1-min load {min(loads):.1f}-{max(loads):.1f} over the run\n")
    print("| figure | before | after | after/before | before vs its floor | after vs its floor |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in got["before"]:
        if name not in got["after"]:
            continue
        (b, bf), (a, af) = ((statistics.median(v for v, _ in got[w][name]), statistics.median(r for _, r in got[w][name]))
                            for w in ("before", "after"))
        if name.startswith("abandon"):  # the second figure is the floor in ms: give both ratio forms
            line = (f"{b:.3f} | {a:.3f} | {a / b:.2f}x | {b / bf:.2f}x, {b - bf:+.2f} ms (floor {bf:.3f}) "
                    f"| {a / af:.2f}x, {a - af:+.2f} ms (floor {af:.3f})")
        else:
            line = f"{b:.3f} | {a:.3f} | {a / b:.2f}x | {bf:.2f}x | {af:.2f}x"
        print(f"| {name} | {line} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
