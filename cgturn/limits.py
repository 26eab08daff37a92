"""Resource limits and the figures a turn leaves behind: plain values, validated here, no I/O.

`Limits` says what a turn, a task or the managed root may use; `Usage` says what a turn used and which
limits the kernel enforced on it. The kernel layer maps these onto controller files (cgroup v2, or
the v1 hierarchies of a hybrid host); this module knows nothing of files.

Values: bytes (int, 0 to MAX_BYTES), pids (int, 1 to MAX_PIDS), cores (float, MIN_CPUS to MAX_CPUS),
weight (int 1-10000), or "max" (explicitly unlimited: removes a limit). None means "not set" at
creation and "unchanged" in `set_limits`. The bounds are what the kernel stores (below), so a value
that passes here is never refused, cut or wrapped by a controller file.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import os
import re
from dataclasses import dataclass
from typing import Any

UNLIMITED = "max"
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}
MAX_WEIGHT = 10000
# memory.max / memory.limit_in_bytes (and swap) go through page_counter_memparse (mm/page_counter.c):
# simple_strtoull wraps past 2**64 (2**64 reads back as 0 here), and anything from about 2**63 up is
# clamped to PAGE_COUNTER_MAX pages, the "no limit" value. So a size is at most LONG_MAX bytes.
MAX_BYTES = 2 ** 63 - 1
# pids.max, v1 and v2 alike (kernel/cgroup/pids.c, pids_max_write): EINVAL from PID_MAX_LIMIT + 1 on
# (4194304 on 64-bit; checked on Linux 6.18: 4194305 and 2**32 are refused in both hierarchies).
MAX_PIDS = 4 * 1024 * 1024
# cpus become a CFS quota per 100 ms period (kernel/controllers.py CPU_PERIOD_US). The kernel takes
# quotas from 1 ms (min_cfs_quota_period) to max_cfs_runtime = 2**44 - 1 us (kernel/sched/core.c,
# tg_set_cfs_bandwidth; EINVAL outside): 0.01 cores, and whole cores below the top.
CPU_PERIOD_US = 100_000
MIN_CPUS = 1000 / CPU_PERIOD_US
MAX_CPUS = float((2 ** 44 - 1) // CPU_PERIOD_US)
# A CPU-time limit (`cgturn run --cpu-time`) is checked against cpu.stat usage_usec (a u64 of
# microseconds). 10**9 s is 31 years of one core: anything above is a typo, and float seconds still
# carry whole microseconds there (below 2**53 us).
MAX_CPU_TIME = 1e9
# The kernel keeps memory limits in whole pages, rounding a size down (page_counter_memparse,
# mm/page_counter.c): below one page a cgroup may hold no page at all, so nothing can start in it.
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def parse_size(text: str) -> int | str:
    """`12`, `1.5G`, `512m`, `max` -> bytes (powers of 1024, rounded down) or "max".

    Raises ValueError with the rule for anything else (`12Q`, `-1`, `1.5.3G`, empty) and for sizes
    above MAX_BYTES (`99999999999T`: more than the kernel can store).
    """
    value = text.strip()
    if value.lower() == UNLIMITED:
        return UNLIMITED
    match = _SIZE.fullmatch(value)
    if not match:
        raise ValueError(f"not a size: {text!r} (a number with an optional K, M, G or T, or 'max')")
    # Exact arithmetic: a float would turn `12345678901234567` into another number. (fractions pulls
    # in decimal: imported by the one parser that needs it, not at every `cgturn` start.)
    from fractions import Fraction
    size = int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
    if size > MAX_BYTES:
        raise ValueError(f"size too large: {text!r} (at most {MAX_BYTES} bytes, just under 8 EiB, what the "
                         f"kernel stores; use 'max' for no limit)")
    return size


def parse_pids(text: str) -> int | str:
    """`50` or `max`; ValueError for anything not a whole number from 1 to MAX_PIDS."""
    value = text.strip()
    if value.lower() == UNLIMITED:
        return UNLIMITED
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_PIDS:
        raise ValueError(f"not a process count: {text!r} (a whole number from 1 to {MAX_PIDS}, or 'max')")
    return int(value)


def parse_cpus(text: str) -> float | str:
    """`1.5` (cores) or `max`; ValueError for anything outside MIN_CPUS..MAX_CPUS."""
    value = text.strip()
    if value.lower() == UNLIMITED:
        return UNLIMITED
    try:
        cores = float(value)
    except ValueError:
        raise ValueError(f"not a number of cores: {text!r} (e.g. 0.5, 2, or 'max')") from None
    problem = _cpus_problem(cores)
    if problem:
        raise ValueError(f"not a number of cores: {text!r} ({problem})")
    return cores


def parse_cpu_time(text: str) -> float:
    """CPU seconds for a CPU-time limit: a finite number > 0 and at most MAX_CPU_TIME.

    Raises ValueError for 0, negative numbers, nan, inf and anything above MAX_CPU_TIME.
    """
    try:
        seconds = float(text.strip())
    except ValueError:
        raise ValueError(f"not a number of CPU seconds: {text!r}") from None
    problem = cpu_time_problem(seconds)
    if problem:
        raise ValueError(f"not a CPU-time limit: {text!r} ({problem})")
    return seconds


def cpu_time_problem(seconds: object) -> str | None:
    """Why `seconds` cannot be a CPU-time limit, or None."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "must be a number of seconds"
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_CPU_TIME:
        return f"must be more than 0 and at most {MAX_CPU_TIME:.0f} seconds"
    return None


def parse_weight(text: str) -> int:
    """A CPU weight, 1-10000 (100 is the kernel's default)."""
    value = text.strip()
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_WEIGHT:
        raise ValueError(f"not a cpu weight: {text!r} (a whole number from 1 to {MAX_WEIGHT})")
    return int(value)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a turn, a task or the managed root may use.

    Args:
        memory_max: hard memory limit in bytes; the kernel reclaims, then OOM-kills (v2 memory.max,
            v1 memory.limit_in_bytes). Lowering it below current use follows the same rule.
        memory_high: throttling threshold in bytes (v2 memory.high; not available on v1).
        swap_max: swap the turn may use on top of memory (v2 memory.swap.max; v1 needs memory_max
            and sets memory.memsw.limit_in_bytes = memory_max + swap_max).
        pids_max: processes and threads at once (pids.max): fork fails beyond it.
        cpus: CPU time as a number of cores, e.g. 1.5 (v2 cpu.max; v1 CFS quota/period).
        cpu_weight: relative share under contention, 1-10000, 100 = default (v2 cpu.weight; v1
            cpu.shares, where 100 maps to 1024).
        oom_group: on OOM kill the whole turn rather than one process (v2 memory.oom.group). None:
            the layout's default (v2: True). v1 has no group kill: True raises LimitsUnavailable.
    """

    memory_max: int | str | None = None
    memory_high: int | str | None = None
    swap_max: int | str | None = None
    pids_max: int | str | None = None
    cpus: float | str | None = None
    cpu_weight: int | None = None
    oom_group: bool | None = None

    def __post_init__(self) -> None:
        for name in ("memory_max", "memory_high", "swap_max"):
            _check(name, getattr(self, name), 0, MAX_BYTES)
        _check("pids_max", self.pids_max, 1, MAX_PIDS)
        if self.cpus is not None and self.cpus != UNLIMITED:
            if isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float)):
                raise ValueError(f"cpus must be a number of cores or 'max', not {self.cpus!r}")
            problem = _cpus_problem(self.cpus)
            if problem:
                raise ValueError(f"cpus {problem}, not {self.cpus!r}")
        if self.cpu_weight is not None and (isinstance(self.cpu_weight, bool) or not isinstance(self.cpu_weight, int)
                                            or not 1 <= self.cpu_weight <= MAX_WEIGHT):
            raise ValueError(f"cpu_weight must be a whole number from 1 to {MAX_WEIGHT}, not {self.cpu_weight!r}")
        if self.oom_group is not None and not isinstance(self.oom_group, bool):
            raise ValueError(f"oom_group must be True, False or None, not {self.oom_group!r}")
        high, top = self.memory_high, self.memory_max
        if isinstance(high, int) and isinstance(top, int) and high > top:
            raise ValueError(f"memory_high ({high}) must not exceed memory_max ({top})")

    def is_empty(self) -> bool:
        """True when nothing is set (every field None)."""
        return _field_values(self) == _NOTHING_SET  # one C call: asked three times per begin_turn

    def merged(self, changes: "Limits") -> "Limits":
        """These limits with every field `changes` sets (None leaves a field unchanged)."""
        updates = changes.to_stored()
        # Limits are frozen: with nothing to change, these are the merged limits (every turn of a
        # root without limits merges empty ones, twice per begin_turn).
        return dataclasses.replace(self, **updates) if updates else self

    def to_json(self) -> dict[str, Any]:
        """The limits as `ps --json` and `cgturn limits --json` show them: null = no limit."""
        values = [getattr(self, name) for name in _FIELDS]  # _FIELDS: not dataclasses.fields() per call
        return {name: None if value == UNLIMITED else value for name, value in zip(_FIELDS, values)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Limits":
        """Limits stored by `to_stored` (unknown keys ignored); ValueError if a value is invalid."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_stored(self) -> dict[str, Any]:
        """Only the fields that are set, "max" kept (what a turn's record holds)."""
        return {name: value for name in _FIELDS if (value := getattr(self, name)) is not None}


_FIELDS = tuple(f.name for f in dataclasses.fields(Limits))
_field_values = operator.attrgetter(*_FIELDS)
_NOTHING_SET = (None,) * len(_FIELDS)


def stored_limits(text: str | None) -> Limits:
    """Limits stored as JSON text (a turn record's `limits`, `Limits.to_stored()`); empty when there
    are none or they cannot be read."""
    if not text:
        return NO_LIMITS
    try:
        return Limits.from_json(json.loads(text))
    except (ValueError, TypeError, AttributeError):
        return NO_LIMITS


def under_one_page(limits: Limits) -> int | None:
    """The `memory_max` of `limits` when it is less than one page (PAGE_SIZE), else None."""
    value = limits.memory_max
    return value if isinstance(value, int) and value < PAGE_SIZE else None


@functools.lru_cache(maxsize=256)
def stored_under_one_page(text: str | None) -> int | None:
    """under_one_page of limits stored as JSON text (a turn record's `limits`); remembered per text,
    since every spawn asks it of the record it holds."""
    return under_one_page(stored_limits(text)) if text else None


def refuse_budget_under_one_page(limits: Limits, level: str) -> None:
    """Refuse a task's or the managed root's memory budget under one page.

    The kernel would make no turn's cgroup below it (a new cgroup's own structures are charged to
    its parent: ENOMEM at mkdir), and the turns already there could start nothing. Refused where it
    is set, so a spawn can trust its turn's own record alone and read no limit file.

    Args:
        limits: the budget asked for.
        level: what it is for, as the message names it ("task 'x'", "the managed root").

    Raises:
        ValueError: `limits.memory_max` is less than PAGE_SIZE.
    """
    size = under_one_page(limits)
    if size is not None:
        raise ValueError(f"memory_max of {level} is {size} bytes, less than one page ({PAGE_SIZE}): no turn "
                         "could be made or start anything below it")


def _check(name: str, value: object, minimum: int, maximum: int) -> None:
    if value is None or value == UNLIMITED:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be a whole number from {minimum} to {maximum} or 'max', not {value!r}")


def _cpus_problem(cores: float) -> str | None:
    """Why `cores` cannot be a CPU limit (the kernel's quota bounds, see MIN_CPUS), or None."""
    if not math.isfinite(cores) or not MIN_CPUS <= cores <= MAX_CPUS:
        return (f"must be from {MIN_CPUS} to {MAX_CPUS:.0f}: the kernel's CPU quota is at least "
                f"1 ms per {CPU_PERIOD_US // 1000} ms period")
    return None


@dataclass(slots=True)
class Usage:
    """What a turn used, and which limits the kernel enforced on it.

    Counters are the turn's own cgroup's (`memory.events` oom_kill, `pids.events` max, `cpu.stat`
    throttled_usec; on v1 `memory.oom_control`, `memory.max_usage_in_bytes`, `cpu.stat`
    throttled_time), hierarchical where the kernel makes them so.

    `memory_peak_bytes` and `cpu_throttled_seconds` are None where the kernel does not report them
    (no memory or cpu controller on the turn).
    """

    oom_kills: int = 0
    pids_max_hits: int = 0
    memory_peak_bytes: int | None = None
    cpu_seconds: float = 0.0
    cpu_throttled_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        """Every figure by field name: the `usage` object of `cgturn limits --json` and the audit log."""
        # Numbers and None only: no deep copy (dataclasses.asdict's), which an abandon's audit paid.
        return dict(zip(_USAGE_FIELDS, _usage_values(self)))


_USAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Usage))
_usage_values = operator.attrgetter(*_USAGE_FIELDS)


NO_LIMITS = Limits()  # frozen: one shared empty value for the hot paths
