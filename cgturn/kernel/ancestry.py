"""The calling process's ancestors, walked once and then kept while none of them has exited.

A process's parent changes only when that parent exits: the orphan is re-parented to a subreaper or
to its namespace's PID 1 (prctl(2) PR_SET_CHILD_SUBREAPER; /proc/PID/stat field 4 is the real
parent, which ptrace does not change). So while no process of a walked chain has exited, the chain
is still the one walked. Each ancestor is pinned by a pidfd (pidfd_open(2), Linux 5.3+), opened
after the walk and checked against the start time the walk read, so a pid recycled in between is
never pinned; a pidfd turns readable when its process exits, and one poll(2) of all of them with a
timeout of 0 tells whether the chain still holds.

This is what lets an abandon read its protected processes (the caller, its ancestors, PID 1) once
and cheaply: getppid(2) and one poll(2), instead of one /proc/PID/stat read per level. Where a pidfd
cannot be had (an older kernel, a seccomp filter) or a start time cannot be read, nothing is pinned
and every reading walks, as before. The pidfds (one per ancestor but PID 1, which cannot exit while
its namespace lives) are close-on-exec, and a forked child closes its parent's at once.
"""
from __future__ import annotations

import os
import select
import threading
from typing import Callable

# ppid -> [(pid, start time or None when unreadable)] from that parent up, as far as the walk reads.
Walk = Callable[[int], "list[tuple[int, int | None]]"]
StartTime = Callable[[int], "int | None"]


class _Pinned:
    """One walked chain and the pidfds that pin it."""

    __slots__ = ("me", "ppid", "pids", "fds", "poller")

    def __init__(self, me: int, ppid: int, pids: frozenset[int], fds: list[int]) -> None:
        self.me = me
        self.ppid = ppid
        self.pids = pids
        self.fds = fds
        self.poller = select.poll()
        for fd in fds:
            self.poller.register(fd, select.POLLIN)

    def holds(self, me: int, ppid: int) -> bool:
        """True while this is the chain of process `me` with parent `ppid` and no pinned one exited."""
        return self.me == me and self.ppid == ppid and not self.poller.poll(0)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


_PINNED: _Pinned | None = None
_LOCK = threading.Lock()  # the poll object is not for two threads at once


def own_ancestors(walk: Walk, start_time: StartTime) -> frozenset[int]:
    """The calling process's ancestors as `walk(getppid())` gives them, walked again only when one of
    them has exited (or the caller is a new process: a forked child).

    Args:
        walk: the walk up from a parent pid (pid, start time) pairs, as procfs reads them.
        start_time: a process's start time now (the pin's check after pidfd_open), None if unreadable.
    """
    global _PINNED
    me, ppid = os.getpid(), os.getppid()
    with _LOCK:
        pinned = _PINNED
        if pinned is not None and pinned.holds(me, ppid):
            return pinned.pids
        chain = walk(ppid)
        if pinned is not None:
            pinned.close()
        _PINNED = _pin(me, ppid, chain, start_time)
    return frozenset(pid for pid, _ in chain)


def _pin(me: int, ppid: int, chain: list[tuple[int, int | None]], start_time: StartTime) -> _Pinned | None:
    """Pidfds for every process of `chain` but PID 1, each checked to be the process the walk read;
    None (nothing kept) when any cannot be pinned."""
    fds: list[int] = []
    try:
        for pid, started in chain:
            if pid == 1:
                continue
            if started is None:
                raise LookupError(pid)
            fds.append(os.pidfd_open(pid))
            if start_time(pid) != started:  # recycled since the walk read it: not the same process
                raise LookupError(pid)
        return _Pinned(me, ppid, frozenset(pid for pid, _ in chain), fds)
    except (OSError, LookupError, AttributeError):  # AttributeError: os.pidfd_open needs Python 3.9+
        for fd in fds:
            os.close(fd)
        return None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _forget_in_child() -> None:
    """A forked child has ancestors of its own: drop (and close) what its parent pinned."""
    global _PINNED, _LOCK
    _LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    if _PINNED is not None:
        _PINNED.close()
        _PINNED = None


os.register_at_fork(after_in_child=_forget_in_child)
