"""The isolation of the cgroup v2 backend's turns: checking a sealed turn can be sealed here, and the
network namespaces of turns begun with network="none" (kernel/netns.py), held by an fd each.

A namespace is made when its turn is, before anything else (IsolationUnavailable leaves nothing
behind), kept while the turn runs so every spawn joins it (through the shim's nsenter step), and
closed once the turn is no longer running: its processes keep it alive while they live, and a turn
that is gone leaves nothing behind. A turn ended by this process lets go at its transition; one ended by
another process (`cgturn stop`, the sentinel) when this process learns it (a Supervisor noticing the
outside abandon, `release`), or at the latest at this process's next begin_turn. Another process spawning into the turn joins the namespace of a
live member instead.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

from ..errors import IsolationUnavailable
from ..kernel import procfs
from ..kernel.cgroupfs import Cgroup
from ..model import RUNNING, TurnRecord

TurnKey = tuple[str, str]


class TurnIsolation:
    """The network namespaces of the turns begun here.

    Args:
        load: the record of a turn by (task_key, turn_key); None when it is gone.
        under: whether a /proc/PID/cgroup path lies in a cgroup (the killer's check).
    """

    def __init__(self, load: Callable[[str, str], TurnRecord | None], under: Callable[[Cgroup, str], bool]):
        self._load = load
        self._under = under
        self._fds: dict[TurnKey, int] = {}
        self._lock = threading.Lock()

    def prepare(self, record: TurnRecord) -> int | None:
        """Check that the turn's isolation can be given here, and make its network namespace (an fd
        holding it, which the caller `keep`s or closes) when it asks for one; nothing else is made.

        Raises:
            IsolationUnavailable: a helper is missing, or the kernel refused the namespace.
        """
        self.release_ended()
        if not record.sealed and record.network == "host":
            return None  # the common turn: the sealing modules are not even imported
        from . import isolation, seal

        if record.sealed:
            seal.check()
        if record.network == "host":
            return None
        isolation.helper(isolation.NSENTER)
        from ..kernel import netns

        try:
            return netns.new_loopback_only()
        except OSError as err:
            raise IsolationUnavailable(f"the kernel refused a network namespace: {err}") from err

    def keep(self, record: TurnRecord, fd: int) -> None:
        """Hold `fd` (from `prepare`) as the turn's namespace while the turn runs."""
        with self._lock:
            self._fds[(record.task_key, record.turn_key)] = fd

    def holds(self, task_key: str, turn_key: str) -> bool:
        """Whether a namespace of this turn is held here."""
        return (task_key, turn_key) in self._fds

    def network_fd(self, record: TurnRecord, cg: Cgroup) -> int:
        """A new fd of the turn's network namespace: a copy of the one held here since begin_turn, or
        else that of a live member of `cg` (another process spawning into the turn); the caller
        closes it.

        Raises:
            IsolationUnavailable: neither exists.
        """
        with self._lock:  # a copy: the held fd may be closed by a concurrent end of the turn
            held = self._fds.get((record.task_key, record.turn_key))
            if held is not None:
                return os.dup(held)  # O_CLOEXEC unset: the shim's Popen passes it on (pass_fds)
        from ..kernel import netns

        for pid in cg.procs_recursive():
            try:
                fd = netns.open_of(pid)
            except OSError:
                continue
            # Opened, then checked: a pid recycled meanwhile is no longer in the turn.
            if self._under(cg, procfs.cgroup_of(pid) or "") and not netns.same_as_ours(fd):
                return fd
            os.close(fd)
        raise IsolationUnavailable(f"turn {record.turn_id!r} of task {record.task_id!r} has no network "
                                   "namespace left to join (its owner's is closed and no process of it lives)")

    def release(self, task_key: str, turn_key: str) -> None:
        """Close the namespace fd of this turn if it is held here and the turn no longer runs (ended
        by another process: this one learnt it from the turn's record)."""
        with self._lock:
            if (task_key, turn_key) not in self._fds:
                return
            rec = self._load(task_key, turn_key)
            if rec is None or rec.state != RUNNING:
                os.close(self._fds.pop((task_key, turn_key)))

    def release_ended(self) -> None:
        """Close the namespace fds of turns no longer running."""
        with self._lock:
            for key in list(self._fds):
                rec = self._load(*key)
                if rec is None or rec.state != RUNNING:
                    os.close(self._fds.pop(key))

    def close(self) -> None:
        """Close every namespace fd held here."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
