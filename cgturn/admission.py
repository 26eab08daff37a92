"""Admission: a new turn waits while the managed root's pressure guard reports pressure.

The guard (in the sentinel, or `cgturn guard`) records `over` on the managed root; any process reads it
there (cgturn.backends.guard_state). With no live guard, or no pressure, a turn starts at once.
The wait re-reads that state every POLL seconds: it is one getxattr, and the caller asked to wait.
"""
from __future__ import annotations

import math
import time
from typing import Any

from .backends import guard_state
from .errors import Overloaded

POLL = 0.05


def deadline(admit_timeout: float) -> float:
    """The monotonic time admission gives up at. Raises ValueError for a timeout that is not a finite
    number >= 0."""
    if isinstance(admit_timeout, bool) or not isinstance(admit_timeout, (int, float)) \
            or not 0 <= admit_timeout < math.inf:
        raise ValueError(f"admit_timeout must be a finite number of seconds >= 0, not {admit_timeout!r}")
    return time.monotonic() + admit_timeout


def wait_time(backend, until: float) -> float | None:
    """None when a turn may start now; else how long to sleep before asking again.

    Raises:
        Overloaded: the guard still reports pressure and `until` has passed.
    """
    state = guard_state.pressing(backend)
    if state is None:
        return None
    remaining = until - time.monotonic()
    if remaining <= 0:
        raise Overloaded(f"the pressure guard (process {state['owner_pid']}) has reported {state.get('resource')} "
                         f"pressure on {state.get('file')} since {_clock(state.get('since'))}: turn not admitted")
    return min(POLL, remaining)


def _clock(ts) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if isinstance(ts, (int, float)) else "?"


def admit(backend: Any, admit_timeout: float | None) -> None:
    """Wait (sleeping) until a turn may start; at once when `admit_timeout` is None.

    Raises:
        ValueError: a timeout that is not a finite number >= 0.
        Overloaded: the guard still reports pressure after `admit_timeout` seconds.
    """
    if admit_timeout is None:
        return
    until = deadline(admit_timeout)
    while (pause := wait_time(backend, until)) is not None:
        time.sleep(pause)


async def aadmit(backend: Any, admit_timeout: float | None) -> None:
    """`admit` for asyncio: each wait is an asyncio.sleep (each check is one getxattr). Raises as `admit`."""
    if admit_timeout is None:
        return
    import asyncio

    until = deadline(admit_timeout)
    while (pause := wait_time(backend, until)) is not None:
        await asyncio.sleep(pause)
