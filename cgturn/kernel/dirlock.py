"""flock(2) on a directory, every wait bounded (flock has no timed form).

flock works on cgroupfs directories, which is what makes a turn's state changes atomic across
processes (the owner, a sentinel, the CLI). flock needs only a read-only fd, so a lock is only as
private as the directory's mode: the directories cgturn locks are made PRIVATE_MODE (cgroupfs.py),
which no other user can open. A holder that keeps the lock past the bound (a process stopped or
wedged while holding it, or one of the same user) is not waited for: LockTimeout, and the caller
does without the operation, never without the lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from typing import Iterator

from ..errors import LockTimeout

# How long any lock is waited for (seconds). Legitimate holders keep a lock for a state change (a
# record read and write) or a spawn: microseconds to milliseconds.
LOCK_WAIT = 2.0
# Waiter threads left blocked by timed-out waits (each until its holder lets go; see _flock_within);
# past this many, a wait polls instead of adding one more.
MAX_STRANDED = 32
_POLL = 0.005

_stranded = 0
_stranded_lock = threading.Lock()


@contextlib.contextmanager
def exclusive(path: str, what: str, timeout: float = LOCK_WAIT) -> Iterator[bool]:
    """Hold an exclusive flock(2) on the directory at `path` for the body.

    Args:
        what: the operation that needs the lock, for the error ("complete turn 't' of task 'x'").
        timeout: the longest wait for another holder, in seconds.

    Yields False, holding nothing, when the directory is gone; else True, holding the lock.
    Raises:
        LockTimeout: another process held the lock for all of `timeout`; the body did not run.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        yield False
        return
    try:
        if not flock_within(fd, fcntl.LOCK_EX, timeout):
            raise LockTimeout(path, what, timeout)
        yield True
    finally:
        os.close(fd)


def flock_within(fd: int, kind: int, timeout: float) -> bool:
    """flock(kind) (LOCK_EX or LOCK_SH) on `fd`, waiting at most `timeout` seconds; True if taken.

    The wait is a blocking flock in a helper thread on a dup of `fd` (flock has no timed form, and a
    polling LOCK_NB loop starves an exclusive locker behind a stream of shared holders). A lock the
    helper takes after the timeout is released at once: it belongs to the open file, which then has
    only the helper's fd left (the caller closes its own after a timeout). While MAX_STRANDED helpers
    are still blocked after timeouts, the wait polls LOCK_NB instead, so a stuck holder costs a
    bounded number of threads.
    """
    global _stranded
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    if _stranded >= MAX_STRANDED:
        return _poll(fd, kind, timeout)
    waiter = os.dup(fd)
    taken = threading.Event()
    gave_up = [False]  # read and written under _stranded_lock

    def wait() -> None:
        global _stranded
        try:
            fcntl.flock(waiter, kind)
            taken.set()
        finally:
            os.close(waiter)
            with _stranded_lock:
                if gave_up[0]:
                    _stranded -= 1

    threading.Thread(target=wait, name="cgturn-flock", daemon=True).start()
    if taken.wait(timeout):
        return True
    with _stranded_lock:
        if taken.is_set():  # taken in the instant between the wait and now
            return True
        gave_up[0] = True
        _stranded += 1
    return False


def _poll(fd: int, kind: int, timeout: float) -> bool:
    """flock(kind | LOCK_NB) every few ms until taken or `timeout` passes."""
    pause = threading.Event()  # never set: only its timed wait is used
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pause.wait(_POLL)
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            continue
    return False
