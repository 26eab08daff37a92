"""Paths by which a child opens its parent's file descriptors through /proc (proc(5): /proc/PID/fd).

Opening /proc/PID/fd/N opens the file the fd refers to afresh (for a pipe: another reader or writer
of the same pipe, and fs/pipe.c fifo_open never waits for a partner when the inode is a pipe). It
needs ptrace read access to PID (PTRACE_MODE_READ_FSCREDS): a child with its parent's credentials has
it unless the parent is not dumpable (prctl(2) PR_SET_DUMPABLE: it changed its uid or gid) and the
child lacks CAP_SYS_PTRACE.
"""
from __future__ import annotations

import os

from .procfs import PROC

_self_pid: tuple[int, str] | None = None  # (os.getpid(), our pid as the mounted /proc names it)


def parent_fd_path(fd: int) -> str:
    """The path our children open to reach our fd `fd`: /proc/<our pid>/fd/<fd>, with our pid as the
    mounted /proc names it (readlink /proc/self), which differs from getpid() when /proc belongs to
    another pid namespace. Read once per process (a forked child reads its own)."""
    global _self_pid
    me = os.getpid()
    if _self_pid is None or _self_pid[0] != me:
        _self_pid = (me, os.readlink(os.path.join(PROC, "self")))
    return os.path.join(PROC, _self_pid[1], "fd", str(fd))


def inherited_fd_path(fd: int) -> str:
    """The path a process opens to reach its own (inherited) fd `fd`."""
    return os.path.join(PROC, "self", "fd", str(fd))


def children_can_open_our_fds() -> bool:
    """Whether our children may open parent_fd_path(): yes for root (CAP_SYS_PTRACE) and for a
    dumpable process. A non-dumpable process's /proc files (its 0500 fd directory among them) are
    owned by root (fs/proc/base.c: task_dump_owner), which is how this tells without prctl."""
    euid = os.geteuid()
    return euid == 0 or os.stat(os.path.join(PROC, "self", "fd")).st_uid == euid
