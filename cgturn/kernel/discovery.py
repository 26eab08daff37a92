"""Host discovery: where cgroup v2 is mounted, where the caller sits, what the managed root can do.

Read-only, always: nothing here creates, writes or moves anything, so `ps`, `doctor` and the other
read-only commands leave no trace and never race a gateway's `begin_turn`. A capability that cannot be
seen without writing (cgroup.kill where no cgroup of the mount can be looked at) stays unknown (None)
until the first real kill decides it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import CgturnError
from . import parsers, procfs, systemd, userscope
from .cgroupfs import CONTROLLERS_FILE, KILL_FILE, PROCS_FILE, Cgroup, child_entries, is_cgroup2

# Where distributions mount cgroup2: unified hierarchy at /sys/fs/cgroup, hybrid at .../unified.
CANDIDATE_MOUNTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
MANAGED_ROOT_NAME = "cgturn"


@dataclass
class HostInfo:
    """What discovery found. `problems` says, in words, why anything is unusable."""

    cgroup2_mount: str | None = None
    own_cgroup: str | None = None          # the caller's cgroup as a path on the mount (absolute)
    managed_root: str | None = None
    root_exists: bool = False
    writable: bool = False
    cgroup_kill: bool | None = None       # None: unknown until the first real kill
    root_explicit: bool = False            # the root was asked for (argument or CGTURN_ROOT)
    controllers: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # systemd's mark on the unit whose cgroup holds the managed root (True: Delegate=yes; False:
    # a unit's cgroup without the mark; None: no systemd unit above it, or systemd is not the init)
    delegated: bool | None = None
    systemd_scope: userscope.ScopePlan | None = None   # the managed root is in cgturn's scope

    @property
    def usable(self) -> bool:
        return self.cgroup2_mount is not None and self.managed_root is not None and self.writable


def cgroup_mount_points() -> list[str]:
    """Where this process sees a cgroup filesystem mounted (cgroup2 and v1 hierarchies), deduplicated
    in mount order. Raises CgturnError when /proc/self/mountinfo cannot be read."""
    text = procfs.DEFAULT.read("self", "mountinfo").decode("utf-8", "replace")
    return list(dict.fromkeys(parsers.parse_mountinfo_cgroup_points(text)))


def find_cgroup2_mount(env: dict[str, str] | None = None) -> tuple[str | None, str | None]:
    """The cgroup2 mount point and the fs root it shows; (None, None) when there is none.

    `CGTURN_CGROUP2_MOUNT` wins; else the first cgroup2 mount in /proc/self/mountinfo, preferring
    the usual places.
    """
    env = dict(os.environ) if env is None else env
    forced = env.get("CGTURN_CGROUP2_MOUNT")
    if forced:
        return (forced, "/") if is_cgroup2(forced) else (None, None)
    try:
        mounts = parsers.parse_mountinfo_cgroup2(procfs.DEFAULT.read("self", "mountinfo").decode("utf-8", "replace"))
    except CgturnError:
        return None, None
    # A cgroup2 mount hidden under a later mount (tmpfs over /sys/fs/cgroup) is still listed in
    # mountinfo; statfs tells whether the path really shows cgroup2 now.
    mounts = [(point, fsroot) for point, fsroot in mounts if is_cgroup2(point)]
    for candidate in CANDIDATE_MOUNTS:
        for point, fsroot in mounts:
            if point == candidate:
                return point, fsroot
    return mounts[0] if mounts else (None, None)


def own_cgroup_dir(mount: str, fsroot: str, proc_cgroup_text: str | None = None) -> str | None:
    """The caller's cgroup as a directory under `mount`; None when it is not visible there.

    /proc/self/cgroup gives the path relative to our cgroup namespace root; the mount shows the
    filesystem from `fsroot`. A path outside that view (`/..` prefix) is not reachable.
    """
    if proc_cgroup_text is None:
        proc_cgroup_text = procfs.DEFAULT.read("self", "cgroup").decode("utf-8", "replace")
    rel = parsers.parse_proc_cgroup(proc_cgroup_text)
    if rel is None or rel.startswith("/.."):
        return None
    rel = rel.removesuffix(" (deleted)")
    if fsroot not in ("/", "") and (rel == fsroot or rel.startswith(fsroot + "/")):
        rel = rel[len(fsroot):] or "/"
    return os.path.normpath(os.path.join(mount, rel.lstrip("/")))


def discover(root: str | None = None, env: dict[str, str] | None = None) -> HostInfo:
    """Find the cgroup2 mount, the caller's cgroup and the managed root, and judge them usable.

    Args:
        root: the managed root asked for (else `CGTURN_ROOT`, else `<own cgroup>/cgturn`).
    """
    env = dict(os.environ) if env is None else env
    info = HostInfo()
    mount, fsroot = find_cgroup2_mount(env)
    if mount is None:
        info.problems.append("no cgroup2 filesystem is mounted (looked in /proc/self/mountinfo)")
        return info
    info.cgroup2_mount = mount
    info.own_cgroup = own_cgroup_dir(mount, fsroot or "/")
    if info.own_cgroup is None:
        info.problems.append("the caller's cgroup is not visible under the cgroup2 mount")

    root = root or env.get("CGTURN_ROOT") or None
    info.root_explicit = root is not None
    if root is None:
        if info.own_cgroup is None:
            return info
        joined = userscope.joined_plan(info.own_cgroup, lambda path: own_cgroup_dir(mount, fsroot or "/", f"0::{path}\n"))
        if joined is not None:  # a process that joined cgturn's scope: its managed root, not one of its own
            return _in_scope(info, joined, mount)
        root = os.path.join(info.own_cgroup, MANAGED_ROOT_NAME)
    if info.root_explicit:
        pending = userscope.pending_plan(root, info.own_cgroup,
                                         lambda path: own_cgroup_dir(mount, fsroot or "/", f"0::{path}\n"), env)
        if pending is not None:  # cgturn's scope, which the first turn makes
            return _in_scope(info, pending, mount)
    problem = check_root_path(root, mount)
    if problem:
        info.problems.append(problem)
        return info
    info.managed_root = root
    info.root_exists = os.path.isfile(os.path.join(root, PROCS_FILE))
    parent = os.path.dirname(root)
    target = root if info.root_exists else parent
    info.writable = os.access(target, os.W_OK | os.X_OK)
    if not info.writable:
        read_only = _read_only(target)
        problem = (f"{target} is not writable ({'read-only filesystem' if read_only else 'no write permission'}): "
                   "run as root or in a delegated subtree")
        if not info.root_explicit and info.own_cgroup is not None and not read_only:
            scope, why = userscope.plan(lambda path: own_cgroup_dir(mount, fsroot or "/", f"0::{path}\n"),
                                        info.own_cgroup, env)
            if scope is not None:
                return _in_scope(info, scope, mount)
            problem += f"; no delegated systemd scope either: {why}"
        info.problems.append(problem)
    info.delegated = unit_delegation(parent, mount)
    try:
        info.controllers = parsers.parse_controllers(Cgroup(target).read(CONTROLLERS_FILE))
    except Exception:  # noqa: BLE001 - informational only
        info.controllers = []
    info.cgroup_kill = cgroup_kill_support(root, mount)
    if info.cgroup_kill is False:
        info.problems.append("cgroup.kill not found (Linux < 5.14?): abandon uses freeze + kill")
    return info


def _in_scope(info: HostInfo, scope: userscope.ScopePlan, mount: str) -> HostInfo:
    """`info` for a managed root in cgturn's delegated scope (userscope.py), made or yet to be made.

    Before the scope exists, its controllers are those its slice hands down (the slice's
    subtree_control); the first turn makes it (userscope.join) and may write it from then on."""
    info.systemd_scope = scope
    info.managed_root = root = scope.managed_root
    info.root_exists = os.path.isfile(os.path.join(root, PROCS_FILE))
    info.delegated = True
    if scope.exists:
        target = root if info.root_exists else scope.cgroup
        info.writable = os.access(target, os.W_OK | os.X_OK)
        if not info.writable:
            info.problems.append(f"{target} in {scope.unit} is not writable: it is not this user's")
        source = os.path.join(scope.cgroup, CONTROLLERS_FILE)
    else:
        info.writable = True  # delegated to the caller the moment it is made
        source = os.path.join(os.path.dirname(scope.cgroup), "cgroup.subtree_control")
    try:
        with open(source) as f:
            info.controllers = parsers.parse_controllers(f.read())
    except OSError:
        info.controllers = []
    info.cgroup_kill = cgroup_kill_support(root, mount)
    return info


def unit_delegation(path: str, mount: str) -> bool | None:
    """systemd's delegation mark on the nearest systemd unit's cgroup at or above `path` (a
    `.service` or `.scope` directory); None when systemd is not the init or no unit is above it."""
    if not systemd.systemd_booted():
        return None
    mount = os.path.normpath(mount)
    path = os.path.normpath(path)
    while path.startswith(mount + "/"):
        if path.endswith((".service", ".scope")):
            return bool(systemd.delegation_mark(path))
        path = os.path.dirname(path)
    return None


def check_root_path(root: str, mount: str) -> str | None:
    """Why `root` cannot be a managed root, or None when it can (absolute, strictly below the mount)."""
    if not os.path.isabs(root):
        return f"managed root {root!r} is not an absolute path"
    norm = os.path.normpath(root)
    mount = os.path.normpath(mount)
    if norm == mount or not norm.startswith(mount + "/"):
        return f"managed root {root!r} is not strictly below the cgroup2 mount {mount}"
    if not os.path.isdir(os.path.dirname(norm)):
        return f"the parent of managed root {root!r} does not exist"
    return None


def cgroup_kill_support(root: str, mount: str) -> bool | None:
    """Whether cgroup.kill (5.14+) exists for cgroups at `root`, decided by looking, never writing.

    The mount root never has the file, so the answer comes from the nearest existing non-root
    cgroup: the managed root, its parent, or any cgroup directly below the mount. None when no such
    cgroup exists to look at (unknown until the first kill).
    """
    mount = os.path.normpath(mount)
    for path in (root, os.path.dirname(os.path.normpath(root))):
        if os.path.normpath(path) != mount and os.path.isfile(os.path.join(path, PROCS_FILE)):
            return os.path.exists(os.path.join(path, KILL_FILE))
    for name, _ in child_entries(mount):
        return os.path.exists(os.path.join(mount, name, KILL_FILE))
    return None


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
