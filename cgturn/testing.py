"""What tests and benchmarks need from cgturn that is not public API: forcing a spawn path, reading the
pressure guard's state, a turn's v1 directories.

An ownership-layer module, so that faces (scripts/, tests) can reach these without importing the
backends or the kernel layer themselves. Nothing here is needed to use cgturn; names may change
between releases.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .backends import guard_state, seal, spawn_paths
from .kernel import posix_spawn
from .kernel import spawn as kspawn

if TYPE_CHECKING:
    from .manager import TurnManager
    from .turn import Turn

# The spawn paths of the cgroup2 backend, preferred first (see cgturn/backends/spawn_paths.py).
CLONE3, POSIX_SPAWN, SHIM = spawn_paths.CLONE3, spawn_paths.POSIX_SPAWN, spawn_paths.SHIM
SPAWN_PATHS = (CLONE3, POSIX_SPAWN, SHIM)


def spawn_paths_available() -> list[str]:
    """The spawn paths `Turn.spawn` may take here now, preferred first (what `cgturn doctor` shows).

    Returns:
        A list of CLONE3, POSIX_SPAWN, SHIM; SHIM always last.
    """
    return spawn_paths.available()


def spawn_path_unavailable(path: str) -> str | None:
    """Why `path` cannot be forced on this host, or None when it can.

    Args:
        path: one of SPAWN_PATHS.

    Returns:
        None for the shim and for a native path whose code this host has (the extension is built;
        the C library has posix_spawnattr_setcgroup_np, glibc 2.39+), else the reason.

    Raises:
        ValueError: `path` names no spawn path.
    """
    if path not in SPAWN_PATHS:
        raise ValueError(f"no spawn path {path!r} (one of {', '.join(SPAWN_PATHS)})")
    if path == CLONE3 and not kspawn.clone3_built():
        return "cgturn._spawn is not built here"
    if path == POSIX_SPAWN and not posix_spawn.available():
        return "the C library has no posix_spawnattr_setcgroup_np (glibc < 2.39)"
    return None


@contextlib.contextmanager
def forced_spawn_path(path: str) -> Iterator[None]:
    """Make `path` the way cgroup2 spawns take in this process until the block ends (trio-style: the
    capability flags decided once at import are set, then restored, whatever the block did to them).

    Args:
        path: one of SPAWN_PATHS; any other name (e.g. "registry") turns both native paths off.

    Raises:
        ValueError: `path` is a native path this host lacks (`spawn_path_unavailable`).
    """
    why = spawn_path_unavailable(path) if path in SPAWN_PATHS else None
    if why is not None:
        raise ValueError(f"cannot force spawn path {path!r}: {why}")
    flags = spawn_paths.forced(path)
    saved = {flag: getattr(spawn_paths, flag) for flag in flags}
    try:
        for flag, value in flags.items():
            setattr(spawn_paths, flag, value)
        yield
    finally:
        for flag, value in saved.items():
            setattr(spawn_paths, flag, value)


def native_seal_works() -> bool:
    """Whether a sealed spawn on the clone3 path builds its sandbox in the C extension here (else it
    execs bubblewrap): docs/security.md."""
    return seal.native_works()


@contextlib.contextmanager
def forced_bubblewrap_seal() -> Iterator[None]:
    """Make sealed spawns exec bubblewrap on every path until the block ends, as where the
    extension's sandbox cannot be built."""
    saved = seal.native_works
    seal.native_works = lambda: False  # restored below
    try:
        yield
    finally:
        seal.native_works = saved


def guard_pressing(manager: TurnManager) -> dict[str, Any] | None:
    """The state of the pressure guard armed on `manager`'s managed root while it reports pressure
    (what admission waits on), else None.

    Args:
        manager: any manager of the managed root (the guard's or another process's).
    """
    return guard_state.pressing(manager.backend)


def guard_live(manager: TurnManager) -> dict[str, Any] | None:
    """The state of the pressure guard armed on `manager`'s managed root, or None when none is."""
    return guard_state.live(manager.backend)


def v1_dirs(manager: TurnManager, turn: Turn | None = None) -> dict[str, str]:
    """The cgroup v1 directories (controller -> path) of `turn`, or of the managed root when None:
    empty where the managed root has no v1 places (pure cgroup v2, or the registry).

    Args:
        manager: the turn's manager.
        turn: a turn of `manager`, or None for the managed root.
    """
    layout = getattr(manager.backend, "layout", None)
    if layout is None:
        return {}
    names = () if turn is None else (turn.record.task_key, turn.record.turn_key)
    dirs: dict[str, str] = layout.v1_dirs(*names)
    return dirs
