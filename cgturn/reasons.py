"""Why a turn was abandoned: the one vocabulary of reasons, shared by every layer and the audit log.

A reason is free text chosen by whoever abandons a turn (`Turn.abandon(reason)`, `cgturn stop
--reason`); the names below are the ones cgturn itself records. Reasons end up in the turn's record,
the audit log and metrics labels, so `validate` refuses what those cannot carry, before anything is
touched.
"""
from __future__ import annotations

import warnings
from typing import Any

from .ids import validate_text

TIMEOUT = "timeout"              # inactivity timeout (supervisor, sentinel, `cgturn run --timeout`)
DEADLINE = "deadline"            # hard deadline since the turn started
STOP = "stop"                    # an explicit /stop (`Supervisor.stop`, `cgturn stop`)
NEW_SESSION = "new-session"      # /new: the task moved on to a new session
DISCONNECT = "disconnect"        # the client of a run went away
ERROR = "error"                  # the supervised worker raised
CANCELLED = "cancelled"          # the awaiting coroutine was cancelled
OWNER_DIED = "owner-died"        # the process that began the turn is gone (sentinel, recovery)
END_TASK = "end-task"            # `TurnManager.end_task`, `cgturn end`
LEASE_EXPIRED = "lease-expired"  # a completed turn's survivors outlived their lease (Turn.complete(keep_for=))
REAP_ON_EXIT = "reap-on-exit"    # `cgturn run --reap-on-exit`: the command exited
NOT_FOUND = "not-found"          # `cgturn run`: the command could not be found
NOT_EXECUTABLE = "not-executable"  # `cgturn run`: the command could not be executed
SIGNAL_PREFIX = "signal:"        # `cgturn run` got a signal: `signal:SIGINT`
OOM = "oom"                      # the kernel OOM-killed a turn's process (a `limit` audit record), or
                                 # the sentinel abandoned the turn at that kill (`cgturn run --oom-kills-turn`)
CPU_TIME = "cpu-time"            # the turn's CPU use passed its CPU-time limit (`cgturn run --cpu-time`)
PIDS_MAX = "pids-max"            # a `limit` audit record: the pids limit refused a fork
PRESSURE = "pressure"            # the pressure guard abandoned the heaviest turn, or one frozen too long
CORRUPT_RECORD = "corrupt-record"  # recovery killed a turn directory without a trustworthy record
PYTEST_LEAK = "pytest-leak"      # the pytest plugin killed what a test left running
PYTEST_SESSION_END = "pytest-session-end"
# What an abandon is said to be for when the record of who abandoned the turn has no reason (a kill
# finished for a killer that died before writing one, another process's abandon seen without its note).
UNRECORDED = "unrecorded"

MAX_REASON_BYTES = 1024


def for_signal(name: str) -> str:
    """The reason for a turn abandoned because `cgturn run` received signal `name` (e.g. SIGINT)."""
    return SIGNAL_PREFIX + name


def validate(reason: object) -> str:
    """Return `reason` if it can be recorded; raise ValueError with a one-line reason otherwise.

    Refused: non-strings, blank strings, NUL, text that is not valid UTF-8 (lone surrogates, as
    `sys.argv` carries undecodable bytes), and more than MAX_REASON_BYTES bytes.
    """
    return validate_text(reason, "reason", MAX_REASON_BYTES)


def __getattr__(name: str) -> Any:
    # PEP 562: `reasons.UNKNOWN` was the name of UNRECORDED (and was the state's word "abandoned").
    if name == "UNKNOWN":
        warnings.warn("cgturn.reasons.UNKNOWN is deprecated: use cgturn.reasons.UNRECORDED", DeprecationWarning,
                      stacklevel=2)
        return UNRECORDED
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
