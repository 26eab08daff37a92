"""What `cgturn ps` shows: every turn as any process can see it, with its processes, usage and ports.

One pass per turn over the backend's views, one sock_diag dump for the whole listing.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from . import ids, keys
from .backends.base import Backend
from .kernel import procfs
from .limits import stored_limits
from .logfields import turn_fields
from .model import COMPLETED, TurnInfo

if TYPE_CHECKING:
    from .control import TurnControl
    from .governance import Limiter

log = logging.getLogger("cgturn")


def list_turns(backend: Backend, limiter: "Limiter | None", task_key: str | None = None,
               detail: bool = False) -> list[TurnInfo]:
    """Every existing turn (of one task), oldest first.

    `detail` also reads every turn's usage figures, pressure (through `limiter`, the backend's limits
    capability; none without it) and frozen state (what `cgturn ps` shows); without it only turns with
    limits get their usage read (cheap listings for a dashboard).
    """
    views = backend.views(task_key, detail=detail)
    if not views:
        return []
    from .kernel import observe  # sockets and psutil: only when there is a turn to look at
    sockets = _listening_sockets() if any(v.cgroup_ids for v in views) else None
    if sockets is not None:  # sock_diag answers for one network namespace: dump in each turn's own
        sockets = sockets + _sockets_in_namespaces(views)
    index = observe.by_cgroup(sockets) if sockets is not None else None
    out = []
    for view in views:
        rec = view.record
        mem = view.memory_bytes
        if mem is None:  # no memory controller on the turn: summed RSS is the next best answer
            mem = observe.rss_bytes(view.pids)
        if view.cgroup_ids and index is not None:
            ports = observe.ports_in_cgroups(index, view.cgroup_ids)
        else:
            ports = observe.ports_of_pids(view.pids)
        info = TurnInfo(task=rec.task_id, turn=rec.turn_id, state=rec.state, pids=view.pids,
                        owner_pid=rec.owner_pid, started_at=rec.started_at, reason=rec.reason or rec.problem,
                        cpu_seconds=view.cpu_seconds, memory_bytes=mem, ports=ports, path=view.path,
                        expires_at=rec.expires_at, sealed=bool(rec.sealed), network=rec.network)
        if rec.keys:
            info.keys = keys.live(rec.keys)
        if rec.limits:
            info.limits = stored_limits(rec.limits)
        if view.usage is not None:  # read in the views' pass (detail, where the backend can)
            info.usage = view.usage
        elif detail or rec.limits or rec.v1_dirs:
            info.usage = backend.turn_usage(rec)
        if detail:
            if limiter is None:
                info.pressure = None
            else:
                info.pressure = view.pressure if view.pressure is not None else limiter.turn_pressure(rec)
            info.frozen = rec.frozen_by is not None or (view.frozen if view.frozen is not None
                                                        else backend.turn_frozen(rec))
        out.append(info)
    out.sort(key=lambda info: (info.started_at, info.task, info.turn))
    return out


def without_own_emptied(control: "TurnControl", infos: list[TurnInfo]) -> list[TurnInfo]:
    """`infos` less the completed turns this process owns whose survivors have all exited, which are
    removed (as completion removes one that is empty at once; recovery.remove_emptied). Where no
    sentinel runs, the owner's listing is what removes them; another process's listing (`cgturn ps`)
    removes nothing: those wait for their owner, its sentinel or `cgturn reap`."""
    me = os.getpid()
    if not any(info.state == COMPLETED and not info.pids and info.owner_pid == me for info in infos):
        return infos
    from . import recovery  # only when there is one to remove

    mine = procfs.own_start_time()
    out = []
    for info in infos:
        if info.state == COMPLETED and not info.pids and info.owner_pid == me:
            rec = control.record(ids.encode(info.task), ids.encode(info.turn))
            if rec is not None and rec.owner_start == mine and recovery.remove_emptied(control, rec):
                continue
        out.append(info)
    return out


def _sockets_in_namespaces(views) -> list:
    """Listening sockets of the turns with a network of their own, one dump per namespace (entered
    through a live member's /proc/PID/ns/net); a namespace that cannot be entered lists no ports."""
    from .kernel import observe

    found: list = []
    seen: set[tuple[int, int]] = set()
    for view in views:
        if view.record.network == "host" or not view.cgroup_ids:
            continue
        try:
            found.extend(observe.listening_sockets_of(view.pids, seen))
        except observe.DiagUnavailable as err:
            log.info("ports of turn %r: %s", view.record.turn_id, err,
                     extra=turn_fields(view.record.task_id, view.record.turn_id))
    return found


def _listening_sockets():
    """One sock_diag dump for a whole listing; None when unusable (ports then come from psutil)."""
    from .kernel import observe

    try:
        return observe.listening_sockets()
    except observe.DiagUnavailable as err:
        log.info("ports via psutil: %s", err)
        return None
