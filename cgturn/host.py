"""What this host offers and which backend owns turns here: decided once, without writing anything.

`discover_host` looks (read-only); `choose_backend` turns what it saw and what the caller asked for
into a backend, passing the capabilities down instead of letting the backend find them again;
`doctor_report` is the same decision in words, for `cgturn doctor`.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .backends.base import Backend
from .errors import CgroupUnavailable
from .kernel import discovery, userscope
from .kernel.discovery import HostInfo as HostInfo  # defined by the kernel layer, exported here

log = logging.getLogger("cgturn")

BACKENDS = ("auto", "cgroup2", "registry")


def discover_host(root: str | None = None) -> HostInfo:
    """What this host offers for owning turns, judged without writing anything.

    Reads /proc/self/mountinfo (the cgroup2 mount), /proc/self/cgroup (the caller's cgroup) and the
    managed root's parent (writable? `cgroup.kill` present? controllers delegated?). Creates nothing.

    Args:
        root: the managed root to judge; else env CGTURN_ROOT, else `<own cgroup>/cgturn`.

    Returns:
        A HostInfo: `usable` or not, with the reasons in `problems`.
    """
    return discovery.discover(root)


def wanted_backend(name: str | None) -> str:
    """The backend asked for: `name`, else CGTURN_BACKEND, else "auto". Raises ValueError when unknown."""
    choice = name or os.environ.get("CGTURN_BACKEND") or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"unknown backend {choice!r} (expected one of {', '.join(BACKENDS)})")
    return choice


def backend_name(host: HostInfo, wanted: str) -> str:
    """Which backend `wanted` means on `host`: "cgroup2" or "registry".

    Raises:
        ValueError: an explicitly given managed root is not a usable path (relative, outside the
            cgroup2 mount, no parent) and `wanted` is not "registry": a mistyped root is an error,
            never a quiet change of backend.
        CgroupUnavailable: cgroup v2 was asked for (by name, or by an explicit root) and is unusable.
    """
    if wanted == "registry":
        return "registry"
    if host.usable:
        return "cgroup2"
    why = "; ".join(host.problems) or "unknown reason"
    if host.root_explicit and host.cgroup2_mount is not None and host.managed_root is None:
        raise ValueError(why)
    if wanted == "cgroup2" or host.root_explicit:
        raise CgroupUnavailable("cgroup v2 is not usable: " + why)
    log.info("cgroup v2 not usable (%s); using the registry fallback", why)
    return "registry"


def choose_backend(host: HostInfo, wanted: str, state_dir: str) -> Backend:
    """The backend that owns turns for `wanted` ("auto", "cgroup2", "registry") on `host`.

    Constructing it creates nothing: the managed root, the registry database and the spawn gates
    are made by the first operation that needs them. Raises as `backend_name`.
    """
    if backend_name(host, wanted) == "cgroup2":
        from .backends.cgroup2 import Cgroup2Backend

        mount, fsroot = discovery.find_cgroup2_mount()
        root, mount = host.managed_root, mount or host.cgroup2_mount
        if root is None or mount is None:  # backend_name said usable: not reached
            raise CgroupUnavailable(f"cgroup v2 is not usable: {'; '.join(host.problems) or 'no managed root'}")
        before_root = ScopeJoin(host.systemd_scope) if host.systemd_scope is not None else None
        return Cgroup2Backend(root, mount, state_dir, fsroot or "/", cgroup_kill=host.cgroup_kill,
                              before_root=before_root)
    from .backends.registry import RegistryBackend

    return RegistryBackend(state_dir)


class ScopeJoin:
    """What a backend in cgturn's systemd scope calls before it creates anything: the caller joins
    the scope (kernel/userscope.py), once per process; logged once, shown by `doctor`."""

    def __init__(self, scope: "userscope.ScopePlan"):
        self.scope = scope
        self._pid: int | None = None
        self._lock = threading.Lock()

    def __call__(self) -> None:
        if self._pid == os.getpid():  # joined (a forked child is in the scope too, but checks again)
            return
        with self._lock:
            if self._pid != os.getpid():
                if userscope.join(self.scope):
                    log.info("cgturn moved this process (%d) into %s (systemd %s manager, Delegate=yes): "
                                "its cgroup was not writable; turns live in %s", os.getpid(), self.scope.owners,
                                self.scope.manager, self.scope.managed_root)
                self._pid = os.getpid()


def doctor_report(root: str | None = None, backend: str | None = None, state_dir: str | None = None) -> dict[str, Any]:
    """What `cgturn doctor --json` prints: the host, the backend that would be used, and why.

    Read-only: it creates nothing (no managed root, no database, no probe directory).

    Args:
        root: as `TurnManager(root=)` (and CGTURN_ROOT).
        backend: as `TurnManager(backend=)` (and CGTURN_BACKEND).
        state_dir: where the registry fallback keeps the pressure guard's state.

    Returns:
        The documented `doctor --json` object (`backend`, `cgroup2_mount`, `managed_root`,
        `cgroup_kill`, `controllers`, `problems`, `limits`, `spawn_paths`, `guard`, ...).
    """
    from .backends import spawn_paths

    host = discover_host(root)
    wanted = wanted_backend(backend)
    problems = list(host.problems)
    if host.delegated is False and host.writable:
        # A unit's cgroup systemd did not delegate (CGROUP_DELEGATION.md: not the user's to arrange).
        # cgturn only makes child cgroups there, never writes the unit's subtree_control; systemd
        # kills them with the unit.
        problems.append(f"{os.path.dirname(host.managed_root or '')} is writable but systemd did not delegate it "
                        "(no user.delegate/trusted.delegate mark): turns work there, limits need Delegate=yes")
    limits = {"layout": None, "available": [], "problems": ["cgroup v2 is not usable: no limits"]}
    guard = None
    try:
        name = backend_name(host, wanted)
        usable = True
        where = state_dir or os.environ.get("CGTURN_STATE_DIR") or "/nonexistent"
        guard = _guard_report(choose_backend(host, wanted, where), problems)  # creates nothing
        if name == "cgroup2" and host.systemd_scope is not None and not host.systemd_scope.exists:
            limits["problems"] = [f"decided when the first turn makes {host.systemd_scope.unit}: the controllers "
                                  f"its slice hands down are {' '.join(host.controllers) or 'none'}"]
        elif name == "cgroup2":
            limiter = choose_backend(host, wanted, "/nonexistent").limiter  # creates nothing
            if limiter is not None:
                limits = limiter.report()
        else:
            limits["problems"] = ["the registry backend cannot enforce limits (they need cgroups)"]
    except (ValueError, CgroupUnavailable):
        name, usable = "registry", False
        asked = "--backend cgroup2" if wanted == "cgroup2" else f"managed root {host.managed_root or root!r}"
        problems.append(f"{asked} was asked for but cgroup v2 is not usable there")
    container_init = _container_init_hint(host, problems)
    # pip hides the optional build's failure. Only a problem where the shim is what is left: glibc
    # 2.39+'s posix_spawn path is as race-free and vfork-fast (the test host has it, and no extension).
    if name == "cgroup2" and not spawn_paths.can_clone3 and not spawn_paths.can_posix_spawn:
        problems.append("the clone3 extension cgturn._spawn is not built (docs/install.md): spawns are slower")
    return {
        "backend": name,
        "cgroup2_mount": host.cgroup2_mount,
        "managed_root": host.managed_root,
        "own_cgroup": host.own_cgroup,
        "cgroup_kill": host.cgroup_kill,
        "controllers": host.controllers,
        "writable": host.writable,
        "problems": problems,
        "usable": usable,
        "delegated": host.delegated,
        "systemd_scope": host.systemd_scope.to_json() if host.systemd_scope is not None else None,
        "limits": limits,
        # preferred first (docs/design.md#how-spawn-works); the registry spawns with plain Popen
        "spawn_paths": spawn_paths.available() if name == "cgroup2" else ["shim"],
        "guard": guard,
        "container_init": container_init,
    }


def _container_init_hint(host: HostInfo, problems: list[str]) -> dict[str, Any] | None:
    """At a container's cgroup-namespace root holding its processes: what `cgturn init` would enable
    (`{"would_enable": [...]}`, with a problem line saying so), else None. Read-only."""
    from .kernel import nsroot

    if host.cgroup2_mount is None:
        return None
    would = nsroot.would_enable(host.cgroup2_mount, host.own_cgroup)
    if not would:
        return None
    if not host.writable:
        problems.append(f"this is a container's cgroup-namespace root and its cgroupfs is not writable: a writable "
                        f"one (docs/containers.md) and `cgturn init -- CMD` as the entrypoint would give limits "
                        f"({' '.join(would)})")
    else:
        problems.append(f"this is a container's cgroup-namespace root holding its processes, so no controller "
                        f"can be enabled below it: `cgturn init -- CMD` as the entrypoint would enable "
                        f"{' '.join(would)} (docs/containers.md)")
    return {"would_enable": would}


def _guard_report(backend: Backend, problems: list[str]) -> dict[str, Any] | None:
    """The pressure guard's recorded state with `active` (armed and its process alive), or None when
    no guard ever recorded one; a guard that could not arm, or died, adds a problem."""
    from .backends import guard_state

    state = guard_state.load(backend)
    if state is None:
        return None
    alive = guard_state.owner_alive(state)
    report = dict(state, active=bool(state.get("armed", True) and alive))
    if state.get("problem"):
        problems.append(f"pressure guard (process {state['owner_pid']}): {state['problem']}")
    elif not alive:
        problems.append(f"pressure guard process {state['owner_pid']} is gone without disarming: no guard runs")
    return report


def default_state_dir() -> str:
    """`/run/cgturn` for root, `$XDG_RUNTIME_DIR/cgturn` (or a per-user /tmp dir) otherwise."""
    if os.geteuid() == 0:
        return "/run/cgturn"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "cgturn") if runtime else f"/tmp/cgturn-{os.geteuid()}"


def sentinel_setting(value: bool | None) -> bool:
    """Whether a manager may start the sentinel: the constructor keyword wins; else env
    CGTURN_SENTINEL ("0", "false", "no", "off" disable; default on)."""
    if value is not None:
        return bool(value)
    return os.environ.get("CGTURN_SENTINEL", "1").strip().lower() not in ("0", "false", "no", "off")
