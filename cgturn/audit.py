"""The audit trail: one JSON-lines record per kill, whichever process killed (owner, sentinel, CLI).

Each record goes to the `cgturn.audit` logger and is appended to `<state_dir>/audit.jsonl` with a
single O_APPEND write, so concurrent writers never interleave within a line.
"""
from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger("cgturn.audit")

AUDIT_FILE = "audit.jsonl"


def audit_path(state_dir: str) -> str:
    return os.path.join(state_dir, AUDIT_FILE)


def record_kill(state_dir: str, *, task: str, turn: str, reason: str, pids: list[int],
                signals: list[str], duration_ms: float, backend: str) -> dict:
    """Write one kill record; returns it. A failing file write is logged, never raised: the kill
    already happened and must not be reported as failed because the log could not be written."""
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
    line = json.dumps(entry, ensure_ascii=False)
    log.info(line)
    try:
        os.makedirs(state_dir, exist_ok=True)
        fd = os.open(audit_path(state_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError as err:
        log.warning("cannot append to %s: %s", audit_path(state_dir), err)
    return entry


def read_records(state_dir: str) -> list[dict]:
    """Every parseable record of the audit log (oldest first); [] when there is none."""
    try:
        with open(audit_path(state_dir), encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
