"""Abandon notes: what a turn's owner needs to know when another process abandoned its turn.

An abandon removes the turn's cgroup (and the record on it) once the kill is done, so an owner that
learns of the abandon afterwards could not read who killed it, why, or what was killed. A killer that
is not the owner therefore leaves a small note for the owner before it returns:
`<state_dir>/outcomes/<hash of task key and turn key>.json` holding the ids, the turn's start time
(so a later turn reusing the ids is never confused with this one), the owner (pid + start time), the
reason, the killer's pid, the killed pids, the signals and the kill's duration.

The owner takes the note (reads and deletes it); `cgturn reap` removes notes whose owner is gone, and
a manager's `close()` those addressed to its process. Writing a note never stands between a kill and
its end: failures are logged, never raised.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Callable

from . import statefiles
from .logfields import turn_fields

log = logging.getLogger("cgturn")

NOTES_DIR = "outcomes"
# A note is a few hundred bytes plus its pids; anything much larger was not written by cgturn.
MAX_NOTE_BYTES = 4 * 1024 * 1024


def note_path(state_dir: str, task_key: str, turn_key: str) -> str:
    """Where the note for the turn at these encoded names lives (names hashed: each key may be 255 bytes)."""
    digest = hashlib.sha256(f"{task_key}/{turn_key}".encode("utf-8", "surrogateescape")).hexdigest()[:40]
    return os.path.join(state_dir, NOTES_DIR, digest + ".json")


def write_note(state_dir: str, note: dict[str, Any]) -> None:
    """Leave `note` (keys task_key, turn_key, started_at, owner_pid, owner_start, reason, killed_by,
    killed, signals, duration_ms, usage) for the turn's owner. Never raises."""
    path = note_path(state_dir, note["task_key"], note["turn_key"])
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = statefiles.open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(note, ensure_ascii=False).encode("utf-8", "backslashreplace"))
        finally:
            os.close(fd)
        os.replace(tmp, path)  # the owner never reads half a note
    except (OSError, TypeError, ValueError) as err:
        log.warning("cannot leave the abandon note %s for the owner of turn %r: %s", path,
                    note.get("turn_key"), err, extra=turn_fields(note.get("task"), note.get("turn"), note.get("reason")))


def read_note(path: str) -> dict[str, Any] | None:
    """The note at `path`, or None when it is missing, unreadable or not a note."""
    try:
        fd = statefiles.open_regular(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, MAX_NOTE_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        note = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return note if isinstance(note, dict) else None


def take_note(state_dir: str, task_key: str, turn_key: str, started_at: float) -> dict[str, Any] | None:
    """Read and delete the note for this turn; None when there is none for *this* turn (a note of an
    earlier turn with the same ids is left for `reap`)."""
    path = note_path(state_dir, task_key, turn_key)
    note = read_note(path)
    if note is None or (note.get("task_key"), note.get("turn_key"), note.get("started_at")) != (
            task_key, turn_key, started_at):
        return None
    try:
        os.unlink(path)
    except OSError:
        pass  # taken by a second reader of the same turn: the content is the same
    return note


def sweep(state_dir: str, keep: Callable[[dict[str, Any]], bool]) -> list[str]:
    """Remove every note for which `keep(note)` is false (and unreadable ones); returns their paths."""
    where = os.path.join(state_dir, NOTES_DIR)
    try:
        names = os.listdir(where)
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(where, name)
        note = read_note(path)
        if note is not None and keep(note):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed
