"""A container's cgroup-namespace root: the proof that it is one, and making it delegate controllers.

`cgturn init` is the one place cgturn moves processes it did not start and writes a
`cgroup.subtree_control` it did not create, so everything here is split in two: `prove()` only reads,
and refuses (`InitRefused`) unless every check passes; `move_into_leaf()` and `enable_controllers()`
act, and are called only with the proof in hand.

The checks, and why each one tells a container's root from a host's:
- the caller is PID 1 of its PID namespace (getpid() is 1, and /proc is that namespace's: /proc/self
  reads "1"), so the processes it may move are the namespace's own;
- its cgroup (/proc/self/cgroup) is the root of its cgroup namespace ("0::/") and a cgroup2 mount
  shows that root (mountinfo root field "/"), so the cgroup it would empty is the namespace's;
- that root has `cgroup.kill` and `cgroup.events`: the real root cgroup has neither
  (Documentation/admin-guide/cgroup-v2.rst, "cgroup.events ... exists on non-root cgroups only"),
  so a namespace that shares the host's root (`unshare --cgroup` from the root) is refused;
- no pid in its `cgroup.procs` reads as 0: the kernel shows a process outside the reader's PID
  namespace as 0 (cgroup-v2.rst, "cgroup.procs"), and such a process is not ours to move;
- the mount is writable (a read-only cgroupfs gives EROFS later, after something moved).
"""
from __future__ import annotations

import dataclasses
import errno
import os

from ..errors import CgturnError, InitRefused
from . import parsers, procfs
from .cgroupfs import CONTROLLERS_FILE, EVENTS_FILE, KILL_FILE, PROCS_FILE, Cgroup, is_cgroup2, read_procs

SUBTREE_CONTROL_FILE = "cgroup.subtree_control"
# The leaf the namespace root's processes move into: the name Docker-in-Docker's entrypoint and
# moby#42331 use, so an operator reading /proc/1/cgroup in a container sees what they expect.
DEFAULT_LEAF = "init"
DEFAULT_MOUNT = "/sys/fs/cgroup"


@dataclasses.dataclass(frozen=True)
class NamespaceRoot:
    """A proven container cgroup-namespace root: `path` is its directory on the cgroup2 mount."""

    path: str


def prove(mount: str = DEFAULT_MOUNT, pid: int | None = None) -> NamespaceRoot:
    """Check, reading only, that the caller is a container's init at its cgroup-namespace root.

    Args:
        mount: where the container's cgroup2 filesystem is mounted.
        pid: the caller's pid as its own namespace sees it (tests pass one; default `os.getpid()`).

    Returns:
        The proven namespace root.

    Raises:
        InitRefused: one check failed; its message says which, in one line. Nothing was written.
    """
    pid = os.getpid() if pid is None else pid
    if pid != 1:
        raise InitRefused(f"not PID 1 of a PID namespace (this process is pid {pid}): "
                          "run `cgturn init` as the container's entrypoint")
    try:
        proc_self = os.readlink("/proc/self")
    except OSError as err:
        raise InitRefused(f"cannot read /proc/self ({err.strerror}): /proc must be mounted") from err
    if proc_self != "1":
        raise InitRefused(f"/proc is not this PID namespace's (/proc/self is {proc_self}, not 1): "
                          "mount a proc filesystem of the container's own")
    if not is_cgroup2(mount):
        raise InitRefused(f"{mount} is not a cgroup2 mount")
    own = parsers.parse_proc_cgroup(procfs.DEFAULT.read("self", "cgroup").decode("utf-8", "replace"))
    if own != "/":
        raise InitRefused(f"this process's cgroup is {own!r}, not the root of its cgroup namespace "
                          "(run the container with a private cgroup namespace)")
    fsroot = _mount_fsroot(mount)
    if fsroot != "/":
        raise InitRefused(f"the cgroup2 mount at {mount} shows {fsroot!r}, not this cgroup namespace's root "
                          "(mount cgroup2 inside the container's namespaces)")
    for name in (KILL_FILE, EVENTS_FILE):
        if not os.path.isfile(os.path.join(mount, name)):
            raise InitRefused(f"{mount} has no {name}: it is the host's root cgroup, not a container's "
                              "cgroup-namespace root (or Linux < 5.14)")
    outsiders = [p for p in read_procs(mount) if p == 0]
    if outsiders:
        raise InitRefused(f"{len(outsiders)} process(es) in {mount}/cgroup.procs are outside this PID namespace "
                          "(read as 0): the namespace root is shared, not the container's own")
    if _read_only(mount) or not os.access(os.path.join(mount, PROCS_FILE), os.W_OK):
        raise InitRefused(f"{mount} is read-only here: give the container a writable cgroupfs "
                          "(docs/containers.md)")
    return NamespaceRoot(os.path.normpath(mount))


def move_into_leaf(root: NamespaceRoot, leaf: str = DEFAULT_LEAF, rounds: int = 100) -> list[int]:
    """Move every process of the namespace root into the child cgroup `leaf` (made if missing).

    A process forked while the move runs may land in the root after it was read: the root is re-read
    until a pass finds it empty, at most `rounds` passes.

    Args:
        root: the proof from `prove()`.
        leaf: the child cgroup's name.
        rounds: how many passes over `cgroup.procs` before giving up.

    Returns:
        The pids moved (a process that exited before its move is left out).

    Raises:
        CgturnError: the leaf cannot be made, a move fails for another reason than the process being
            gone, or the root is still not empty after `rounds` passes.
    """
    top = Cgroup(root.path)
    target = top.child(leaf)
    target.create()
    moved: list[int] = []
    for _ in range(rounds):
        pids = top.procs()
        if not pids:
            return moved
        for pid in pids:
            try:
                target.move_in(pid)
            except CgturnError as err:
                if getattr(err, "errno", None) == errno.ESRCH:  # it exited after the read
                    continue
                raise
            moved.append(pid)
    raise CgturnError(f"{root.path} still holds processes after {rounds} passes moving them to {target.path}")


def enable_controllers(root: NamespaceRoot) -> tuple[list[str], dict[str, str]]:
    """Enable in the namespace root's subtree every controller the container was given.

    Each controller is enabled by its own write, so one the kernel refuses (a threaded subtree, a
    controller the parent enabled only for threads) leaves the others enabled.

    Args:
        root: the proof from `prove()`, after `move_into_leaf()` emptied it.

    Returns:
        (the controllers now enabled, controller -> why the kernel refused it).
    """
    top = Cgroup(root.path)
    given = parsers.parse_controllers(top.read(CONTROLLERS_FILE))
    refused: dict[str, str] = {}
    for name in given:
        try:
            top.write(SUBTREE_CONTROL_FILE, f"+{name}")
        except (CgturnError, OSError) as err:
            refused[name] = str(err)
    enabled = parsers.parse_controllers(top.read(SUBTREE_CONTROL_FILE))
    return enabled, refused


def would_enable(mount: str, own_cgroup: str | None) -> list[str] | None:
    """What `cgturn init` would enable for a caller sitting at a container's namespace root, read only.

    Args:
        mount: the cgroup2 mount point.
        own_cgroup: the caller's cgroup directory on that mount.

    Returns:
        The controllers the root has but does not delegate yet, or None when the caller is not at a
        cgroup-namespace root (the mount's own directory with `cgroup.kill`: never the host's root).
    """
    if own_cgroup is None or os.path.normpath(own_cgroup) != os.path.normpath(mount):
        return None
    if not os.path.isfile(os.path.join(mount, KILL_FILE)):
        return None
    top = Cgroup(mount)
    try:
        given = parsers.parse_controllers(top.read(CONTROLLERS_FILE))
        enabled = set(parsers.parse_controllers(top.read(SUBTREE_CONTROL_FILE)))
    except (CgturnError, OSError):
        return None
    return [name for name in given if name not in enabled]


def _mount_fsroot(mount: str) -> str | None:
    """The fs root the cgroup2 mount at `mount` shows; the last such mount is the visible one."""
    text = procfs.DEFAULT.read("self", "mountinfo").decode("utf-8", "replace")
    found = None
    for point, fsroot in parsers.parse_mountinfo_cgroup2(text):
        if os.path.normpath(point) == os.path.normpath(mount):
            found = fsroot
    return found


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return True
