#!/usr/bin/env python3
"""10,000 live turns on one host: what listing, reaping, ending and abandoning cost when every turn
holds a running process, each figure beside the kernel's own cost on the same tree and its target.

Builds N running turns (default 10,000; one `sleep` each, across 100 tasks) in one managed root under
one sentinel (started before the first turn, so every turn is tracked for owner death), then prints:
`turns()` in process, `cgturn ps --json` wall, `cgturn reap` with nothing to do, `end_task` of a
100-turn task, the owner's RSS per live turn, the sentinel's RSS and its CPU use while idle over 30 s,
and the abandon of one turn among N against the same abandon with no others (and the kernel floor:
cgroup.kill, re-read `cgroup.events` until `populated 0`, rmdir). The kernel floor of the whole tree:
mkdir of N cgroups (in a raw directory beside the managed root), and for each view the files it must
read per turn with bare os.open/os.read relative to the task directory (`turns()`: cgroup.procs,
cpu.stat, the record's xattr, /proc/PID/statm; `ps` also cgroup.events and the three pressure files;
`reap` the records). Every figure is printed with the load average when it was taken.

Run by hand, not in CI (it costs N processes): mind `pid_max` (the bench refuses to start without
N + 2,000 free pids) and RLIMIT_NOFILE (cgturn holds no fd per turn; the bench prints how many it
holds). Everything lives below `<own cgroup2>/cgturn-bench-<random>`, removed at the end, on errors
and on Ctrl-C/SIGTERM (every turn is killed by that removal). Run as root:

    python3 scripts/bench_many.py [--turns 10000] [--tasks 100] [--idle 30]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from bench_many_floors import PS_FILES, TURNS_FILES, floor_reads, floor_tree, interpreter_start  # noqa: E402
from bench_many_procs import abandon_elsewhere, cli_wall, print_pairs, side_by_side  # noqa: E402
from benchlib import bench_root, destroy, floor_abandon, ms, wait_settled  # noqa: E402

from cgturn import Supervisor, TurnManager  # noqa: E402

SLEEP = ["sleep", "3600"]
TICK = os.sysconf("SC_CLK_TCK")
ABANDONS = 20   # single-turn abandons timed in each setting (median)
BUILD_LIMIT = 900.0  # seconds: a build slower than this is stopped (and torn down)


def status_kib(pid: int | str, field: str) -> int:
    """A `kB` field of /proc/PID/status (VmRSS, ...)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def free_pids() -> int:
    with open("/proc/sys/kernel/pid_max", encoding="ascii") as f:
        pid_max = int(f.read())
    return pid_max - sum(1 for name in os.listdir("/proc") if name.isdigit())


class Figures(dict):
    """The figures by name, each with the 1-minute load average when it was taken (`load[name]`): on a
    shared machine a figure means little without the load it was taken at."""

    def __init__(self) -> None:
        super().__init__()
        self.load: dict[str, float] = {}

    def __setitem__(self, name: str, value: float) -> None:
        super().__setitem__(name, value)
        self.load[name] = os.getloadavg()[0]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class CollectorTime:
    """Seconds Python's cyclic garbage collector ran while installed (gc.callbacks): how much of a timed
    call the owner's collector took, which grows with the objects the owner holds."""

    def __init__(self) -> None:
        self.seconds, self.runs, self._began = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began
            self.runs += 1


def abandon_one(mgr: TurnManager, task: str, turn_id: str, collector: CollectorTime | None = None,
                gc_off: bool = False) -> float:
    """abandon(grace=0) of a fresh turn holding one sleeping process, at rest as the floor's is
    (benchlib.wait_settled); the time the garbage collector took meanwhile is added to `collector`;
    with `gc_off` the collector is off for the abandon."""
    turn = mgr.begin_turn(task, turn_id)
    proc = turn.spawn(SLEEP)
    wait_settled(turn.pids, 1)
    if collector is not None:
        gc.callbacks.append(collector)
    if gc_off:
        gc.disable()
    t0 = time.perf_counter()
    try:
        result = turn.abandon("bench", grace=0)
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
        if collector is not None:
            gc.callbacks.remove(collector)
    proc.wait()
    if result.killed != [proc.pid]:
        raise RuntimeError(f"abandon killed {result.killed}, not [{proc.pid}]")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=10_000)
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--idle", type=float, default=30.0, help="seconds over which the sentinel's idle CPU is measured")
    ap.add_argument("--base", metavar="TREE", help="a source tree of an earlier version (e.g. a `git worktree` of "
                    "main): its turns(), ps --json and reap run alternately with this checkout's on the same turns")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds with --base")
    args = ap.parse_args()
    n, tasks = args.turns, args.tasks
    if n % tasks or not 0 < n <= 20_000:
        print("--turns must be a multiple of --tasks, at most 20000", file=sys.stderr)
        return 2
    if free_pids() < n + 2000:
        print(f"refusing: {free_pids()} free pids, the bench needs {n} + 2000 headroom", file=sys.stderr)
        return 1
    base = bench_root()
    if base is None:
        return 1
    fig = Figures()
    pairs: dict[str, list[tuple[float, float]]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as state:
        os.mkdir(base)
        root = os.path.join(base, "main")
        mgr = TurnManager(root=root, backend="cgroup2", state_dir=state)
        try:
            fig["floor_mkdir"], fig["floor_rmdir"] = floor_tree(os.path.join(base, "floor-tree"), n, tasks)
            sentinel_pid = Supervisor.start_sentinel(mgr)
            if sentinel_pid is None:
                raise RuntimeError("the sentinel is switched off (CGTURN_SENTINEL=0): this bench measures it")
            mgr.begin_turn("warm-up").spawn(["/bin/true"]).wait()
            mgr.end_task("warm-up", grace=0)
            os.mkdir(os.path.join(base, "floor"))
            # Alone, before and after the others exist (the host's load drifts over a long run).
            alone = [abandon_one(mgr, "one-alone", f"b{i}") for i in range(ABANDONS)]
            floor_alone = [floor_abandon(os.path.join(base, "floor"), 1) for _ in range(ABANDONS)]
            fig["elsewhere_alone"] = abandon_elsewhere(root, state, "elsewhere-alone")
            rss0, fds0 = status_kib("self", "VmRSS"), len(os.listdir("/proc/self/fd"))
            held = []  # the gateway's view: every Turn and its Popen stay referenced
            t0 = time.perf_counter()
            for t in range(tasks):
                for u in range(n // tasks):
                    turn = mgr.begin_turn(f"task-{t:03d}", f"u{u}")
                    held.append((turn, turn.spawn(SLEEP)))
                if time.perf_counter() - t0 > BUILD_LIMIT:
                    raise RuntimeError(f"building took over {BUILD_LIMIT:.0f} s ({len(held)} turns): stopped")
                if t % 10 == 9:
                    print(f"  {len(held)} turns, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            fig["build"] = time.perf_counter() - t0
            fig["owner_rss_per_turn"] = (status_kib("self", "VmRSS") - rss0) * 1024 / n
            fig["owner_fds"] = len(os.listdir("/proc/self/fd")) - fds0
            fig["floor_procs"], seen = floor_reads(root, ("cgroup.procs",), record=False, rss=False)
            if seen < n:
                raise RuntimeError(f"only {seen} of {n} processes are in their turns")
            # Medians of 3, as the figures they are the floors of (the load moves between single reads).
            fig["floor_turns"] = statistics.median(floor_reads(root, TURNS_FILES, True, True)[0] for _ in range(3))
            fig["floor_ps"] = statistics.median(floor_reads(root, PS_FILES, True, True)[0] for _ in range(3))
            fig["floor_reap"] = statistics.median(floor_reads(root, (), True, False)[0] for _ in range(3))
            fig["interpreter"] = statistics.median(interpreter_start() for _ in range(3))
            listed = []
            fig["turns"] = statistics.median(timed(lambda: listed.append(len(mgr.turns()))) for _ in range(3))
            if listed[-1] < n:
                raise RuntimeError(f"turns() listed {listed[-1]} of {n}")
            fig["ps"] = statistics.median(cli_wall(root, state, "ps", "--json") for _ in range(2))
            fig["reap"] = cli_wall(root, state, "reap", "--json")
            pairs = side_by_side(root, state, os.path.abspath(args.base), args.rounds) if args.base else {}
            fig["sentinel_rss"] = status_kib(sentinel_pid, "VmRSS")
            cpu0, w0 = cpu_seconds(sentinel_pid), time.monotonic()
            time.sleep(args.idle)  # the measured interval itself: the owner does nothing meanwhile
            fig["sentinel_idle_cpu"] = (cpu_seconds(sentinel_pid) - cpu0) / (time.monotonic() - w0)
            # One turn among all the others, in a task of its own so no other turn shares its parent.
            # Alternating with the same abandon with the collector off (what the N held objects cost
            # through it), so both see the same moment: the first abandons after the idle interval
            # are not the others'.
            collector, among, gc_off = CollectorTime(), [], []
            for i in range(ABANDONS):
                among.append(abandon_one(mgr, "one-among", f"a{i}", collector))
                gc_off.append(abandon_one(mgr, "one-among", f"g{i}", gc_off=True))
            fig["abandon_among"], fig["among_gc_off"] = statistics.median(among), statistics.median(gc_off)
            fig["among_gc_seconds"], fig["among_gc_runs"] = collector.seconds / ABANDONS, collector.runs
            fig["among_first"] = among[0]  # the first abandon after the idle interval
            # The kernel's own abandon of one process while the N others exist: what the N cost it.
            fig["floor_among"] = statistics.median(floor_abandon(os.path.join(base, "floor"), 1)
                                                   for _ in range(ABANDONS))
            fig["elsewhere_among"] = abandon_elsewhere(root, state, "elsewhere-among")
            last = f"task-{tasks - 1:03d}"
            fig["end_task"] = timed(lambda: mgr.end_task(last, grace=0))
            for _, proc in held[-(n // tasks):]:
                proc.wait()
            fig["end_all"] = timed(lambda: [mgr.end_task(f"task-{t:03d}", grace=0) for t in range(tasks - 1)])
            for _, proc in held:
                proc.wait()
            held.clear()
            alone += [abandon_one(mgr, "one-alone", f"a{i}") for i in range(ABANDONS)]
            floor_alone += [floor_abandon(os.path.join(base, "floor"), 1) for _ in range(ABANDONS)]
            fig["abandon_alone"], fig["abandon_floor"] = statistics.median(alone), statistics.median(floor_alone)
        except KeyboardInterrupt:
            print("interrupted: cleaning up", file=sys.stderr)
            return 130
        finally:
            try:
                destroy(base, mgr)
            finally:
                mgr.close()
    print_table(fig, n, tasks, time.monotonic() - started)
    if pairs:
        print_pairs(pairs, args.base)
    return 0


def print_table(fig: Figures, n: int, tasks: int, total: float) -> None:
    print(f"cgturn with {n:,} live turns ({tasks} tasks, one sleeping process each) on {os.uname().release}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, load {os.getloadavg()[0]:.1f}, "
          f"built in {fig['build']:.0f} s, total {total:.0f} s\n")
    print("| figure | cgturn | kernel floor | ratio | target | met | load |")
    print("|---|---:|---:|---:|---:|---|---:|")

    def row(name: str, value: str, floor: str, ratio: float | None, target: str, met: bool, key: str = "") -> None:
        shown = f"{ratio:.1f}x" if ratio is not None else "-"
        load = f"{fig.load[key]:.1f}" if key in fig.load else "-"
        print(f"| {name} | {value} | {floor} | {shown} | {target} | {'yes' if met else 'NO'} | {load} |")

    procs, floor_turns, floor_ps, floor_reap = fig["floor_procs"], fig["floor_turns"], fig["floor_ps"], fig["floor_reap"]
    row(f"read {n:,} cgroup.procs (kernel)", f"{procs:.2f} s", "-", None, "-", True, "floor_procs")
    row("`turns()` in process", f"{fig['turns']:.2f} s",
        f"{floor_turns:.2f} s ({', '.join(TURNS_FILES)}, record xattr, statm)", fig["turns"] / floor_turns,
        "<= 0.5 s", fig["turns"] <= 0.5, "turns")
    start = fig["interpreter"]
    row("`python3 -c pass` (an interpreter's start: in every CLI floor)", f"{start:.2f} s", "-", None, "-", True,
        "interpreter")
    row("`cgturn ps --json` (wall)", f"{fig['ps']:.2f} s",
        f"{floor_ps + start:.2f} s (also events, 3 pressure files; + start)", fig["ps"] / (floor_ps + start),
        "<= 1 s", fig["ps"] <= 1, "ps")
    row("`cgturn reap`, nothing to do (wall)", f"{fig['reap']:.2f} s", f"{floor_reap + start:.2f} s (the records; + start)",
        fig["reap"] / (floor_reap + start), "<= 2 s", fig["reap"] <= 2, "reap")
    per = n // tasks
    floor_task = (fig["floor_rmdir"] / n) * per
    row(f"`end_task` of a {per}-turn task", f"{ms(fig['end_task']):.0f} ms", f"{ms(floor_task):.1f} ms (rmdir {per})",
        fig["end_task"] / floor_task, "-", True, "end_task")
    row(f"end the other {tasks - 1} tasks", f"{fig['end_all']:.1f} s", "-", None, "-", True, "end_all")
    row("owner RSS per live turn (Turn + Popen held)", f"{fig['owner_rss_per_turn'] / 1024:.1f} KiB", "-", None,
        "<= 4 KiB", fig["owner_rss_per_turn"] <= 4096)
    row("owner fds opened while building them", f"{fig['owner_fds']:.0f}", "-", None, "no fd per turn",
        fig["owner_fds"] < min(100, n))
    row("sentinel RSS", f"{fig['sentinel_rss'] / 1024:.1f} MiB", "-", None, "-", True)
    row(f"sentinel CPU while idle ({n:,} tracked)", f"{fig['sentinel_idle_cpu'] * 100:.2f} % of a core", "-", None,
        "<= 1 %", fig["sentinel_idle_cpu"] <= 0.01, "sentinel_idle_cpu")
    among, alone, floor = fig["abandon_among"], fig["abandon_alone"], fig["abandon_floor"]
    floor_among = fig["floor_among"]
    row(f"abandon 1 turn among {n:,} (floor: the same kernel steps among them)", f"{ms(among):.2f} ms",
        f"{ms(floor_among):.2f} ms", among / floor_among, "<= 1.3x alone", among <= 1.3 * alone, "abandon_among")
    row("abandon 1 turn alone (before and after the others)", f"{ms(alone):.2f} ms", f"{ms(floor):.2f} ms",
        alone / floor, "-", True, "abandon_alone")
    row(f"among {n:,} / alone", f"{among / alone:.2f}x", f"{floor_among / floor:.2f}x (the kernel's)", None,
        "<= 1.3x", among <= 1.3 * alone)
    row(f"abandon 1 turn among {n:,}: the first one after the idle interval", f"{ms(fig['among_first']):.2f} ms",
        "-", None, "-", True)
    row(f"abandon 1 turn among {n:,}: the owner's garbage collector meanwhile (mean)",
        f"{ms(fig['among_gc_seconds']):.2f} ms", f"{fig['among_gc_runs']:.0f} runs in {ABANDONS}", None, "-", True)
    row(f"abandon 1 turn among {n:,}, the owner's garbage collector off", f"{ms(fig['among_gc_off']):.2f} ms",
        f"{ms(floor_among):.2f} ms", fig["among_gc_off"] / floor_among, "-", True, "among_gc_off")
    row(f"control: the same abandon by a fresh process holding no turn, among {n:,} / alone",
        f"{ms(fig['elsewhere_among']):.2f} / {ms(fig['elsewhere_alone']):.2f} ms", "-",
        fig["elsewhere_among"] / fig["elsewhere_alone"], "-", True, "elsewhere_among")
    row(f"cgturn's own part (abandon - floor): among {n:,} / alone",
        f"{ms(among - floor_among):.2f} / {ms(alone - floor):.2f} ms", "-",
        (among - floor_among) / (alone - floor) if alone > floor else None, "-", True)
    row(f"mkdir of {n:,} cgroups (kernel)", f"{fig['floor_mkdir']:.2f} s", "-", None, "-", True, "floor_mkdir")
    row(f"rmdir of {n:,} empty cgroups (kernel)", f"{fig['floor_rmdir']:.2f} s", "-", None, "-", True)


if __name__ == "__main__":
    sys.exit(main())
