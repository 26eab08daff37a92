"""The one place cgturn calls the C library through ctypes: what the os module does not offer.

- getxattr(2) with a caller-sized buffer (os.getxattr asks twice for any value over 128 bytes);
- statfs(2) for a filesystem's magic number (os.statvfs has no f_type);
- prctl(2) PR_SET/GET_CHILD_SUBREAPER (Linux 3.4+);
- unshare(2) and setns(2) (os has them only from Python 3.12).

Every wrapper raises OSError with errno and path, as the os module would.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

_FS_ENCODING = sys.getfilesystemencoding()  # os.fsencode's rules, without its Python-level cost

PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux 3.4+
PR_GET_CHILD_SUBREAPER = 37


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    libc.getxattr.restype = ctypes.c_ssize_t
    return libc


def _raise(path: str | None = None) -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), path)


@functools.lru_cache(maxsize=8)
def _buffer_type(size: int):
    return ctypes.c_char * size  # one type per size, not one per call (create_string_buffer)


def getxattr(path: str, key: str, size: int) -> bytes:
    """The value of xattr `key` of `path`, read with one `size`-byte buffer.

    Raises:
        OSError: ENODATA when the attribute is absent; ERANGE when the value is larger than `size`
            (the caller then asks os.getxattr, which sizes its buffer itself).
    """
    buf = _buffer_type(size)()
    got = _libc().getxattr(path.encode(_FS_ENCODING, "surrogateescape"), key.encode(), buf, size)
    if got < 0:
        _raise(path)
    return ctypes.string_at(buf, got)


class _StatFs(ctypes.Structure):
    # struct statfs begins with f_type (__fsword_t, a long); the rest is only room for the kernel.
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 120)]


def filesystem_magic(path: str) -> int:
    """statfs(2) `f_type` of the filesystem holding `path` (e.g. CGROUP2_SUPER_MAGIC). Raises OSError."""
    buf = _StatFs()
    if _libc().statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        _raise(path)
    return buf.f_type & 0xFFFFFFFF


def prctl(option: int, arg) -> int:
    """prctl(2) with one argument; raises OSError on failure."""
    rc = _libc().prctl(option, arg, 0, 0, 0)
    if rc != 0:
        _raise()
    return rc


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper (PR_GET_CHILD_SUBREAPER)."""
    value = ctypes.c_int(0)
    prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value))
    return bool(value.value)


def set_child_subreaper(on: bool) -> None:
    """Make this process a child subreaper, or stop being one (PR_SET_CHILD_SUBREAPER)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0)


CLONE_NEWNET = 0x40000000  # sched.h


def unshare(flags: int) -> None:
    """unshare(2) for the calling thread (a network namespace is per thread); raises OSError."""
    if _libc().unshare(flags) != 0:
        _raise()


def setns(fd: int, nstype: int) -> None:
    """setns(2) of the calling thread into the namespace `fd` refers to; raises OSError."""
    if _libc().setns(fd, nstype) != 0:
        _raise()
