"""Where the pressure guard's state lives, so that admission in any process can read it.

On cgroup v2 the state is one JSON xattr (`user.cgturn.guard`) on the managed root; the registry
fallback keeps it in `<state_dir>/guard.json`. The state names its owner (pid + start time, so a
reused pid is never taken for a live guard): a state whose owner is gone is no guard at all.

One guard per managed root: `claim` writes the caller's state only when no live guard owns the root,
under the managed root's flock on cgroup v2 (two guards arming at once cannot both win; a holder
that keeps it past dirlock.LOCK_WAIT makes the claim fail, GuardUnavailable, rather than wait). The registry
file is claimed without a lock (a narrow race between two guards started in the same instant;
documented in docs/guard.md).
"""
from __future__ import annotations

import json
import logging
import os

from ..errors import GuardUnavailable, LockTimeout
from ..kernel import procfs
from ..statefiles import open_regular

log = logging.getLogger("cgturn")

XATTR_KEY = "user.cgturn.guard"
STATE_FILE = "guard.json"
MAX_STATE = 4096


def load(backend) -> dict | None:
    """The stored guard state (a dict with at least `owner_pid`, `owner_start`, `over`), or None."""
    raw = _read(backend)
    if not raw:
        return None
    try:
        state = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("owner_pid"), int) \
            or not isinstance(state.get("owner_start"), int):
        return None
    return state


def owner_alive(state: dict | None) -> bool:
    """True if the state's owner process (pid + start time) still runs."""
    if not state:
        return False
    return procfs.alive_or_unknown(state.get("owner_pid"), state.get("owner_start"))


def live(backend) -> dict | None:
    """The state of the guard armed on this managed root, or None when none is (its owner died, or
    it recorded that it could not arm)."""
    state = load(backend)
    return state if state is not None and state.get("armed", True) and owner_alive(state) else None


def pressing(backend) -> dict | None:
    """The live guard's state while it reports pressure (`over`), else None: what admission waits on."""
    state = live(backend)
    return state if state is not None and state.get("over") else None


def claim(backend, state: dict) -> dict | None:
    """Store `state` if no live guard owns the managed root. Returns None when claimed, else the
    owner's state (nothing written).

    Raises:
        GuardUnavailable: another process kept the managed root's lock past its bound (nothing written).
    """
    root = _root(backend)
    if root is None:
        current = live(backend)
        if current is not None and not _mine(current, state):
            return current
        save(backend, state)
        return None
    backend.ensure_root()
    try:
        with root.lock("claim the managed root for a pressure guard"):
            current = live(backend)
            if current is not None and not _mine(current, state):
                return current
            save(backend, state)
    except LockTimeout as busy:
        raise GuardUnavailable(str(busy)) from busy
    return None


def save(backend, state: dict) -> None:
    """Write the state (the owner updates `over`/`since`). Raises OSError when it cannot be stored."""
    data = json.dumps(state, sort_keys=True).encode()
    root = _root(backend)
    if root is not None:
        root.set_xattr(XATTR_KEY, data)
        return
    path = _file(backend)
    tmp = f"{path}.{os.getpid()}.tmp"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def release(backend, state: dict) -> None:
    """Remove the state if it is still the caller's (a guard that stops leaves no claim behind)."""
    current = load(backend)
    if current is None or not _mine(current, state):
        return
    root = _root(backend)
    try:
        if root is not None:
            root.remove_xattr(XATTR_KEY)
        else:
            os.unlink(_file(backend))
    except OSError as err:
        log.warning("could not remove the guard state: %s", err.strerror or err)


def _mine(current: dict, state: dict) -> bool:
    return (current.get("owner_pid"), current.get("owner_start")) == (state["owner_pid"], state["owner_start"])


def _root(backend):
    """The managed root's Cgroup on cgroup v2; None on the registry fallback."""
    return backend.root if backend.name == "cgroup2" else None


def _file(backend) -> str:
    return os.path.join(os.path.dirname(backend.db_path), STATE_FILE)


def _read(backend) -> bytes | None:
    root = _root(backend)
    if root is not None:
        try:
            return root.get_xattr(XATTR_KEY)
        except OSError as err:
            log.info("cannot read the guard state of %s: %s", root.path, err.strerror or err)
            return None
    try:
        fd = open_regular(_file(backend), os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, MAX_STATE)
    finally:
        os.close(fd)
