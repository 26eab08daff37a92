"""How late the shared watchdog fires for many concurrent supervised turns while the event loop is blocked.

N supervised turns (default 2,000) in one process, each with an inactivity timeout spread over
0.5-1.0 s, a coroutine worker that never returns, grace 0, no sentinel. Right after they start, the
loop is blocked (a blocking wait) until every timeout has fired; each `on_interrupt` records when it
ran. Lateness = interrupt time - due time (start + timeout). Side by side: N=50 and N (the same
code), so the ratio shows what scale costs. Also printed: cgturn's own threads at most (target <= 3)
and the cost of the state poll (one record read per turn and second). Target (issue 15): every
timeout within 50 ms of its due time.

Everything lives in one managed root `<own cgroup2>/cgturn-bench-<random>`, removed at the end, on
errors and on Ctrl-C/SIGTERM. Run as root: `PYTHONPATH=$PWD python3 scripts/bench_watchdog.py`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import bench_root, destroy  # noqa: E402

from cgturn import Supervisor, TurnManager  # noqa: E402


def one_round(mgr: TurnManager, n: int, tag: str) -> tuple[list[float], int]:
    """Lateness (ms) of every timeout of `n` supervised turns, and cgturn's most threads seen."""
    turns = [mgr.begin_turn(tag, f"t{i}") for i in range(n)]
    fired_at: dict[int, float] = {}
    done = threading.Event()
    most = [0]

    def interrupt(i: int) -> None:
        fired_at[i] = time.monotonic()
        most[0] = max(most[0], sum(t.name.startswith("cgturn") for t in threading.enumerate()))
        if len(fired_at) == n:
            done.set()

    async def main():
        never = asyncio.Event()
        sups = [Supervisor(t, timeout=0.5 + (i % 100) / 200, grace=0, use_sentinel=False,
                           on_interrupt=lambda _r, i=i: interrupt(i)) for i, t in enumerate(turns)]
        runs = [asyncio.ensure_future(s.run(never.wait)) for s in sups]
        await asyncio.sleep(0)
        if not done.wait(120):  # the loop is blocked: only the watchdog thread can fire
            raise SystemExit(f"only {len(fired_at)} of {n} timeouts fired")
        await asyncio.gather(*runs)
        return sups

    sups = asyncio.run(main())
    late = [(fired_at[i] - (s._started_at + s.timeout)) * 1000 for i, s in enumerate(sups)]
    return late, most[0]


def poll_cost(mgr: TurnManager, n: int = 2000) -> float:
    """Microseconds of one record read (what the state poll costs per turn and second)."""
    turn = mgr.begin_turn("poll")
    started = time.perf_counter()
    for _ in range(n):
        turn.record  # read fresh from the backend at every access
    cost = (time.perf_counter() - started) / n * 1e6
    turn.abandon("bench", grace=0)
    return cost


def measure(mgr: TurnManager, turns: int, rounds: int) -> tuple[dict[int, list[float]], dict[int, int], float]:
    """Lateness per size (50 and `turns`, alternating), most threads per size, one record read (us)."""
    results: dict[int, list[float]] = {50: [], turns: []}
    threads: dict[int, int] = {50: 0, turns: 0}
    for r in range(rounds):
        for n in (50, turns) if r % 2 == 0 else (turns, 50):
            late, most = one_round(mgr, n, f"r{r}-{n}")
            results[n].extend(late)
            threads[n] = max(threads[n], most)
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return results, threads, poll_cost(mgr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base = bench_root()
    if base is None:
        return 1
    try:
        with tempfile.TemporaryDirectory() as state:
            mgr = TurnManager(root=base, backend="cgroup2", state_dir=state, sentinel=False)
            try:
                results, threads, load_us = measure(mgr, args.turns, args.rounds)
            finally:
                mgr.close()
                destroy(base)
    except KeyboardInterrupt:
        print("interrupted: cleaned up", file=sys.stderr)
        return 130
    print(f"cgturn watchdog bench on {os.uname().release}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"rounds={args.rounds}, loop blocked until every timeout fired\n")
    print("| concurrent turns | p50 late (ms) | p99 late (ms) | max late (ms) | cgturn threads (max) | target |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, late in results.items():
        late.sort()
        p99 = late[min(len(late) - 1, int(len(late) * 0.99))]
        print(f"| {n} | {statistics.median(late):.1f} | {p99:.1f} | {late[-1]:.1f} | {threads[n]} | <= 50 ms, <= 3 |")
    print(f"\nstate poll: one record read {load_us:.1f} us -> {load_us * args.turns / 1e4:.2f} % of a core "
          f"for {args.turns} turns at one read per turn and second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
