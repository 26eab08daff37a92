"""A sealed spawn's sandbox, described twice: as the `seal=` tuple the C extension's child builds it
from (native(), the clone3 path), and as the bubblewrap(1) command that builds the same sandbox
where the extension cannot (command(): the shim path, a caller without CAP_SYS_ADMIN, Linux < 5.12).
Either way no process of a sealed turn, root included, reaches a cgroup, a limit, a host setting, a
process or a file outside what the turn was given (docs/security.md, issue 21).

The sandbox is built once the process is in its turn, so it and everything it starts run inside the
turn's cgroups from their first instruction. In a fixed order: new PID, mount, cgroup and IPC
namespaces (a small init is PID 1, reaping, and with the extension's sandbox forwarding signals to
the target; the target is PID 2, so SIGTERM from outside reaches it with its default action), the
host's `/` read-only (sysfs, the cgroup mounts and every other mount below it too), a fresh `/proc`
for the PID namespace (its `/proc/sys`, `/proc/sysrq-trigger`, `/proc/irq`, `/proc/bus` bound
read-only), a minimal `/dev`, private `/tmp` and `/run`, the binds of _binds() in order; then the
capability set KEPT_CAPS, no_new_privs and the syscall filter (seal_filter.py), then exec.

Why the extension's own sandbox first: bubblewrap's exec and its per-mount steps were most of what a
seal cost (4-5x a plain turn; docs/security.md has the breakdown), and the child makes the whole tree
read-only in one mount_setattr call. Why bubblewrap behind it: a small, audited C program (Flatpak's
sandbox) doing the same sequence, so the promise never depends on the extension being built.
Why no user namespace (bwrap's `--unshare-user`, `--disable-userns`): a root target would become
root of a namespace that owns none of the host's resources, so binding a port below 1024 on the
host's network, or reading a file of another user, would stop working, and bwrap maps only one uid,
so a `user=` target would run as host root. The seccomp filter refuses new user namespaces instead.
"""
from __future__ import annotations

import functools
import os

from ..errors import IsolationUnavailable
from ..identity import Identity
from ..writable import writable_paths
from ..kernel import sandbox
from . import seal_filter
from .isolation import SETPRIV, helper

BWRAP = "bwrap"

# What a sealed root process keeps (capabilities(7)): files it owns or not (CHOWN, DAC_OVERRIDE,
# FOWNER, FSETID) on the paths it may write, and ports below 1024 (NET_BIND_SERVICE). Docker's
# default keeps 14; of those, SETUID/SETGID (setfsuid into another user's /proc/PID/root, attack 1),
# KILL, MKNOD, NET_RAW, SETFCAP, SETPCAP, SYS_CHROOT and AUDIT_WRITE go too.
KEPT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_NET_BIND_SERVICE")
# A `user=` spawn also keeps these until setpriv(1) has switched its ids: a change from uid 0 to
# non-zero clears the permitted, effective and ambient sets (capabilities(7)), so the target has none.
ID_CAPS = ("CAP_SETUID", "CAP_SETGID")
# /proc/sys first: the one bubblewrap must have (the others may be missing on a kernel without them).
PROC_READ_ONLY = tuple(arg for i, path in enumerate(sandbox.PROC_HOST_STATE)
                       for arg in ("--ro-bind" if i == 0 else "--ro-bind-try", path, path))

def _private(path: str) -> bool:
    return any(path == top or path.startswith(top + "/") for top in ("/tmp", "/run"))


def _working_dir(cwd) -> str:
    """The spawn's working directory as an absolute path (None: this process's)."""
    return os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()


def _binds(writable: list[str], cwd) -> list[tuple[str, bool]]:
    """(path, writable) of every path a sealed spawn binds onto itself, in the order they are bound."""
    binds = []
    resolv = _resolv_conf_under_run()
    if resolv is not None:  # systemd-resolved's stub: DNS keeps working with a private /run
        binds.append((resolv, False))
    base = _working_dir(cwd)
    if _private(base) and not any(base == p or base.startswith(p + "/") for p in writable):
        # the working directory exists in the sandbox, read-only; bound first: binds go in order,
        # and a writable path below it must come on top
        binds.append((base, False))
    binds += [(path, True) for path in writable]
    return binds


def _caps(identity: Identity | None) -> tuple[str, ...]:
    if identity is None:
        return KEPT_CAPS
    if identity.uid == 0:
        raise ValueError("a sealed spawn cannot keep uid 0 and switch groups: give user= a non-root user")
    return KEPT_CAPS + ID_CAPS


def command(writable: list[str], cwd, identity: Identity | None, filter_fd: int) -> list[str]:
    """The bubblewrap helper command (without the target) that seals the spawn; `filter_fd` is an
    inherited fd holding seal_filter.program(), which bubblewrap reads.

    Raises:
        IsolationUnavailable: bubblewrap (or, for `identity`, setpriv) is not installed.
        ValueError: `identity` keeps uid 0 (a sealed spawn cannot switch groups and stay root).
    """
    args = [helper(BWRAP, "bubblewrap"), "--unshare-pid", "--unshare-cgroup", "--unshare-ipc",
            "--ro-bind", "/", "/", "--proc", sandbox.PROC, *PROC_READ_ONLY,
            "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp", "--tmpfs", "/run"]  # --perms: bwrap 0.6
    for path, rw in _binds(writable, cwd):
        args += ["--bind" if rw else "--ro-bind", path, path]
    caps = _caps(identity)
    args += ["--cap-drop", "ALL"]
    for cap in caps:
        args += ["--cap-add", cap]
    args += ["--seccomp", str(filter_fd), "--"]
    if identity is not None:
        args += [helper(SETPRIV), *identity.setpriv_args(), "--"]
    return args


# capabilities(7) numbers (linux/capability.h) of KEPT_CAPS and ID_CAPS, for the native sandbox.
CAP_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_SETGID": 6,
               "CAP_SETUID": 7, "CAP_NET_BIND_SERVICE": 10}
# The flags of each of _binds()'s paths, which the extension's PID 1 binds (see _spawn.c, seal_enter)
# as command() asks bubblewrap to: the same list, in the same order.
_BIND_WRITABLE, _BIND_DIR = 1, 2


def native(writable, cwd, identity: Identity | None, netns_fd: int = -1) -> tuple[tuple, list[str]]:
    """The native sandbox of a sealed spawn: the `seal=` tuple the C extension builds it from (its
    child does what command() asks bubblewrap to, see _spawn.c) and the helper command that still
    runs before the target (setpriv for `identity`, else []).

    Args:
        writable: as Turn.spawn's writable= (None: the working directory).
        cwd: the spawn's working directory (None: this process's).
        identity: the user= target's ids, or None.
        netns_fd: an fd of the turn's network namespace, entered before the target forks; -1: none.

    Raises:
        ValueError: a refused writable path, or an identity that keeps uid 0.
        IsolationUnavailable: setpriv is not installed (for `identity`).
    """
    paths = writable_paths(writable, cwd)
    binds = tuple((os.fsencode(path), (_BIND_WRITABLE if rw else 0) | (_BIND_DIR if os.path.isdir(path) else 0))
                  for path, rw in _binds(paths, cwd))
    mask = 0
    for cap in _caps(identity):
        mask |= 1 << CAP_NUMBERS[cap]
    spec = (binds, _PROC_HOST_STATE, os.fsencode(_working_dir(cwd)), _program(), mask, sandbox.last_capability(), netns_fd)
    prefix = [helper(SETPRIV), *identity.setpriv_args(), "--"] if identity is not None else []
    return spec, prefix


_PROC_HOST_STATE = tuple(os.fsencode(path) for path in sandbox.PROC_HOST_STATE)


def native_works() -> bool:
    """Whether the C extension can build the sandbox here (tried once per process around /bin/true,
    outside any cgroup): it needs the extension, root's CAP_SYS_ADMIN and Linux 5.12+ (mount_setattr);
    where not, sealed spawns exec bubblewrap. False for good once a sealed clone was refused
    (native_refused)."""
    return not _refused and _probe()


_refused = False


def native_refused() -> None:
    """The kernel refused a sealed clone after the probe (the caller lost CAP_SYS_ADMIN, a seccomp
    filter came): sealed spawns exec bubblewrap from now on, and unsealed ones keep clone3."""
    global _refused
    _refused = True


@functools.lru_cache(maxsize=1)
def _probe() -> bool:
    import subprocess

    from ..kernel import spawn as kspawn

    if not kspawn.clone3_built():
        return False
    try:
        spec, _ = native(None, "/", None)
        probe = kspawn.CgroupPopen(["/bin/true"], cgroup=-1, seal=spec, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    except (OSError, ValueError):
        return False
    return probe.wait() == 0


def filter_fd() -> int:
    """A new pipe's read end, inheritable, holding the syscall filter (written whole: it is far below
    a pipe's buffer); the caller passes it to the spawn and closes it."""
    data = _program()
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    os.set_inheritable(read, True)
    return read


@functools.lru_cache(maxsize=1)
def _program() -> bytes:
    return seal_filter.program()


@functools.lru_cache(maxsize=1)
def _resolv_conf_under_run() -> str | None:
    target = os.path.realpath("/etc/resolv.conf")
    return target if target.startswith("/run/") and os.path.exists(target) else None


@functools.lru_cache(maxsize=1)
def check() -> None:
    """Raise IsolationUnavailable unless bubblewrap can seal a process here (tried once per process:
    the seal's own namespaces, mounts and filter around /bin/true)."""
    import subprocess

    fd = filter_fd()
    try:
        argv = [*command([], "/", None, fd), "/bin/true"]
        probe = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, pass_fds=(fd,), cwd="/")
    finally:
        os.close(fd)
    if probe.returncode != 0:
        raise IsolationUnavailable(f"bubblewrap could not seal a process here: {probe.stderr.strip()}")
    native_works()  # decided here too, so that no spawn pays for the probe


def steps(writable, cwd, identity: Identity | None) -> tuple[list[str], int]:
    """The helper command of a sealed spawn (command()) and the filter fd it reads, which the caller
    passes to the spawn (pass_fds) and closes once the spawn started.

    Raises:
        ValueError: a refused writable path, or an identity that keeps uid 0.
        IsolationUnavailable: bubblewrap or setpriv is not installed.
    """
    paths = writable_paths(writable, cwd)
    fd = filter_fd()
    try:
        return command(paths, cwd, identity, fd), fd
    except BaseException:
        os.close(fd)
        raise
