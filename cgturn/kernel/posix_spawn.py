"""Start a process directly in a cgroup through the C library: a real `subprocess.Popen` whose child
glibc's posix_spawn starts in the cgroup (posix_spawnattr_setcgroup_np, glibc 2.39+: clone3 with
CLONE_INTO_CGROUP, CLONE_VM | CLONE_VFORK, the child running only glibc's own code until exec, so it
is safe with threads). For hosts where the C extension `cgturn._spawn` is not built.

`PosixSpawnPopen` is a `CgroupPopen` (kernel/spawn.py) with the C library's `_execute_child`.
posix_spawn cannot do everything Popen can: a request it cannot honour exactly raises `CannotHonour`
before anything is started (Popen closes the pipes it made), and the caller takes another way.
What it cannot honour: preexec_fn, user/group/extra_groups, umask, pass_fds, a standard stream
given as another standard fd (e.g. stdout=2: glibc's dup2 actions would clobber one another, the
condition CPython's own posix_spawn use has), and a program without a `/` looked up along a PATH
other than this process's (posix_spawnp searches the caller's PATH, Popen the `env=` one).
"""
from __future__ import annotations

import errno
import os
import signal
import sys

from . import libc
from .spawn import CgroupPopen, CloneUnsupported, child_argv

# posix_spawn's errnos that are the clone's refusal, never the program's (see _as_popen_error)
REFUSED = frozenset({errno.ENOSYS, errno.EINVAL, errno.E2BIG})


class CannotHonour(Exception):
    """posix_spawn cannot start this request as Popen would: nothing was started."""


def available() -> bool:
    """Whether the C library can posix_spawn into a cgroup (glibc 2.39+)."""
    return libc.has_spawn_cgroup()


class PosixSpawnPopen(CgroupPopen):
    """A subprocess.Popen whose child starts in the cgroup open at `cgroup` (an fd), its environment
    (inherited, or `env=`) plus `extra_env` (KEY=VALUE bytes, which win). See the module doc."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        if self._join_fds:
            raise CannotHonour("joining v1 cgroups")  # the child would have to write cgroup.procs
        if preexec_fn is not None or gid is not None or gids is not None or uid is not None:
            raise CannotHonour("preexec_fn, user, group or extra_groups")
        if umask >= 0 or pass_fds:
            raise CannotHonour("umask or pass_fds")
        if any(fd != -1 and fd <= 2 and fd != target for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))):
            raise CannotHonour("a standard stream given as another standard fd")
        args, executable = child_argv(args, executable, shell)
        program = os.fsencode(executable)
        search = not os.path.dirname(program)
        if search and env is not None and os.get_exec_path(env) != os.get_exec_path():
            raise CannotHonour("a program looked up along the PATH of env=")
        argv = [os.fsencode(a) for a in args]
        envp = _environment(env, self._extra_env)
        # ctypes' c_char_p would end an item at a NUL; Popen refuses it before anything starts.
        if any(b"\0" in item for item in (program, *argv, *envp)):
            raise ValueError("embedded null byte")
        sys.audit("subprocess.Popen", executable, args, cwd, env)
        dup2 = [(fd, target) for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)) if fd != -1]
        default_signals = (signal.SIGPIPE, signal.SIGXFSZ) if restore_signals else ()  # as Popen
        try:
            self.pid = libc.spawn(
                program, argv, envp, search=search, cgroup_fd=self._cgroup,
                dup2=dup2, close_from=3 if close_fds else None, cwd=None if cwd is None else os.fsencode(cwd),
                setsid=bool(start_new_session), pgroup=None if process_group < 0 else process_group,
                default_signals=default_signals)
        except OSError as err:
            raise _as_popen_error(err.errno or 0, executable, cwd) from None
        self._child_created = True
        self._close_child_ends(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def _environment(env, extra: tuple[bytes, ...]) -> list[bytes]:
    """KEY=VALUE bytes: `env` (None: this process's environment) without the names `extra` sets,
    then `extra`; names checked as Popen checks them."""
    names = {item.split(b"=", 1)[0] for item in extra}
    out = []
    for k, v in (os.environb.items() if env is None else env.items()):
        k = os.fsencode(k)
        if b"=" in k:
            raise ValueError("illegal environment variable name")
        if k not in names:
            out.append(k + b"=" + os.fsencode(v))
    out.extend(extra)
    return out


def _as_popen_error(err: int, executable, cwd) -> OSError:
    """What Popen raises for a child that could not start: the exec's error names the program, a
    chdir's the directory. posix_spawn returns only the errno, so a failing chdir is recognised by
    the directory being unusable now. The clone's own errors: ENODEV (the cgroup was removed) names
    nothing; ENOSYS, EINVAL, E2BIG mean the kernel refuses clone3 into a cgroup (glibc has no
    fallback for it): CloneUnsupported."""
    if err in REFUSED:
        return CloneUnsupported(err, f"posix_spawn into a cgroup: {os.strerror(err)}")
    if err == errno.ENODEV:
        return OSError(err, os.strerror(err))
    if cwd is not None and not (os.path.isdir(cwd) and os.access(cwd, os.X_OK)):
        return OSError(err, os.strerror(err), cwd)
    return OSError(err, os.strerror(err), executable)
