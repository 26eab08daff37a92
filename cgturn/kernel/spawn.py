"""Start a process directly in a cgroup: a real `subprocess.Popen` whose child is cloned into the cgroup
(clone3 with CLONE_INTO_CGROUP, Linux 5.7+) by the C extension `cgturn._spawn`.

`CgroupPopen` overrides only `Popen._execute_child`, as CPython's own posix_spawn path does: Popen
prepares the pipes and fds, the extension clones (CLONE_VFORK | CLONE_VM, the child on its own stack,
async-signal-safe code only, so threads are safe: no Python runs in the child), and exec failures
come back through a CLOEXEC pipe in _posixsubprocess's format and are raised as Popen raises them.

`spawn_into` holds a shared flock(2) on the cgroup directory across the caller's state check and the
clone; whoever marks the cgroup's owner as finished takes the same lock exclusively, so a clone can
never follow the mark (a clone that precedes it is in the cgroup when the kill comes). The wait for
it is bounded (dirlock.LOCK_WAIT; LockTimeout, nothing started), in the extension too.
"""
from __future__ import annotations

import builtins
import errno
import fcntl
import os
import subprocess
import sys
import threading
from typing import Callable

from ..errors import LockTimeout
from . import dirlock

try:
    import cgturn._spawn as _spawn  # the C extension: kernel I/O, like this module
except ImportError:  # not built (no compiler at install, or not x86_64): the caller uses another way
    _spawn = None  # type: ignore[assignment]  # clone3_built() says which

# clone3 errors that mean "this kernel (or its seccomp filter) cannot clone into a cgroup": clone3 is
# 5.3+, CLONE_INTO_CGROUP 5.7+ (EINVAL before), and container seccomp profiles answer ENOSYS or EPERM.
UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.E2BIG, errno.EPERM})


class CloneUnsupported(OSError):
    """clone3(CLONE_INTO_CGROUP) is refused by this kernel: nothing was started."""


class CgroupJoinError(OSError):
    """The child could not join a v1 cgroup (its cgroup.procs write failed); it exited 255 unexecuted."""


# _posixsubprocess refuses fds outside 0..INT_MAX (a C int) with this ValueError; the extension
# would cut a larger one to an int (2**32 + 1 became fd 1) and fail on a negative one with EBADF.
_FD_MAX = 2 ** 31 - 1


def fds_to_keep(pass_fds) -> tuple[int, ...]:
    """`pass_fds` as the sorted fds a child keeps, checked as Popen checks them.

    Raises:
        ValueError: an fd below 0 or above INT_MAX ("bad value(s) in fds_to_keep", Popen's words),
            or a value int() refuses.
    """
    keep = tuple(sorted(map(int, set(pass_fds)))) if pass_fds else ()
    if keep and (keep[0] < 0 or keep[-1] > _FD_MAX):
        raise ValueError("bad value(s) in fds_to_keep")
    return keep


def clone3_built() -> bool:
    """True when the C extension is importable."""
    return _spawn is not None


# Directory fds whose shared lock is in flight. A child forked meanwhile (os.fork in another thread)
# would share the lock through its copy of the fd and hold off every exclusive locker for as long as
# it lives: it closes its copies at once (closing, not unlocking, which would release ours too).
_inflight: set[int] = set()
_inflight_lock = threading.Lock()


def _close_inflight_in_child() -> None:
    global _inflight_lock
    _inflight_lock = threading.Lock()  # held by the forking thread in the parent; only we exist here
    for fd in _inflight:
        try:
            os.close(fd)
        except OSError:
            pass
    _inflight.clear()


os.register_at_fork(before=lambda: _inflight_lock.acquire(), after_in_parent=lambda: _inflight_lock.release(),
                    after_in_child=_close_inflight_in_child)


def environment_entries(extra: dict[str, str]) -> tuple[bytes, ...]:
    """`extra` as the KEY=VALUE bytes CgroupPopen adds to a child's environment."""
    return tuple(os.fsencode(k) + b"=" + os.fsencode(v) for k, v in extra.items())


def spawn_if_unchanged(cgroup_dir: str, key: bytes, expected: bytes, v1_procs: list[str], argv,
                       extra_env: tuple[bytes, ...], popen_kwargs: dict) -> "CgroupPopen | None":
    """Start `argv` (Popen kwargs `popen_kwargs`, environment plus `extra_env`: KEY=VALUE bytes) in
    the cgroup `cgroup_dir`, and in the v1 cgroups whose cgroup.procs files are `v1_procs`, before it
    runs, if the directory's xattr `key` holds exactly `expected` under a shared flock on it, held
    until the child has exec'd (all of it in the extension, without the GIL).

    Returns None, starting nothing, when the xattr differs (or is absent).
    Raises: as `spawn_into` (LockTimeout: the extension waited 2 s for the shared lock).
    """
    target = (cgroup_dir, key, expected)
    try:
        if not v1_procs:
            return CgroupPopen(argv, cgroup=target, extra_env=extra_env, **popen_kwargs)
        return _with_joins(v1_procs, lambda join: CgroupPopen(
            argv, cgroup=target, join_fds=join, extra_env=extra_env, **popen_kwargs))
    except _Changed:
        return None


def spawn_into(cgroup_dir: str, v1_procs: list[str], may_spawn: Callable[[int], bool], argv,
               extra_env: tuple[bytes, ...], popen_kwargs: dict, popen=None) -> "subprocess.Popen | None":
    """Start `argv` (Popen kwargs `popen_kwargs`, environment plus `extra_env`: KEY=VALUE bytes) in
    the cgroup `cgroup_dir`, and in the v1 cgroups whose cgroup.procs files are `v1_procs`, before it runs.

    `may_spawn(fd)` is asked with `fd` open on `cgroup_dir` (for reads relative to it) under a shared
    flock on it, held until the child has exec'd. `popen`: the Popen class that starts it, called
    with `cgroup=fd`, `join_fds` and `extra_env` (default CgroupPopen; kernel/posix_spawn.py has the
    C library's).

    Returns None, starting nothing, when `may_spawn()` says no.
    Raises:
        FileNotFoundError: `cgroup_dir` (or a v1 directory) is gone.
        LockTimeout: another process held the directory's lock exclusively for dirlock.LOCK_WAIT.
        CloneUnsupported: the kernel refuses clone3 into a cgroup (nothing started).
        CgroupJoinError: the child could not join a v1 cgroup.
        OSError: as Popen raises for the target (FileNotFoundError, PermissionError, ...), or the
            clone's own errno (ENODEV: the cgroup was removed meanwhile).
    """
    with _inflight_lock:
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        _inflight.add(fd)
    try:
        if not dirlock.flock_within(fd, fcntl.LOCK_SH, dirlock.LOCK_WAIT):
            raise LockTimeout(cgroup_dir, "spawn into the cgroup", dirlock.LOCK_WAIT)
        if not may_spawn(fd):
            return None
        return _with_joins(v1_procs, lambda join: (popen or CgroupPopen)(
            argv, cgroup=fd, join_fds=join, extra_env=extra_env, **popen_kwargs))
    finally:
        with _inflight_lock:
            _inflight.discard(fd)
            os.close(fd)


def _with_joins(v1_procs: list[str], start: Callable[[list[int]], "CgroupPopen"]) -> "CgroupPopen":
    """start(fds of the open v1 cgroup.procs files), closing them after."""
    join: list[int] = []
    try:
        for path in v1_procs:
            join.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
        return start(join)
    finally:
        for jfd in join:
            os.close(jfd)


class _Changed(Exception):
    """A checked spawn found the xattr changed: nothing was started (Popen has closed its pipes)."""


class CgroupPopen(subprocess.Popen):
    """A subprocess.Popen whose child starts in a cgroup, its environment (inherited, or `env=`) plus
    `extra_env` (KEY=VALUE bytes, which win). `cgroup`: an open cgroup directory fd, or (path, xattr
    key, expected value) for a checked spawn (see `spawn_if_unchanged`).
    Options it cannot honour (preexec_fn, user, group, extra_groups) raise ValueError."""

    def __init__(self, args, *, cgroup, join_fds=(), extra_env: tuple[bytes, ...] = (), seal: tuple | None = None,
                 **kwargs):
        # seal: a sealed turn's sandbox, built by the extension's child (backends/seal.py, native)
        self._cgroup, self._join_fds, self._extra_env, self._seal = cgroup, tuple(join_fds), extra_env, seal
        fds_to_keep(kwargs.get("pass_fds", ()))  # refused before Popen makes a pipe, as Popen refuses them
        super().__init__(args, **kwargs)

    def _get_handles(self, stdin, stdout, stderr):
        """Popen's _get_handles. With no stream given (the usual spawn) it opens nothing and returns
        six -1s, but still enters a @contextmanager meant to close what it opened on error (0.8 us in a
        loop here, more right after a clone): skipped for that case."""
        if stdin is None and stdout is None and stderr is None:
            return -1, -1, -1, -1, -1, -1
        return super()._get_handles(stdin, stdout, stderr)  # type: ignore[misc]  # Popen's own

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        if preexec_fn is not None or gid is not None or gids is not None or uid is not None:
            raise ValueError("CgroupPopen cannot honour preexec_fn, user, group or extra_groups")
        args, executable = child_argv(args, executable, shell)
        sys.audit("subprocess.Popen", executable, args, cwd, env)
        env_list = None if env is None else _env_list(env)  # the extension adds extra_env
        program = os.fsencode(executable)
        executable_list: tuple[bytes, ...]
        if b"/" in program:  # what Popen's os.path.dirname(program) tests, without the call
            executable_list = (program,)
        else:  # resolved in the child along PATH, as Popen does (os._execvpe's order)
            executable_list = tuple(os.path.join(os.fsencode(d), program) for d in os.get_exec_path(env))
        keep = fds_to_keep(pass_fds)
        try:
            started = _spawn.spawn(
                args, executable_list, close_fds, keep,
                None if cwd is None else os.fsencode(cwd), env_list, self._extra_env,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                restore_signals, start_new_session, process_group, umask, self._cgroup, self._join_fds, self._seal)
        except OSError as err:
            if err.errno in UNSUPPORTED and err.filename is None:
                raise CloneUnsupported(err.errno, f"clone3(CLONE_INTO_CGROUP): {err.strerror}") from None
            if err.errno == errno.ETIMEDOUT and isinstance(self._cgroup, tuple):
                # the extension's bounded wait for the checked spawn's shared lock (2 s, as dirlock's)
                raise LockTimeout(self._cgroup[0], "spawn into the cgroup", dirlock.LOCK_WAIT) from None
            raise
        if started is None:
            raise _Changed()
        # the pid, or (pid, what the child reported before it exited unexecuted)
        report = None
        if isinstance(started, tuple):
            self.pid, report = started
        else:
            self.pid = started
        self._child_created = True
        self._close_child_ends(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if report:
            self._raise_child_error(report, executable, cwd)

    def _close_child_ends(self, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite) -> None:
        """Popen's _close_pipe_fds, which closes the child's ends of the pipes Popen made and its
        DEVNULL fd; with neither (no PIPE, no DEVNULL: the usual spawn) all it does is set the flag,
        so that is done here without its contextlib.ExitStack (0.5 us in a loop here)."""
        if p2cwrite == c2pread == errread == -1 and not hasattr(self, "_devnull"):
            self._closed_child_pipe_fds = True
        else:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]  # Popen's own

    def _raise_child_error(self, data: bytes, executable, cwd) -> None:
        """Reap the failed child and raise what it reported, as Popen does."""
        try:
            pid, status = os.waitpid(self.pid, 0)
            if pid == self.pid:
                self._handle_exitstatus(status)  # type: ignore[attr-defined]  # Popen's own
            else:
                self.returncode = sys.maxsize
        except ChildProcessError:
            pass
        try:
            name, hex_errno, raw_stage = data.split(b":", 2)
            err = int(hex_errno, 16)
            kind = getattr(builtins, name.decode("ascii"))
        except (ValueError, AttributeError, UnicodeDecodeError):
            raise subprocess.SubprocessError(f"bad exception data from child: {data!r}") from None
        stage = raw_stage.decode()
        message = os.strerror(err) if err else ""
        if stage == "noexec:cgroup":
            raise CgroupJoinError(err, f"joining a v1 cgroup: {message}")
        if stage == "noexec:chdir":
            raise kind(err, message, cwd)
        raise kind(err, message, None if stage == "noexec" else executable)


def child_argv(args, executable, shell: bool) -> tuple[list, object]:
    """(argv, program) as Popen's POSIX _execute_child makes them from its arguments."""
    args = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if shell:
        args = ["/bin/sh", "-c", *args]
        if executable:
            args[0] = executable
    return args, args[0] if executable is None else executable


def _env_list(env) -> list[bytes]:
    """An `env=` mapping as KEY=VALUE bytes, checked as Popen checks it."""
    out = []
    for k, v in env.items():
        k = os.fsencode(k)
        if b"=" in k:
            raise ValueError("illegal environment variable name")
        out.append(k + b"=" + os.fsencode(v))
    return out
