"""Where processes are, for the cgroup v2 backend: a /proc/PID/cgroup path placed on the mount the
backend sees, the turn a process is in (this manager's, or another's by its record or environment),
and the caller's own way into a turn and back (`enter`/`leave`).
"""
from __future__ import annotations

import os
from typing import Callable

from ..errors import UnsafeOperation
from ..kernel import procfs
from ..kernel.cgroupfs import Cgroup
from ..kernel.discovery import own_cgroup_dir
from .base import scope_tag
from .metadata import XATTR_KEY


class Placement:
    """Processes on one cgroup2 mount, seen from one managed root.

    Args:
        root: the managed root; its path is this manager's scope.
        mount: where cgroup2 is mounted here.
        fsroot: the root of the mount (a cgroup namespace's), as /proc/self/mountinfo says.
    """

    def __init__(self, root: Cgroup, mount: str, fsroot: str):
        self.root, self.mount, self.fsroot = root, mount, fsroot
        self._home: str | None = None  # where the caller was before its first enter()
        self._home_v1: dict[str, str] = {}  # and in the v1 hierarchies
        self._away_v1 = False  # an enter joined a turn's v1 cgroups: leave takes the caller back there

    def path_on_mount(self, rel: str) -> str | None:
        """Where a /proc/PID/cgroup path lies on our mount; None when outside our view."""
        if not rel:
            return None
        return own_cgroup_dir(self.mount, self.fsroot, f"0::{rel}\n")

    def turn_of(self, pid: int) -> tuple[str, str] | None:
        """(scope, task_key) of the turn `pid` is in: ours by its cgroup, another manager's by the
        record on its directory (or an ancestor's) or by its environment; None when in none."""
        path = self.path_on_mount(procfs.cgroup_of(pid) or "")
        if path is None:
            return None
        root = self.root.path
        if path.startswith(root + "/"):
            return root, path[len(root) + 1:].split("/", 1)[0]
        # Another manager's turn carries a record on its directory (or an ancestor of it).
        while path.startswith(self.mount + "/"):
            if Cgroup(path).get_xattr(XATTR_KEY) is not None:
                task = os.path.dirname(path)
                return os.path.dirname(task), os.path.basename(task)
            path = os.path.dirname(path)
        tag = scope_tag(procfs.environ(pid))
        return tag if tag is not None and tag[0] != root else None

    def enter(self, cg: Cgroup, own_v1_dirs: Callable[[], dict[str, str]], joins_v1: bool = False) -> None:
        """Move the caller into `cg`, first noting where it was (and in which v1 cgroups,
        `own_v1_dirs()`) so `leave` can take it back. `joins_v1`: the caller will join the turn's v1
        cgroups too (the caller does that itself), so `leave` must take it back there as well.

        Raises:
            UnsafeOperation: the caller's own cgroup is not visible on our mount.
            FileNotFoundError: `cg` is gone.
        """
        if self._home is None:
            self._home = self.path_on_mount(procfs.cgroup_of("self") or "")
            if self._home is None:
                raise UnsafeOperation("cannot enter a turn: the caller's own cgroup is not visible")
            self._home_v1 = own_v1_dirs()
        cg.move_in(os.getpid())
        self._away_v1 = self._away_v1 or joins_v1

    def leave(self) -> None:
        """Move the caller back to where it was before its first `enter`: in v1 only if a turn's v1
        cgroups took it (a turn without v1 limits leaves it where it was: no write to its own v1
        cgroups, which it did not create, on every leave)."""
        if self._home is not None:
            Cgroup(self._home).move_in(os.getpid())  # the one move outside the managed root
        if self._away_v1:
            for path in self._home_v1.values():
                Cgroup(path).move_in(os.getpid())  # and back to its own v1 cgroups
            self._away_v1 = False
