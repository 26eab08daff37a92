"""What the benches share: the trees they kill, the kernel floors timed with the standard library
alone (no cgturn code: a bare mkdir, cgroup.procs, cgroup.kill, `populated 0`, rmdir), the cgturn
rows measured against them, and the bench's managed root and its removal.

Imported by scripts/bench.py and the bench_*.py scripts (scripts/ is on their sys.path).
"""
from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import sys
import time
import uuid

from cgturn import TurnManager, discover_host

SHIM = 'echo $$ > "$0" || exit 125; exec "$@"'



def tree_argv(n: int) -> list[str]:
    """A tree of exactly n processes: `sh` and n-1 sleeping children (n=1: one sleep)."""
    if n == 1:
        return ["sleep", "300"]
    return ["sh", "-c", f"i=1; while [ $i -lt {n} ]; do sleep 300 & i=$((i+1)); done; wait"]


def wait_count(count, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while count() < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"tree of {n} did not come up")
        time.sleep(0.005)


def wait_settled(pids, n: int, timeout: float = 120) -> None:
    """Wait until `pids()` (a turn's or a cgroup's members) is a whole tree_argv(n) at rest: n
    processes, n-1 of them (n=1: the one) `sleep`s, every one asleep (state S).

    A kill row times a tree at rest, as an abandoned turn's processes mostly are. Timed the moment
    the count reaches n, the kill raced the tree's last forks and execs, and how far each row's tree
    had got by then depended on how that row counts its members (the cgturn row's Turn.pids() reads
    every member's /proc stat, the floor's reads cgroup.procs), not on what it kills. Measured here
    (100 processes, 250 rounds, rows interleaved): counted, the floor's 25th percentile was 5.5 ms
    and cgturn's 6.8-8.0 ms; at rest, 7.8-7.9 ms and 7.5-8.0 ms.
    """
    sleeps = 1 if n == 1 else n - 1
    wait_count(lambda: n if _at_rest(pids(), n, sleeps) else 0, n, timeout)


def _at_rest(pids: list[int], n: int, sleeps: int) -> bool:
    if len(pids) != n:
        return False
    asleep = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        comm, state = stat[stat.index(b"(") + 1:stat.rindex(b")")], stat[stat.rindex(b")") + 2:][:1]
        if state != b"S":
            return False
        asleep += comm == b"sleep"
    return asleep == sleeps


def cgroup_members(path: str):
    """A `pids()` for wait_settled: the pids in cgroup `path` (its cgroup.procs)."""
    def pids() -> list[int]:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(pid) for pid in f.read().split()]
    return pids


def ms(seconds: float) -> float:
    return seconds * 1000


# --- the raw kernel floor: no cgturn code at all ----------------------------------------------------

# How long the floor re-reads cgroup.events back to back after the kill (cgroupfs.SPIN_FOR).
FLOOR_SPIN = 0.005


def floor_abandon(parent: str, n: int) -> float:
    """The kernel's own work of an abandon, timed alone on the same tree as cgturn's row: write
    cgroup.kill, re-read cgroup.events until it says `populated 0`, rmdir (again while EBUSY).

    The tree is put in place untimed (mkdir, the shim joins it, n processes) and left to come to
    rest (wait_settled). The file is re-read as cgturn's own wait re-reads it
    (cgroupfs.Cgroup.wait_events), written here with the standard library alone: back to back for
    the first 5 ms after the kill began, with sched_yield(2) between reads so the dying processes
    get the CPU on a small machine, then at least every 1 ms asleep in poll(2). Not poll(2) from
    the start: the kernel rate-limits cgroup.events notifications (10 ms, kernel/cgroup/cgroup.c),
    so a poll timeout would time the timeout. Not a spin to the end either: a kill of 100
    processes here often returns from the write only after 2-8 ms (the processes it woke preempt
    the writer and queue on its CPU), and a spin after that takes the CPU they need: such a
    floor's median was 10.5-12 ms where this one's is 8.5-9.1 ms, its 90th percentile 48-60 ms
    against 11-14 ms (150-300 rounds each).
    """
    path = os.path.join(parent, f"floor-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    proc = subprocess.Popen(["/bin/sh", "-c", SHIM, os.path.join(path, "cgroup.procs"), *tree_argv(n)])
    wait_settled(cgroup_members(path), n)
    events = os.open(os.path.join(path, "cgroup.events"), os.O_RDONLY)
    kill = os.open(os.path.join(path, "cgroup.kill"), os.O_WRONLY)
    poller = select.poll()
    poller.register(events, select.POLLPRI)
    t0 = time.perf_counter()
    os.write(kill, b"1")
    while b"populated 0" not in os.pread(events, 4096, 0):
        if time.perf_counter() - t0 < FLOOR_SPIN:
            os.sched_yield()
        else:
            poller.poll(1)
    while not _removed(path):  # EBUSY while the kernel finishes its own bookkeeping
        pass
    elapsed = time.perf_counter() - t0
    for fd in (kill, events):
        os.close(fd)
    proc.wait()
    return elapsed


def _removed(path: str) -> bool:
    """rmdir `path`: True once done, False on EBUSY (anything else raises)."""
    try:
        os.rmdir(path)
    except OSError as err:
        if err.errno == errno.EBUSY:
            return False
        raise
    return True


# --- cgturn against the floors ---------------------------------------------------------------------

def cgturn_abandon(mgr: TurnManager, n: int, limits=None, check=None) -> float:
    """abandon(grace=0) of a turn (with `limits`) holding n processes; `check(turn, result)` after."""
    turn = mgr.begin_turn("bench-abandon", limits=limits)
    proc = turn.spawn(tree_argv(n))
    wait_settled(turn.pids, n)
    t0 = time.perf_counter()
    result = turn.abandon("bench", grace=0)
    elapsed = time.perf_counter() - t0
    proc.wait()
    if len(result.killed) != n:
        raise RuntimeError(f"{mgr.backend_name}: killed {len(result.killed)} of {n}")
    if check is not None:
        check(turn, result)
    return elapsed


def time_spawn(start) -> tuple[float, float]:
    """(seconds until `start()` returned, seconds until the process it started has exited)."""
    t0 = time.perf_counter()
    p = start()
    t1 = time.perf_counter()
    p.wait()
    return t1 - t0, time.perf_counter() - t0


def churn(mgr: TurnManager, seconds: float) -> float:
    """Turns per second: begin + spawn(/bin/true) + wait + complete, back to back."""
    done = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        turn = mgr.begin_turn("bench-churn")
        turn.spawn(["/bin/true"]).wait()
        turn.complete()
        done += 1
    return done / (time.perf_counter() - t0)


# --- the bench root ---------------------------------------------------------------------------------

def bench_root(parent: str | None = None) -> str | None:
    """A fresh managed-root path `<parent>/cgturn-bench-<random>` (not created; parent: this process's
    own cgroup2 unless given), with SIGTERM made a KeyboardInterrupt so the caller's cleanup runs; None
    (reported) without root or cgroup2."""
    host = discover_host()
    if host.cgroup2_mount is None or os.geteuid() != 0:
        print("needs root and a cgroup2 mount", file=sys.stderr)
        return None
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    return os.path.join(parent or host.own_cgroup or host.cgroup2_mount, f"cgturn-bench-{uuid.uuid4().hex[:8]}")


def destroy(root: str, *managers: TurnManager) -> None:
    """Kill whatever is left under the bench root (never holds this process) and remove it; then let
    each manager of a managed root below it remove that root's v1 directories on a hybrid host (and
    the empty mirrors above them, such as `cgturn-bench-*` itself), which a cgroup2 rmdir cannot reach.
    Called from `finally`, so an interrupted or failed bench leaves nothing behind either."""
    try:
        _remove_tree(root)
    finally:
        for mgr in managers:
            mgr.remove_root()


def _remove_tree(root: str) -> None:
    if not os.path.isdir(root):
        return
    with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.kill"), "w") as f:
        f.write("1")
    for dirpath, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        for _ in range(200):
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
