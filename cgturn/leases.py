"""Leases for survivors: how long what a completed turn left running may live.

`Turn.complete(keep_for=S)` stamps the turn's record with `expires_at` (wall clock); `Turn.set_lease`
moves or clears it. The lease clock runs whether the turn is frozen or not. Expiry is an abandon with
reason `lease-expired`, carried out by whichever process sees it first: the owner's sentinel (for the
turns its owner leased), `cgturn reap`, or `TurnManager(recover=True)`. The record is the one truth:
an expiry is a compare-and-set on it, so a lease extended meanwhile is never cut short.
"""
from __future__ import annotations

import math
import os

from .model import COMPLETED, TurnRecord

ENV_LEASE = "CGTURN_LEASE"


def validate(seconds, name: str = "keep_for") -> float | None:
    """`seconds` as a float (>= 0; `math.inf` means no lease), or None; ValueError for anything else."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 or None, not {seconds!r}")
    return float(seconds)


def expires_at(now: float, seconds: float | None) -> float | None:
    """When a lease of `seconds` taken at `now` expires; None for no lease (None or infinite)."""
    return None if seconds is None or math.isinf(seconds) else now + seconds


def default_lease(value=None) -> float | None:
    """The manager-wide default: the keyword when given, else env CGTURN_LEASE (seconds; empty or
    "none" for no lease). Raises ValueError for a value that is not a duration."""
    if value is not None:
        return validate(value, "lease")
    text = os.environ.get(ENV_LEASE, "").strip()
    if not text or text.lower() == "none":
        return None
    try:
        return validate(float(text), ENV_LEASE)
    except ValueError:
        raise ValueError(f"{ENV_LEASE} must be a number of seconds >= 0, not {text!r}") from None


def expired(rec: TurnRecord | None, now: float) -> bool:
    """True when `rec` is a completed turn whose lease has run out at wall clock `now`."""
    return rec is not None and rec.state == COMPLETED and rec.expires_at is not None and rec.expires_at <= now
