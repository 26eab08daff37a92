"""The kernel's own cost of what scripts/bench_many.py measures, timed with the standard library alone
(no cgturn code): mkdir and rmdir of N cgroups, the files each view must read per turn, an
interpreter's start (in every CLI's floor).

Imported by scripts/bench_many.py (scripts/ is on its sys.path).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time


def floor_tree(parent: str, n: int, tasks: int) -> tuple[float, float]:
    """mkdir of n empty cgroups in `tasks` parents, then their rmdir: (mkdir seconds, rmdir seconds)."""
    per = n // tasks
    os.mkdir(parent)
    t0 = time.perf_counter()
    for t in range(tasks):
        os.mkdir(os.path.join(parent, f"t{t}"))
        for u in range(per):
            os.mkdir(os.path.join(parent, f"t{t}", f"u{u}"))
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in range(tasks):
        for u in range(per):
            os.rmdir(os.path.join(parent, f"t{t}", f"u{u}"))
        os.rmdir(os.path.join(parent, f"t{t}"))
    removed = time.perf_counter() - t0
    os.rmdir(parent)
    return made, removed


# What each view must read per turn, as files relative to the turn's directory: the kernel floor of
# `turns()` (its pids, its cpu.stat) and of `ps` (also frozen, from cgroup.events, and the three
# pressure files). The record (an xattr) and each process's /proc/PID/statm (its RSS, where the turn has
# no memory controller, as on a hybrid host) come on top, read by `floor_reads`.
TURNS_FILES = ("cgroup.procs", "cpu.stat")
PS_FILES = TURNS_FILES + ("cgroup.events", "cpu.pressure", "memory.pressure", "io.pressure")
RECORD_XATTR = "user.cgturn"


def floor_reads(root: str, files: tuple[str, ...], record: bool, rss: bool) -> tuple[float, int]:
    """The kernel's own cost of a listing: per turn, open + read + close of `files` (relative to the
    open task directory: the cheapest way to name them), getxattr of its record when `record`, one
    /proc/PID/statm per process when `rss` (needs cgroup.procs in `files`); no parsing.
    Returns (seconds, pids seen)."""
    t0 = time.perf_counter()
    seen = 0
    pids: list[bytes] = []
    for task in os.scandir(root):
        if not task.is_dir():
            continue
        task_fd = os.open(task.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for turn in os.scandir(task.path):
                if not turn.is_dir():
                    continue
                for name in files:
                    fd = os.open(f"{turn.name}/{name}", os.O_RDONLY, dir_fd=task_fd)
                    try:
                        data = os.read(fd, 65536)
                    finally:
                        os.close(fd)
                    if name == "cgroup.procs":
                        pids = data.split()
                        seen += len(pids)
                if record:
                    os.getxattr(turn.path, RECORD_XATTR)
                for pid in pids if rss else ():
                    fd = os.open(b"/proc/" + pid + b"/statm", os.O_RDONLY)
                    os.read(fd, 4096)
                    os.close(fd)
        finally:
            os.close(task_fd)
    return time.perf_counter() - t0, seen


def interpreter_start() -> float:
    """Wall time of `python3 -c pass` (with site, as a user's `cgturn` starts): part of a CLI's floor."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - t0
