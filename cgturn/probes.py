"""What the supervision layer reads from the kernel and the backends, in one ownership-layer module: the
pressure guard's PSI trigger and per-turn loads (RSS, io.stat), its state on the managed root, the
cgroup of the process a guard watches. (The sentinel's pidfd of its owner is cgturn.processes.open_owner:
the sentinel's start imports none of the guard's kernel readers.)

Supervision (the guard, the sentinel) decides; this module only reads and arms, so that no supervision
module imports `cgturn.kernel` or `cgturn.backends` (docs/design.md, the layer map). Everything else
supervision needs from a manager goes through `manager._control` (cgturn.control).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .backends import guard_state
from .kernel import cgroupfiles, discovery, observe, procfs, psi

if TYPE_CHECKING:
    from .manager import TurnManager

# The PSI vocabulary the guard's settings are checked against (cgturn.kernel.psi).
RESOURCES = psi.RESOURCES
Trigger = psi.Trigger
ArmedTrigger = psi.ArmedTrigger
parse_trigger = psi.parse_trigger
pressure_file = psi.pressure_file


def check_trigger(trigger: psi.Trigger) -> None:
    """Raise ValueError when this process may not arm `trigger` here (the kernel's CAP_SYS_RESOURCE
    rule for windows, Linux 6.5+: see cgturn.kernel.psi.check_privilege)."""
    psi.check_privilege(trigger, psi.privileged(), psi.kernel_version())


def owner_cgroup_dir(pid: int) -> str | None:
    """The cgroup directory of `pid` on the cgroup2 mount; None when it sits in the root cgroup (a host
    whose processes all share the v2 root), is gone, or its cgroup is not visible from here."""
    mount, fsroot = discovery.find_cgroup2_mount()
    rel = procfs.cgroup_of(pid)
    if mount is None or rel in (None, "/"):
        return None
    path = discovery.own_cgroup_dir(mount, fsroot or "/", f"0::{rel}\n")
    return None if path == os.path.normpath(mount) else path


def turn_load(view: Any, resource: str) -> float:
    """One turn's load for the guard's "heaviest": memory in use (the cgroup's figure, else the summed
    RSS of its pids), bytes read+written (io.stat; CPU time without the io controller), CPU seconds."""
    if resource == "memory":
        memory = view.memory_bytes if view.memory_bytes is not None else observe.rss_bytes(view.pids)
        return float(memory or 0)
    if resource == "io" and view.path and (io := cgroupfiles.read_io_bytes(view.path)) is not None:
        return float(io)
    return float(view.cpu_seconds)


def claim_guard(manager: "TurnManager", state: dict[str, Any]) -> dict[str, Any] | None:
    """Record `state` as the managed root's guard unless a live guard owns it (under the root's lock).
    Returns None when claimed, else the owner's state (cgturn.backends.guard_state.claim)."""
    return guard_state.claim(manager._control.backend, state)


def save_guard(manager: "TurnManager", state: dict[str, Any]) -> None:
    """Write the guard's state on the managed root. Raises OSError when it cannot be stored."""
    guard_state.save(manager._control.backend, state)


def release_guard(manager: "TurnManager", state: dict[str, Any]) -> None:
    """Remove the guard's state if it is still `state`'s owner's."""
    guard_state.release(manager._control.backend, state)


def live_guard(manager: "TurnManager") -> dict[str, Any] | None:
    """The state of the guard armed on the managed root, or None when none is (or its owner died)."""
    return guard_state.live(manager._control.backend)

