"""The one place cgturn calls the C library through ctypes: what the os module does not offer.

- getxattr(2) with a caller-sized buffer (os.getxattr asks twice for any value over 128 bytes);
- statfs(2) for a filesystem's magic number (os.statvfs has no f_type);
- prctl(2) PR_SET/GET_CHILD_SUBREAPER (Linux 3.4+);
- unshare(2) and setns(2) (os has them only from Python 3.12);
- posix_spawn(3) into a cgroup (glibc 2.39+: posix_spawnattr_setcgroup_np), which os.posix_spawn
  cannot ask for.

Every wrapper raises OSError with errno and path, as the os module would (getxattr answers None
where the attribute is absent).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys

_FS_ENCODING = sys.getfilesystemencoding()  # os.fsencode's rules, without its Python-level cost

PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux 3.4+
PR_GET_CHILD_SUBREAPER = 37


# The C library by its soname, never looked up through ctypes.util.find_library: on Linux that runs
# `/sbin/ldconfig -p` (a process per call, a few ms: the larger part of `cgturn run`'s start-up).
# Where the soname is not glibc's (musl names itself libc.so), the symbols of the running process,
# which the interpreter itself links, serve (dlopen(NULL), dlopen(3)).
LIBC_SONAME = "libc.so.6"


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    try:
        libc = ctypes.CDLL(LIBC_SONAME, use_errno=True)
    except OSError:
        libc = ctypes.CDLL(None, use_errno=True)
    libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    libc.getxattr.restype = ctypes.c_ssize_t
    return libc


def _raise(path: str | None = None) -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), path)


@functools.lru_cache(maxsize=8)
def _buffer_type(size: int):
    return ctypes.c_char * size  # one type per size, not one per call (create_string_buffer)


_ABSENT = frozenset({errno.ENODATA, errno.ENOENT})


def getxattr(path: str, key: str, size: int) -> bytes | None:
    """The value of xattr `key` of `path`, read with one `size`-byte buffer; None where the attribute
    or `path` is absent (ENODATA, ENOENT), without an exception to make and catch for the answer
    most reads of a rarely set attribute (a task's or the root's limits) give.

    Raises:
        OSError: any other errno; ERANGE when the value is larger than `size` (the caller then asks
            os.getxattr, which sizes its buffer itself).
    """
    buf = _buffer_type(size)()
    got = _libc().getxattr(path.encode(_FS_ENCODING, "surrogateescape"), key.encode(), buf, size)
    if got < 0:
        if ctypes.get_errno() in _ABSENT:
            return None
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


# <spawn.h> (glibc): flags of posix_spawnattr_setflags. SETSID is 2.26+, SETCGROUP 2.39+ (clone3 with
# CLONE_INTO_CGROUP; glibc does not fall back to clone(2) for it).
POSIX_SPAWN_SETPGROUP = 0x02
POSIX_SPAWN_SETSIGDEF = 0x04
POSIX_SPAWN_SETSID = 0x80
POSIX_SPAWN_SETCGROUP = 0x100
# Room for posix_spawnattr_t (336 bytes on x86_64), posix_spawn_file_actions_t (80) and sigset_t (128):
# opaque to us, initialised and destroyed by the C library.
_ATTR_SIZE, _ACTIONS_SIZE, _SIGSET_SIZE = 512, 256, 128


def has_spawn_cgroup() -> bool:
    """Whether the C library can posix_spawn into a cgroup (posix_spawnattr_setcgroup_np, glibc
    2.39+), with the file actions `spawn` uses (addchdir_np 2.29+, addclosefrom_np 2.34+)."""
    try:
        libc = _libc()
        return all(hasattr(libc, name) for name in (
            "posix_spawnattr_setcgroup_np", "posix_spawn_file_actions_addchdir_np",
            "posix_spawn_file_actions_addclosefrom_np"))
    except OSError:
        return False


def spawn(program: bytes, argv: list[bytes], envp: list[bytes], *, search: bool, cgroup_fd: int | None,
          dup2: list[tuple[int, int]], close_from: int | None, cwd: bytes | None, setsid: bool,
          pgroup: int | None, default_signals: tuple[int, ...]) -> int:
    """posix_spawn(3) (posix_spawnp with `search`: along this process's PATH, in the child) of
    `program` with `argv` and `envp`; the child's pid. In the child, in glibc's order: process group
    or session, signals in `default_signals` to SIG_DFL, then the file actions: each (fd, target) of
    `dup2`, chdir(`cwd`), closefrom(`close_from`); then exec. With `cgroup_fd`, the child starts in
    that cgroup (clone3 CLONE_INTO_CGROUP). glibc's child runs no Python and shares the caller's
    memory until exec (CLONE_VM | CLONE_VFORK); the GIL is released meanwhile.

    Raises:
        OSError: the errno posix_spawn returns, which includes the exec's and the file actions'
            (glibc reaps such a child itself), or the clone's (ENODEV: the cgroup was removed).
    """
    libc = _libc()
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    actions = ctypes.create_string_buffer(_ACTIONS_SIZE)
    _check(libc.posix_spawnattr_init(attr))
    try:
        _check(libc.posix_spawn_file_actions_init(actions))
        try:
            flags = 0
            if default_signals:
                sigset = ctypes.create_string_buffer(_SIGSET_SIZE)
                libc.sigemptyset(sigset)
                for sig in default_signals:
                    libc.sigaddset(sigset, sig)
                _check(libc.posix_spawnattr_setsigdefault(attr, sigset))
                flags |= POSIX_SPAWN_SETSIGDEF
            if setsid:
                flags |= POSIX_SPAWN_SETSID
            if pgroup is not None:
                _check(libc.posix_spawnattr_setpgroup(attr, pgroup))
                flags |= POSIX_SPAWN_SETPGROUP
            if cgroup_fd is not None:
                _check(libc.posix_spawnattr_setcgroup_np(attr, cgroup_fd))
                flags |= POSIX_SPAWN_SETCGROUP
            _check(libc.posix_spawnattr_setflags(attr, ctypes.c_short(flags)))
            for fd, target in dup2:
                _check(libc.posix_spawn_file_actions_adddup2(actions, fd, target))
            if cwd is not None:
                _check(libc.posix_spawn_file_actions_addchdir_np(actions, cwd))
            if close_from is not None:
                _check(libc.posix_spawn_file_actions_addclosefrom_np(actions, close_from))
            c_argv = (ctypes.c_char_p * (len(argv) + 1))(*argv, None)
            c_envp = (ctypes.c_char_p * (len(envp) + 1))(*envp, None)
            pid = ctypes.c_int(0)
            call = libc.posix_spawnp if search else libc.posix_spawn
            _check(call(ctypes.byref(pid), program, actions, attr, c_argv, c_envp))
            return pid.value
        finally:
            libc.posix_spawn_file_actions_destroy(actions)
    finally:
        libc.posix_spawnattr_destroy(attr)


def _check(rc: int) -> None:
    """posix_spawn* return an errno (0 on success) instead of setting errno."""
    if rc != 0:
        raise OSError(rc, os.strerror(rc))
