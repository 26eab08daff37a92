"""One instance per key: `Turn.spawn(argv, key=K)` refuses while a process spawned with key K in the
same task is alive (`AlreadyRunning`), across all the task's turns, completed ones included.

What a key names is the process spawn started (pid + start time, so a reused pid never holds a key),
not its descendants. Keys live on the turn records (`keys`: JSON `{key: [pid, start]}`), where every
process can read them; they are written under the turn's lock while the task's lock is held (flock on
the task's cgroup directory on cgroup v2, the SQLite write transaction on the registry), so a check and
the spawn that follows it are one step across processes (`spawn_keyed`).
"""
from __future__ import annotations

import json
import logging
import subprocess
from typing import TYPE_CHECKING, Any

from .errors import AlreadyRunning, LockTimeout
from .ids import MAX_ID_BYTES, validate_text
from .kernel import procfs
from .logfields import turn_fields
from .model import COMPLETED, RUNNING, Argv, TurnRecord

if TYPE_CHECKING:
    from .backends.base import Backend

log = logging.getLogger("cgturn")


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


def spawn_keyed(backend: "Backend", rec: TurnRecord, argv: Argv, key: str,
                popen_kwargs: dict[str, Any]) -> subprocess.Popen[Any]:
    """Spawn into `rec`'s turn unless a live process spawned with `key` in its task holds the key;
    check, spawn and record are one step under the task's lock.

    Raises:
        AlreadyRunning: a live process of the task holds `key` (`.pid`).
        LockTimeout: the turn's lock stayed held, so the key could not be recorded (the process
            spawned for it was killed).
        ValueError: a key that cannot name a spawn; otherwise as `Turn.spawn`.
    """
    validate(key)
    with backend.task_lock(rec.task_key):
        for other in backend.records(rec.task_key):
            held = parse(other.keys).get(key)
            if held is not None and holds(*held):
                raise AlreadyRunning(held[0], key, f"key {key!r} of task {rec.task_id!r} is held by process "
                                                   f"{held[0]} (turn {other.turn_id!r})")
        proc = backend.spawn(rec, argv, popen_kwargs)
        # Our unreaped child: its start time is its own (on cgroup2 the shim execs the target, same pid).
        started = procfs.start_time(proc.pid)
        if started is not None:  # None only once it is gone (and then it holds no key)
            try:
                _note_key(backend, rec, key, (proc.pid, started))
            except LockTimeout as busy:
                # A key that is not recorded guards nothing: the process it was for must not run.
                log.warning("killed process %d of turn %r of task %r: its key %r could not be recorded: %s",
                            proc.pid, rec.turn_id, rec.task_id, key, busy,
                            extra=turn_fields(rec.task_id, rec.turn_id, pids=[proc.pid]))
                proc.kill()
                proc.wait()
                raise LockTimeout(busy.path, f"record key {key!r} of the process spawned into turn {rec.turn_id!r} "
                                             f"(the process was killed)", busy.waited) from busy
    return proc


def _note_key(backend: "Backend", rec: TurnRecord, key: str, member: tuple[int, int]) -> None:
    """Record `key` -> member on the turn (dropping keys whose process is gone), under its lock."""
    for _ in range(3):  # the turn may complete between the load and the write
        current = backend.load(rec.task_key, rec.turn_key)
        if current is None or current.state not in (RUNNING, COMPLETED):
            return  # abandoned: its kill takes the process, and the key with it
        held = {k: v for k, v in parse(current.keys).items() if holds(*v)}
        held[key] = member
        won, _ = backend.transition(rec.task_key, rec.turn_key, {current.state}, current.state,
                                    {"keys": dump(held)})
        if won:
            return
