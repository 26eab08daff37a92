"""The cgroup v2 backend's kill paths, as a mixin of `Cgroup2Backend`: signalling, cgroup.kill and its
freeze-and-kill fallback, freezing, and processes that left their turn (strays).

Kill: cgroup.kill (5.14+) SIGKILLs the subtree and, via a flag checked in cgroup_post_fork, whatever is
forked during the kill. Where it is missing or refused, freeze -> enumerate -> SIGKILL -> thaw, repeated
until the subtree is empty (what runc does). Every path refuses a cgroup outside the managed root or
holding the caller, one of its ancestors or PID 1, and signals through pidfds after checking the
process is still inside, so a recycled pid is never hit.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Callable

from ..errors import NoSuchTurn, UnsafeOperation
from ..kernel import procfs
from ..kernel.cgroupfs import Cgroup, KillUnsupported

log = logging.getLogger("cgturn")
FREEZE_TIMEOUT = 1.0
FALLBACK_ROUNDS = 50


class KillingMixin:
    """Kill paths for Cgroup2Backend (uses its root, mount, _cg, _path_on_mount, cgroup_kill_works)."""

    if TYPE_CHECKING:  # what Cgroup2Backend provides
        from ..model import TurnRecord

        root: Cgroup
        cgroup_kill_works: bool

        def _cg(self, record: TurnRecord) -> Cgroup: ...
        def _path_on_mount(self, rel: str) -> str | None: ...

    def _guard(self, cg: Cgroup) -> None:
        """Refuse to kill or freeze outside the managed root, or a cgroup holding the caller, one of
        its ancestors or PID 1."""
        real = os.path.realpath(cg.path)
        if not real.startswith(os.path.realpath(self.root.path) + "/"):
            raise UnsafeOperation(f"refusing to kill {cg.path}: outside the managed root {self.root.path}")
        who = self._protected_inside(cg)
        if who is not None:
            raise UnsafeOperation(f"refusing to kill {cg.path}: it contains {who}")

    def _protected_inside(self, cg: Cgroup) -> str | None:
        """Which protected process (the caller, an ancestor of it, PID 1) `cg` holds; None if none."""
        me = os.getpid()
        for pid in sorted(procfs.protected_pids()):
            where = procfs.cgroup_of("self" if pid == me else pid)
            if where is not None and self._under(cg, where):
                who = "the calling process" if pid == me else ("PID 1" if pid == 1 else "an ancestor of the caller")
                return f"{who} ({pid})"
        return None

    def signal_members(self, record, sig) -> list[int]:
        cg = self._cg(record)
        self._guard(cg)
        sent = []
        for pid in cg.procs_recursive():
            if self._signal_if_inside(cg, pid, sig):
                sent.append(pid)
        return sent

    def _signal_if_inside(self, cg: Cgroup, pid: int, sig: int) -> bool:
        """Signal `pid` only if, once pinned by a pidfd, it is still inside `cg` (no PID-reuse hit)."""
        fd = procfs.open_pidfd(pid)
        if fd is None:
            return False
        try:
            where = procfs.cgroup_of(pid)
            if where is None or not self._under(cg, where):
                return False
            return procfs.pidfd_signal(fd, sig)
        finally:
            os.close(fd)

    def _under(self, cg: Cgroup, rel: str) -> bool:
        path = self._path_on_mount(rel)
        return path is not None and (path == cg.path or path.startswith(cg.path + "/"))

    def kill_members(self, record) -> list[int]:
        cg = self._cg(record)
        self._guard(cg)
        pids = cg.procs_recursive()
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

    def freeze_members(self, record, frozen: bool) -> list[int]:
        cg = self._cg(record)
        self._guard(cg)
        pids = cg.procs_recursive()
        try:
            cg.set_frozen(frozen)
        except FileNotFoundError:
            raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} no longer exists") from None
        # cgroup.events `frozen` follows once every task has stopped (or runs again).
        cg.wait_events(lambda ev: ev.get("frozen", int(frozen)) == int(frozen), FREEZE_TIMEOUT)
        return pids

    def kill_where(self, record, doomed) -> list[int]:
        cg = self._cg(record)
        self._guard(cg)
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
        cg = Cgroup(where)
        if cg != self.root and os.path.dirname(where) != self.root.path:
            raise UnsafeOperation(f"refusing to kill in {where}: not the managed root or a task directory")
        if pid in procfs.protected_pids():
            raise UnsafeOperation(f"refusing to kill process {pid}: the caller, an ancestor of it, or PID 1")
        fd = procfs.open_pidfd(pid)
        if fd is None:
            return False
        try:  # pinned by the pidfd: signal it only if it is still where it was found
            here = self._path_on_mount(procfs.cgroup_of(pid) or "")
            return here == where and procfs.pidfd_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)
