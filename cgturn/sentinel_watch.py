"""What the sentinel holds per turn: its clocks (`TurnClock`: deadline, inactivity timeout) and, for
a turn watched for a CPU-time limit or its first OOM kill (`cgturn run --cpu-time`,
`--oom-kills-turn`), when to look at its counters next and what they say (`Watch`).

The sentinel reads a watched turn's counters (cpu.stat usage, the OOM-kill count: `Usage`). A turn's
processes cannot use more than one CPU second per CPU per wall second, so the next look at its CPU
use comes when the rest of its allowance could at the earliest be used up, never sooner than
MIN_CPU_LOOK: an idle turn costs almost nothing, and the overshoot is at most MIN_CPU_LOOK times the
number of CPUs, plus the kill. OOM kills are counted by the kernel and looked at every OOM_LOOK.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import clocks, reasons

if TYPE_CHECKING:
    from .limits import Usage

# Added to every due time in the sentinel: covers the owner's touch rate limit and lets the
# in-process watchdog (which fires the interrupt and knows the exact activity) act first when it can.
SLACK = 0.25
# How often a turn watched for its first OOM kill is looked at (v1's memory.oom_control counts kills
# but has no pollable change notification short of cgroup.event_control's eventfd).
OOM_LOOK = 0.05
# The shortest wait between two looks at a watched turn's CPU use.
MIN_CPU_LOOK = 0.01
# Every CPU the turn's processes may run on: os.cpu_count() bounds any affinity mask or cpuset.
CPUS = os.cpu_count() or 1


@dataclass
class TurnClock:
    """One tracked turn: its deadlines as the sentinel sees them."""

    task: str
    turn: str
    deadline: float | None
    inactivity: float | None
    grace: float
    last: float
    # Frozen time the clocks leave out, learnt from the turn's record when a due time arrives.
    frozen: clocks.FrozenTime = field(default_factory=clocks.FrozenTime)

    def due(self) -> tuple[float, str] | None:
        """(monotonic time at which to abandon, reason), or None when only owner death ends it."""
        return clocks.due(self.deadline, self.inactivity, self.last, self.frozen, SLACK)

    def due_after_look(self, state: tuple[float, bool], now: float) -> tuple[float, str] | None:
        """`due` once a fresh `clocks.frozen_state` of the turn's record is accounted."""
        return clocks.due_after_look(self.deadline, self.inactivity, self.last, self.frozen, state, now, SLACK)


@dataclass
class Watch:
    """One watched turn: its CPU-time limit, whether its first OOM kill ends it, and the next look."""

    task: str
    turn: str
    cpu_time: float | None
    oom: bool
    grace: float
    next_look: float

    def after(self, cpu_seconds: float, now: float) -> float:
        """When to look again, given the CPU seconds used by now."""
        later = now + OOM_LOOK if self.oom else float("inf")
        if self.cpu_time is not None:
            later = min(later, now + max(MIN_CPU_LOOK, (self.cpu_time - cpu_seconds) / CPUS))
        return later

    def verdict(self, usage: "Usage") -> str | None:
        """The reason to abandon the turn now, given what it used, or None."""
        if self.oom and usage.oom_kills > 0:
            return reasons.OOM
        if self.cpu_time is not None and usage.cpu_seconds >= self.cpu_time:
            return reasons.CPU_TIME
        return None
