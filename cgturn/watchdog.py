"""One watchdog for every supervised turn of a process: a deadline heap served by one daemon thread.

A thread, not a task on the event loop, so it fires while the loop is blocked (a blocking call in a
coroutine, a CPU-bound callback: CPython hands the GIL over every sys.getswitchinterval()). One
thread, not one per turn, so a gateway with thousands of concurrent turns has a flat thread count.

The watchdog only *decides* (a client's `on_due`, which must be quick: a record read, a compare, the
`on_interrupt` callback). A kill waits out its grace, so it runs in a small pool (`KILL_THREADS`),
never in the watchdog thread: one turn's grace never delays another turn's timeout.

cgturn's own threads for supervision are therefore at most 1 + KILL_THREADS, named `cgturn-*`.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("cgturn.supervisor")

# Kills carried out side by side (each may wait out a grace).
KILL_THREADS = 2


class Client(Protocol):
    def on_due(self, now: float) -> float | None:
        """Called at (or just after) the due time: act, then return the next due time (monotonic),
        or None to leave the heap."""

    @property
    def finished(self) -> bool:
        """True once `on_due` would only return None: the entry leaves the heap without a call."""


class Watchdog:
    """The process's deadline heap (use `shared()`); entries are (due, seq, client)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Client]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None

    def schedule(self, client: Client, due: float) -> None:
        """Call `client.on_due` at monotonic time `due` (again each time it returns a time)."""
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), client))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cgturn-watchdog", daemon=True)
                self._thread.start()
            if self._heap[0][2] is client:
                self._cond.notify()  # the new entry is the nearest: sleep less

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` in the kill pool (exceptions are logged)."""
        with self._cond:
            if self._pool is None:  # made at the first kill: a process that never kills never imports it
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=KILL_THREADS, thread_name_prefix="cgturn-kill")
            pool = self._pool
        pool.submit(_logged, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    # Entries of finished clients (a supervised turn completes long before its
                    # timeout) leave as soon as they reach the head: the thread then sleeps until
                    # the next live due time, not once per finished turn.
                    while self._heap and getattr(self._heap[0][2], "finished", False):
                        heapq.heappop(self._heap)
                    if self._heap and self._heap[0][0] <= now:
                        _, _, client = heapq.heappop(self._heap)
                        break
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
            try:
                following = client.on_due(now)
            except Exception:  # noqa: BLE001 - one broken client must not stop the others' timeouts
                log.exception("watchdog client %r failed", client)
                continue
            if following is not None:
                self.schedule(client, following)


def _logged(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - recorded on the outcome by the callee; logged here
        log.exception("watchdog action %r failed", fn)


_SHARED: Watchdog | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> Watchdog:
    """The process's watchdog (made on first use; a forked child gets a fresh one)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Watchdog()
        return _SHARED


def _forget_after_fork() -> None:
    global _SHARED, _SHARED_LOCK
    _SHARED, _SHARED_LOCK = None, threading.Lock()  # the parent's thread does not exist in the child


os.register_at_fork(after_in_child=_forget_after_fork)
