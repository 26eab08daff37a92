"""The audit trail: one JSON-lines record per kill, whichever process killed (owner, sentinel, CLI).

Each record goes to the `cgturn.audit` logger and is appended to `<state_dir>/audit.jsonl` with a
single O_APPEND write, so concurrent writers never interleave within a line.
"""
from __future__ import annotations

import json
import logging
import os
import time

from . import statefiles
from .logfields import turn_fields

log = logging.getLogger("cgturn.audit")

AUDIT_FILE = "audit.jsonl"


def audit_path(state_dir: str) -> str:
    return os.path.join(state_dir, AUDIT_FILE)


def record_kill(state_dir: str, *, task: str, turn: str, reason: str, pids: list[int],
                signals: list[str], duration_ms: float, backend: str, usage: dict | None = None) -> dict:
    """Write one kill record; returns it. Never raises for the log's sake: the kill already happened
    and must not be reported as failed because the log could not be written. A failing write is
    logged; text that cannot be UTF-8 (a lone surrogate in a reason) is written as a JSON escape."""
    entry = {
        "time": time.time(),
        "task": task,
        "turn": turn,
        "reason": reason,
        "pids": sorted(pids),
        "signals": signals,
        "duration_ms": round(duration_ms, 3),
        "backend": backend,
        "by_pid": os.getpid(),
    }
    if usage is not None:  # what the turn used and which limits the kernel enforced (cgturn.Usage)
        entry["usage"] = usage
    _append(state_dir, entry)
    return entry


def record_limit(state_dir: str, *, task: str, turn: str, reason: str, count: int, limit: int | str | None,
                 backend: str) -> dict:
    """Write one `limit` record: the kernel enforced a limit on the turn `count` more times (reason
    `oom`: processes OOM-killed; `pids-max`: forks refused). No pids, no signals: not a kill."""
    entry = {"time": time.time(), "action": "limit", "task": task, "turn": turn, "reason": reason,
             "count": count, "limit": limit, "backend": backend, "by_pid": os.getpid()}
    _append(state_dir, entry)
    return entry


def record_action(state_dir: str, *, action: str, task: str, turn: str, reason: str, pids: list[int],
                  backend: str) -> dict:
    """Write one `freeze` or `thaw` record (who asked: reason `user` or `guard`/`pressure`)."""
    entry = {"time": time.time(), "action": action, "task": task, "turn": turn, "reason": reason,
             "pids": sorted(pids), "backend": backend, "by_pid": os.getpid()}
    _append(state_dir, entry)
    return entry


def _append(state_dir: str, entry: dict) -> None:
    line = json.dumps(entry, ensure_ascii=False)
    log.info(line, extra=turn_fields(entry["task"], entry["turn"], entry["reason"], action=entry.get("action", "kill"),
                                     pids=entry.get("pids", []), record=entry))
    path = audit_path(state_dir)
    try:
        os.makedirs(state_dir, exist_ok=True)
        fd = statefiles.open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            # backslashreplace turns a lone surrogate into the JSON escape \udcff: still one valid line.
            os.write(fd, (line + "\n").encode("utf-8", "backslashreplace"))
        finally:
            os.close(fd)
    except OSError as err:
        log.warning("cannot append to %s: %s", path, err.strerror or err)


def read_records(state_dir: str) -> list[dict]:
    """Every parseable record of the audit log (oldest first); [] when there is none, or when it is
    not a regular file (logged)."""
    path = audit_path(state_dir)
    try:
        fd = statefiles.open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return []
    except OSError as err:
        log.warning("cannot read %s: %s", path, err.strerror or err)
        return []
    with open(fd, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
