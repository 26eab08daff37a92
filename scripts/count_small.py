#!/usr/bin/env python3
"""What one small-turn operation costs in steps that do not move with load: Python-level and C-level
calls (sys.setprofile; the spin-wait's inside Cgroup.wait_events left out) and the calling thread's
system calls (strace), per begin_turn + complete (sentinel off and on) and per abandon of a 1- and a
10-process turn (grace=0); and how often the sentinel woke up for the begin + complete it was sent.

    python3 scripts/count_small.py [--ops 20] [--no-strace]
    CGTURN_TREE=/tmp/before python3 scripts/count_small.py   # count another checkout's cgturn

System calls are the calling thread's between two marker writes, as `strace -f` sees them (children
and the sentinel left out). The wait for `populated 0` re-reads cgroup.events with a sched_yield(2)
(later a poll(2)) before each read; how many depends on how fast the processes die, so those pairs
are a column of their own ("+ spin-wait"; the wait's open, first read and close are in "system
calls"), and so are getpid(2) calls ("of which getpid": a few hundred nanoseconds each). Works in a
managed root of its own, `<own cgroup>/cgturn-bench-<random>`, removed at the end.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("CGTURN_TREE") or os.path.join(HERE, ".."))

from benchlib import bench_root, destroy, tree_argv, wait_count  # noqa: E402

from cgturn import Supervisor, TurnManager  # noqa: E402

MARK = "@@cgturn-count"
OPS = ("begin + complete, sentinel off", "begin + complete, sentinel on", "abandon 1", "abandon 10")
WARM_UP = 5


def run_ops(ops: int, measure) -> None:
    """Run every operation of OPS `ops` times after WARM_UP unmeasured ones; `measure(name, fn)` runs
    one measured operation `fn`. A managed root and state directory of its own, removed at the end."""
    root, state = bench_root(), tempfile.mkdtemp()
    os.mkdir(root)
    try:
        with TurnManager(root=os.path.join(root, "off"), backend="cgroup2", state_dir=os.path.join(state, "off"),
                         sentinel=False) as off, \
                TurnManager(root=os.path.join(root, "on"), backend="cgroup2", state_dir=os.path.join(state, "on"),
                            sentinel=True) as on:
            Supervisor.start_sentinel(on)
            for name, mgr in ((OPS[0], off), (OPS[1], on)):
                for i in range(WARM_UP + ops):
                    fn = lambda mgr=mgr: mgr.begin_turn("count").complete()  # noqa: E731
                    measure(name, fn) if i >= WARM_UP else fn()
            for n, name in ((1, OPS[2]), (10, OPS[3])):
                for i in range(WARM_UP + ops):
                    turn = off.begin_turn("count")
                    proc = turn.spawn(tree_argv(n))
                    wait_count(lambda: len(turn.pids()), n)
                    fn = lambda turn=turn: turn.abandon("count", grace=0)  # noqa: E731
                    measure(name, fn) if i >= WARM_UP else fn()
                    proc.wait()
            off.end_task("count")
            on.end_task("count")
    finally:
        destroy(root)
        shutil.rmtree(state, ignore_errors=True)


def sentinel_wake_ups(turns: int) -> float:
    """The sentinel's wake-ups (voluntary context switches: one per sleep it wakes from) per begin +
    complete, `turns` of them back to back, nothing else measured meanwhile."""
    root, state = bench_root(), tempfile.mkdtemp()
    os.mkdir(root)
    try:
        with TurnManager(root=root, backend="cgroup2", state_dir=state, sentinel=True) as mgr:
            pid = Supervisor.start_sentinel(mgr)
            for _ in range(WARM_UP):
                mgr.begin_turn("count").complete()
            before = _voluntary_switches(pid)
            for _ in range(turns):
                mgr.begin_turn("count").complete()
            woken = _voluntary_switches(pid) - before
            mgr.end_task("count")
    finally:
        destroy(root)
        shutil.rmtree(state, ignore_errors=True)
    return woken / turns


def _voluntary_switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))


def count_calls(ops: int) -> dict[str, tuple[float, float]]:
    """{operation: (Python calls, C calls) per operation}, those inside the wait for `populated 0`
    (Cgroup.wait_events: its number of re-reads depends on how fast the processes die) left out."""
    counts = {name: collections.Counter() for name in OPS}
    current: list[collections.Counter] = []
    waiting: list[object] = []  # the frame of the wait under way

    def profile(frame, event, arg):
        if waiting:
            if event == "return" and frame is waiting[0]:
                waiting.clear()
            return
        if event in ("call", "c_call"):
            current[0][event] += 1
        if event == "call" and frame.f_code.co_name == "wait_events":
            waiting.append(frame)

    def measure(name, fn):
        current[:] = [counts[name]]
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
    run_ops(ops, measure)
    return {name: (c["call"] / ops, c["c_call"] / ops) for name, c in counts.items()}


def child(ops: int) -> int:
    """Under strace: every measured operation between two marker writes on stderr."""
    def measure(name, fn):
        os.write(2, f"{MARK} {OPS.index(name)}\n".encode())
        fn()
        os.write(2, f"{MARK} end\n".encode())
    run_ops(ops, measure)
    return 0


SYSCALL = re.compile(r"^(\d+) +([a-z_0-9]+)\(")


def count_syscalls(ops: int) -> dict[str, tuple[float, float, float]] | None:
    """{operation: (system calls, of which spin-wait, getpid) per operation}; None without strace."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    with tempfile.NamedTemporaryFile(prefix="cgturn-count-", suffix=".strace") as log:
        proc = subprocess.run([strace, "-f", "-o", log.name, sys.executable, os.path.abspath(__file__), "--child",
                               "--ops", str(ops)], env=os.environ, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"the counting child exited with {proc.returncode}")
        lines = open(log.name, encoding="utf-8", errors="replace").read().splitlines()
    totals = {name: collections.Counter() for name in OPS}
    caller, op, waiting, opening, first = None, None, None, False, True
    for line in lines:
        if MARK in line:
            caller = line.split()[0]
            tag = line.split(MARK, 1)[1].split("\\n")[0].strip()
            op = None if tag == "end" else OPS[int(tag)]
            continue
        if opening and line.startswith(f"{caller} ") and "openat resumed>" in line:
            waiting, opening, first = re.search(r"= (\d+)", line)[1], False, True  # type: ignore[index]
            continue
        m = SYSCALL.match(line)
        if op is None or m is None or m[1] != caller:
            continue
        totals[op][m[2]] += 1
        # The wait for populated 0: from the open of cgroup.events to its close, the reads after
        # the first one (with the sched_yield or poll before each) are the wait's own. Under -f an
        # open may be cut in two (<unfinished ...>, then <... openat resumed> = fd).
        if m[2] == "openat" and "cgroup.events" in line:
            fd = re.search(r"\) = (\d+)", line)
            if fd is None:
                opening = True
            else:
                waiting, first = fd[1], True
        elif waiting is not None and m[2] == "close" and line.split("(", 1)[1].startswith(waiting):
            waiting = None
        elif waiting is not None and m[2] == "pread64":
            if not first:
                totals[op]["wait"] += 1
            first = False
        elif waiting is not None and m[2] in ("sched_yield", "poll"):
            totals[op]["wait"] += 1
    # c["wait"] counts again calls that their own names count too.
    return {name: ((sum(c.values()) - 2 * c["wait"]) / ops, c["wait"] / ops, c["getpid"] / ops)
            for name, c in totals.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=20, help="measured operations of each kind")
    ap.add_argument("--no-strace", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.ops)
    import cgturn

    calls = count_calls(args.ops)
    syscalls = None if args.no_strace else count_syscalls(args.ops)
    print(f"cgturn from {os.path.dirname(os.path.dirname(os.path.abspath(cgturn.__file__)))}, "
          f"{args.ops} operations of each kind; per operation:\n")
    print("| operation | Python calls | C calls | system calls | + spin-wait | of which getpid |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in OPS:
        py, c = calls[name]
        sc = "| n/a | | |" if syscalls is None else "| {:.1f} | {:.1f} | {:.1f} |".format(*syscalls[name])
        print(f"| {name} | {py:.1f} | {c:.1f} {sc}")
    print(f"\nThe sentinel's wake-ups (its voluntary context switches) per begin + complete, 2,000 back to "
          f"back: {sentinel_wake_ups(2000):.3f} (two messages a turn; under load a sleeping sentinel may be "
          f"woken once for several anyway)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
