"""Opening files in the state directory without trusting what is found there.

Anyone who can write the state directory can put a FIFO, a device or a symlink where cgturn expects a
regular file (`audit.jsonl`, `sentinel.log`). Opened plainly, a FIFO blocks the opener until a peer
appears (fifo(7): forever, on a kill path), and a symlink to /dev/zero never ends a read. So state
files are opened with O_NONBLOCK (a FIFO neither blocks the open nor a read), O_NOFOLLOW (a symlink is
refused, never followed) and O_CLOEXEC, and anything fstat does not call a regular file is refused.
"""
from __future__ import annotations

import errno
import os
import stat


class NotRegularFile(OSError):
    """A state file is a FIFO, device, directory, socket or symlink."""


def open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """os.open(path, flags) for a regular file only; the fd is blocking again when returned.

    Raises:
        NotRegularFile: `path` is a symlink or not a regular file.
        OSError: as os.open (ENXIO: a FIFO opened for writing with no reader).
    """
    return open_regular_stat(path, flags, mode)[0]


def open_regular_stat(path: str, flags: int, mode: int = 0o644) -> tuple[int, os.stat_result]:
    """`open_regular`, with the fstat that checked the file (an appender's size and inode, without a
    second fstat). Raises as open_regular."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "is a symbolic link, not a regular file", path) from None
        if err.errno == errno.ENXIO:
            raise NotRegularFile(errno.ENXIO, "is a FIFO, not a regular file", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"is not a regular file (mode {stat.filemode(st.st_mode)})", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st
