"""The calling process's ancestors, walked once and then kept while none of them has exited.

A process's parent changes only when that parent exits: the orphan is re-parented to a subreaper or
to its namespace's PID 1 (prctl(2) PR_SET_CHILD_SUBREAPER; /proc/PID/stat field 4 is the real
parent, which ptrace does not change). So while no process of a walked chain has exited, the chain
is still the one walked. Each ancestor is pinned by a pidfd (pidfd_open(2), Linux 5.3+) opened
before its parent is read, and the chain is kept only if none of them has exited by the walk's end,
so no pid was recycled under the walk; a pidfd turns readable when its process exits, and one
poll(2) of all of them with a timeout of 0 tells whether the chain still holds.

This is what lets an abandon read its protected processes (the caller, its ancestors, PID 1) once
and cheaply: getppid(2) and one poll(2), instead of one /proc/PID/stat read per level. Where a pidfd
cannot be had (an older kernel, a seccomp filter) or the walk does not reach PID 1, nothing is
pinned and every reading walks, as before. The pidfds (one per ancestor but PID 1, which cannot exit while
its namespace lives) are close-on-exec, and a forked child closes its parent's at once.
"""
from __future__ import annotations

import os
import select
import threading
from typing import Callable

# pid -> its parent pid; 0 when it is gone or cannot be read (the walk ends there).
ParentOf = Callable[[int], int]


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


def own_ancestors(parent_of: ParentOf) -> frozenset[int]:
    """The calling process's ancestors up to PID 1, following `parent_of` from getppid(2); walked
    again only when one of them has exited (or the caller is a new process: a forked child).

    Args:
        parent_of: a process's parent pid as /proc gives it, 0 when it cannot be read.
    """
    global _PINNED
    me, ppid = os.getpid(), os.getppid()
    with _LOCK:
        pinned = _PINNED
        if pinned is not None and pinned.holds(me, ppid):
            return pinned.pids
        if pinned is not None:
            pinned.close()
        pids, _PINNED = _walk(me, ppid, parent_of)
    return pids


def _walk(me: int, ppid: int, parent_of: ParentOf) -> tuple[frozenset[int], _Pinned | None]:
    """(the ancestors from `ppid` up, the chain pinned or None).

    Each process is pinned by a pidfd before its parent is read from /proc: if it is still alive at
    the end of the walk (its pidfd not readable), its pid was never free to be recycled in between,
    so what was read was its own. Only a whole chain, up to PID 1, is pinned: one that ends at a
    process that cannot be read (hidepid, another pid namespace's parent) is walked every time.
    """
    chain: list[int] = []
    fds: list[int] | None = []
    try:
        while ppid > 0 and ppid not in chain:
            chain.append(ppid)
            if ppid == 1:
                break
            if fds is not None:
                try:
                    fds.append(os.pidfd_open(ppid))
                except (OSError, AttributeError):  # gone, refused, or no pidfd_open (Python < 3.9)
                    _close(fds)
                    fds = None
            ppid = parent_of(ppid)
        pids = frozenset(chain)
        if fds is None or not chain or chain[-1] != 1:
            return pids, None
        pinned = _Pinned(me, chain[0], pids, fds)
        fds = None  # the pin owns them now
        if pinned.poller.poll(0):  # one of them exited during the walk: what was read may be stale
            pinned.close()
            return pids, None
        return pids, pinned
    finally:
        if fds:
            _close(fds)


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def forget() -> None:
    """Drop (and close) the kept chain: the next reading walks."""
    global _PINNED
    with _LOCK:
        if _PINNED is not None:
            _PINNED.close()
            _PINNED = None


def _forget_in_child() -> None:
    """A forked child has ancestors of its own: drop (and close) what its parent pinned."""
    global _LOCK
    _LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    forget()


os.register_at_fork(after_in_child=_forget_in_child)
