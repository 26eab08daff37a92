"""What observers of a manager see: the listener hooks, the `turn_ended` event and the listener list.

A leaf below ownership: it names no manager and no Turn class. A hook that receives a turn is typed by
`TurnHandle`, the few properties a hook may rely on (a `cgturn.Turn` has them all), so the backends and
the model, which sit below ownership, never import it back (docs/design.md, the layer map).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

if TYPE_CHECKING:
    from .limits import Usage
    from .model import TurnRecord

log = logging.getLogger("cgturn")


class TurnHandle(Protocol):
    """What a hook receives as `turn` (`turn_begun`, `turn_touched`): a `cgturn.Turn`, typed by what
    hooks may rely on."""

    @property
    def task_id(self) -> str:
        """The task's original id."""
        ...

    @property
    def turn_id(self) -> str:
        """The turn's original id."""
        ...

    @property
    def names(self) -> tuple[str, str]:
        """(task_key, turn_key): the encoded directory names (what CGTURN_TASK/CGTURN_TURN hold)."""
        ...

    @property
    def started_at(self) -> float:
        """When the turn began (wall clock)."""
        ...

    @property
    def last_activity(self) -> float:
        """`time.monotonic()` of the last `touch()` (or of the turn's creation)."""
        ...


@dataclass(slots=True)
class TurnEnded:
    """The `turn_ended` listener event: a turn completed or was abandoned, by this process.

    Emitted once the end is final: for a completion right after the state change (`reason` None,
    no figures), for an abandon once the kill is done (`reason`, and the kill's `killed`, `killed_by`,
    `signals`, `duration_ms`, `usage`). `task_id`/`turn_id` are the original ids; `task_key`/`turn_key`
    the encoded directory names (`names` is the pair).
    """

    task_id: str
    turn_id: str
    task_key: str
    turn_key: str
    state: str
    reason: str | None = None
    killed: list[int] = field(default_factory=list)
    killed_by: int | None = None
    signals: list[str] = field(default_factory=list)
    duration_ms: float = 0.0
    usage: "Usage | None" = None

    @property
    def names(self) -> tuple[str, str]:
        """(task_key, turn_key): the encoded directory names."""
        return self.task_key, self.turn_key

    @property
    def key(self) -> tuple[str, str]:
        """Deprecated alias of `names` ("key" is what `Turn.spawn(key=)` takes)."""
        warnings.warn("TurnEnded.key is deprecated: use TurnEnded.names", DeprecationWarning, stacklevel=2)
        return self.names


class TurnListener(Protocol):
    """The hooks of an observer registered with `TurnManager.add_listener` (docs/events.md).

    Every hook is optional: the manager calls the ones an object has. Subclass this to implement a
    few (the others stay no-ops) and have a type checker check their signatures. Hooks run
    synchronously in the thread that caused the event, for this process's own actions only; they must
    be cheap and must not raise (an exception is logged and never reaches the caller).
    """

    def turn_begun(self, turn: TurnHandle) -> None:
        """`begin_turn` created `turn` (running).

        Args:
            turn: the new `cgturn.Turn`.
        """
        return None  # a no-op: subclasses implement the hooks they need

    def turn_touched(self, turn: TurnHandle) -> None:
        """`turn.touch()` recorded activity (inactivity clocks restart).

        Args:
            turn: the `cgturn.Turn` touched.
        """
        return None

    def turn_ended(self, event: TurnEnded) -> None:
        """A turn completed or was abandoned by this process (after the kill: its figures are final).

        Args:
            event: what ended and how.
        """
        return None

    def lease_set(self, record: "TurnRecord") -> None:
        """A completed turn's lease was set, moved or cleared.

        Args:
            record: the turn's record after the change (`expires_at`: wall clock, or None).
        """
        return None

    def manager_closed(self) -> None:
        """`TurnManager.close()` was called."""
        return None


class Listeners:
    """The observers of one manager's turns (the sentinel client, a gateway's hooks), in the order
    they were added. Each hook is called synchronously; a failing one is logged and never breaks
    ownership."""

    def __init__(self) -> None:
        self._items: list[object] = []

    def add(self, listener: object) -> None:
        """Register `listener` (any object with some of `TurnListener`'s hooks)."""
        self._items.append(listener)

    def __iter__(self) -> Iterator[object]:
        return iter(tuple(self._items))

    def emit(self, event: str, *args: Any) -> None:
        """Call hook `event` with `args` on every listener that has it; exceptions are logged."""
        for listener in tuple(self._items):
            hook = getattr(listener, event, None)
            if hook is not None:
                try:
                    hook(*args)
                except Exception:  # noqa: BLE001 - an observer must never break ownership
                    log.exception("cgturn listener %r failed on %s", listener, event)


class ManagerAddOn(Protocol):
    """What `TurnManager(guard=)` needs of its guard (a `cgturn.PressureGuard`): the manager attaches
    it once it is built and shows its settings; it never imports the supervision layer."""

    def attach(self, manager: Any) -> None:
        """Start watching for `manager` (a `cgturn.TurnManager`)."""
        ...

    def to_json(self) -> dict[str, Any]:
        """The add-on's settings as JSON."""
        ...
