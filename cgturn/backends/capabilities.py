"""What a backend may be able to do beyond its core (`backends/base.py`): optional capabilities as
objects, `None` on a backend without them.

`backend.limiter` (a `Limiter`): limits, usage counters and pressure, which need cgroups; the cgroup v2
backend has one (`cgroup2_limiter.CgroupLimiter`), the registry backend has none.

Where there is no limiter, the ownership layer (cgturn/governance.py) refuses a limit with
`no_limits_error` and reads empty figures: no stand-in object answers for a capability that is absent.
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
