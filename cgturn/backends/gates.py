"""Spawn gates: an anonymous pipe per spawn on which the child's shim waits until the parent has moved
it into its turn, so the target cannot run one instruction outside the turn and the parent never
waits for the shim to start.

The shim inherits the pipe's read end (`pass_fds`) and reads it as `/proc/self/fd/<n>`
(`read go < "$0"`). Opening a pipe through /proc never waits for a writer (fs/pipe.c: fifo_open only
waits when the inode is not a pipe), and the parent holds the only write end: when the parent dies
before writing "go", the shim reads EOF and exits 125 without running the target, so a shim can never
be left waiting for a parent that is gone. (A named FIFO cannot give that: opening one for reading
blocks until a writer appears, forever if the writer died first.) Once "go" is written it stays in
the pipe, so a parent that exits right after `spawn` returns does not stop the target. The shim holds
its own read end for the same reason: a gate opened through the parent's /proc fd table would vanish
with the parent. The price: the target inherits that one drained fd (dash cannot close an fd above 9).

After "go" is written the parent closes its write end; it closes the read end once the shim has read
the line (FIONREAD says the pipe is empty) or has exited. A forked child closes its copies at once
(os.register_at_fork), so it can never keep a gate of its parent open.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import select
import struct
import termios
import threading
import time
import weakref
from dataclasses import dataclass

from ..kernel import procfd

GO = b"go\n"
CLOSE_WAIT = 1.0  # how long close() lets starting shims pick up their "go"


@dataclass
class Gate:
    path: str                # what the shim opens
    rfd: int                 # the parent's read end (the shim opens it through /proc)
    wfd: int                 # the parent's write end, closed once "go" is written
    pass_fds: tuple = ()     # fds the shim must inherit: its read end
    pid: int | None = None   # the shim it was released to


class SpawnGates:
    """The gates of one backend: no files, no names, nothing to remove after a crash."""

    def __init__(self):
        self._pending: list[Gate] = []  # released; their shim may not have read "go" yet
        self._lock = threading.Lock()
        _LIVE.add(self)

    def open(self) -> Gate:
        """A fresh gate for one spawn; `path` goes to the shim, `pass_fds` to Popen."""
        self.sweep()
        rfd, wfd = os.pipe()  # O_CLOEXEC: no other child inherits it
        return Gate(procfd.inherited_fd_path(rfd), rfd, wfd, pass_fds=(rfd,))

    def release(self, gate: Gate, pid: int) -> None:
        """Let the shim of `pid` exec its target."""
        os.write(gate.wfd, GO)
        os.close(gate.wfd)
        gate.wfd, gate.pid = -1, pid
        with self._lock:
            self._pending.append(gate)

    def discard(self, gate: Gate) -> None:
        """Close a gate now: its shim reads EOF or finds no fd, and exits 125 without the target."""
        for fd in (gate.wfd, gate.rfd):
            if fd >= 0:
                os.close(fd)
        gate.wfd = gate.rfd = -1

    def sweep(self) -> None:
        """Close the gates whose shim has read its "go" or exited."""
        with self._lock:
            keep = []
            for gate in self._pending:
                if _unread(gate.rfd) == 0 or _exited(gate.pid):
                    self.discard(gate)
                else:
                    keep.append(gate)
            self._pending = keep

    def close(self) -> None:
        """Wait briefly for starting shims, then close every gate."""
        deadline = time.monotonic() + CLOSE_WAIT
        while True:
            self.sweep()
            if not self._pending or time.monotonic() >= deadline:
                break
            select.poll().poll(5)
        with self._lock:
            for gate in self._pending:
                self.discard(gate)
            self._pending = []

    def _forget_inherited(self) -> None:
        """In a forked child: close our copies of the parent's gates (held open here, a gate would
        not read EOF when the parent dies). Only the forking thread exists, so no lock is taken:
        one held by another thread at fork stays held."""
        self._lock = threading.Lock()
        for gate in self._pending:
            with contextlib.suppress(OSError):
                self.discard(gate)
        self._pending = []


_LIVE: "weakref.WeakSet[SpawnGates]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for gates in list(_LIVE):
        gates._forget_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe (ioctl FIONREAD)."""
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return struct.unpack("i", buf)[0]


def _exited(pid: int | None) -> bool:
    """True once our child `pid` has exited, whether or not it was reaped (WNOWAIT leaves it to
    Popen.wait). A pid since reaped and reused only delays the answer: the gate is kept longer."""
    if pid is None:
        return True
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # already reaped by its Popen
