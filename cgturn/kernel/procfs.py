"""/proc reads and pidfd signalling: process identity that survives PID reuse.

A process is identified by (pid, start time), start time being /proc/PID/stat field 22 (clock ticks
since boot): a recycled pid gets a new start time, so a stale record never matches a new process.
Signals go through pidfds (5.3+) where possible: once opened, a pidfd can only ever reach the process
it was opened for.
"""
from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

from . import parsers

PROC = "/proc"


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    start_time: int


def stat(pid: int) -> ProcStat | None:
    """/proc/PID/stat parsed; None when the process is gone (or unreadable)."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    try:
        state, ppid, start = parsers.parse_proc_stat(text)
    except (ValueError, IndexError):
        return None
    return ProcStat(pid, state, ppid, start)


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when it does not exist."""
    st = stat(pid)
    return st.start_time if st else None


def is_alive(pid: int, started: int) -> bool:
    """True if `pid` is running and is the process that started at `started` (not a zombie)."""
    st = stat(pid)
    return st is not None and st.start_time == started and st.state not in ("Z", "X")


def environ(pid: int) -> dict[str, str] | None:
    """The initial environment of `pid`; None when gone or not readable (other user, zombie)."""
    try:
        with open(f"{PROC}/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return parsers.parse_environ(data)


def cmdline(pid: int) -> str:
    """The command line of `pid` joined with spaces; '' when gone or a kernel thread."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")


def cgroup_of(pid: int | str) -> str | None:
    """The cgroup v2 path of a process as /proc/PID/cgroup shows it; None when gone."""
    try:
        with open(f"{PROC}/{pid}/cgroup") as f:
            return parsers.parse_proc_cgroup(f.read())
    except OSError:
        return None


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir(PROC) if name.isdigit()]


def ancestors(pid: int) -> set[int]:
    """`pid`'s ancestors up to PID 1 (inclusive), following ppid links."""
    out: set[int] = set()
    st = stat(pid)
    while st is not None and st.ppid > 0 and st.ppid not in out:
        out.add(st.ppid)
        st = stat(st.ppid)
    return out


def protected_pids() -> set[int]:
    """Pids cgturn never signals: PID 1, the caller and the caller's ancestors."""
    me = os.getpid()
    return {1, me} | ancestors(me)


def open_pidfd(pid: int, started: int | None = None) -> int | None:
    """Open a pidfd for `pid`, checking its start time when given; None if gone or not that process.

    The start-time check happens after pidfd_open, so a pid recycled in between is caught: the pidfd
    then belongs to the new process, whose start time differs.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError as err:
        if err.errno == errno.ESRCH:
            return None
        raise
    if started is not None and start_time(pid) != started:
        os.close(fd)
        return None
    return fd


def pidfd_signal(fd: int, sig: int) -> bool:
    """Send `sig` through a pidfd; False when the process has already exited."""
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False


def signal_pid(pid: int, sig: int, started: int | None = None) -> bool:
    """Signal `pid` (if its start time still matches) via a pidfd; False when it is gone."""
    fd = open_pidfd(pid, started)
    if fd is None:
        return False
    try:
        return pidfd_signal(fd, sig)
    finally:
        os.close(fd)
