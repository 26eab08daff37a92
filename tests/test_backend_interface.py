"""The backend core (cgturn/backends/base.py) and its capability objects (capabilities.py): what every
backend must implement is abstract in the base (no do-nothing defaults to inherit by accident), and
limits are an object, `backend.limiter`, with exactly the Limiter methods, None on the registry."""
from __future__ import annotations

import inspect

import pytest

from cgturn.backends.base import Backend
from cgturn import TurnManager
from cgturn.backends.capabilities import Limiter
from cgturn.backends.cgroup2 import Cgroup2Backend
from cgturn.backends.cgroup2_limiter import CgroupLimiter
from cgturn.backends.registry import RegistryBackend
from cgturn.errors import LimitsUnavailable
from cgturn.limits import Limits, Usage

CORE = {
    "create_turn", "load", "records", "transition", "task_lock", "spawn", "adopt", "members", "contains_caller",
    "checked_members_at",
    "turn_of", "enter", "leave", "signal_members", "kill_members", "freeze_members", "kill_where", "wait_empty",
    "remove", "remove_task", "task_keys", "turn_usage", "turn_frozen", "strays", "kill_stray", "ensure_root",
    "remove_root", "cgroup_dir", "views", "close", "scope", "location", "env_for",
}
LIMITER = {
    "set_turn_limits", "set_task_limits", "set_root_limits", "task_limits", "root_limits", "limit_counters",
    "task_usage", "root_usage", "report", "turn_pressure", "unthrottle", "sweep_v1_dirs",
}


def _public(cls) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}


def test_the_core_is_abstract_and_nothing_else_is_in_the_base():
    assert Backend.__abstractmethods__ == CORE
    assert _public(Backend) == CORE | {"name"}  # `limiter` is declared, each backend sets it
    for backend in (Cgroup2Backend, RegistryBackend):
        assert not backend.__abstractmethods__, backend


def test_limits_are_a_capability_with_exactly_the_limiter_methods(tmp_path):
    assert _public(CgroupLimiter) == LIMITER
    assert {name for name in dir(Limiter) if not name.startswith("_")} == LIMITER
    registry = RegistryBackend(str(tmp_path))
    try:
        assert registry.limiter is None and not LIMITER & _public(RegistryBackend)
        # Where there is none, the manager refuses limits and reads empty figures (cgturn/governance.py).
        mgr = TurnManager(backend=registry, state_dir=str(tmp_path))
        with pytest.raises(LimitsUnavailable, match="registry backend cannot enforce limits"):
            mgr.set_limits(Limits(pids_max=10))
        assert (mgr.limits(), mgr.usage()) == (Limits(), Usage())
    finally:
        registry.close()
