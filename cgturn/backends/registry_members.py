"""Membership of the registry backend's turns, from one pass over /proc: what a turn owns is its
recorded processes (pid + start time, so a reused pid never matches), their descendants (one ppid map
per pass) and any process whose initial environment names the registry and the turn (double-forked
or setsid daemons keep it wherever they went), and their descendants. Also what waiting for members
and reading their usage need.
"""
from __future__ import annotations

import os
import select
import time

from ..errors import AccessDenied, KernelError, NoSuchProcess
from ..kernel import procfs
from .base import Member, turn_tag


class Snapshot:
    """One pass over /proc: every process's stat, children by parent, and turn environments.

    Built once per membership query, so a process is judged against one consistent ppid map.
    """

    def __init__(self, scope: str):
        self.stats: dict[int, procfs.ProcStat] = {}
        self.children: dict[int, list[int]] = {}
        # pid -> (task_key, turn_key) for processes whose environment names `scope`
        self.tagged: dict[int, tuple[str, str]] = {}
        kthreadd = KTHREADD if kernel_threads_visible() else None
        for pid in procfs.all_pids():
            try:
                st = procfs.stat(pid)
            except AccessDenied:
                continue  # not ours to look at, so never a member (hidepid)
            if st is None:
                continue
            self.stats[pid] = st
            self.children.setdefault(st.ppid, []).append(pid)
            if kthreadd in (pid, st.ppid) or st.state in ("Z", "X"):
                continue  # kernel threads have no environment; a zombie's is gone
            tag = turn_tag(settled_environ(pid), scope)
            if tag is not None:
                self.tagged[pid] = tag

    def live(self, pid: int, started: int | None = None) -> bool:
        """True if `pid` is in the snapshot, not a zombie, and (when given) started at `started`."""
        st = self.stats.get(pid)
        return (st is not None and st.state not in ("Z", "X")
                and (started is None or st.start_time == started))

    def member(self, pid: int) -> Member:
        return pid, self.stats[pid].start_time


# kthreadd, the parent of every kernel thread, is pid 2 of the initial PID namespace (kernel/kthread.c);
# its stat flags carry PF_KTHREAD (include/linux/sched.h).
KTHREADD = 2
PF_KTHREAD = 0x00200000


def kernel_threads_visible() -> bool:
    """Whether this /proc shows kernel threads (pid 2 is kthreadd, so it and its children are them).

    In a PID namespace of its own (a container) no kernel thread is visible, and pid
    2 is a process like any other: often the container's main program, a child subreaper, to which a
    turn's orphaned daemons reparent (taking it for kthreadd would skip them all)."""
    try:
        stat = procfs.HOST.read(KTHREADD, "stat", whole=True)
        flags = int(stat.rsplit(b")", 1)[1].split()[6])  # field 9 (flags): the 7th after the name
    except (KernelError, AccessDenied, NoSuchProcess, ValueError, IndexError):
        return False  # no pid 2 (or a truncated read of one exiting): not kthreadd, which never exits
    return bool(flags & PF_KTHREAD)


# How long one snapshot waits for a process between two images (below) to show its environment:
# execve(2) builds the new image in microseconds, but it reads the program's and the ELF interpreter's
# headers from disk in between (milliseconds when the cache is cold, more under emulation and load).
EXEC_SETTLE_SECONDS = 1.0


def settled_environ(pid: int) -> dict[str, str] | None:
    """The initial environment of `pid`, read again while the process is between two images.

    A process inside execve(2) reads as having no environment *and* no command line: from the switch
    to the new image's memory until the ELF loader lays out its stack, mm->env_end is 0 and
    fs/proc/base.c returns nothing ("Ensure the process spawned far enough to have an
    environment"); an open made before the switch reads nothing after it. A turn's daemon caught
    there would be missed by the pass (a `sleep` its shell forked, execing, while the shell exited).
    An environment that reads empty while the command line reads non-empty on both sides of it is
    really empty (`env -i`).

    Args:
        pid: the process.

    Returns:
        Its environment; None when it is gone, a zombie or not ours to read; empty when it really is,
        or when it was still between two images after EXEC_SETTLE_SECONDS.
    """
    env = procfs.environ(pid)
    deadline = None
    while env == {}:
        if procfs.cmdline(pid):
            env = procfs.environ(pid)
            if env or procfs.cmdline(pid):
                return env
        else:
            try:
                st = procfs.stat(pid)
            except AccessDenied:
                return None
            if st is None or st.exited:
                return None  # gone, or a zombie: no environment to find
        now = time.monotonic()
        deadline = deadline or now + EXEC_SETTLE_SECONDS
        if now >= deadline:
            return env
        time.sleep(0.001)
        env = procfs.environ(pid)
    return env


def collect(recorded: list[Member], key: tuple[str, str], snap: Snapshot, protected: set[int]) -> set[Member]:
    """Live members of the turn `key` (task_key, turn_key): its `recorded` processes still alive,
    processes whose environment names it, and their descendants.

    Protected pids (PID 1, the caller, its ancestors) are neither members nor walked through, so a
    turn never reaches the caller's other children.
    """
    seeds = [pid for pid, start in recorded if snap.live(pid, start)]
    seeds += [pid for pid, tag in snap.tagged.items() if tag == key]
    found: set[int] = set()
    stack = [pid for pid in seeds if pid not in protected]
    while stack:
        pid = stack.pop()
        if pid in found or not snap.live(pid):
            continue
        found.add(pid)
        stack.extend(child for child in snap.children.get(pid, ()) if child not in protected)
    return {snap.member(pid) for pid in found}


def usage(pids: list[int]) -> tuple[float, int]:
    """CPU seconds (user + system) and summed RSS of the live processes `pids` (psutil)."""
    import psutil

    cpu, rss = 0.0, 0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            times = proc.cpu_times()
            cpu += times.user + times.system
            rss += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return cpu, rss


def wait_any_exit(members: list[Member], timeout: float) -> None:
    """Sleep until one of `members` exits (pidfd POLLIN, 5.3+) or `timeout` passes."""
    fds = []
    try:
        poller = select.poll()
        for pid, start in members:
            fd = procfs.open_pidfd(pid, start)
            if fd is None:
                return  # already gone: let the caller re-collect right away
            fds.append(fd)
            poller.register(fd, select.POLLIN)
        poller.poll(timeout * 1000)
    finally:
        for fd in fds:
            os.close(fd)


