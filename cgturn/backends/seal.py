"""A sealed spawn's sandbox: the bubblewrap(1) command that runs between joining the turn and the
target, so that no process of a sealed turn, root included, reaches a cgroup, a limit, a host
setting, a process or a file outside what the turn was given (docs/security.md, issue 21).

bubblewrap is exec'd once the process is in its turn (by the shim after its gate), so it and
everything it starts run inside the turn's cgroups from their first instruction. It builds, in one
process and a fixed order: new PID, mount, cgroup and IPC namespaces (its own small init is PID 1,
reaping; the target is PID 2, so SIGTERM from outside reaches it with its default action), the host's
`/` bound read-only (sysfs, the cgroup mounts and every other mount below it too), a fresh `/proc`
for the PID namespace (its `/proc/sys`, `/proc/sysrq-trigger`, `/proc/irq`, `/proc/bus` bound read-only),
a minimal `/dev`, private `/tmp` and `/run`, the writable paths bound back read-write; then the
capability set KEPT_CAPS, no_new_privs and the syscall filter (seal_filter.py), then exec.

Why bubblewrap rather than our own plumbing: it is a small, audited C program (Flatpak's sandbox)
that does exactly this sequence, and what it does not do (the user's ids) is one setpriv(1) after it.
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


def command(writable: list[str], cwd, identity: Identity | None, filter_fd: int) -> list[str]:
    """The helper command (without the target) that seals the spawn; `filter_fd` is an inherited fd
    holding seal_filter.program(), which bubblewrap reads.

    Raises:
        IsolationUnavailable: bubblewrap (or, for `identity`, setpriv) is not installed.
        ValueError: `identity` keeps uid 0 (a sealed spawn cannot switch groups and stay root).
    """
    args = [helper(BWRAP, "bubblewrap"), "--unshare-pid", "--unshare-cgroup", "--unshare-ipc",
            "--ro-bind", "/", "/", "--proc", sandbox.PROC, *PROC_READ_ONLY,
            "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run"]
    resolv = _resolv_conf_under_run()
    if resolv is not None:  # systemd-resolved's stub: DNS keeps working with a private /run
        args += ["--ro-bind", resolv, resolv]
    base = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
    if _private(base) and not any(base == p or base.startswith(p + "/") for p in writable):
        # the working directory exists in the sandbox, read-only; bound first: bubblewrap binds in order,
        # and a writable path below it must come on top
        args += ["--ro-bind", base, base]
    for path in writable:
        args += ["--bind", path, path]
    caps: tuple[str, ...] = KEPT_CAPS
    if identity is not None:
        if identity.uid == 0:
            raise ValueError("a sealed spawn cannot keep uid 0 and switch groups: give user= a non-root user")
        caps = caps + ID_CAPS
    args += ["--cap-drop", "ALL"]
    for cap in caps:
        args += ["--cap-add", cap]
    args += ["--seccomp", str(filter_fd), "--"]
    if identity is not None:
        args += [helper(SETPRIV), *identity.setpriv_args(), "--"]
    return args


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
