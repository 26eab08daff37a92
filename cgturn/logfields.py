"""Structured fields on cgturn's log records about a turn (the `extra` of a logging call).

Every record cgturn logs about one turn carries `cgturn_task` and `cgturn_turn` (the original ids)
and `cgturn_reason` (why it was abandoned, frozen or thawed; None when no reason applies), plus
whichever of the fields below the line is about. Prefixed `cgturn_` so they never collide with a
LogRecord attribute. Documented in docs/events.md ("Log records").
"""
from __future__ import annotations

from typing import Any

PREFIX = "cgturn_"
# Every field a record may carry (beyond task, turn, reason), and what it holds.
FIELDS = {
    "pids": "list of int: the processes the line is about (killed, frozen, found)",
    "action": "str: audit records: kill, limit, freeze or thaw",
    "record": "dict: audit records: the whole JSON record (what the message holds as text)",
    "key": "str: a keyed spawn's key",
}


def turn_fields(task: str | None, turn: str | None, reason: str | None = None, **more: Any) -> dict[str, Any]:
    """`extra` for a log call about turn `turn` of task `task`: cgturn_task, cgturn_turn, cgturn_reason,
    and `cgturn_<name>` for each of `more` (names from FIELDS)."""
    fields = {"cgturn_task": task, "cgturn_turn": turn, "cgturn_reason": reason}
    for name, value in more.items():
        fields[PREFIX + name] = value
    return fields
