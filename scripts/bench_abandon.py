#!/usr/bin/env python3
"""Abandon a 500-process tree: cgturn (cgroup.kill) vs the psutil tree-kill recipe, side by side.

Both trees are the same `sh` with N sleeping children, started in this run, alternately, and each is
timed from "decide to kill" to "every process gone". The psutil recipe is
children(recursive=True) + kill + wait_procs. Its tree also runs inside a throwaway cgturn turn so that
whatever it misses is still cleaned up afterwards (that cleanup is not timed).

Usage: python3 scripts/bench_abandon.py [--procs 500] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import psutil  # noqa: E402

from cgturn.kernel import discovery  # noqa: E402
from cgturn.manager import TurnManager  # noqa: E402


def start_tree(turn, n: int):
    proc = turn.spawn(["sh", "-c", f"i=0; while [ $i -lt {n} ]; do sleep 300 & i=$((i+1)); done; wait"])
    deadline = time.monotonic() + 60
    while len(turn.pids()) < n + 1:
        if time.monotonic() > deadline:
            raise RuntimeError("tree did not come up")
        time.sleep(0.01)
    return proc


def time_cgturn(mgr, n: int) -> float:
    turn = mgr.begin_turn("bench", f"cgturn-{uuid.uuid4().hex[:6]}")
    proc = start_tree(turn, n)
    t0 = time.perf_counter()
    result = turn.abandon("bench", grace=0)
    elapsed = time.perf_counter() - t0
    proc.wait()
    assert len(result.killed) == n + 1, len(result.killed)
    return elapsed


def _dead(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def time_psutil(mgr, n: int) -> tuple[float, float, int]:
    """(seconds until every victim is dead, seconds until wait_procs returned, survivors)."""
    turn = mgr.begin_turn("bench", f"psutil-{uuid.uuid4().hex[:6]}")
    proc = start_tree(turn, n)
    t0 = time.perf_counter()
    parent = psutil.Process(proc.pid)
    victims = parent.children(recursive=True) + [parent]
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    while not all(_dead(p) for p in victims):
        pass
    dead = time.perf_counter() - t0
    # The recipe as written: wait_procs also waits until orphans are reaped by PID 1.
    psutil.wait_procs(victims, timeout=30)
    reaped = time.perf_counter() - t0
    proc.wait()
    survivors = len(turn.pids())
    turn.abandon("bench-cleanup", grace=0)
    return dead, reaped, survivors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    mount = discovery.discover().cgroup2_mount
    if mount is None:
        print("cgroup v2 is not mounted here", file=sys.stderr)
        return 1
    root = os.path.join(mount, f"cgturn-bench-{uuid.uuid4().hex[:8]}")
    with tempfile.TemporaryDirectory() as state, TurnManager(root=root, backend="cgroup2", state_dir=state) as mgr:
        try:
            cg, ps_dead, ps_reaped, missed = [], [], [], 0
            for _ in range(args.rounds):
                cg.append(time_cgturn(mgr, args.procs))
                dead, reaped, survivors = time_psutil(mgr, args.procs)
                ps_dead.append(dead)
                ps_reaped.append(reaped)
                missed += survivors
        finally:
            for rec in mgr.backend.records():
                mgr.end_task(rec.task_id)
            mgr.backend.root.remove_tree()
    cg_ms = statistics.median(cg) * 1000
    dead_ms, reaped_ms = statistics.median(ps_dead) * 1000, statistics.median(ps_reaped) * 1000
    print(f"abandon a {args.procs + 1}-process tree, median of {args.rounds} rounds each, same run")
    print(f"  cgturn Turn.abandon(grace=0), until populated 0 + rmdir: {cg_ms:8.1f} ms   0 survivors")
    print(f"  psutil children+kill, until all dead (zombie or gone):   {dead_ms:8.1f} ms   "
          f"{missed} survivors in all rounds")
    print(f"  psutil recipe incl. wait_procs (orphans reaped by PID 1): {reaped_ms:8.1f} ms")
    print(f"  ratio cgturn / psutil (until dead):                      {cg_ms / dead_ms:8.2f}x")
    print(f"  ratio cgturn / psutil (recipe with wait_procs):          {cg_ms / reaped_ms:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
