"""Run markers for API servers: which task and turn a run (one request, one websocket) owns while its
worker is in flight, and the one call a server makes when the run's client goes away.

The supervisor sets the markers when the worker starts and clears them the instant it finishes, in
the same locked step as the turn's completion; `abandon_disconnected(run)` abandons only a run that
still holds them, so a disconnect that lands after the reply kills nothing.
"""
from __future__ import annotations

import threading
from typing import Any, Protocol

from . import ids, reasons
from .model import AbandonResult


class Stopper(Protocol):
    """What a run's supervisor offers a disconnect (cgturn.Supervisor)."""

    def stop(self, reason: str = ..., grace: float | None = None, interrupt: bool = True) -> AbandonResult: ...


class Run:
    """Per-run ownership markers of an API server: which task and turn a run owns while in flight.

    Args:
        run_id: the server's name for the run (shown in repr and logs only).
    """

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self.task_id: str | None = None
        self.turn: Any = None
        self.supervisor: Stopper | None = None

    def __repr__(self) -> str:
        return f"<Run {self.run_id!r} owns {self.task_id!r}>" if self.owned else f"<Run {self.run_id!r} idle>"

    def mark(self, task_id: str, turn: Any, supervisor: Stopper | None = None) -> None:
        """Record that this run owns `turn` of `task_id` (set while the run is in flight).

        Args:
            task_id: the turn's task id.
            turn: the Turn.
            supervisor: the Supervisor running its worker, which a disconnect stops (None: abandon
                the turn directly).
        """
        with self._lock:
            self.task_id, self.turn, self.supervisor = task_id, turn, supervisor

    def clear(self) -> None:
        """Drop the markers: the run no longer owns anything."""
        with self._lock:
            self.task_id = self.turn = self.supervisor = None

    @property
    def owned(self) -> bool:
        """True while the run holds markers (its worker is in flight)."""
        return self.turn is not None

    def markers(self) -> tuple[str | None, Any, Stopper | None]:
        """The markers, read together.

        Returns:
            (task id, turn, supervisor); all None when the run owns nothing.
        """
        with self._lock:
            return self.task_id, self.turn, self.supervisor


def abandon_disconnected(run: Run, grace: float = 2.0) -> AbandonResult | None:
    """A client of `run` went away: abandon the turn the run owns (reason `disconnect`).

    Args:
        run: the run whose client disconnected.
        grace: seconds between SIGTERM and SIGKILL.

    Returns:
        The AbandonResult (through the run's supervisor when it has one, so its outcome and
        `on_interrupt` say `disconnect`), or None when the run holds no markers (never started, or
        finished) or its task id is blank: nothing is killed then.

    Raises:
        UnsafeOperation: the turn contains the calling process.
    """
    task_id, turn, supervisor = run.markers()
    if turn is None or task_id is None or ids.is_blank(task_id):
        return None
    if supervisor is not None:
        return supervisor.stop(reasons.DISCONNECT, grace=grace)
    result: AbandonResult = turn.abandon(reasons.DISCONNECT, grace=grace)
    return result


async def aabandon_disconnected(run: Run, grace: float = 2.0) -> AbandonResult | None:
    """`abandon_disconnected` for asyncio, the kill and its grace in a worker thread.

    A process that ignores SIGTERM never stalls the event loop then.

    Args:
        run: as `abandon_disconnected`.
        grace: as `abandon_disconnected`.

    Returns:
        As `abandon_disconnected`.

    Raises:
        UnsafeOperation: the turn contains the calling process.
    """
    import asyncio  # here: a process that never awaits one does not import asyncio

    return await asyncio.to_thread(abandon_disconnected, run, grace)


# The names earlier versions and the contract use ("reap" is crash recovery's word now).
reap_disconnected = abandon_disconnected
areap_disconnected = aabandon_disconnected
