"""Spawn gates: a FIFO per spawn on which the child's shim waits until the parent has moved it into
its turn, so the target cannot run one instruction outside the turn and the parent never waits for
the shim to start.

The parent holds each FIFO open read-write (so the shim's open never blocks and "go" can be written
before the shim even opened it). Gates are reused: once a shim has read its whole "go" line (FIONREAD
says the pipe is empty; dash's `read` takes one byte at a time and stops at the newline, then closes
the FIFO), nothing will read that FIFO again, and the next spawn can take it. That spares each spawn
a mkfifo, an open, an unlink and a close (~80 us of its ~0.35 ms over plain Popen here). A gate whose
shim exited without reading its "go" (killed meanwhile) still holds that line and is removed, never
reused. Gates left by a process that died are removed at start-up.
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import select
import stat
import struct
import termios
import threading
import time
from dataclasses import dataclass

GO = b"go\n"
CLOSE_WAIT = 1.0  # how long close() lets starting shims pick up their "go"
FREE_MAX = 8      # idle gates kept for reuse; more are removed
# mkfifo costs ~8 us on tmpfs and ~250 us on ext4 (measured here): gates prefer a private tmpfs dir.
SHM = "/dev/shm"


def gate_directory_path(uid: int) -> str:
    """Where the gates of processes running as `uid` live (tmpfs)."""
    return os.path.join(SHM, f"cgturn-gates-{uid}")


def gate_directory(fallback: str) -> str:
    """A private (0700, ours, not a symlink) directory on /dev/shm for gates, else `fallback`."""
    path = gate_directory_path(os.geteuid())
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return fallback
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700:
        return path
    return fallback  # someone else's, or tampered with: do not put FIFOs there


@dataclass
class Gate:
    path: str
    fd: int                  # the parent's read-write end
    pid: int | None = None   # the shim it was released to


class SpawnGates:
    """The gates of one backend, in `directory` (created 0700)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._seq = itertools.count()
        self._pending: list[Gate] = []  # released; their shim may not have read "go" yet
        self._free: list[Gate] = []     # read out: ready for the next spawn
        self._lock = threading.Lock()
        self._ready = False
        self._owner = os.getpid()

    def open(self) -> Gate:
        """A gate for one spawn (reused when one is free); its path goes to the shim."""
        self.sweep()
        with self._lock:
            if self._free:
                return self._free.pop()
        if not self._ready:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            self._remove_stale()
            self._ready = True
        path = os.path.join(self.directory, f"{os.getpid()}-{next(self._seq)}")
        os.mkfifo(path, 0o600)
        return Gate(path, os.open(path, os.O_RDWR | os.O_CLOEXEC))

    def release(self, gate: Gate, pid: int) -> None:
        """Let the shim of `pid` exec its target; the gate is free again once the shim read it."""
        os.write(gate.fd, GO)
        gate.pid = pid
        with self._lock:
            self._pending.append(gate)

    def discard(self, gate: Gate) -> None:
        """Remove a gate now (its shim will never run the target: it reads EOF or finds no FIFO)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(gate.path)
        os.close(gate.fd)

    def sweep(self) -> None:
        """Free the gates whose shim has read its "go"; remove those whose shim exited unread."""
        if self._owner != os.getpid():
            self._forget_inherited()
        with self._lock:
            keep = []
            for gate in self._pending:
                if _unread(gate.fd) == 0:
                    gate.pid = None
                    if len(self._free) < FREE_MAX:
                        self._free.append(gate)
                    else:
                        self.discard(gate)
                elif _exited(gate.pid):
                    self.discard(gate)
                else:
                    keep.append(gate)
            self._pending = keep

    def close(self) -> None:
        """Wait briefly for starting shims, then remove every gate."""
        deadline = time.monotonic() + CLOSE_WAIT
        while True:
            self.sweep()
            if not self._pending or time.monotonic() >= deadline:
                break
            select.poll().poll(5)
        with self._lock:
            for gate in self._pending + self._free:
                self.discard(gate)
            self._pending, self._free = [], []

    def _forget_inherited(self) -> None:
        """In a forked child: the parent's gates are the parent's (sharing one FIFO between two
        processes could hand one shim another's "go"). Close our copies of their fds, leave the
        files to the parent, and start a set of our own (named with our pid). Only the forking
        thread exists here, so no lock is taken: one held by another thread at fork stays held."""
        self._lock = threading.Lock()
        for gate in self._pending + self._free:
            os.close(gate.fd)
        self._pending, self._free = [], []
        self._owner = os.getpid()

    def _remove_stale(self) -> None:
        """Remove gates of processes that died before retiring them (their prefix is the pid)."""
        for name in os.listdir(self.directory):
            pid = name.split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, name))


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
