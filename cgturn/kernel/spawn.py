"""Start a process directly in a cgroup: a real `subprocess.Popen` whose child is cloned into the cgroup
(clone3 with CLONE_INTO_CGROUP, Linux 5.7+) by the C extension `cgturn._spawn`.

`CgroupPopen` overrides only `Popen._execute_child`, as CPython's own posix_spawn path does: Popen
prepares the pipes and fds, the extension clones (CLONE_VFORK | CLONE_VM, the child on its own stack,
async-signal-safe code only, so threads are safe: no Python runs in the child), and exec failures
come back through a CLOEXEC pipe in _posixsubprocess's format and are raised as Popen raises them.

`spawn_into` holds a shared flock(2) on the cgroup directory across the caller's state check and the
clone; whoever marks the cgroup's owner as finished takes the same lock exclusively, so a clone can
never follow the mark (a clone that precedes it is in the cgroup when the kill comes).
"""
from __future__ import annotations

import builtins
import errno
import fcntl
import os
import subprocess
import sys
import threading
from typing import Callable, Iterable

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


def spawn_into(cgroup_dir: str, v1_procs: list[str], may_spawn: Callable[[], bool], argv,
               extra_env: dict[str, str], popen_kwargs: dict) -> "CgroupPopen | None":
    """Start `argv` (Popen kwargs `popen_kwargs`, environment plus `extra_env`) in the cgroup
    `cgroup_dir`, and in the v1 cgroups whose cgroup.procs files are `v1_procs`, before it runs.

    `may_spawn()` is asked under a shared flock on `cgroup_dir`, held until the child has exec'd.

    Returns None, starting nothing, when `may_spawn()` says no.
    Raises:
        FileNotFoundError: `cgroup_dir` (or a v1 directory) is gone.
        CloneUnsupported: the kernel refuses clone3 into a cgroup (nothing started).
        CgroupJoinError: the child could not join a v1 cgroup.
        OSError: as Popen raises for the target (FileNotFoundError, PermissionError, ...), or the
            clone's own errno (ENODEV: the cgroup was removed meanwhile).
    """
    with _inflight_lock:
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        _inflight.add(fd)
    join: list[int] = []
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not may_spawn():
            return None
        for path in v1_procs:
            join.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
        return CgroupPopen(argv, cgroup_fd=fd, join_fds=join, extra_env=extra_env, **popen_kwargs)
    finally:
        for jfd in join:
            os.close(jfd)
        with _inflight_lock:
            _inflight.discard(fd)
            os.close(fd)


class CgroupPopen(subprocess.Popen):
    """A subprocess.Popen whose child starts in the cgroup open at `cgroup_fd` (see the module doc).
    Options it cannot honour (preexec_fn, user, group, extra_groups) raise ValueError."""

    def __init__(self, args, *, cgroup_fd: int, join_fds=(), extra_env: dict[str, str] | None = None, **kwargs):
        self._cgroup_fd, self._join_fds = cgroup_fd, tuple(join_fds)
        self._extra_env = {os.fsencode(k): os.fsencode(v) for k, v in (extra_env or {}).items()}
        super().__init__(args, **kwargs)

    def _env_list(self, env) -> list[bytes]:
        """Popen's environment as KEY=VALUE bytes, with the extra variables (which win)."""
        extra = self._extra_env
        items: Iterable[tuple[bytes, bytes]]
        if env is None:
            items = os.environb.items()
        else:
            items = [(os.fsencode(k), os.fsencode(v)) for k, v in env.items()]
        out = []
        for k, v in items:
            if b"=" in k:
                raise ValueError("illegal environment variable name")
            if k not in extra:
                out.append(k + b"=" + v)
        out.extend(k + b"=" + v for k, v in extra.items())
        return out

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        if preexec_fn is not None or gid is not None or gids is not None or uid is not None:
            raise ValueError("CgroupPopen cannot honour preexec_fn, user, group or extra_groups")
        if isinstance(args, (str, bytes, os.PathLike)):
            args = [args]
        else:
            args = list(args)
        if shell:
            args = ["/bin/sh", "-c", *args]
            if executable:
                args[0] = executable
        if executable is None:
            executable = args[0]
        sys.audit("subprocess.Popen", executable, args, cwd, env)
        orig_executable = executable

        errpipe_read, errpipe_write = os.pipe()
        low = []
        while errpipe_write < 3:  # keep it clear of the standard fds the child arranges
            low.append(errpipe_write)
            errpipe_write = os.dup(errpipe_write)
        for fd in low:
            os.close(fd)
        try:
            try:
                env_list = self._env_list(env) if env is not None or self._extra_env else None
                executable = os.fsencode(executable)
                executable_list: tuple[bytes, ...]
                if os.path.dirname(executable):
                    executable_list = (executable,)
                else:  # resolved in the child along PATH, as Popen does (os._execvpe's order)
                    executable_list = tuple(os.path.join(os.fsencode(d), executable) for d in os.get_exec_path(env))
                keep = tuple(sorted({*map(int, pass_fds), errpipe_write}))
                cwd_bytes = None if cwd is None else os.fsencode(cwd)
                try:
                    self.pid = _spawn.spawn(
                        [os.fsencode(a) for a in args], executable_list, close_fds, keep, cwd_bytes, env_list,
                        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, errpipe_write,
                        restore_signals, start_new_session, process_group, umask, self._cgroup_fd,
                        self._join_fds)
                except OSError as err:
                    if err.errno in UNSUPPORTED:
                        raise CloneUnsupported(err.errno, f"clone3(CLONE_INTO_CGROUP): {err.strerror}") from None
                    raise
                self._child_created = True
            finally:
                os.close(errpipe_write)
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]  # Popen's own
            # CLONE_VFORK: the child has exec'd (the pipe is closed) or failed (it wrote, then exited).
            data = bytearray()
            while True:
                part = os.read(errpipe_read, 50000)
                data += part
                if not part or len(data) > 50000:
                    break
        finally:
            os.close(errpipe_read)
        if data:
            self._raise_child_error(bytes(data), orig_executable, cwd)

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
