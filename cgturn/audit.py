"""The audit trail: one JSON-lines record per kill, whichever process killed (owner, sentinel, CLI),
and the one parser of its lines (the metrics exporter reads the log through it).

Each record goes to the `cgturn.audit` logger and is appended to `<state_dir>/audit.jsonl` with a
single O_APPEND write, so concurrent writers never interleave within a line.

Rotation is cgturn's own, by size: the writer whose record takes the log past `max_bytes()`
(`CGTURN_AUDIT_MAX_BYTES`, default 64 MiB; 0 never rotates) renames it to `audit.jsonl.1` (shifting
`.1`.. up to KEEP generations, the oldest dropped) and the next record starts a new file. Renaming,
never copying and truncating, is what lets a reader that tracks the file's inode (the metrics
exporter's AuditTail) finish the old file from where it stopped and never count a record twice or lose
one; logrotate's `copytruncate` loses the records written between its copy and its truncate.

Format: one JSON object per line with `v` (the format version, FORMAT), `time`, `action` (`kill`
when absent: the first records had none), `task`, `turn`, `reason`, `backend`, `by_pid`, and per
action: `pids`, `signals`, `duration_ms` (and `usage`) for a kill, `count` and `limit` for a limit
event, `pids` for a freeze or thaw. A line without `v` is format 0, which has the same fields: it is
read exactly as format 1. A later format may add fields; one that changed what these fields mean
would give them new names, so a reader reads any version's lines by the rules of `parse_line`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time

from . import statefiles
from .logfields import turn_fields

log = logging.getLogger("cgturn.audit")

AUDIT_FILE = "audit.jsonl"
FORMAT = 1
FORMAT_FIELD = "v"
KILL = "kill"
LIMIT = "limit"
# Rotated generations kept beside the log: audit.jsonl.1 (newest) .. audit.jsonl.KEEP (oldest).
KEEP = 3
MAX_BYTES_ENV = "CGTURN_AUDIT_MAX_BYTES"
CLAIM_SUFFIX = ".rotating"   # the rotating writer's claim, beside the log
CLAIM_STALE = 10.0           # seconds after which a claim is a dead writer's
DEFAULT_MAX_BYTES = 64 << 20
_ENCODER = json.JSONEncoder(ensure_ascii=False)  # json.dumps with a keyword builds one per call


def audit_path(state_dir: str) -> str:
    return os.path.join(state_dir, AUDIT_FILE)


def rotated_path(path: str, generation: int) -> str:
    """Where generation `generation` (1 = the newest) of the log at `path` is kept after rotation."""
    return f"{path}.{generation}"


def max_bytes() -> int:
    """The size past which a writer rotates the log: `CGTURN_AUDIT_MAX_BYTES` (bytes; 0 never
    rotates), DEFAULT_MAX_BYTES when unset or not a whole number (logged)."""
    raw = os.environ.get(MAX_BYTES_ENV, "")
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        log.warning("%s=%r is not a whole number of bytes: rotating at %d", MAX_BYTES_ENV, raw, DEFAULT_MAX_BYTES)
        return DEFAULT_MAX_BYTES
    return value


def record_kill(state_dir: str, *, task: str, turn: str, reason: str, pids: list[int],
                signals: list[str], duration_ms: float, backend: str, usage: dict | None = None) -> dict:
    """Write one kill record; returns it. Never raises for the log's sake: the kill already happened
    and must not be reported as failed because the log could not be written. A failing write is
    logged; text that cannot be UTF-8 (a lone surrogate in a reason) is written as a JSON escape."""
    entry = {
        FORMAT_FIELD: FORMAT,
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
    entry = {FORMAT_FIELD: FORMAT, "time": time.time(), "action": LIMIT, "task": task, "turn": turn, "reason": reason,
             "count": count, "limit": limit, "backend": backend, "by_pid": os.getpid()}
    _append(state_dir, entry)
    return entry


def record_action(state_dir: str, *, action: str, task: str, turn: str, reason: str, pids: list[int],
                  backend: str) -> dict:
    """Write one `freeze` or `thaw` record (who asked: reason `user` or `guard`/`pressure`)."""
    entry = {FORMAT_FIELD: FORMAT, "time": time.time(), "action": action, "task": task, "turn": turn, "reason": reason,
             "pids": sorted(pids), "backend": backend, "by_pid": os.getpid()}
    _append(state_dir, entry)
    return entry


def _append(state_dir: str, entry: dict) -> None:
    line = _ENCODER.encode(entry)
    if log.isEnabledFor(logging.INFO):  # its `extra` is built only for a logger that takes the record
        log.info(line, extra=turn_fields(entry["task"], entry["turn"], entry["reason"],
                                         action=entry.get("action", KILL), pids=entry.get("pids", []), record=entry))
    path = audit_path(state_dir)
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT
    try:
        try:
            fd, st = statefiles.open_regular_stat(path, flags)
        except FileNotFoundError:  # the state directory's first record: made now, not looked for each time
            os.makedirs(state_dir, exist_ok=True)
            fd, st = statefiles.open_regular_stat(path, flags)
        try:
            # backslashreplace turns a lone surrogate into the JSON escape \udcff: still one valid line.
            data = (line + "\n").encode("utf-8", "backslashreplace")
            # The fstat that checked the file serves the line check and the rotation's size and inode.
            if not _ends_a_line(fd, st.st_size):
                data = b"\n" + data  # a short write (a full disk) left half a line: never glue onto it
            os.write(fd, data)
            _rotate_if_full(path, st.st_size + len(data), st.st_ino)
        finally:
            os.close(fd)
    except OSError as err:
        log.warning("cannot append to %s: %s", path, err.strerror or err)


def _ends_a_line(fd: int, size: int) -> bool:
    """Whether the log, `size` bytes long, is empty or ends with a newline (every whole write leaves it so)."""
    return size == 0 or os.pread(fd, 1, size - 1) == b"\n"


def _rotate_if_full(path: str, size: int, inode: int) -> None:
    """Rename the log at `path` (inode `inode`, at least `size` bytes once this process's record is
    in: other writers may have appended too) to generation 1 when it has reached `max_bytes()`.

    Best effort and never blocking: the kill that wrote the record is done. One writer rotates at a
    time: the one that creates the claim file `<log>.rotating` (O_EXCL) and still finds its file at
    `path` (a writer that lost the race finds the new log there, or none). A claim older than
    CLAIM_STALE seconds was left by a writer that died mid-rotation (a rotation takes milliseconds):
    it is removed, and a later record rotates.
    """
    limit = max_bytes()
    if limit == 0 or size < limit:
        return
    claim = path + CLAIM_SUFFIX
    try:
        os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - os.lstat(claim).st_mtime > CLAIM_STALE:
                os.unlink(claim)
        return
    except OSError as err:
        log.warning("cannot rotate %s: %s", path, err.strerror or err)
        return
    try:
        if os.stat(path).st_ino != inode:
            return
        for generation in range(KEEP - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.rename(rotated_path(path, generation), rotated_path(path, generation + 1))
        os.rename(path, rotated_path(path, 1))
    except OSError as err:
        log.warning("cannot rotate %s: %s", path, err.strerror or err)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(claim)


def open_log(path: str) -> int:
    """An O_RDONLY fd of the audit log at `path`, refused unless it is a regular file
    (`statefiles.open_regular`: a FIFO or a symlink to /dev/zero is never read).

    Raises:
        FileNotFoundError: there is no log (yet).
        OSError: it cannot be opened, or is not a regular file.
    """
    return statefiles.open_regular(path, os.O_RDONLY)


def read_records(state_dir: str) -> list[dict]:
    """Every record of the audit log and its rotated generations that `parse_line` accepts, oldest
    first.

    Returns:
        The records as written; [] when there is no log; a file that is not a regular file is
        skipped (logged).
    """
    path = audit_path(state_dir)
    lines: list[str] = []
    for name in [rotated_path(path, g) for g in range(KEEP, 0, -1)] + [path]:
        try:
            fd = open_log(name)
        except FileNotFoundError:
            continue
        except OSError as err:
            log.warning("cannot read %s: %s", name, err.strerror or err)
            continue
        with open(fd, encoding="utf-8", errors="replace") as f:
            lines.extend(f.readlines())
    return [record for record in map(parse_line, lines) if record is not None]


def parse_line(line: bytes | str) -> dict | None:
    """One audit line as the record it holds, or None when it holds none.

    The log is writable by others, so nothing in it is trusted: a record is a JSON object whose
    `v` (when present) is a whole number >= 0, whose `action` and `reason` are strings, and whose
    action's own fields have their types: a kill has a non-empty reason, `pids` a list of ints and
    `duration_ms` a finite number >= 0 (both may be absent); a limit event a non-empty reason and a
    whole `count` >= 0 (absent: 1).

    Args:
        line: one line of the log (its newline may be included).

    Returns:
        The record as written (absent fields stay absent: read them with `action_of`, `pids_of`,
        `duration_of`, `count_of`), or None.
    """
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's limit
        return None
    if not isinstance(record, dict):
        return None
    version = record.get(FORMAT_FIELD, 0)
    if not _whole(version):
        return None
    action = action_of(record)
    reason = record.get("reason", None if action in (KILL, LIMIT) else "")
    if not isinstance(action, str) or not isinstance(reason, str):
        return None
    if action == LIMIT:
        return record if reason and _whole(record.get("count", 1)) else None
    if action != KILL:
        return record
    pids, duration = record.get("pids", []), record.get("duration_ms", 0.0)
    if not reason or not isinstance(pids, list) or not all(_int(p) for p in pids):
        return None
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not 0 <= duration < math.inf:
        return None  # NaN fails the comparison too
    return record


def action_of(record: dict) -> str:
    """A record's action: `kill` when it has none (the first format's kill records)."""
    action: str = record.get("action", KILL)
    return action


def pids_of(record: dict) -> list[int]:
    """The pids a record names ([] when it names none)."""
    pids: list[int] = record.get("pids", [])
    return pids


def duration_of(record: dict) -> float:
    """A kill record's duration in seconds (0 when absent)."""
    return float(record.get("duration_ms", 0.0)) / 1000.0


def count_of(record: dict) -> int:
    """How many times a limit record's counter increased (1 when absent)."""
    count: int = record.get("count", 1)
    return count


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole(value: object) -> bool:
    return _int(value) and value >= 0  # type: ignore[operator]
