"""Per-turn observation the kernel can answer without policy: listening ports and resident memory.

Ports come from sock_diag (kernel/sockdiag.py, one netlink dump per protocol and family, ~1 ms):
every reply carries INET_DIAG_CGROUP_ID, the inode number of the cgroup directory the socket was
created in (cgroup v2 ids are kernfs inode numbers, so `os.stat(dir).st_ino` matches). That maps
sockets to turns without scanning /proc. Where sock_diag is unusable, or a turn has no cgroup (the
registry backend), psutil scans the turn's pids instead.

Knows nothing of tasks or turns: callers hand in cgroup directories or pids.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Iterable

from ..ports import Port
from . import procfs, sockdiag
from .cgroupfs import walk_tree
from .sockdiag import ListeningSocket

log = logging.getLogger("cgturn")

class DiagUnavailable(Exception):
    """sock_diag cannot be used here (netlink refused or unsupported); use the psutil path."""


def listening_sockets() -> list[ListeningSocket]:
    """Every listening socket of this network namespace, with the id of the cgroup it was made in.

    Raises:
        DiagUnavailable: the kernel refused the sock_diag dump (or has no such netlink family), or
            gave no cgroup ids (before 5.7, or built without CONFIG_SOCK_CGROUP_DATA): without them
            no socket could be matched to a turn.
    """
    try:
        sockets = sockdiag.listening_sockets()
    except OSError as err:
        raise DiagUnavailable(f"sock_diag refused: {err}") from err
    if sockets and all(s.cgroup_id is None for s in sockets):
        raise DiagUnavailable("sock_diag gave no cgroup ids (kernel before 5.7?)")
    return sockets


def listening_sockets_of(pids: list[int], seen: set) -> list[ListeningSocket]:
    """Every listening socket of the network namespace of the first of `pids` that can be entered,
    unless that namespace's (dev, inode) is in `seen` (then []); the namespace is added to `seen`.

    Raises DiagUnavailable when setns is refused (it needs CAP_SYS_ADMIN) or sock_diag refuses.
    """
    from . import netns

    for pid in pids:
        try:
            fd = netns.open_of(pid)
        except OSError:
            continue  # gone, or not ours to look at
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen or netns.same_as_ours(fd):
                return []
            seen.add((st.st_dev, st.st_ino))
            return netns.run_inside(fd, listening_sockets)
        except OSError as err:
            raise DiagUnavailable(f"cannot enter the network namespace of process {pid}: {err}") from err
        finally:
            os.close(fd)
    return []


def cgroup_ids(path: str) -> set[int]:
    """Ids (inode numbers) of the cgroup at `path` and of every cgroup below it; empty when gone."""
    return {cgroup_id for _, cgroup_id in walk_tree(path)}


def by_cgroup(sockets: list[ListeningSocket]) -> dict[int | None, list[ListeningSocket]]:
    """Sockets grouped by the id of the cgroup they were created in: one pass for a whole listing."""
    index: dict[int | None, list[ListeningSocket]] = {}
    for sock in sockets:
        index.setdefault(sock.cgroup_id, []).append(sock)
    return index


def ports_in_cgroups(index: dict[int | None, list[ListeningSocket]], ids: Iterable[int]) -> list[Port]:
    """The sockets (grouped by `by_cgroup`) created in one of the cgroups `ids`, as sorted,
    de-duplicated ports."""
    found = [sock for cgroup_id in ids if cgroup_id in index for sock in index[cgroup_id]]
    return _unique(found) if found else []


def ports_of_pids(pids: list[int]) -> list[Port]:
    """Listening sockets held by `pids` (psutil walks each process's fds; others' need root)."""
    import psutil

    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for conn in conns:
            proto = "tcp" if conn.type == socket.SOCK_STREAM else "udp"
            listening = conn.status == psutil.CONN_LISTEN if proto == "tcp" else not conn.raddr
            if listening and conn.laddr:
                found.append(ListeningSocket(proto, conn.laddr.ip, conn.laddr.port, None))
    return _unique(found)


def _unique(sockets: Iterable[ListeningSocket]) -> list[Port]:
    return sorted({Port(s.proto, s.address, s.port) for s in sockets})


def rss_bytes(pids: list[int]) -> int | None:
    """Summed resident set size of `pids` (shared pages count once per process); None if none readable.

    Read from /proc/PID/statm directly: psutil costs ~10x more per pid, which dominated `ps` over
    many turns.
    """
    sizes = [size for size in map(procfs.rss_bytes, pids) if size is not None]
    return sum(sizes) if sizes or not pids else None
