"""Bench (not a test): what cgturn.celery costs a task and what it buys at revoke, side by side in one run.

Starts a Redis on a loopback port and two prefork workers (concurrency 2) of the same app, one with
`cgturn.celery.setup(app)` and one without, then measures:

1. the added cost per task inside the worker, for a task that spawns /bin/true: the time from the
   first `task_prerun` receiver to the task body plus from the body's end to the last `task_postrun`
   receiver (receivers connected before and after cgturn's), minus the same without the integration;
2. the end-to-end latency of that task through Redis (send_task → result), both workers interleaved;
3. the time from `revoke(terminate=True)` to "nothing the task started is alive", for a task that
   left a `setsid` child: cgturn vs Celery alone (which never gets there; bounded, then this script
   kills the child it started).

Run as root from a checkout with the celery extra, redis-server installed:
    python3 scripts/bench_celery.py [--tasks 200] [--revokes 10] [--json]
Everything it starts (Redis, workers, their managed roots) it stops and removes, failures included.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from celery_fleet import Redis, fleet_env, start_worker, stop_worker, write_app  # noqa: E402
from conftest import alive, need_cgroup2, wait_until  # noqa: E402


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3)


def p90_ms(values: list[float]) -> float:
    return round(statistics.quantiles(values, n=10)[-1] * 1000, 3) if len(values) >= 10 else float("nan")


def overheads(out: str, worker_pids: set[int]) -> list[float]:
    values = []
    for path in glob.glob(os.path.join(out, "bench-*.jsonl")):
        pid = int(os.path.basename(path)[6:-6])
        if pid in worker_pids:
            with open(path) as f:
                values.extend(json.loads(line)["overhead_s"] for line in f if line.strip())
    return values


def pool_pids(worker) -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process(worker.proc.pid).children()}


def revoke_to_gone(client, out: str, queue: str, bound: float) -> float | None:
    """Seconds from revoke(terminate=True) until the task's setsid child is dead; None past `bound`."""
    res = client.send_task("fleet.setsid_child", queue=queue)
    path = os.path.join(out, f"{res.id}.child")
    if not wait_until(lambda: os.path.exists(path), timeout=30):
        raise RuntimeError("the task never started its child")
    with open(path) as f:
        child = int(f.read())
    start = time.perf_counter()
    client.control.revoke(res.id, terminate=True)
    gone = wait_until(lambda: not alive(child), timeout=bound, interval=0.0005)
    elapsed = time.perf_counter() - start
    if not gone:
        os.kill(child, signal.SIGKILL)  # the child this bench's task started
        return None
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--revokes", type=int, default=10)
    parser.add_argument("--bound", type=float, default=5.0, help="seconds to wait for Celery alone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import celery

    mount = need_cgroup2()
    tmp = tempfile.mkdtemp(prefix="cgturn-bench-celery-")
    out = write_app(tmp)
    redis = Redis(tmp)
    workers = []
    try:
        env = dict(fleet_env(redis.url, tmp, out), FLEET_BENCH="1")
        with_cg = start_worker("with", dict(env, FLEET_CGTURN="1"), mount, tmp)
        workers.append(with_cg)
        without = start_worker("without", dict(env, FLEET_CGTURN="0"), mount, tmp)
        workers.append(without)
        client = celery.Celery("bench", broker=redis.url, backend=redis.url)
        latency: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(10):  # warm both up
            for q in latency:
                client.send_task("fleet.true", queue=q).get(timeout=30)
        for f in glob.glob(os.path.join(out, "bench-*.jsonl")):
            os.unlink(f)
        for _ in range(args.tasks):
            for q in latency:
                t0 = time.perf_counter()
                client.send_task("fleet.true", queue=q).get(timeout=30)
                latency[q].append(time.perf_counter() - t0)
        inside = {"with": overheads(out, pool_pids(with_cg)), "without": overheads(out, pool_pids(without))}
        revoke = {"with": [], "without": []}
        for _ in range(args.revokes):
            for q in revoke:
                revoke[q].append(revoke_to_gone(client, out, q, args.bound))
        added = median_ms(inside["with"]) - median_ms(inside["without"])
        report = {
            "tasks": args.tasks,
            "hooks_median_ms": {q: median_ms(v) for q, v in inside.items()},
            "hooks_p90_ms": {q: p90_ms(v) for q, v in inside.items()},
            "added_per_task_ms": round(added, 3),
            "end_to_end_median_ms": {q: median_ms(v) for q, v in latency.items()},
            "end_to_end_p90_ms": {q: p90_ms(v) for q, v in latency.items()},
            "revoke_to_gone_median_ms": {
                q: (median_ms([x for x in v if x is not None]) if all(x is not None for x in v) else None)
                for q, v in revoke.items()},
            "revoke_never_gone": {q: sum(1 for x in v if x is None) for q, v in revoke.items()},
            "revoke_bound_s": args.bound,
        }
    finally:
        for w in workers:
            stop_worker(w)
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
