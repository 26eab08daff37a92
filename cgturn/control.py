"""The state changes and look-ups that `Turn`, the supervision layer and recovery need from a manager,
kept off `TurnManager`'s public surface (which is what applications call).

A `TurnControl` is reached as `manager._control`: the underscore says it is not for applications; the
layers above ownership use it as their one door into a manager's turns (docs/design.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # transitional: the implementations move here from the manager (issue: the house)
    from .manager import TurnManager


class TurnControl:
    """Friend operations of one manager, addressed by encoded names (task_key, turn_key)."""

    def __init__(self, manager: "TurnManager") -> None:
        self._m = manager

    def record(self, task_key: str, turn_key: str) -> Any:
        """The stored record of the turn at these names, read fresh; None when it does not exist."""
        return self._m.backend.load(task_key, turn_key)

    def views(self) -> list[Any]:
        """Every existing turn with its live pids and usage (TurnView), as the backend sees them."""
        return self._m.backend.views()

    def complete_turn(self, task_key: str, turn_key: str, keep_for: float | None = None,
                      figures: bool = False) -> Any:
        return self._m.complete_turn(task_key, turn_key, keep_for, figures)

    def abandon_turn(self, task_key: str, turn_key: str, reason: str, grace: float, force: bool = False,
                     when: Callable[[Any], bool] | None = None) -> Any:
        return self._m.abandon_turn(task_key, turn_key, reason, grace, force, when)

    def finish_kill(self, rec: Any) -> Any:
        return self._m.finish_kill(rec)

    def take_abandon_note(self, task_key: str, turn_key: str, started_at: float) -> Any:
        return self._m.take_abandon_note(task_key, turn_key, started_at)

    def turn_usage_quietly(self, rec: Any) -> Any:
        return self._m.turn_usage_quietly(rec)

    def adopt_into(self, rec: Any, pid: int) -> None:
        self._m.adopt_into(rec, pid)

    def running_turns_of_caller(self) -> list[tuple[str, str]]:
        return self._m.running_turns_of_caller()

    def owner_alive(self, rec: Any) -> bool:
        return self._m.owner_alive(rec)

    def turn_state(self, task_key: str, turn_key: str) -> str | None:
        return self._m.turn_state(task_key, turn_key)

    def check_limits(self, task_key: str, turn_key: str, usage: Any = None, rec: Any = None) -> list[dict[str, Any]]:
        return self._m.check_limits(task_key, turn_key, usage, rec)

    def freeze_turn(self, task_key: str, turn_key: str, by: str = "user") -> list[int]:
        return self._m.freeze_turn(task_key, turn_key, by)

    def thaw_turn(self, task_key: str, turn_key: str, by: str = "user") -> list[int]:
        return self._m.thaw_turn(task_key, turn_key, by)

    def set_lease(self, task_key: str, turn_key: str, seconds: float | None) -> Any:
        return self._m.set_lease(task_key, turn_key, seconds)

    def expire_lease(self, task_key: str, turn_key: str) -> Any:
        return self._m.expire_lease(task_key, turn_key)

    def spawn_keyed(self, rec: Any, argv: Any, key: str, popen_kwargs: dict[str, Any]) -> Any:
        return self._m.spawn_keyed(rec, argv, key, popen_kwargs)

    def backend(self) -> Any:
        """The manager's backend, for the one ownership-layer module that reads backend state on the
        supervision layer's behalf (cgturn.probes: the guard's state on the managed root)."""
        return self._m.backend
