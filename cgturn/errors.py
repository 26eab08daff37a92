"""The one exception hierarchy cgturn raises, and `translate`, which maps an OSError from cgroupfs
into it (an OSError from /proc is mapped by cgturn.kernel.procfs, which tells "gone", NoSuchProcess,
from "can't look", AccessDenied).

Callers catch `CgturnError` for anything cgturn-specific and a subclass for the cases they handle.
Invalid ids raise the builtin `ValueError`, as any Python API does for a bad argument.
"""
from __future__ import annotations

import errno


class CgturnError(Exception):
    """Base of every error cgturn raises on purpose."""


class CgroupUnavailable(CgturnError):
    """cgroup v2 cannot be used here (not mounted, read-only, not writable, not delegated)."""


class PermissionDenied(CgturnError):
    """The kernel refused an operation for lack of privilege (EACCES/EPERM)."""


class TurnExists(CgturnError):
    """A turn with this id already exists in its task (running, or completed with survivors)."""


class NoSuchTurn(CgturnError):
    """No turn with this task and turn id exists."""


class UnsafeOperation(CgturnError):
    """A kill or freeze was refused because it would hit the caller, or lands outside the managed root."""


class NoSuchProcess(CgturnError):
    """The process does not exist (any more). Carries `pid`."""

    def __init__(self, pid: int, message: str | None = None):
        self.pid = pid
        super().__init__(message or f"no process {pid}")


class AlreadyRunning(CgturnError):
    """A process spawned with this key in the same task is still alive (`Turn.spawn(key=)`).
    Carries `pid` (the live process holding the key) and `key`."""

    def __init__(self, pid: int, key: str, message: str | None = None):
        self.pid, self.key = pid, key
        super().__init__(message or f"key {key!r} is held by process {pid}")


class AccessDenied(PermissionDenied):
    """The process exists, or may, but the caller is not allowed to look at it (EACCES/EPERM under
    /proc, e.g. `hidepid=1`). Never to be taken for "gone". Carries `pid`."""

    def __init__(self, pid: int, message: str | None = None):
        self.pid = pid
        super().__init__(message or f"not allowed to look at process {pid}")


class LimitsUnavailable(CgturnError):
    """A resource limit was asked for that this host (or backend) cannot enforce; nothing was created.
    The message says which limit and why (no controller delegated, a v1-only or v2-only file, ...)."""


class IsolationUnavailable(CgturnError):
    """A turn asked for isolation (`seal`, `network="none"`) or a spawn for another user, and this host
    or backend cannot give it: a namespace the kernel refuses, a missing helper binary (util-linux
    `setpriv`, `unshare`, `nsenter`), or the registry backend. Raised before anything is created or run."""


class RegistryUnavailable(CgturnError):
    """The registry database cannot be opened or written (permissions, corrupt file, full disk)."""


class SentinelUnavailable(CgturnError):
    """The sentinel process did not start: turns are not guarded against the owner's death."""


class Overloaded(CgturnError):
    """Admission refused: the pressure guard of the managed root reported pressure for longer than
    the caller's `admit_timeout`."""


class GuardUnavailable(CgturnError):
    """The pressure guard could not arm its trigger (no PSI file, no permission, the kernel refused),
    or another live guard owns the managed root."""


class InitRefused(CgturnError):
    """`cgturn init` found no proof that it runs as a container's init at its own cgroup-namespace
    root (PID 1, `cgroup.kill` at the root, no process of another PID namespace there, a writable
    cgroupfs); the message names the failed check. Raised before anything is moved or written."""


class LockTimeout(CgturnError):
    """A lock that makes an operation exclusive stayed held by another process for longer than its
    bound, so the operation was not done (a state change, a spawn, a guard's claim): a holder that is
    stopped or wedged, or one of the gateway's own user (locks are closed to every other user). The
    caller may retry. Carries `path` (what is locked), `what` (the operation) and `waited` (seconds)."""

    def __init__(self, path: str, what: str, waited: float):
        self.path, self.what, self.waited = path, what, waited
        super().__init__(f"{what}: the lock on {path} stayed held by another process for {waited:g} s "
                         f"(a holder that is stopped or wedged, or a process of the same user); nothing was done")


class KernelError(CgturnError):
    """A cgroupfs or procfs operation failed in a way the caller cannot handle; carries path and data."""

    def __init__(self, op: str, path: str, err: OSError, data: str | None = None):
        self.op, self.path, self.data, self.errno = op, path, data, err.errno
        detail = f" (data {data!r})" if data is not None else ""
        super().__init__(f"{op} {path}{detail}: {err.strerror or err}")


def translate(op: str, path: str, err: OSError, data: str | None = None) -> CgturnError:
    """Map an OSError from cgroupfs to the cgturn exception a caller can act on.

    Returns the exception; callers `raise translate(...) from err` so the OSError stays attached.
    """
    if err.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"{op} {path}: {err.strerror} (run as root or in a delegated subtree)")
    if err.errno == errno.EROFS:
        return CgroupUnavailable(f"{op} {path}: cgroup filesystem is read-only")
    return KernelError(op, path, err, data)
