"""What a backend may be able to do beyond its core (`backends/base.py`): optional capabilities as
objects, `None` on a backend without them.

`backend.limiter` (a `Limiter`): limits, usage counters and pressure, which need cgroups; the cgroup v2
backend has one (`cgroup2_limiter.CgroupLimiter`), the registry backend has none.

`limiter_of(backend)` gives callers one object either way: the backend's limiter, or `NO_LIMITS_HERE`,
which refuses every limit (LimitsUnavailable, with the registry's message) and answers every question
with empty figures. It is what the ownership layer calls until it asks `backend.limiter` itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..errors import LimitsUnavailable
from ..limits import Limits, Usage

if TYPE_CHECKING:
    from ..model import TurnRecord


class Limiter(Protocol):
    """Limits and figures at the three levels (turn, task, managed root)."""

    def set_turn_limits(self, record: "TurnRecord", limits: Limits) -> "TurnRecord": ...
    def set_task_limits(self, task_key: str, limits: Limits) -> None: ...
    def set_root_limits(self, limits: Limits) -> None: ...
    def task_limits(self, task_key: str) -> Limits: ...
    def root_limits(self) -> Limits: ...
    def limit_counters(self, record: "TurnRecord") -> Usage: ...
    def task_usage(self, task_key: str) -> Usage: ...
    def root_usage(self) -> Usage: ...
    def report(self) -> dict: ...
    def turn_pressure(self, record: "TurnRecord") -> dict | None: ...
    def unthrottle(self, record: "TurnRecord") -> None: ...
    def sweep_v1_dirs(self) -> list[str]: ...


def no_limits_error(backend_name: str) -> LimitsUnavailable:
    """The refusal of a limit on a backend without a limiter."""
    return LimitsUnavailable(f"the {backend_name} backend cannot enforce limits (they need cgroups)")


class _NoLimits:
    """A backend without a limiter, seen as one: limits refused, figures empty."""

    def __init__(self, backend_name: str):
        self._name = backend_name

    def set_turn_limits(self, record: "TurnRecord", limits: Limits) -> "TurnRecord":
        raise no_limits_error(self._name)

    def set_task_limits(self, task_key: str, limits: Limits) -> None:
        raise no_limits_error(self._name)

    def set_root_limits(self, limits: Limits) -> None:
        raise no_limits_error(self._name)

    def task_limits(self, task_key: str) -> Limits:
        return Limits()

    def root_limits(self) -> Limits:
        return Limits()

    def limit_counters(self, record: "TurnRecord") -> Usage:
        return Usage()

    def task_usage(self, task_key: str) -> Usage:
        return Usage()

    def root_usage(self) -> Usage:
        return Usage()

    def report(self) -> dict:
        return {"layout": None, "available": [], "problems": [str(no_limits_error(self._name))]}

    def turn_pressure(self, record: "TurnRecord") -> dict | None:
        return None

    def unthrottle(self, record: "TurnRecord") -> None:
        return None

    def sweep_v1_dirs(self) -> list[str]:
        return []


class _HasLimiter(Protocol):
    name: str
    limiter: "Limiter | None"


def limiter_of(backend: _HasLimiter) -> Limiter:
    """`backend.limiter`, or a stand-in that refuses limits and reports empty figures."""
    return backend.limiter if backend.limiter is not None else _NoLimits(backend.name)
