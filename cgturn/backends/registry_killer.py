"""The registry backend's killer: signals, SIGSTOP-based freezing and SIGKILL over a turn's members.

There is no kernel-side container, so kills are best effort against forks: every member is held by
a pidfd and SIGSTOPped, membership is re-collected until a pass finds nothing new, then SIGKILL (a
fork racing the stop either fails with a pending signal or hands the stop to the child; see
copy_process in kernel/fork.c). PID 1, the caller and its ancestors are never signalled.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Callable, Iterable

from ..kernel import procfs
from ..logfields import turn_fields
from ..model import TurnRecord
from .base import Member

log = logging.getLogger("cgturn")

# Rounds of "collect members, SIGSTOP the new ones" before the final SIGKILL; a fork storm is
# bounded by it (each round stops a generation, and a stopped process cannot fork).
FREEZE_PASSES = 50


class RegistryKiller:
    """Kills, signals and stops the members of registry turns.

    Args:
        members: a turn's live members, never walking through the given protected pids.
        expect_orphans: told which members this process killed (they may reparent to it dead).
    """

    def __init__(self, members: Callable[[TurnRecord, set[int]], set[Member]],
                 expect_orphans: Callable[[Iterable[Member]], None]):
        self._members = members
        self._expect_orphans = expect_orphans

    def _send(self, fd: int, pid: int, sig: int, protected: set[int]) -> bool:
        """Signal through a pidfd, never a protected pid (PID 1, the caller, its ancestors)."""
        if pid in protected:
            log.error("refusing to send signal %d to protected pid %d", sig, pid)
            return False
        return procfs.pidfd_signal(fd, sig)

    def signal(self, record: TurnRecord, sig: int) -> list[int]:
        """Send `sig` to every member, oldest first, through pidfds; the pids signalled."""
        protected = procfs.protected_pids()
        sent = []
        # Oldest first, so parents before their children: a shell waiting for its children must get
        # its SIGTERM before it can see them die and exit 0 (cgroup.procs lists in that order too).
        members = sorted(self._members(record, protected), key=lambda m: (m[1], m[0]))
        for pid, start in members:
            fd = procfs.open_pidfd(pid, start)
            if fd is None:
                continue
            try:
                if self._send(fd, pid, sig, protected):
                    sent.append(pid)
            finally:
                os.close(fd)
        return sorted(sent)

    def _freeze(self, record: TurnRecord, protected: set[int]) -> dict[Member, tuple[int, bool]]:
        """SIGSTOP members until a pass finds none new. Returns member -> (pidfd, was stopped before).

        The pidfds stay open so the final signal reaches exactly the process that was stopped.
        """
        held: dict[Member, tuple[int, bool]] = {}
        try:
            for _ in range(FREEZE_PASSES):
                new = False
                for member in self._members(record, protected):
                    if member in held:
                        continue
                    fd = procfs.open_pidfd(*member)
                    if fd is None:
                        continue
                    st = procfs.stat(member[0])
                    held[member] = (fd, st is not None and st.state in ("T", "t"))
                    if self._send(fd, member[0], signal.SIGSTOP, protected):
                        new = True
                if not new:
                    break
            else:
                log.warning("turn %r still gaining processes after %d stop passes", record.turn_id, FREEZE_PASSES,
                            extra=turn_fields(record.task_id, record.turn_id, record.reason))
        except BaseException:
            _close_all(held)
            raise
        return held

    def kill(self, record: TurnRecord) -> list[int]:
        """SIGSTOP every member until a pass finds none new, then SIGKILL them all; the pids hit."""
        protected = procfs.protected_pids()
        held = self._freeze(record, protected)
        killed = []
        try:
            for (pid, _), (fd, _) in held.items():
                if self._send(fd, pid, signal.SIGKILL, protected):
                    killed.append(pid)
            self._expect_orphans(held)
        finally:
            _close_all(held)
        return sorted(killed)

    def freeze(self, record: TurnRecord, frozen: bool) -> list[int]:
        """SIGSTOP every member until a pass finds none new (a fork racing the stop is caught by
        the next pass), or SIGCONT them all. Weaker than cgroup.freeze: a process that catches
        SIGCONT from elsewhere runs again, and one started by a member after the last pass runs."""
        protected = procfs.protected_pids()
        if frozen:
            held = self._freeze(record, protected)
            pids = sorted(pid for pid, _ in held)
            _close_all(held)
            return pids
        return self.signal(record, signal.SIGCONT)

    def kill_where(self, record: TurnRecord, doomed: Callable[[int, int], bool]) -> list[int]:
        """Stop every member, SIGKILL those with doomed(pid, start), resume the rest (not one
        stopped by someone else); the pids killed."""
        protected = procfs.protected_pids()
        held = self._freeze(record, protected)
        killed = []
        try:
            for (pid, start), (fd, was_stopped) in held.items():
                if doomed(pid, start):
                    if self._send(fd, pid, signal.SIGKILL, protected):
                        killed.append(pid)
                        self._expect_orphans([(pid, start)])
                elif not was_stopped:  # leave a process stopped by someone else (^Z) stopped
                    self._send(fd, pid, signal.SIGCONT, protected)
        finally:
            _close_all(held)
        return sorted(killed)


def _close_all(held: dict[Member, tuple[int, bool]]) -> None:
    for fd, _ in held.values():
        os.close(fd)
    held.clear()
