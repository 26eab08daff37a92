"""An exclusive flock(2) on a directory, with an optional bound on the wait (flock has no timed form).

flock works on cgroupfs directories, which is what makes a turn's state changes atomic across
processes (the owner, a sentinel, the CLI).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from typing import Iterator

log = logging.getLogger("cgturn")


@contextlib.contextmanager
def exclusive(path: str, timeout: float | None = None) -> Iterator[bool]:
    """Hold an exclusive flock(2) on the directory at `path`.

    Yields False, holding nothing, when the directory is gone. With `timeout`, a holder that keeps
    the lock longer than that (a process stopped or wedged while holding it) is not waited for:
    the body runs unlocked (yielding True), and the holder is logged.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        yield False
        return
    try:
        if timeout is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        elif not _flock_within(fd, timeout):
            log.warning("%s stayed locked for %.1f s (its holder is stopped or wedged): going on without it",
                        path, timeout)
        yield True
    finally:
        os.close(fd)


def _flock_within(fd: int, timeout: float) -> bool:
    """flock(LOCK_EX) on `fd`, waiting at most `timeout` seconds; True if it was taken.

    The wait is a blocking flock in a helper thread on a dup of `fd` (flock has no timed form, and a
    polling LOCK_NB loop starves behind a stream of shared holders). A lock taken after the timeout
    is released when both fds are closed: the caller's at the end of its block, the helper's at once.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    waiter = os.dup(fd)
    taken = threading.Event()

    def wait() -> None:
        try:
            fcntl.flock(waiter, fcntl.LOCK_EX)
            taken.set()
        finally:
            os.close(waiter)

    threading.Thread(target=wait, name="cgturn-flock", daemon=True).start()
    return taken.wait(timeout)
