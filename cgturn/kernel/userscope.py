"""cgturn's delegated systemd scope: finding it (read-only) and joining it (the caller moves in).

Where the caller's own cgroup is not writable and a systemd manager for the caller's user answers
(kernel/systemd.py), the managed root lives in one well-known transient scope per manager, so per
user: `cgturn.scope` in the user's `app.slice` (root: the system manager's `system.slice`). Its
layout, all of it below the delegated scope and so the user's to write:

    cgturn.scope/          Delegate=yes: its cgroup.subtree_control is written here (delegated)
      owners/              the processes that own turns (the no-internal-processes rule keeps
                           them out of the scope itself once controllers are enabled)
      cgturn/              the managed root: <task>/<turn>

`plan()` only looks: it asks the manager where the scope is (GetUnit, the manager's ControlGroup),
which creates nothing, so `ps`, `stop` and `reap` from another login session find the same managed
root. `join()` is for a process about to own turns: it makes the scope with itself as its process
(StartTransientUnit), or, when the scope exists, asks the manager to move it into `owners`
(AttachProcessesToUnit: a move across the root-owned session cgroup that only the manager can make).
The scope goes when its last process exits; the user manager stops it, with everything in it, when
it stops itself: at the end of the user's last session unless the user lingers (loginctl(1)
enable-linger).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from ..errors import CgroupUnavailable, CgturnError
from . import parsers, procfs, systemd
from .cgroupfs import CONTROLLERS_FILE, Cgroup

log = logging.getLogger("cgturn")
SUBTREE_CONTROL = "cgroup.subtree_control"
ROOT_NAME = "cgturn"


@dataclass
class ScopePlan:
    """Where cgturn's scope is, or will be once a turn begins. `cgroup` is a directory on the mount."""

    manager: str                  # "user" or "system"
    socket: str                   # the manager's bus
    unit: str
    cgroup: str
    exists: bool
    caller_inside: bool           # the caller's own cgroup is in the scope already
    # a cgroup path as /proc/PID/cgroup names it -> its directory on the mount (None: not visible)
    to_mount: Callable[[str], str | None] = field(repr=False, compare=False, default=lambda path: None)

    @property
    def managed_root(self) -> str:
        return os.path.join(self.cgroup, ROOT_NAME)

    @property
    def owners(self) -> str:
        return os.path.join(self.cgroup, systemd.OWNERS_LEAF)

    def to_json(self) -> dict:
        return {"manager": self.manager, "unit": self.unit, "cgroup": self.cgroup, "exists": self.exists,
                "caller_inside": self.caller_inside, "moves_caller": not self.caller_inside,
                "owners": self.owners}


def plan(to_mount: Callable[[str], str | None], own_cgroup: str | None,
         env: dict[str, str]) -> tuple[ScopePlan | None, str]:
    """Where cgturn's delegated scope is (or would be made), asking the manager without creating anything.

    Args:
        to_mount: maps a cgroup path as the kernel names it (/proc/PID/cgroup) to its directory on
            the cgroup2 mount, None when the mount does not show it.
        own_cgroup: the caller's cgroup directory on the mount (None when not visible).
        env: the caller's environment (XDG_RUNTIME_DIR).

    Returns:
        (the plan, "") or (None, why no scope can be had).
    """
    address, why = systemd.manager_address(os.geteuid(), env)
    if address is None:
        return None, why
    try:
        with systemd.Manager(address) as manager:
            found = manager.unit_control_group(systemd.SCOPE_UNIT)
            where = found or _join_path(manager.control_group(), address.slice, systemd.SCOPE_UNIT)
    except CgroupUnavailable as err:
        return None, str(err)
    cgroup = to_mount(where)
    if cgroup is None:
        return None, f"the systemd {address.kind} manager's cgroup {where} is not visible under the cgroup2 mount"
    exists = found is not None and os.path.isdir(cgroup)
    inside = own_cgroup is not None and _below(own_cgroup, cgroup)
    return ScopePlan(address.kind, address.socket, systemd.SCOPE_UNIT, cgroup, exists, inside, to_mount), ""


def joined_plan(own_cgroup: str, to_mount: Callable[[str], str | None]) -> ScopePlan | None:
    """The plan of the scope whose `owners` leaf the caller is in (it joined before), read from the
    path alone; None when `own_cgroup` is not such a leaf."""
    scope = os.path.dirname(own_cgroup)
    if os.path.basename(own_cgroup) != systemd.OWNERS_LEAF or os.path.basename(scope) != systemd.SCOPE_UNIT:
        return None
    kind = "system" if os.geteuid() == 0 else "user"
    return ScopePlan(kind, "", systemd.SCOPE_UNIT, scope, exists=True, caller_inside=True, to_mount=to_mount)


def pending_plan(root: str, own_cgroup: str | None, to_mount: Callable[[str], str | None],
                 env: dict[str, str]) -> ScopePlan | None:
    """The plan for an explicitly given managed root `<…>/cgturn.scope/cgturn` whose scope is not made
    yet (the sentinel of a `cgturn run` gets the root before the first turn makes the scope); None
    for any other root, or when no manager is reachable. Asks the manager nothing."""
    scope = os.path.dirname(os.path.normpath(root))
    if os.path.basename(root) != ROOT_NAME or os.path.basename(scope) != systemd.SCOPE_UNIT or os.path.isdir(scope):
        return None
    address, _ = systemd.manager_address(os.geteuid(), env)
    if address is None:
        return None
    inside = own_cgroup is not None and _below(own_cgroup, scope)
    return ScopePlan(address.kind, address.socket, systemd.SCOPE_UNIT, scope, False, inside, to_mount)


def join(scope: ScopePlan) -> bool:
    """Put the caller into the scope's `owners` leaf, making the scope first when there is none.

    Enables in the scope's subtree every controller the manager gave it (the scope is delegated, so
    its cgroup.subtree_control is the caller's to write). The caller's whole process moves (all its
    threads: cgroup v2 moves thread groups); its children started before stay where they were.

    Returns:
        True when the caller moved; False when it was in the scope already.

    Raises:
        CgroupUnavailable: the manager refused, or the scope is not where the plan said.
    """
    pid = os.getpid()
    if _inside(scope, scope.cgroup):
        return False
    address = systemd.ManagerAddress(scope.manager, scope.socket)
    with systemd.Manager(address) as manager:
        for _ in range(3):  # a scope that was just going (its last process exited) is made again
            if manager.start_delegated_scope(scope.unit, pid, "cgturn: turns of this user (Delegate=yes)"):
                _settle(scope)
                break
            try:
                manager.attach(scope.unit, "/" + systemd.OWNERS_LEAF, pid)
                break
            except systemd.ManagerError as err:
                if err.name not in ("org.freedesktop.systemd1.NoSuchUnit", "org.freedesktop.systemd1.UnitInactive"):
                    raise
        else:
            raise CgroupUnavailable(f"{scope.unit} kept appearing and going while the caller joined it")
    if not _inside(scope, scope.owners):
        raise CgroupUnavailable(f"after joining {scope.unit} the caller is in {procfs.cgroup_of('self')!r}, "
                                f"not in {scope.owners}")
    scope.exists = scope.caller_inside = True
    return True


def _settle(scope: ScopePlan) -> None:
    """The caller made the scope and sits in it: move into `owners`, enable the delegated controllers."""
    root = Cgroup(scope.cgroup)
    if not root.exists():
        raise CgroupUnavailable(f"the new {scope.unit} is not at {scope.cgroup} (its Slice= was changed?)")
    owners = root.child(systemd.OWNERS_LEAF)
    owners.create()
    owners.move_in(os.getpid())  # the common ancestor is the scope: delegated, so the caller's
    try:
        given = parsers.parse_controllers(root.read(CONTROLLERS_FILE))
        if given:
            root.write(SUBTREE_CONTROL, " ".join(f"+{name}" for name in given))
    except CgturnError as err:  # limits then report what is missing; ownership still works
        log.warning("cannot enable the controllers of %s: %s", scope.cgroup, err)


def _inside(scope: ScopePlan, cgroup: str) -> bool:
    """Whether the caller's cgroup, now, is `cgroup` or below it."""
    own = procfs.cgroup_of("self")
    where = scope.to_mount(own) if own else None
    return where is not None and _below(where, cgroup)


def _below(path: str, ancestor: str) -> bool:
    return (os.path.normpath(path) + "/").startswith(os.path.normpath(ancestor) + "/")


def _join_path(*parts: str) -> str:
    return "/" + "/".join(p.strip("/") for p in parts if p.strip("/"))
