"""Open-file-description locks on a whole file (fcntl(2) F_OFD_SETLK / F_OFD_GETLK, Linux 3.15+).

Why this kind of lock where a process must show it is alive (the sentinel's file, cgturn.sentinel_locks):
- The kernel drops it when the last descriptor of its open file description closes: at exit, SIGKILL
  and an OOM kill alike, and never earlier. A POSIX lock (F_SETLK) is dropped when its process
  closes *any* descriptor of the file, which a library in that process may do unawares.
- F_OFD_GETLK says whether a lock is held without taking one. flock(2) has no such query: asking
  means taking the lock for a moment (LOCK_SH|LOCK_NB), and a reader must never hold what a writer
  may want.
- Taking it never waits (F_OFD_SETLK, not F_OFD_SETLKW): no holder can stall the taker.
"""
from __future__ import annotations

import fcntl
import sys

# struct flock: l_type (short) first, then l_whence, l_start, l_len (0: to the end of the file, so
# the whole file from SEEK_SET 0) and l_pid (must be 0 for OFD locks), 32 bytes on 64-bit Linux. Only
# l_type is set or read; the buffer is zero elsewhere and at least as large as the kernel's struct.
_FLOCK_SIZE = 32


def _flock(kind: int) -> bytes:
    return kind.to_bytes(2, sys.byteorder) + bytes(_FLOCK_SIZE - 2)


def try_lock(fd: int) -> bool:
    """Take a write lock on the whole file open at `fd` (opened for writing), without waiting.

    Returns:
        True when taken; False when another open file description holds a lock on it.
    Raises:
        OSError: anything else (EBADF, EINVAL on a kernel without OFD locks).
    """
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK))
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held (fcntl(2))
        return False
    return True


def is_locked(fd: int) -> bool:
    """Whether some other open file description holds a lock on the file open at `fd` (any mode,
    read-only included). Takes nothing: F_OFD_GETLK only reports the lock a write lock would meet.

    Raises:
        OSError: as fcntl(2) (EBADF, EINVAL on a kernel without OFD locks).
    """
    reply = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK))
    return int.from_bytes(reply[:2], sys.byteorder) != fcntl.F_UNLCK
