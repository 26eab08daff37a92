"""Bench (not a test): what cgturn.celery costs a task and what it buys at revoke, side by side in one run.

Starts a Redis on a loopback port and two prefork workers (concurrency 2) of the same app, one with
`cgturn.celery.setup(app)` and one without, then measures, in rounds that alternate the two workers
task by task (so both see the same load; the load average is printed with every round), each task
sent once the last one's pool process has finished its `task_postrun`:

1. the added cost per task inside the worker, for a task that spawns /bin/true: the time from the
   first `task_prerun` receiver to the task body plus from the body's end to the last `task_postrun`
   receiver (receivers connected before and after cgturn's), minus the same without the integration;
   and, in the pool processes, the time of each cgturn call the integration makes (begin_turn,
   Turn.enter, leave_turn, complete) and of the two halves of the hooks (before and after the body);
   the same added cost with the tasks sent back to back (each worker gets a round's tasks at once),
   where a pool process moves between cgroups in quick succession;
2. the end-to-end latency of that task through Redis (send_task -> result, one at a time);
3. the time from `revoke(terminate=True)` to "nothing the task started is alive", for a task that
   left a `setsid` child: cgturn vs Celery alone (which never gets there; bounded, then this script
   kills the child it started);
4. `--breakdown` (scripts/bench_celery_steps.py): where the added cost goes, in this process, with
   the integration's own code (`Integration.begin`/`end`, what a pool process runs per task): each
   cgturn call it makes timed (begin_turn, Turn.enter, leave_turn, complete), the integration's own
   work as the rest, with and without a sentinel, back to back and with `--gap` ms of idleness
   before each turn; beside it the bare cgturn calls, alternated with the integration turn by turn,
   and the kernel's floor: this process moved into a cgroup and back by bare writes to
   cgroup.procs, after the same idleness.

Run as root from a checkout with the celery extra, redis-server installed:
    python3 scripts/bench_celery.py [--rounds 5] [--tasks 100] [--revokes 10] [--breakdown 200] [--gap 20] [--json]
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
from bench_celery_steps import FLOOR, Steps, breakdown, load, ms, spread  # noqa: E402


def take_overheads(out: str, worker_pids: set[int], steps: dict[str, list[float]] | None = None) -> list[float]:
    """The hooks figures the pool processes of one worker wrote since the last call (files removed);
    the time of each cgturn call the integration made is added to `steps`."""
    values = []
    for path in glob.glob(os.path.join(out, "bench-*.jsonl")):
        pid = int(os.path.basename(path)[6:-6])
        if pid in worker_pids:
            with open(path) as f:
                for line in f:
                    if line.strip():
                        entry = json.loads(line)
                        values.append(entry["overhead_s"])
                        if steps is not None:
                            # "pre"/"post": the two halves of the hooks, keyed by worker.
                            side = "with" if entry.get("steps_s") else "without"
                            for half in ("pre", "post"):
                                steps.setdefault(f"{half}_hooks_{side}", []).append(entry[f"{half}_s"])
                            for name, seconds in entry.get("steps_s", {}).items():
                                steps.setdefault(name, []).append(seconds)
            os.unlink(path)
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


def fleet(args, mount: str) -> dict:
    """Figures 1-3: the two workers through a real Redis."""
    import celery

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
        pids = {"with": pool_pids(with_cg), "without": pool_pids(without)}
        client = celery.Celery("bench", broker=redis.url, backend=redis.url)
        for _ in range(10):  # warm both up
            for q in pids:
                client.send_task("fleet.true", queue=q).get(timeout=30)
        wait_until(lambda: len(glob.glob(os.path.join(out, "done-*"))) >= 20, timeout=30)
        for done in glob.glob(os.path.join(out, "done-*")):
            os.unlink(done)
        for q in pids:
            take_overheads(out, pids[q])
        rounds = []
        hooks_all: dict[str, list[float]] = {"with": [], "without": []}
        steps: dict[str, list[float]] = {}
        latency_all: dict[str, list[float]] = {"with": [], "without": []}
        for n in range(args.rounds):
            load_before = load()
            latency: dict[str, list[float]] = {"with": [], "without": []}
            for i in range(args.tasks):
                for q in (("with", "without") if i % 2 == 0 else ("without", "with")):
                    t0 = time.perf_counter()
                    res = client.send_task("fleet.true", queue=q)
                    res.get(timeout=30)
                    latency[q].append(time.perf_counter() - t0)
                    # Celery stores the result before task_postrun: the next task waits until this
                    # one's pool process is done, so neither worker's hooks overlap the other's task.
                    done = os.path.join(out, "done-" + res.id)
                    if not wait_until(lambda: os.path.exists(done), timeout=30, interval=0.0002):
                        raise RuntimeError(f"task {res.id} never finished its task_postrun")
                    os.unlink(done)
            hooks = {q: take_overheads(out, pids[q], steps) for q in pids}
            for q in pids:
                hooks_all[q].extend(hooks[q])
                latency_all[q].extend(latency[q])
            rounds.append({
                "round": n + 1, "load": [load_before, load()],
                "hooks_ms": {q: spread(v)["median"] for q, v in hooks.items()},
                "added_ms": round(ms(statistics.median(hooks["with"])) - ms(statistics.median(hooks["without"])), 3),
                "end_to_end_ms": {q: spread(v)["median"] for q, v in latency.items()},
            })
        # Back to back: each worker gets `tasks` tasks at once (workers alternate, round by round), so
        # a pool process takes its next task right after the last; the cgroup moves then come in
        # quick succession, which changes what the kernel makes them cost (docs/celery.md).
        burst_rounds = []
        burst_all: dict[str, list[float]] = {"with": [], "without": []}
        burst_steps: dict[str, list[float]] = {}
        for n in range(args.rounds):
            load_before = load()
            hooks = {}
            for q in (("with", "without") if n % 2 == 0 else ("without", "with")):
                results = [client.send_task("fleet.true", queue=q) for _ in range(args.tasks)]
                for res in results:
                    res.get(timeout=120)
                wait_until(lambda: len(glob.glob(os.path.join(out, "done-*"))) >= args.tasks, timeout=30)
                for done in glob.glob(os.path.join(out, "done-*")):
                    os.unlink(done)
                hooks[q] = take_overheads(out, pids[q], burst_steps)
                burst_all[q].extend(hooks[q])
            burst_rounds.append({
                "round": n + 1, "load": [load_before, load()],
                "hooks_ms": {q: spread(v)["median"] for q, v in hooks.items()},
                "added_ms": round(ms(statistics.median(hooks["with"])) - ms(statistics.median(hooks["without"])), 3),
            })
        revoke: dict[str, list[float | None]] = {"with": [], "without": []}
        revoke_load = load()
        for _ in range(args.revokes):
            for q in revoke:
                revoke[q].append(revoke_to_gone(client, out, q, args.bound))
        added = [r["added_ms"] for r in rounds]
        return {
            "tasks_per_round": args.tasks,
            "rounds": rounds,
            "added_per_task_ms": {"median_of_rounds": round(statistics.median(added), 3),
                                  "min": min(added), "max": max(added)},
            "hooks_ms": {q: spread(v) for q, v in hooks_all.items()},
            "back_to_back": {"rounds": burst_rounds,
                             "added_per_task_ms": {"median_of_rounds": round(statistics.median(
                                 [r["added_ms"] for r in burst_rounds]), 3),
                                 "min": min(r["added_ms"] for r in burst_rounds),
                                 "max": max(r["added_ms"] for r in burst_rounds)},
                             "hooks_ms": {q: spread(v) for q, v in burst_all.items()},
                             "steps_in_worker_ms": {name: spread(v) for name, v in sorted(burst_steps.items())}},
            "steps_in_worker_ms": {name: spread(v) for name, v in sorted(steps.items())},
            "end_to_end_ms": {q: spread(v) for q, v in latency_all.items()},
            "revoke_to_gone_ms": {q: (spread([x for x in v if x is not None]) if all(x is not None for x in v)
                                      else None) for q, v in revoke.items()},
            "revoke_never_gone": {q: sum(1 for x in v if x is None) for q, v in revoke.items()},
            "revoke_bound_s": args.bound,
            "revoke_load": revoke_load,
        }
    finally:
        for w in workers:
            stop_worker(w)
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=100, help="tasks per worker and round")
    parser.add_argument("--revokes", type=int, default=10)
    parser.add_argument("--bound", type=float, default=5.0, help="seconds to wait for Celery alone")
    parser.add_argument("--breakdown", type=int, default=200, help="turns per breakdown (0: none)")
    parser.add_argument("--gap", type=float, default=20.0,
                        help="ms of idleness before each turn in the last breakdown (the others: none)")
    parser.add_argument("--breakdown-only", action="store_true", help="skip the workers and Redis")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mount = need_cgroup2()
    report: dict = {"load_at_start": list(os.getloadavg())}
    if not args.breakdown_only:
        report["fleet"] = fleet(args, mount)
    if args.breakdown:
        report["breakdown"] = [breakdown(args.breakdown, mount, sentinel, gap)
                               for sentinel, gap in ((True, 0.0), (False, 0.0), (True, args.gap / 1000))]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"load at start {report['load_at_start']}")
    if "fleet" in report:
        f = report["fleet"]
        print(f"{f['tasks_per_round']} tasks per worker and round, alternated task by task")
        for r in f["rounds"]:
            print(f"  round {r['round']}: load {r['load'][0]}-{r['load'][1]}  hooks with {r['hooks_ms']['with']} ms, "
                  f"without {r['hooks_ms']['without']} ms, added {r['added_ms']} ms; end to end "
                  f"{r['end_to_end_ms']['with']} vs {r['end_to_end_ms']['without']} ms")
        for key in ("added_per_task_ms", "hooks_ms", "steps_in_worker_ms"):
            print(f"{key:22} {f[key]}")
        print(f"back to back, {f['tasks_per_round']} tasks at once per worker and round")
        for r in f["back_to_back"]["rounds"]:
            print(f"  round {r['round']}: load {r['load'][0]}-{r['load'][1]}  hooks with {r['hooks_ms']['with']} ms, "
                  f"without {r['hooks_ms']['without']} ms, added {r['added_ms']} ms")
        for key in ("added_per_task_ms", "hooks_ms", "steps_in_worker_ms"):
            print(f"  {key:20} {f['back_to_back'][key]}")
        for key in ("end_to_end_ms", "revoke_to_gone_ms", "revoke_never_gone",
                    "revoke_bound_s", "revoke_load"):
            print(f"{key:22} {f[key]}")
    for b in report.get("breakdown", []):
        print(f"breakdown, sentinel {'on' if b['sentinel'] else 'off'}, {b['gap_ms']:g} ms idle before each, "
              f"{b['turns']} turns, load "
              f"{b['load'][0]}-{b['load'][1]} (ms: median p10 p90); CPU ms per turn {b['cpu_ms_per_turn']}")
        for name in Steps.NAMES + ("own", "integration", "bare") + FLOOR:
            print(f"  {name:12} {b[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
