"""The pressure guard (supervision): freeze or abandon the heaviest running turn when the watched
cgroup stalls, before the gateway starves; thaw when the pressure has stayed away.

This module is the guard's public settings, `PressureGuard` (validated at construction, carried to the
sentinel as JSON). The decisions are pure functions in cgturn.guard_policy; the loop that waits for the
kernel's PSI trigger and acts on the turns is cgturn.guard_runner.

`TurnManager(guard=PressureGuard(...))` runs the guard in the sentinel process (`attach`), and
`cgturn guard` runs it in the foreground for a unit of its own, so it acts precisely when the gateway
itself cannot run. One guard per managed root: the first to arm it owns it; its state (`over`,
`since`) is recorded on the managed root, and admission in any process reads it. See docs/guard.md.

Imports run one way: the guard starts the sentinel (`attach`); the sentinel's modules never import the
guard (its process entry, cgturn.sentinel_main, arms the runner).
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from . import probes
from .guard_policy import ACTIONS, WATCHES

if TYPE_CHECKING:
    from .guard_runner import GuardRunner
    from .manager import TurnManager

SETTINGS = ("resource", "trigger", "watch", "action", "thaw_after", "abandon_after")


class PressureGuard:
    """What the guard watches and does; validated at construction.

    Args:
        resource: "memory", "cpu" or "io": the PSI file watched and what "heaviest" means (memory in
            use; CPU time in the last window; bytes read+written in the last window).
        trigger: `some|full <stall us> <window us>` (kernel PSI trigger syntax, Documentation/accounting/psi.rst).
        watch: "owner" (the cgroup of the process that owns the manager: the gateway), "root" (the
            managed root: all turns together), "host" (/proc/pressure), or a cgroup directory.
        action: "freeze" the heaviest running turn, or "abandon" it (reason `pressure`).
        thaw_after: thaw guard-frozen turns once pressure stayed below the threshold this long (s).
        abandon_after: abandon a turn guard-frozen longer than this (s).

    Raises:
        ValueError: a setting breaks a rule (the message names it, for a trigger the kernel's).
    """

    def __init__(self, resource: str = "memory", trigger: str = "some 150000 1000000", watch: str = "owner",
                 action: str = "freeze", thaw_after: float = 5.0, abandon_after: float = 60.0):
        if resource not in probes.RESOURCES:
            raise ValueError(f"unknown resource {resource!r} (expected one of {', '.join(probes.RESOURCES)})")
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r} (expected one of {', '.join(ACTIONS)})")
        if not isinstance(watch, str) or not (watch in WATCHES or os.path.isabs(watch)):
            raise ValueError(f"watch must be one of {', '.join(WATCHES)} or an absolute cgroup path, not {watch!r}")
        for name, value in (("thaw_after", thaw_after), ("abandon_after", abandon_after)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
        self.parsed = probes.parse_trigger(trigger)
        self.resource, self.trigger, self.watch, self.action = resource, str(self.parsed), watch, action
        self.thaw_after, self.abandon_after = float(thaw_after), float(abandon_after)

    def __repr__(self) -> str:
        return (f"PressureGuard(resource={self.resource!r}, trigger={self.trigger!r}, watch={self.watch!r}, "
                f"action={self.action!r}, thaw_after={self.thaw_after:g}, abandon_after={self.abandon_after:g})")

    def check(self) -> None:
        """Check that this process may arm the trigger here.

        Raises:
            ValueError: the kernel would refuse the window (without CAP_SYS_RESOURCE, Linux 6.5+ takes
                only multiples of 2 s; before 6.5 it takes none).
        """
        probes.check_trigger(self.parsed)

    def to_json(self) -> dict[str, Any]:
        """The guard's settings as JSON (what the sentinel is started with).

        Returns:
            A dict of the six settings, which `from_json` reads back.
        """
        return {name: getattr(self, name) for name in SETTINGS}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "PressureGuard":
        """The guard `to_json` describes.

        Args:
            data: a dict with the six settings (extra keys are ignored).

        Raises:
            KeyError: a setting is missing. ValueError: a setting breaks a rule.
        """
        return cls(**{name: data[name] for name in SETTINGS})

    def runner(self, manager: TurnManager, owner_pid: int | None = None) -> "GuardRunner":
        """A runner of this guard for `manager`, not armed yet (`arm()`, then `run()`).

        Args:
            manager: a TurnManager of the managed root.
            owner_pid: the process whose cgroup `watch="owner"` means (default: this one).

        Returns:
            A cgturn.guard_runner.GuardRunner.
        """
        from .guard_runner import GuardRunner

        return GuardRunner(self, manager, owner_pid)

    def attach(self, manager: TurnManager) -> None:
        """Start `manager`'s sentinel with this guard armed in it (what `TurnManager(guard=...)` calls).

        Args:
            manager: the TurnManager whose `guard` this is.

        Raises:
            ValueError: the trigger is not allowed for this process, or the sentinel is switched off.
            GuardUnavailable: the sentinel could not arm the trigger (the reason is in the message).
            SentinelUnavailable: the sentinel could not start.
        """
        self.check()
        if not manager.sentinel_enabled:
            raise ValueError("the pressure guard runs in the sentinel, which is switched off "
                             "(sentinel=False / CGTURN_SENTINEL=0): run `cgturn guard` instead")
        from . import sentinel

        sentinel.attach(manager)
