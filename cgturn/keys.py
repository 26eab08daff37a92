"""One instance per key: `Turn.spawn(argv, key=K)` refuses while a process spawned with key K in the
same task is alive (`AlreadyRunning`), across all the task's turns, completed ones included.

What a key names is the process spawn started (pid + start time, so a reused pid never holds a key),
not its descendants. Keys live on the turn records (`keys`: JSON `{key: [pid, start]}`), where every
process can read them; they are written under the turn's lock while the task's lock is held (flock on
the task's cgroup directory on cgroup v2, the SQLite write transaction on the registry), so a check and
the spawn that follows it are one step across processes. Helpers here; the manager does the rest.
"""
from __future__ import annotations

import json

from .ids import MAX_ID_BYTES, validate_text
from .kernel import procfs


def validate(key: object) -> str:
    """Return `key` if it can name a spawn; ValueError otherwise (blank, NUL, not UTF-8, too long)."""
    return validate_text(key, "key", MAX_ID_BYTES)


def parse(text: str | None) -> dict[str, tuple[int, int]]:
    """The `keys` field of a record: {key: (pid, start time)}; entries of the wrong shape are dropped."""
    if not text:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: (v[0], v[1]) for k, v in data.items()
            if isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)}


def dump(held: dict[str, tuple[int, int]]) -> str | None:
    """The `keys` field for `held` (None when empty)."""
    return json.dumps({k: list(v) for k, v in sorted(held.items())}) if held else None


def holds(pid: int, start: int) -> bool:
    """True while the process that got a key lives (one we may not look at is taken as alive)."""
    return procfs.alive_or_unknown(pid, start)


def live(text: str | None) -> dict[str, int]:
    """{key: pid} of a record's keyed spawns that are still alive (what `ps --json` shows)."""
    return {key: pid for key, (pid, start) in parse(text).items() if holds(pid, start)}
