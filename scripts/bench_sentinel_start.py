#!/usr/bin/env python3
"""A sentinel's whole life as its owner pays for it, for two or more installs side by side: a one-thread
owner forks it and waits for `ready` (`Supervisor.start_sentinel`), then closes its manager and waits
for it to exit (what `cgturn run` does around its command), with the sentinel's CPU time (its rusage,
once reaped) beside; the system calls of one sentinel (strace -f, the sentinel's own lines); and, for
an install that has sentinel lock files (cgturn.sentinel_locks), what a hold + release costs.

    python3 -m venv /tmp/a && /tmp/a/bin/pip install .    # one plain install per tree
    python3 scripts/bench_sentinel_start.py --venv /tmp/a --venv /tmp/b [-n 15] [--per-round 20]

Rounds alternate between the installs, so each sees the machine in the same state; the first install
is the base the others' ratios are over. Works in a managed root of its own
(`<own cgroup>/cgturn-bench-<random>`, removed at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import bench_root, destroy  # noqa: E402

# One owner process: `per_round` sentinels started and closed one after the other, each timed.
OWNER = """
import json, os, resource, sys, time
from cgturn import Supervisor, TurnManager
root, state, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = []
for _ in range(n):
    mgr = TurnManager(root=root, backend="cgroup2", state_dir=state)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    Supervisor.start_sentinel(mgr)
    t1 = time.perf_counter()
    mgr.close()
    t2 = time.perf_counter()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    out.append([(t1 - t0) * 1000, (t2 - t1) * 1000, cpu * 1000])
print(json.dumps(out))
"""


def run_owner(venv: str, root: str, state: str, n: int, strace: str | None = None) -> list[list[float]]:
    argv = [os.path.join(venv, "bin", "python"), "-c", OWNER, root, state, str(n)]
    if strace:
        argv = ["strace", "-f", "-qq", "-o", strace, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd="/")
    if out.returncode != 0:
        raise SystemExit(f"{venv}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.splitlines()[-1])


def sentinel_syscalls(venv: str, root: str, state: str) -> int:
    """System calls of one forked sentinel, from its fork to its exit (its own lines of strace -f)."""
    with tempfile.TemporaryDirectory(prefix="cgturn-bench-strace-") as tmp:
        path = os.path.join(tmp, "trace")
        run_owner(venv, root, state, 1, strace=path)
        lines = open(path).read().splitlines()
    # the sentinel is the one process that names itself: write(..., "cgturn-sentinel", 15)
    [sentinel] = {int(line.split()[0]) for line in lines if '"cgturn-sentinel"' in line and " write(" in line}
    return sum(1 for line in lines if line.startswith(f"{sentinel} ") and "exited with" not in line)


# The lock file's own cost where an install has it: hold + release, timed in a loop, in the state
# directory the runs above used (its filesystem decides most of it: a create and an unlink).
PARTS = """
import json, os, sys, time
state, n = sys.argv[1], int(sys.argv[2])
import cgturn.processes
try:
    from cgturn import sentinel_locks
except ImportError:
    print(json.dumps(None)); sys.exit()
me, start = os.getpid(), cgturn.processes.start_time(os.getpid())
runs = []
for _ in range(n):
    t0 = time.perf_counter()
    sentinel_locks.hold(state, me, start).release()
    runs.append(time.perf_counter() - t0)
runs.sort()
print(json.dumps(runs[len(runs) // 2] * 1e6))
"""


def parts(venv: str, state: str, n: int = 2000) -> float | None:
    """Median µs of a hold + release for an install with sentinel lock files, else None."""
    out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", PARTS, state, str(n)], capture_output=True,
                         text=True, timeout=300, cwd="/")
    return json.loads(out.stdout.splitlines()[-1]) if out.returncode == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", action="append", required=True, help="a plain install (repeat; the first is the base)")
    parser.add_argument("-n", type=int, default=15, help="rounds (default 15)")
    parser.add_argument("--per-round", type=int, default=20, help="sentinels per owner process and round (default 20)")
    args = parser.parse_args()
    root = bench_root()
    if root is None:
        raise SystemExit("needs cgroup v2")
    state = tempfile.mkdtemp(prefix="cgturn-bench-state-")
    load = os.getloadavg()[0]
    figures: dict[str, list[list[float]]] = {v: [] for v in args.venv}
    try:
        for _ in range(args.n):
            for venv in args.venv:
                figures[venv] += run_owner(venv, root, state, args.per_round)
        calls = {venv: sentinel_syscalls(venv, root, state) for venv in args.venv} if shutil.which("strace") else {}
        lock_parts = {venv: parts(venv, state) for venv in args.venv}
    finally:
        destroy(root)
        shutil.rmtree(state, ignore_errors=True)
    print(f"sentinel start + close, forked, {args.n} rounds x {args.per_round}, load {load:.1f} before / "
          f"{os.getloadavg()[0]:.1f} after\n")
    print("| install | start to ready, median (ms) | close to exit (ms) | sentinel CPU (ms) | ratio start+close | sentinel syscalls |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for venv, rows in figures.items():
        start, close, cpu = (statistics.median(col) for col in zip(*rows))
        base = base or start + close
        print(f"| {venv} | {start:.2f} | {close:.2f} | {cpu:.2f} | {(start + close) / base:.3f}x | {calls.get(venv, '-')} |")
    print()
    for venv, found in lock_parts.items():
        if found is not None:
            print(f"- {venv}: the lock file's hold + release {found:.1f} us (median of 2,000, in "
                  f"{os.path.dirname(state)}; made after `ready`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
