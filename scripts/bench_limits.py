#!/usr/bin/env python3
"""What limits cost: turn churn with and without memory+pids+cpu limits, and abandoning 500 processes of
a limited turn against the kernel floor, measured side by side in one run and printed as one table.

- churn: begin + spawn(/bin/true) + wait + complete, back to back, alternating rounds of
  `limits=Limits(memory_max=256M, pids_max=100, cpus=1)` and no limits (target: limited >= 0.6x).
- abandon: a turn with those limits holding 500 sleeping processes, `abandon(grace=0)`, against
  cgroup.kill + wait for `populated 0` + rmdir on a raw cgroup2 directory holding the same tree
  (target: <= 1.25x). On a hybrid host the limited turn also has v1 directories to remove.

Everything lives in one managed root `<cgroup2 mount>/cgturn-bench-<random>` (its v1 directories
below this process's own v1 cgroups), removed at the end, on errors and on Ctrl-C/SIGTERM. Run as root:

    python3 scripts/bench_limits.py [--rounds 5] [--seconds 1.0] [--size 500]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchlib import bench_root, cgturn_abandon, destroy, floor_abandon  # noqa: E402

from cgturn import Limits, TurnManager  # noqa: E402
from cgturn.testing import v1_dirs  # noqa: E402

LIMITS = Limits(memory_max=256 * 2 ** 20, pids_max=100, cpus=1.0)


def churn(mgr: TurnManager, seconds: float, limits: Limits | None) -> float:
    """Turns per second: begin (with `limits`) + spawn(/bin/true) + wait + complete."""
    done = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        turn = mgr.begin_turn("bench-churn", limits=limits)
        turn.spawn(["/bin/true"]).wait()
        if not turn.complete():
            raise RuntimeError("a churn turn did not complete")
        done += 1
    return done / (time.perf_counter() - t0)


def limited_abandon(mgr: TurnManager, n: int) -> float:
    """abandon(grace=0) of a limited turn holding n processes: kill, wait, usage read, v1 removal."""
    def check(turn, result):
        dirs = v1_dirs(mgr, turn)
        if result.usage is None or any(os.path.exists(d) for d in dirs.values()):
            raise RuntimeError(f"usage {result.usage}; v1 directories left behind: {dirs}")

    return cgturn_abandon(mgr, n, Limits(memory_max=LIMITS.memory_max, pids_max=n + 50, cpus=LIMITS.cpus), check)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=1.0, help="length of one churn round")
    ap.add_argument("--size", type=int, default=500, help="processes in the abandoned tree")
    args = ap.parse_args()
    base = bench_root()
    if base is None:
        return 1
    rates = {"limited": [], "plain": []}
    abandon = {"floor": [], "limited": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as state:
        os.mkdir(base)
        mgr = TurnManager(root=os.path.join(base, "main"), backend="cgroup2", state_dir=state, sentinel=False)
        try:
            report = mgr.limits_report()
            mgr.begin_turn("warm-up", limits=LIMITS).complete()
            os.mkdir(os.path.join(base, "floor"))
            for i in range(args.rounds):
                order = ("limited", "plain") if i % 2 == 0 else ("plain", "limited")
                for name in order:
                    rates[name].append(churn(mgr, args.seconds, LIMITS if name == "limited" else None))
                pair = [("floor", lambda: floor_abandon(os.path.join(base, "floor"), args.size)),
                        ("limited", lambda: limited_abandon(mgr, args.size))]
                for name, measure in (pair if i % 2 == 0 else pair[::-1]):
                    abandon[name].append(measure())
                print(f"  round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            print("interrupted: cleaning up", file=sys.stderr)
            return 130
        finally:
            destroy(base, mgr)
            mgr.close()
    limited, plain = statistics.median(rates["limited"]), statistics.median(rates["plain"])
    floor_ms, limited_ms = (statistics.median(abandon[k]) * 1000 for k in ("floor", "limited"))
    print(f"cgturn limits bench on {os.uname().release}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"layout {report['layout']} ({', '.join(report['available'])}), rounds={args.rounds}, "
          f"total {time.monotonic() - started:.0f} s")
    print(f"\n## Turn churn (begin + spawn /bin/true + wait + complete; turns/s, median of {args.rounds} rounds "
          f"of {args.seconds:g} s, alternating)\n")
    print("| no limits | memory+pids+cpu limits | limited/plain | target |")
    print("|---:|---:|---:|---:|")
    print(f"| {plain:.0f} | {limited:.0f} | {limited / plain:.2f}x | >= 0.6x |")
    print(f"\n## Abandon of {args.size} sleeping processes (median ms of {args.rounds}, grace=0, alternating)\n")
    print("| kernel floor (cgroup.kill + populated 0 + rmdir) | limited turn abandon | limited/floor | target |")
    print("|---:|---:|---:|---:|")
    print(f"| {floor_ms:.1f} | {limited_ms:.1f} | {limited_ms / floor_ms:.2f}x | <= 1.25x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
