"""Processes as cgturn sees them, for the layers above and the faces: identity that survives PID reuse
(pid + start time), liveness, children, command lines. Thin answers over kernel.procfs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import AccessDenied
from .kernel import procfs


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One live process: pid, start time (clock ticks since boot) and command line."""

    pid: int
    start_time: int
    command: str


def start_time(pid: int) -> int | None:
    """`pid`'s start time (/proc/PID/stat field 22), None when it does not exist.
    Raises AccessDenied when it may exist but cannot be read."""
    return procfs.start_time(pid)


def is_running(pid: int, started: int) -> bool:
    """True if `pid` runs and is the process that started at `started` (a zombie has exited).
    Raises AccessDenied when that cannot be told."""
    return procfs.is_alive(pid, started)


def alive_or_unknown(pid: int | None, started: int | None) -> bool:
    """True unless `pid` (started at `started`) is known to be gone: one that cannot be looked at
    counts as alive (see cgturn.kernel.procfs.alive_or_unknown)."""
    return procfs.alive_or_unknown(pid, started)


def open_owner(pid: int, start: int | None) -> int | None:
    """A pidfd of the process `pid` started at `start` (clock ticks), or None when it is already gone
    or the pid was reused. A pidfd polls readable once its process exits (pidfd_open(2), Linux 5.3)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    # Checked after opening: the pidfd now pins this very process, so a later start-time match holds.
    # Cannot look is not known to be dead: the pidfd will tell when it exits.
    if not alive_or_unknown(pid, start):
        os.close(fd)
        return None
    return fd


def own_thread_count() -> int | None:
    """How many threads the calling process runs, C libraries' included; None when unknown."""
    return procfs.own_thread_count()


def set_own_name(name: str) -> bool:
    """Name the calling thread as `ps -e` and `top` show it (15 bytes); False when refused."""
    return procfs.set_own_name(name)


def command_line(pid: int) -> str:
    """The command line of `pid` joined with spaces; '' when gone or unreadable."""
    return procfs.cmdline(pid)


def children(pid: int | None = None) -> list[ProcessInfo]:
    """The live (non-zombie) children of `pid` (default: the calling process)."""
    parent = os.getpid() if pid is None else pid
    out = []
    for child in procfs.children_of(parent):
        try:
            st = procfs.stat(child)
        except AccessDenied:
            continue
        if st is not None and st.ppid == parent and not st.exited:
            out.append(ProcessInfo(child, st.start_time, procfs.cmdline(child)))
    return out
