"""The supervisor's wake-up plumbing: what an async `Supervisor.run` awaits (`Wake`), and the one
listener per manager that routes `turn_ended` events to this process's supervisors (`dispatcher`)."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # an annotation only: importing this module must not import asyncio
    import asyncio

from . import reasons
from .model import ABANDONED, AbandonResult


class Wake:
    """What `Supervisor.run` awaits: woken by the worker's task finishing (on the loop) or by a
    decision in another thread (`set_threadsafe`); re-armed after each wake-up. One future per
    wake-up instead of an asyncio.Event, a task waiting on it and asyncio.wait's own futures."""

    __slots__ = ("_loop", "_future")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._future = loop.create_future()

    def set(self, *_: object) -> None:
        if not self._future.done():
            self._future.set_result(None)

    def set_threadsafe(self) -> None:
        self._loop.call_soon_threadsafe(self.set)

    async def wait(self) -> None:
        try:
            await self._future
        finally:
            self._future = self._loop.create_future()


class Watched(Protocol):
    """What the dispatcher needs of a supervisor (cgturn.Supervisor)."""

    names: tuple[str, str]

    def _abandoned_elsewhere(self, reason: str, rec: Any = None, result: AbandonResult | None = None) -> None: ...


class Dispatcher:
    """Routes `turn_ended` events of one manager to the supervisors of this process (an abandon by
    another thread: Turn.abandon, end_task), in O(1) per event."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_names: dict[tuple[str, str], Watched] = {}

    def watch(self, sup: Watched) -> None:
        with self._lock:
            self._by_names[sup.names] = sup

    def forget(self, sup: Watched) -> None:
        with self._lock:
            if self._by_names.get(sup.names) is sup:
                del self._by_names[sup.names]

    def turn_ended(self, event: Any) -> None:
        if event.state != ABANDONED:
            return
        with self._lock:
            sup = self._by_names.get((event.task_key, event.turn_key))
        if sup is not None:
            reason = event.reason or reasons.UNRECORDED
            sup._abandoned_elsewhere(reason, None, AbandonResult(
                killed=list(event.killed), skipped=False, reason=reason, signals=list(event.signals),
                duration_ms=event.duration_ms, usage=event.usage, killed_by=event.killed_by))


_DISPATCH_LOCK = threading.Lock()


def dispatcher(manager: Any) -> Dispatcher:
    """The manager's Dispatcher, registered as its listener on first use."""
    with _DISPATCH_LOCK:
        for listener in manager.listeners:
            if isinstance(listener, Dispatcher):
                return listener
        found = Dispatcher()
        manager.add_listener(found)
        return found
