"""What `cgturn init` does before it runs the container's command: prove, move, enable, make the root.

In a container with a private cgroup namespace, the namespace root holds PID 1 and every `exec`'d
process, so no controller can be enabled below it (the "no internal processes" rule of cgroup v2)
until something moves them into a leaf. This module does that, in a fixed order, and only after
`kernel.nsroot.prove()` has checked, reading only, that the root is the container's own:

1. prove (nothing written if any check fails: `InitRefused`);
2. move the root's processes into the leaf `init`;
3. enable every controller the container was given in the root's `cgroup.subtree_control`;
4. make the managed root `<mount>/cgturn` (its layout then records the v2 controllers the root now
   delegates) and recover it, as `cgturn reap` would, for what a crashed gateway of an earlier run of a
   restarted container left.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from .kernel import nsroot
from .kernel.discovery import MANAGED_ROOT_NAME
from .manager import TurnManager


@dataclasses.dataclass(frozen=True)
class ContainerRoot:
    """What `init_container` did: where things are, what moved, what was enabled or refused."""

    namespace_root: str
    leaf: str
    managed_root: str
    moved: list[int]
    enabled: list[str]
    refused: dict[str, str]
    recovered: list[dict[str, Any]]


def init_container(mount: str = nsroot.DEFAULT_MOUNT, leaf: str = nsroot.DEFAULT_LEAF,
                   state_dir: str | None = None) -> ContainerRoot:
    """Make a container's cgroup-namespace root delegate its controllers to a cgturn managed root.

    Args:
        mount: where the container's cgroup2 filesystem is mounted.
        leaf: the child cgroup the root's processes (this one included) move into.
        state_dir: as `TurnManager(state_dir=)`.

    Returns:
        A ContainerRoot; its `managed_root` is what turns inside the container use (`CGTURN_ROOT`).

    Raises:
        InitRefused: the caller is not a container's init at its own namespace root; nothing moved.
        CgturnError: a step after the proof failed (the message says which and where).
    """
    root = nsroot.prove(mount)
    moved = nsroot.move_into_leaf(root, leaf)
    enabled, refused = nsroot.enable_controllers(root)
    managed = os.path.join(root.path, MANAGED_ROOT_NAME)
    manager = TurnManager(root=managed, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        manager.create_root()
        recovered = [action.to_json() for action in manager.recover()]
    finally:
        manager.close()
    return ContainerRoot(root.path, os.path.join(root.path, leaf), managed, moved, enabled, refused, recovered)
