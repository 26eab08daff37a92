"""The in-process part of scripts/bench_celery.py (not a test): the integration's per-task code
(`Integration.begin`/`end`, what a pool process runs per task) with each cgturn call it makes timed,
beside the bare cgturn calls and the kernel's floor (this process moved into a cgroup and back by
bare writes to cgroup.procs). Run through `scripts/bench_celery.py --breakdown-only`.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid

from conftest import destroy_cgroup_tree  # bench_celery.py put tests/ on sys.path


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def spread(values: list[float]) -> dict[str, float]:
    """Median, p10 and p90 in ms of `values` (seconds)."""
    if len(values) < 10:
        return {"median": ms(statistics.median(values)) if values else float("nan")}
    deciles = statistics.quantiles(values, n=10)
    return {"median": ms(statistics.median(values)), "p10": ms(deciles[0]), "p90": ms(deciles[-1])}


def load() -> float:
    return round(os.getloadavg()[0], 1)


class Steps:
    """Times each cgturn call the integration makes (wrappers on one manager and on cgturn.Turn)."""

    NAMES = ("begin_turn", "enter", "leave_turn", "complete")

    def __init__(self, mgr) -> None:
        import cgturn

        self.last: dict[str, int] = {}
        self.saved = (cgturn.Turn.enter, cgturn.Turn.complete)
        mgr.begin_turn = self.timed("begin_turn", mgr.begin_turn)
        mgr.leave_turn = self.timed("leave_turn", mgr.leave_turn)
        cgturn.Turn.enter = self.timed("enter", cgturn.Turn.enter)
        cgturn.Turn.complete = self.timed("complete", cgturn.Turn.complete)

    def timed(self, name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                self.last[name] = time.perf_counter_ns() - t0
        return wrapper

    def restore(self) -> None:
        import cgturn

        cgturn.Turn.enter, cgturn.Turn.complete = self.saved


FLOOR = ("move_in_floor", "move_out_floor")


def own_v2_cgroup() -> str:
    """This process's cgroup v2 path (the `0::` line of /proc/self/cgroup)."""
    with open("/proc/self/cgroup") as f:
        return next(line[3:].strip() for line in f if line.startswith("0::"))


def move(procs: str, pid: bytes) -> None:
    fd = os.open(procs, os.O_WRONLY)
    try:
        os.write(fd, pid)
    finally:
        os.close(fd)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of `pid` so far (0 for None), from /proc/PID/stat."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def breakdown(turns: int, mount: str, sentinel: bool, gap: float = 0.0) -> dict:
    """Figure 4, one manager: the integration's per-task path, alternated with the bare cgturn calls;
    `gap` seconds of idleness before each (a worker waiting for its next task)."""
    import cgturn
    import cgturn.celery as cc

    root = os.path.join(mount, f"cgturn-bench-celery-{uuid.uuid4().hex[:8]}")
    state = tempfile.mkdtemp(prefix="cgturn-bench-celery-")
    mgr = cgturn.TurnManager(root=root, state_dir=state, sentinel=sentinel)
    steps = None
    sentinel_pid = None
    try:
        if sentinel:
            sentinel_pid = cgturn.Supervisor.start_sentinel(mgr)  # as a pool process does, before its first turn
        app = types.SimpleNamespace()
        it = cc.Integration(app, cc.check_settings({}, "bench"), role="pool", manager=mgr)
        task = types.SimpleNamespace(name="bench.true", app=app, request=types.SimpleNamespace(retries=0))
        steps = Steps(mgr)
        per: dict[str, list[float]] = {name: [] for name in Steps.NAMES + FLOOR + ("integration", "own", "bare")}
        floor = os.path.join(root, "floor", "cgroup.procs")  # a cgroup of this bench's managed root
        os.makedirs(os.path.dirname(floor))
        home = os.path.join(mount, own_v2_cgroup().lstrip("/"), "cgroup.procs")
        pid = str(os.getpid()).encode()
        load_before = load()
        cpu_before: dict[str, float] = {}
        for i in range(turns + 20):
            if i == 20:
                cpu_before = {"sentinel": cpu_seconds(sentinel_pid), "self": cpu_seconds(os.getpid())}
            celery_id = uuid.uuid4().hex
            time.sleep(gap)  # pacing, not a wait: the idle time between two tasks
            t0 = time.perf_counter_ns()
            it.begin(task, celery_id, (), {})
            t1 = time.perf_counter_ns()
            subprocess.run(["/bin/true"], check=True)
            t2 = time.perf_counter_ns()
            it.end("SUCCESS", True)
            t3 = time.perf_counter_ns()
            total = (t1 - t0) + (t3 - t2)
            step = dict(steps.last)
            time.sleep(gap)
            t4 = time.perf_counter_ns()  # the same four calls, bare, in a task of its own as the integration's
            turn = mgr.begin_turn(celery_id + "-bare", f"{celery_id}#0", limits=cgturn.Limits())
            turn.enter()
            t5 = time.perf_counter_ns()
            subprocess.run(["/bin/true"], check=True)
            t6 = time.perf_counter_ns()
            mgr.leave_turn()
            turn.complete()
            t7 = time.perf_counter_ns()
            time.sleep(gap)
            t8 = time.perf_counter_ns()  # the kernel's floor: the same move in and out, bare writes
            move(floor, pid)
            t9 = time.perf_counter_ns()
            move(home, pid)
            t10 = time.perf_counter_ns()
            if i < 20:
                continue  # warm-up
            per["move_in_floor"].append((t9 - t8) / 1e9)
            per["move_out_floor"].append((t10 - t9) / 1e9)
            for name in Steps.NAMES:
                per[name].append(step[name] / 1e9)
            per["integration"].append(total / 1e9)
            per["own"].append((total - sum(step.values())) / 1e9)
            per["bare"].append(((t5 - t4) + (t7 - t6)) / 1e9)
        # CPU of both processes per turn: the integration's turn and the bare one (and the spawns).
        cpu = {who: round((cpu_seconds(pid) - cpu_before[who]) * 1000 / (2 * turns), 3)
               for who, pid in (("sentinel", sentinel_pid), ("self", os.getpid()))}
        return {"sentinel": sentinel, "gap_ms": gap * 1000, "turns": turns, "load": [load_before, load()],
                "cpu_ms_per_turn": cpu, **{name: spread(v) for name, v in per.items()}}
    finally:
        if steps is not None:
            steps.restore()
        try:
            for info in mgr.turns():
                mgr.end_task(info.task, grace=0)
        finally:
            mgr.close()
            destroy_cgroup_tree(root)
            shutil.rmtree(state, ignore_errors=True)


class _StubTurn:
    state = "running"

    def enter(self) -> None:
        pass

    def complete(self, keep_for=None) -> bool:
        return True


class _StubManager:
    def begin_turn(self, task_id, turn_id, **_):
        return _StubTurn()

    def leave_turn(self) -> None:
        pass


def _integration_module(checkout: str | None):
    """cgturn.celery of this tree, or that file of another checkout (`base`), loaded beside it."""
    import importlib.util

    if checkout is None:
        import cgturn.celery as cc

        return cc
    spec = importlib.util.spec_from_file_location("cgturn_celery_base", os.path.join(checkout, "cgturn", "celery.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def own_code(base: str | None, tasks: int = 20000, rounds: int = 7) -> dict:
    """The integration's own per-task code (`Integration.begin` + `end` of a task that returns) with
    the four cgturn calls stubbed out, in µs per task (the median of `rounds`); with `base`, that
    checkout's cgturn/celery.py beside this tree's, round by round alternated, and the ratio."""
    sides = {"this tree": _integration_module(None)}
    if base:
        sides["base"] = _integration_module(base)
    runs = {}
    for name, cc in sides.items():
        app = types.SimpleNamespace()
        task = types.SimpleNamespace(name="bench.true", app=app, request=types.SimpleNamespace(retries=0))
        it = cc.Integration(app, cc.check_settings({}, "bench"), role="pool", manager=_StubManager())
        runs[name] = (it, task)
    ids = [uuid.uuid4().hex for _ in range(tasks)]
    per: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, (it, task) in runs.items():
            t0 = time.perf_counter_ns()
            for celery_id in ids:
                it.begin(task, celery_id, (), {})
                it.end("SUCCESS", True)
            per[name].append((time.perf_counter_ns() - t0) / tasks / 1000)
    out = {name: round(statistics.median(v), 3) for name, v in per.items()}
    if base:
        out["this tree / base"] = round(out["this tree"] / out["base"], 2)
    return {"load": load(), "us_per_task": out}


def floor_after_idle(mount: str, gaps_ms: list[float], moves: int) -> dict:
    """The kernel's floor against idleness: this process moved into a cgroup of its own by a bare write
    to cgroup.procs after `gap` ms without a move of its own (and back at once), `moves` times per gap,
    the gaps taken in turn so that all see the same load. Other processes' moves on the host in the
    meantime make some of them cheap: the spread says how often."""
    root = os.path.join(mount, f"cgturn-bench-celery-{uuid.uuid4().hex[:8]}")
    floor = os.path.join(root, "floor", "cgroup.procs")
    home = os.path.join(mount, own_v2_cgroup().lstrip("/"), "cgroup.procs")
    pid = str(os.getpid()).encode()
    per: dict[float, list[float]] = {gap: [] for gap in gaps_ms}
    load_before = load()
    try:
        os.makedirs(os.path.dirname(floor))
        for _ in range(moves):
            for gap in gaps_ms:
                time.sleep(gap / 1000)  # pacing, not a wait: the idle spell before the move
                t0 = time.perf_counter_ns()
                move(floor, pid)
                per[gap].append((time.perf_counter_ns() - t0) / 1e9)
                move(home, pid)
        return {"load": [load_before, load()], "moves": moves, "move_in_ms": {gap: spread(v) for gap, v in per.items()}}
    finally:
        destroy_cgroup_tree(root)
