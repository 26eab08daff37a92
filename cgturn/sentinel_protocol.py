"""The sentinel's message protocol: what the owner and its sentinel say to each other, built and
checked in one place so that neither end can drift from the other.

Channel: an AF_UNIX SOCK_SEQPACKET socketpair; each datagram is one JSON object with `op` and `v`, the
protocol version. Owner to sentinel: `track` (a turn's deadlines), `touch` (activity), `untrack` (the
turn ended), `lease` (a completed turn's lease expiry, wall clock), `watch` (the turn's CPU-time limit
and whether its first OOM kill abandons it). Sentinel to owner, once: `ready`
or `error`. Times are CLOCK_MONOTONIC except a lease's expiry.

Versions: the owner starts its sentinel with `--protocol VERSION`; a sentinel of another version
refuses to start (it answers `error`, naming both versions, so the owner raises SentinelUnavailable),
an owner refuses a `ready` of another version, and a sentinel drops (and logs) any message of another
version. An owner from before versioning (no `v`, ops `guard`/`unguard`) is thereby refused too, never
half understood.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any

from . import ids

# Bump on any change a peer of the previous version would misread (2: `watch`, which a version-1
# sentinel would drop, leaving a CPU-time limit unenforced).
VERSION = 2
# The largest datagram either end accepts. Ids are at most ids.MAX_ID_BYTES each, so a `track` (two
# ids, each byte escaped as \u00XX at worst) always fits; anything larger is refused, never cut.
MAX_MESSAGE = 65536
OWNER_OPS = ("track", "touch", "untrack", "lease", "watch")
SENTINEL_OPS = ("ready", "error")


def key(task_id: str, turn_id: str) -> list[str]:
    """The encoded names (task_key, turn_key) a message addresses a turn by."""
    return [ids.encode(task_id), ids.encode(turn_id)]


def track(task_id: str, turn_id: str, deadline: float | None, inactivity: float | None, grace: float,
          last: float) -> dict[str, Any]:
    """Track a turn: abandon it at `deadline` or after `inactivity` s from `last` (both monotonic)."""
    return {"v": VERSION, "op": "track", "key": key(task_id, turn_id), "task": task_id, "turn": turn_id,
            "deadline": deadline, "inactivity": inactivity, "grace": grace, "last": last}


def touch(task_id: str, turn_id: str, at: float) -> dict[str, Any]:
    """The turn was active at monotonic time `at`."""
    return {"v": VERSION, "op": "touch", "key": key(task_id, turn_id), "at": at}


def untrack(task_key: str, turn_key: str) -> dict[str, Any]:
    """The turn ended: forget its deadlines."""
    return {"v": VERSION, "op": "untrack", "key": [task_key, turn_key]}


def lease(task_key: str, turn_key: str, expires_at: float | None) -> dict[str, Any]:
    """A completed turn's survivors may live until wall clock `expires_at` (None: no lease)."""
    return {"v": VERSION, "op": "lease", "key": [task_key, turn_key], "expires_at": expires_at}


def watch(task_id: str, turn_id: str, cpu_time: float | None, oom: bool, grace: float) -> dict[str, Any]:
    """Abandon the turn once its CPU use passes `cpu_time` seconds (reason `cpu-time`, with `grace`),
    and, when `oom`, at its first OOM kill (reason `oom`, no grace)."""
    return {"v": VERSION, "op": "watch", "key": key(task_id, turn_id), "task": task_id, "turn": turn_id,
            "cpu_time": cpu_time, "oom": oom, "grace": grace}


def ready(log_problem: str | None) -> dict[str, Any]:
    """The sentinel's first word when it can track turns (`log_problem`: why it logs to stderr)."""
    return {"v": VERSION, "op": "ready", "log_problem": log_problem}


def error(message: str, guard: bool = False) -> dict[str, Any]:
    """The sentinel's first word when it cannot start (`guard`: the pressure guard could not arm)."""
    return {"v": VERSION, "op": "error", "message": message, "guard": guard}


def encode(message: dict[str, Any]) -> bytes:
    """One datagram. Raises ValueError when it is larger than MAX_MESSAGE (it is never cut)."""
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"sentinel message of {len(data)} bytes; the limit is {MAX_MESSAGE}")
    return data


def version_problem(version: Any) -> str | None:
    """Why a peer speaking `version` is not understood, or None when it speaks this one."""
    if version == VERSION and not isinstance(version, bool):
        return None
    said = "no version (an older cgturn)" if version is None else f"version {version!r:.20}"
    return f"protocol {said}, this cgturn speaks version {VERSION}"


def parse_message(data: bytes) -> dict[str, Any]:
    """One datagram from the owner, checked field by field.

    Returns:
        The message, `key` a tuple of the two encoded names.

    Raises:
        ValueError: bad UTF-8 or JSON, another protocol version, an unknown op, a missing or
            mistyped field.
    """
    msg = _decode(data)
    if (problem := version_problem(msg.get("v"))) is not None:
        raise ValueError(problem)
    if msg.get("op") not in OWNER_OPS:
        raise ValueError(f"not a {', '.join(OWNER_OPS)} message")
    key_ = msg.get("key")
    if not (isinstance(key_, list) and len(key_) == 2 and all(isinstance(k, str) and k for k in key_)):
        raise ValueError(f"bad key {key_!r:.80}")
    out: dict[str, Any] = {"op": msg["op"], "key": tuple(key_)}
    if msg["op"] in ("track", "watch"):
        for name in ("task", "turn"):
            out[name] = ids.validate(msg.get(name), name)
        if key(out["task"], out["turn"]) != key_:
            raise ValueError("key does not match the ids")
        out["grace"] = _number(msg, "grace", optional=True) or 0.0
    if msg["op"] == "track":
        out["deadline"] = _number(msg, "deadline", optional=True)
        out["inactivity"] = _number(msg, "inactivity", optional=True)
        last = _number(msg, "last", optional=True)
        out["last"] = time.monotonic() if last is None else last
    elif msg["op"] == "watch":
        out["cpu_time"] = _number(msg, "cpu_time", optional=True)
        if not isinstance(msg.get("oom"), bool):
            raise ValueError(f"oom is not true or false: {msg.get('oom')!r:.40}")
        out["oom"] = msg["oom"]
    elif msg["op"] == "touch":
        out["at"] = _number(msg, "at")
    elif msg["op"] == "lease":
        out["expires_at"] = _number(msg, "expires_at", optional=True)
    return out


def parse_reply(data: bytes) -> dict[str, Any]:
    """The sentinel's first datagram to the owner.

    Returns:
        {"op": "ready", "log_problem": str | None} or {"op": "error", "message": str, "guard": bool}.

    Raises:
        ValueError: not JSON, another protocol version (the sentinel is not this cgturn's), or neither op.
    """
    msg = _decode(data)
    if msg.get("op") == "error" and msg.get("v") is None:
        # A sentinel from before versioning that could not start: its reason still counts.
        return {"op": "error", "message": str(msg.get("message")), "guard": bool(msg.get("guard"))}
    if (problem := version_problem(msg.get("v"))) is not None:
        raise ValueError(f"the sentinel speaks {problem}")
    if msg.get("op") == "ready":
        problem_ = msg.get("log_problem")
        return {"op": "ready", "log_problem": str(problem_) if problem_ else None}
    if msg.get("op") == "error":
        return {"op": "error", "message": str(msg.get("message")), "guard": bool(msg.get("guard"))}
    raise ValueError(f"not a {' or '.join(SENTINEL_OPS)} message: {data[:80]!r}")


def _decode(data: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as err:
        raise ValueError(str(err)) from None
    if not isinstance(msg, dict):
        raise ValueError("not a JSON object")
    return msg


def _number(msg: dict[str, Any], field: str, optional: bool = False) -> float | None:
    value = msg.get(field)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{field} is not a finite number >= 0: {value!r:.40}")
    return float(value)
