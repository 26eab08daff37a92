"""Bench (not a test): what cgturn.celery costs a task and what it buys at revoke, side by side in one run.

Starts a Redis on a loopback port and two prefork workers (concurrency 2) of the same app, one with
`cgturn.celery.setup(app)` and one without (and with `--base DIR` a third, with the integration of
DIR's cgturn, e.g. main's: before and after in one run), then measures, in rounds that alternate the
workers task by task (so all see the same load; the load average is printed with every round), each
task sent once the last one's pool process has finished its `task_postrun`:

1. the added cost per task inside the worker, for a task that spawns /bin/true: the time from the
   first `task_prerun` receiver to the task body plus from the body's end to the last `task_postrun`
   receiver (receivers connected before and after cgturn's), minus the same without the integration;
   and, in the pool processes, split task by task: each cgturn call the integration makes
   (begin_turn, Turn.enter, leave_turn, complete), the integration's own code around them, Celery's
   signal dispatch, and Celery's result store after the body (in both workers);
   the same with `--idle` ms of idleness before each task (a worker waiting for work: the move into
   the turn then comes long after the host's last cgroup move, which the kernel makes wait for an
   RCU grace period), and with the tasks sent back to back (each worker gets a round's tasks at
   once), where a pool process moves between cgroups in quick succession;
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
   cgroup.procs, after the same idleness;
5. the integration's own code per task with its four cgturn calls stubbed out (µs), beside that of
   `--base DIR`'s cgturn/celery.py, alternated round by round;
6. the kernel's floor against idleness: a bare move into a cgroup after 0-100 ms without one
   (`--floor-gaps`), which says what the move into a turn costs a worker that sat idle.

Run as root from a checkout with the celery extra, redis-server installed:
    python3 scripts/bench_celery.py [--rounds 5] [--tasks 100] [--idle 100] [--idle-tasks 20] [--revokes 10]
                                    [--breakdown 200] [--gap 20] [--floor-gaps 0,1,2,5,10,20,50,100]
                                    [--base DIR] [--json]
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
from bench_celery_steps import FLOOR, Steps, breakdown, floor_after_idle, load, ms, own_code, spread  # noqa: E402

TARGET_MS = 1.0  # issue 25: added cost per task inside the worker, for a task that spawns /bin/true


def take_overheads(out: str, worker_pids: set[int], side: str, steps: dict[str, list[float]] | None = None) -> list[float]:
    """The hooks figures the pool processes of one worker (`side`) wrote since the last call (files
    removed); what each part of them took is added to `steps` (attribute())."""
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
                            attribute(entry, side, steps)
            os.unlink(path)
    return values


def attribute(entry: dict, side: str, steps: dict[str, list[float]]) -> None:
    """One task's hooks, split task by task (a difference of medians would mislead: `enter` is
    bimodal). Every worker: the halves before and after the body ("pre"/"post") and Celery's own work
    after the body ("store": its result store, before the first task_postrun receiver). With cgturn:
    each cgturn call, the integration's receivers, its own code in them ("own": a receiver less its
    calls) and the rest of the hooks ("dispatch": Celery's signal dispatch, the bench's receivers)."""
    for half in ("pre", "post", "store"):
        steps.setdefault(f"{half}_{side}", []).append(entry[f"{half}_s"])
    calls = entry.get("steps_s") or {}
    if not calls:
        return
    prefix = "" if side == "with" else f"{side}:"
    for name, seconds in calls.items():
        steps.setdefault(prefix + name, []).append(seconds)
    prerun, postrun = calls["receiver_prerun"], calls["receiver_postrun"]
    own = (prerun - calls["begin_turn"] - calls["enter"]) + (postrun - calls["leave_turn"] - calls["complete"])
    steps.setdefault(prefix + "own", []).append(own)
    steps.setdefault(prefix + "calls", []).append(sum(calls[name] for name in Steps.NAMES))
    steps.setdefault(prefix + "dispatch", []).append(entry["overhead_s"] - entry["store_s"] - prerun - postrun)


def added(hooks: dict[str, list[float]]) -> dict[str, float]:
    """ms a round's tasks took in the hooks of each worker with cgturn above those without (medians)."""
    alone = ms(statistics.median(hooks["without"]))
    return {q: round(ms(statistics.median(v)) - alone, 3) for q, v in hooks.items() if q != "without"}


def send_one(client, out: str, queue: str) -> float:
    """Seconds from send_task to the result; returns once the task's pool process has finished its
    task_postrun (Celery stores the result before it), so no worker's hooks overlap the next task."""
    t0 = time.perf_counter()
    res = client.send_task("fleet.true", queue=queue)
    res.get(timeout=30)
    latency = time.perf_counter() - t0
    done = os.path.join(out, "done-" + res.id)
    if not wait_until(lambda: os.path.exists(done), timeout=30, interval=0.0002):
        raise RuntimeError(f"task {res.id} never finished its task_postrun")
    os.unlink(done)
    return latency


def alternated_rounds(client, out: str, pids: dict[str, set[int]], rounds: int, tasks: int, idle: float) -> dict:
    """`rounds` rounds of `tasks` tasks per worker, sent one at a time, the workers taking turns task by
    task (their order rotating), each task after `idle` s with no task running anywhere; each round's
    hooks, added cost, load and latency, and the spread of every part over all rounds."""
    sides = list(pids)
    per_round = []
    hooks_all: dict[str, list[float]] = {q: [] for q in sides}
    latency_all: dict[str, list[float]] = {q: [] for q in sides}
    steps: dict[str, list[float]] = {}
    for n in range(rounds):
        load_before = load()
        latency: dict[str, list[float]] = {q: [] for q in sides}
        for i in range(tasks):
            for q in sides[i % len(sides):] + sides[:i % len(sides)]:
                time.sleep(idle)  # pacing, not a wait: a worker's idle spell between two tasks
                latency[q].append(send_one(client, out, q))
        hooks = {q: take_overheads(out, pids[q], q, steps) for q in sides}
        for q in sides:
            hooks_all[q].extend(hooks[q])
            latency_all[q].extend(latency[q])
        per_round.append({"round": n + 1, "load": [load_before, load()],
                          "hooks_ms": {q: spread(v)["median"] for q, v in hooks.items()},
                          "added_ms": added(hooks),
                          "end_to_end_ms": {q: spread(v)["median"] for q, v in latency.items()}})
    return {"idle_ms": idle * 1000, "tasks_per_round": tasks, "rounds": per_round,
            "added_per_task_ms": over_rounds(per_round),
            "hooks_ms": {q: spread(v) for q, v in hooks_all.items()},
            "steps_in_worker_ms": {name: spread(v) for name, v in sorted(steps.items())},
            "end_to_end_ms": {q: spread(v) for q, v in latency_all.items()}}


def over_rounds(per_round: list[dict]) -> dict[str, dict[str, float]]:
    """The added cost per task over the rounds (median, min, max), for each worker with cgturn."""
    out = {}
    for q in per_round[0]["added_ms"]:
        values = [r["added_ms"][q] for r in per_round]
        out[q] = {"median_of_rounds": round(statistics.median(values), 3), "min": min(values), "max": max(values)}
    return out


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
    """Figures 1-3: the workers through a real Redis."""
    import celery

    tmp = tempfile.mkdtemp(prefix="cgturn-bench-celery-")
    out = write_app(tmp)
    redis = Redis(tmp)
    workers = {}
    try:
        env = dict(fleet_env(redis.url, tmp, out), FLEET_BENCH="1")
        workers["with"] = start_worker("with", dict(env, FLEET_CGTURN="1"), mount, tmp)
        if args.base:  # the same app, its cgturn imported from the other checkout
            base_env = dict(env, FLEET_CGTURN="1", PYTHONPATH=os.pathsep.join((tmp, args.base, env["PYTHONPATH"])))
            workers["base"] = start_worker("base", base_env, mount, tmp)
        workers["without"] = start_worker("without", dict(env, FLEET_CGTURN="0"), mount, tmp)
        pids = {q: pool_pids(w) for q, w in workers.items()}
        client = celery.Celery("bench", broker=redis.url, backend=redis.url)
        for _ in range(10):  # warm every worker up
            for q in pids:
                send_one(client, out, q)
        for q in pids:
            take_overheads(out, pids[q], q)
        steady = alternated_rounds(client, out, pids, args.rounds, args.tasks, 0.0)
        # Each task after an idle spell, as a worker waiting for work sees it: the move into the turn
        # then comes long after the host's last cgroup move (docs/celery.md: an RCU grace period).
        after_idle = (alternated_rounds(client, out, pids, args.rounds, args.idle_tasks, args.idle / 1000)
                      if args.idle_tasks else None)
        # Back to back: each worker gets `tasks` tasks at once (workers take turns, round by round), so
        # a pool process takes its next task right after the last; the cgroup moves then come in
        # quick succession, which changes what the kernel makes them cost (docs/celery.md).
        burst_rounds = []
        burst_all: dict[str, list[float]] = {q: [] for q in pids}
        burst_steps: dict[str, list[float]] = {}
        sides = list(pids)
        for n in range(args.rounds):
            load_before = load()
            hooks = {}
            for q in sides[n % len(sides):] + sides[:n % len(sides)]:
                results = [client.send_task("fleet.true", queue=q) for _ in range(args.tasks)]
                for res in results:
                    res.get(timeout=120)
                wait_until(lambda: len(glob.glob(os.path.join(out, "done-*"))) >= args.tasks, timeout=30)
                for done in glob.glob(os.path.join(out, "done-*")):
                    os.unlink(done)
                hooks[q] = take_overheads(out, pids[q], q, burst_steps)
                burst_all[q].extend(hooks[q])
            burst_rounds.append({"round": n + 1, "load": [load_before, load()],
                                 "hooks_ms": {q: spread(v)["median"] for q, v in hooks.items()},
                                 "added_ms": added(hooks)})
        revoke: dict[str, list[float | None]] = {"with": [], "without": []}
        revoke_load = load()
        for _ in range(args.revokes):
            for q in revoke:
                revoke[q].append(revoke_to_gone(client, out, q, args.bound))
        return {
            "steady": steady,
            "after_idle": after_idle,
            "back_to_back": {"tasks_per_round": args.tasks, "rounds": burst_rounds,
                             "added_per_task_ms": over_rounds(burst_rounds),
                             "hooks_ms": {q: spread(v) for q, v in burst_all.items()},
                             "steps_in_worker_ms": {name: spread(v) for name, v in sorted(burst_steps.items())}},
            "revoke_to_gone_ms": {q: (spread([x for x in v if x is not None]) if all(x is not None for x in v)
                                      else None) for q, v in revoke.items()},
            "revoke_never_gone": {q: sum(1 for x in v if x is None) for q, v in revoke.items()},
            "revoke_bound_s": args.bound,
            "revoke_load": revoke_load,
        }
    finally:
        for w in workers.values():
            stop_worker(w)
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def print_rounds(label: str, part: dict) -> None:
    print(f"{label}: {part['tasks_per_round']} tasks per worker and round")
    for r in part["rounds"]:
        latency = r.get("end_to_end_ms")
        print(f"  round {r['round']}: load {r['load'][0]}-{r['load'][1]}  hooks {r['hooks_ms']} ms, added {r['added_ms']} ms"
              + (f"; end to end {latency} ms" if latency else ""))
    for q, figure in part["added_per_task_ms"].items():
        verdict = "met" if figure["median_of_rounds"] <= TARGET_MS else "not met"
        print(f"  added per task, {q}: {figure} against the target of {TARGET_MS} ms: {verdict}")
    print(f"  hooks_ms {part['hooks_ms']}")
    if "end_to_end_ms" in part:
        print(f"  end_to_end_ms {part['end_to_end_ms']}")
    print("  in the worker, task by task (ms: median p10 p90):")
    for name, figure in part["steps_in_worker_ms"].items():
        print(f"    {name:26} {figure}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=100, help="tasks per worker and round")
    parser.add_argument("--revokes", type=int, default=10)
    parser.add_argument("--idle", type=float, default=100.0, help="ms of idleness before each task of the idle rounds")
    parser.add_argument("--idle-tasks", type=int, default=20, help="tasks per worker and idle round (0: none)")
    parser.add_argument("--bound", type=float, default=5.0, help="seconds to wait for Celery alone")
    parser.add_argument("--breakdown", type=int, default=200, help="turns per breakdown (0: none)")
    parser.add_argument("--gap", type=float, default=20.0,
                        help="ms of idleness before each turn in the last breakdown (the others: none)")
    parser.add_argument("--floor-gaps", default="0,1,2,5,10,20,50,100",
                        help="ms of idleness before the kernel's floor moves (comma-separated; empty: none)")
    parser.add_argument("--floor-moves", type=int, default=30, help="moves per gap")
    parser.add_argument("--breakdown-only", action="store_true", help="skip the workers and Redis")
    parser.add_argument("--base", help="another checkout (e.g. main's): a third worker imports its cgturn, and its "
                                       "cgturn/celery.py's own code is timed beside this tree's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mount = need_cgroup2()
    report: dict = {"load_at_start": list(os.getloadavg())}
    if not args.breakdown_only:
        report["fleet"] = fleet(args, mount)
    report["own_code"] = own_code(args.base)
    if args.floor_gaps:
        report["floor_after_idle"] = floor_after_idle(mount, [float(g) for g in args.floor_gaps.split(",")],
                                                      args.floor_moves)
    if args.breakdown:
        report["breakdown"] = [breakdown(args.breakdown, mount, sentinel, gap)
                               for sentinel, gap in ((True, 0.0), (False, 0.0), (True, args.gap / 1000))]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"load at start {report['load_at_start']}")
    if "fleet" in report:
        f = report["fleet"]
        for label, key in (("one at a time", "steady"), (f"one at a time, {args.idle:g} ms idle before each", "after_idle")):
            if f[key] is not None:
                print_rounds(label, f[key])
        print_rounds("back to back, a round's tasks at once per worker", f["back_to_back"])
        for key in ("revoke_to_gone_ms", "revoke_never_gone", "revoke_bound_s", "revoke_load"):
            print(f"{key:22} {f[key]}")
    print(f"the integration's own code per task, its cgturn calls stubbed out (µs, load {report['own_code']['load']}): "
          f"{report['own_code']['us_per_task']}")
    if "floor_after_idle" in report:
        f = report["floor_after_idle"]
        print(f"the kernel's floor: a bare move into a cgroup after N ms without one, {f['moves']} moves each, load "
              f"{f['load'][0]}-{f['load'][1]} (ms: median p10 p90)")
        for gap, figure in f["move_in_ms"].items():
            print(f"  after {gap:>5g} ms  {figure}")
    for b in report.get("breakdown", []):
        print(f"breakdown, sentinel {'on' if b['sentinel'] else 'off'}, {b['gap_ms']:g} ms idle before each, "
              f"{b['turns']} turns, load "
              f"{b['load'][0]}-{b['load'][1]} (ms: median p10 p90); CPU ms per turn {b['cpu_ms_per_turn']}")
        for name in Steps.NAMES + ("own", "integration", "bare") + FLOOR:
            print(f"  {name:12} {b[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
