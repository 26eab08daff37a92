"""The cgroup v2 backend's killer: signalling, cgroup.kill and its freeze-and-kill fallback, freezing,
and processes that left their turn (strays).

Kill: cgroup.kill (5.14+) SIGKILLs the subtree and, via a flag checked in cgroup_post_fork, whatever is
forked during the kill. Where it is missing or refused, freeze -> enumerate -> SIGKILL -> thaw, repeated
until the subtree is empty (what runc does). Every path refuses a cgroup outside the managed root or
holding the caller, one of its ancestors or PID 1 (`_refuse_protected`), and signals through pidfds
after checking the process is still inside, so a recycled pid is never hit.

The killer works on cgroups, not turns: it needs only the managed root and a way to place a
/proc/PID/cgroup path on the mount the backend sees, so the backend composes it.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Callable

from ..errors import UnsafeOperation
from ..kernel import pidns, procfs
from ..kernel.cgroupfs import Cgroup, KillUnsupported

log = logging.getLogger("cgturn")
FREEZE_TIMEOUT = 1.0
FALLBACK_ROUNDS = 50


class CgroupKiller:
    """Kills, signals and freezes cgroups below one managed root, never a protected process.

    Args:
        root: the managed root; nothing outside it is ever signalled.
        path_on_mount: where a /proc/PID/cgroup path lies on the backend's cgroup2 mount (None when
            outside its view).
        cgroup_kill: False when cgroup.kill is known not to work (the freeze fallback from the
            start); None or True try it, and the first refusal switches it off
            (`cgroup_kill_works`, a capability flag tests set too).
    """

    def __init__(self, root: Cgroup, path_on_mount: Callable[[str], str | None], cgroup_kill: bool | None = None):
        self.root = root
        self._path_on_mount = path_on_mount
        self.cgroup_kill_works = cgroup_kill is not False

    def _refuse_protected(self, cg: Cgroup, checked: list[int] | None = None) -> list[int]:
        """Refuse to kill or freeze outside the managed root, or a cgroup holding the caller, one of
        its ancestors or PID 1 (as `procfs.protected` reads them: once per abandon); the pids of
        `cg`'s subtree, as read for the check. `checked`: that reading, made just before by
        `unprotected_members` (an abandon's first kill): taken as it is.

        Raises:
            UnsafeOperation: naming the cgroup and why.
        """
        if not self.inside_root(cg):
            raise UnsafeOperation(f"refusing to kill {cg.path}: outside the managed root {self.root.path}")
        if checked is not None:
            return checked
        pids = cg.procs_recursive()
        who = _protected_among(pids)
        if who is not None:
            raise UnsafeOperation(f"refusing to kill {cg.path}: it contains {who}")
        return pids

    def inside_root(self, cg: Cgroup) -> bool:
        """True when `cg` lies below the managed root. A turn's path is the root's joined with names
        Cgroup.child checked (no `/`, `.`, `..`), and cgroupfs has no symlinks, so the plain prefix
        answers; any other path is resolved (realpath) before it is refused."""
        root = self.root.path.rstrip("/") + "/"
        if cg.path.startswith(root) and ".." not in cg.path[len(root):].split("/"):
            return True
        return os.path.realpath(cg.path).startswith(os.path.realpath(self.root.path) + "/")

    def unprotected_members(self, cg: Cgroup) -> list[int] | None:
        """The pids of `cg`'s subtree, or None when the caller, an ancestor of it or PID 1 is among
        them. The kernel's own list of the subtree's members (cgroup.procs) answers, not each
        protected process's /proc/PID/cgroup: one read per cgroup of the turn instead of two per
        protected process, and no path to translate between cgroup namespaces."""
        pids = cg.procs_recursive()
        return None if _protected_among(pids) is not None else pids

    def under(self, cg: Cgroup, rel: str) -> bool:
        """True when the /proc/PID/cgroup path `rel` is `cg` or below it."""
        path = self._path_on_mount(rel)
        return path is not None and (path == cg.path or path.startswith(cg.path + "/"))

    def signal(self, cg: Cgroup, sig: int, spare_inits: bool = False) -> list[int]:
        """Send `sig` to every process of `cg`'s subtree still inside it; the pids reached. With
        `spare_inits` (a sealed turn), a PID namespace's init is reached through its target, not
        signalled: it forwards what it gets to the target, which is signalled here (no second copy)."""
        return [pid for pid in self._refuse_protected(cg)
                if (spare_inits and pidns.is_namespace_init(pid)) or self._signal_if_inside(cg, pid, sig)]

    def _signal_if_inside(self, cg: Cgroup, pid: int, sig: int) -> bool:
        """Signal `pid` only if, once pinned by a pidfd, it is still inside `cg` (no PID-reuse hit)."""
        fd = procfs.open_pidfd(pid)
        if fd is None:
            return False
        try:
            where = procfs.cgroup_of(pid)
            if where is None or not self.under(cg, where):
                return False
            return procfs.pidfd_signal(fd, sig)
        finally:
            os.close(fd)

    def kill(self, cg: Cgroup, checked: list[int] | None = None) -> list[int]:
        """SIGKILL `cg`'s subtree: cgroup.kill, else freeze-and-kill; the pids hit. `checked`: its
        members as `unprotected_members` read them just before (Backend.kill_members)."""
        pids = self._refuse_protected(cg, checked)
        if self.cgroup_kill_works:
            try:
                cg.kill()
                return pids
            except FileNotFoundError:
                return pids
            except KillUnsupported as err:
                if not os.path.isdir(cg.path):
                    return pids
                log.warning("cgroup.kill unusable (%s); falling back to freeze + kill", err)
                self.cgroup_kill_works = False
        return sorted(set(pids) | set(self._freeze_and_kill(cg, lambda pid, start: True)))

    def _freeze_and_kill(self, cg: Cgroup, doomed: Callable[[int, int], bool], rounds=FALLBACK_ROUNDS) -> list[int]:
        """Freeze, SIGKILL what `doomed` selects, thaw; repeat until none is left to kill."""
        killed: set[int] = set()
        for _ in range(rounds):
            hit = False
            try:
                cg.set_frozen(True)
            except FileNotFoundError:
                break
            try:
                cg.wait_events(lambda ev: ev.get("frozen", 1) == 1, FREEZE_TIMEOUT)
                for pid in cg.procs_recursive():
                    started = procfs.start_time(pid)
                    if started is not None and doomed(pid, started) and self._signal_if_inside(cg, pid, signal.SIGKILL):
                        killed.add(pid)
                        hit = True
            finally:
                try:
                    cg.set_frozen(False)
                except FileNotFoundError:
                    pass
            if not hit:
                break
        return sorted(killed)

    def freeze(self, cg: Cgroup, frozen: bool) -> list[int]:
        """Freeze (or thaw) `cg` and wait, bounded, for cgroup.events to say so; the pids inside.

        Raises:
            FileNotFoundError: the cgroup is gone.
        """
        pids = self._refuse_protected(cg)
        cg.set_frozen(frozen)
        # cgroup.events `frozen` follows once every task has stopped (or runs again).
        cg.wait_events(lambda ev: ev.get("frozen", int(frozen)) == int(frozen), FREEZE_TIMEOUT)
        return pids

    def kill_where(self, cg: Cgroup, doomed: Callable[[int, int], bool]) -> list[int]:
        """Freeze `cg`, SIGKILL the processes with doomed(pid, start), thaw; the pids killed."""
        self._refuse_protected(cg)
        return self._freeze_and_kill(cg, doomed, rounds=1)

    def strays(self) -> list[tuple[str, int]]:
        """Processes directly in the managed root or in a task directory: only a turn process that
        moved itself (or a child) out of its turn puts one there (no controllers are enabled, so
        non-leaf cgroups may hold processes)."""
        out = [(self.root.path, pid) for pid in self.root.procs()]
        for task in self.root.children():
            out.extend((task.path, pid) for pid in task.procs())
        return out

    def kill_stray(self, where: str, pid: int) -> bool:
        """SIGKILL the stray `pid` if it is still directly in `where`; True if it was signalled.

        Raises:
            UnsafeOperation: `where` is not the managed root or a task directory, or `pid` is protected.
        """
        cg = Cgroup(where)
        if cg != self.root and os.path.dirname(where) != self.root.path:
            raise UnsafeOperation(f"refusing to kill in {where}: not the managed root or a task directory")
        if pid in procfs.protected().pids:
            raise UnsafeOperation(f"refusing to kill process {pid}: the caller, an ancestor of it, or PID 1")
        fd = procfs.open_pidfd(pid)
        if fd is None:
            return False
        try:  # pinned by the pidfd: signal it only if it is still where it was found
            here = self._path_on_mount(procfs.cgroup_of(pid) or "")
            return here == where and procfs.pidfd_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)


def _protected_among(pids: list[int]) -> str | None:
    """Which protected process (procfs.protected) is among `pids`, named; None if none."""
    protected = procfs.protected()
    hit = protected.pids.intersection(pids)
    if not hit:
        return None
    pid = min(hit)
    who = "the calling process" if pid == protected.me else ("PID 1" if pid == 1 else "an ancestor of the caller")
    return f"{who} ({pid})"
