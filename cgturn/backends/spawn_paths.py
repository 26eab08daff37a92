"""Which way `Turn.spawn` starts a process on cgroup v2, and the native ways themselves.

Paths, preferred first:
- "clone3": the C extension `cgturn._spawn` clones the child straight into the turn's cgroup
  (clone3 CLONE_INTO_CGROUP, Linux 5.7+) and execs the target: no shim, no migration (kernel/spawn.py).
- "posix_spawn": where the extension is not built, glibc 2.39+'s posix_spawn does the same
  (posix_spawnattr_setcgroup_np; kernel/posix_spawn.py), for the options it can honour.
- "shim": the gated /bin/sh shim (shim.py, gates.py): works everywhere, honours every option.

A request goes to the first path that can honour it: which Popen options each path honours is the one
table in spawn_options.py; a sealed turn takes clone3 (whose child builds the seal's sandbox, seal.py) or the
shim, and a turn with only a network of its own always takes the shim. Taking the
shim because of an option logs one debug line naming it. posix_spawn also hands over what it finds
it cannot do once Popen has arranged the request (kernel/posix_spawn.py). On
hybrid hosts a turn with v1 directories is joined by the child itself before it execs (clone3
only): it writes "0" (itself) to each v1 cgroup.procs, opened by the parent (open and write are
async-signal-safe), so v1 limits hold before the target runs.

The abandon race (issue 16): the spawn holds a shared flock on the turn directory across its state
check and the clone; `transition` (which marks a turn abandoned) takes it exclusively. So either the
spawn sees the mark and starts nothing, or its child is in the turn before the mark and the kill
that follows the mark takes it.

Capabilities are decided once, without writing (`can_clone3`: the extension is importable;
`can_posix_spawn`: the C library has posix_spawnattr_setcgroup_np), and switched off on the first
refusal by the kernel (clone3 or CLONE_INTO_CGROUP missing, or a seccomp filter). Tests set the
flags to force a path (trio's `can_try_pidfd_open`).
"""
from __future__ import annotations

import errno
import logging
import os
from typing import TYPE_CHECKING

from ..errors import KernelError, NoSuchTurn
from ..kernel import posix_spawn
from ..logfields import turn_fields
from ..kernel import spawn as kspawn
from ..kernel.cgroupfiles import xattr_or_none
from ..kernel.cgroupfs import Cgroup
from ..model import RUNNING
from . import shim
from .shim import ShimHooks
from .base import IDENTITY_KWARGS, normalize_spawn, prepare_spawn
from .metadata import XATTR_KEY, MetadataStore, record_from_xattr
from .spawn_options import CLONE3, POSIX_SPAWN, SHIM, SpawnTarget, options_refused_by

if TYPE_CHECKING:
    import subprocess

    from ..model import TurnRecord

log = logging.getLogger("cgturn")

__all__ = ["CLONE3", "POSIX_SPAWN", "SHIM", "ShimHooks", "available", "forced", "choose", "spawn", "target"]

can_clone3 = kspawn.clone3_built()
can_posix_spawn = posix_spawn.available()


def available() -> list[str]:
    """The spawn paths usable here, preferred first (what `cgturn doctor` shows)."""
    return [path for path, usable in ((CLONE3, can_clone3), (POSIX_SPAWN, can_posix_spawn), (SHIM, True)) if usable]


def forced(path: str) -> dict[str, bool]:
    """The capability flags (names in this module) that make `path` the way spawns take: what tests
    and benchmarks set to force one (trio-style), e.g. with monkeypatch.setattr."""
    return {"can_clone3": path == CLONE3, "can_posix_spawn": path == POSIX_SPAWN}


def choose(record: "TurnRecord", popen_kwargs: dict) -> str:
    """The first path that can honour this request, logged at debug level."""
    path, why = _choose(record, popen_kwargs)
    if log.isEnabledFor(logging.DEBUG):  # on every spawn: not even the extra dict when it is off
        log.debug("spawn path for turn %r: %s (%s)", record.turn_id, path, why,
                  extra=turn_fields(record.task_id, record.turn_id))
    return path


def _choose(record: "TurnRecord", popen_kwargs: dict) -> tuple[str, str]:
    native = CLONE3 if can_clone3 else POSIX_SPAWN if can_posix_spawn else None
    if native is None:
        return SHIM, "no native path here"
    if record.sealed:
        if native != CLONE3:
            return SHIM, "a sealed turn passes an fd (posix_spawn cannot)"
        # the seal's own chain honours these (seal.py): only the rest is the extension's to honour
        refused = options_refused_by(CLONE3, {k: v for k, v in popen_kwargs.items() if k not in SEALED_KWARGS})
        return (SHIM, f"{native} cannot honour {', '.join(refused)}") if refused else (CLONE3, "a sealed turn")
    if record.network not in (None, "host"):
        return SHIM, "an isolated turn"
    if native == POSIX_SPAWN and record.v1_dirs:
        return SHIM, "posix_spawn cannot join v1 cgroups"
    if popen_kwargs:
        refused = options_refused_by(native, popen_kwargs)
        if refused:
            return SHIM, f"{native} cannot honour {', '.join(refused)}"
    return native, "all options honoured"


def target(cgroup_dir: str, v1_procs: list[str], environment: dict[str, str]) -> SpawnTarget:
    """The SpawnTarget of a turn: its cgroup directory, its v1 cgroup.procs files and CGTURN_* entries."""
    return SpawnTarget(cgroup_dir, v1_procs, environment, kspawn.environment_entries(environment))


def spawn(record: "TurnRecord", where: SpawnTarget, meta: MetadataStore, hooks: ShimHooks, argv,
          popen_kwargs: dict) -> "subprocess.Popen":
    """Start `argv` in the turn at `where` by the first path that honours the request.

    Args:
        record: the turn's record as the caller read it (ids, isolation, v1 directories).
        meta: the record store, read under the turn's lock before the child is let run.
        hooks: what the shim needs from the backend, should the spawn take it.

    Raises:
        NoSuchTurn: the turn is not running (marked, or its directory gone); nothing ran.
        KernelError: the child could not join the turn's v1 cgroups for another reason.
        ValueError: a refused option, or an unknown user or group.
        OSError: as Popen, for the target program (FileNotFoundError, PermissionError, ...); ENOMEM
            when the turn's memory limit is under one page (nothing can run; a task or root budget
            that small is refused where it is set).
    """
    shim.refuse_under_one_page(record, str(argv[0]) if argv else "")  # the record in hand: no file read
    way = choose(record, popen_kwargs)
    if way != SHIM:
        if record.sealed:
            proc = _spawn_sealed(record, where, meta, hooks, argv, popen_kwargs)
        else:
            proc = _spawn_native(record, where, meta, way, argv, popen_kwargs)
        if proc is not None:
            return proc
    return shim.spawn(record, where, meta, hooks, argv, popen_kwargs)


# Spawn options a sealed spawn's chain takes care of itself (the sandbox's binds, setpriv).
SEALED_KWARGS = ("writable", *IDENTITY_KWARGS)


def _spawn_sealed(record: "TurnRecord", where: SpawnTarget, meta: MetadataStore, hooks: ShimHooks, argv,
                  popen_kwargs: dict) -> "subprocess.Popen | None":
    """A sealed spawn the native way: the child is cloned into the turn and builds the sandbox itself
    (seal.native: the extension's PID 1, then [setpriv →] the target), or, where the extension
    cannot (seal.native_works), execs the bubblewrap chain ([nsenter →] bwrap [→ setpriv] → the
    target). No shim and no gate either way. None as _spawn_native.

    Raises:
        as _spawn_native; ValueError for a refused writable path or identity (nothing started).
    """
    argv, program, kwargs, identity = prepare_spawn(argv, {k: v for k, v in popen_kwargs.items() if k != "writable"})
    from . import isolation, seal  # a sealed turn's modules, not every spawn's

    fds: list[int] = []
    try:
        if seal.native_works():
            netns = -1
            if record.network != "host":
                fds.append(hooks.network_fd())
                netns = fds[-1]  # entered by the child's PID 1 (setns), closed by its target
            kwargs["seal"], steps = seal.native(popen_kwargs.get("writable"), kwargs.get("cwd"), identity, netns)
        else:
            steps, sealed_fd = seal.steps(popen_kwargs.get("writable"), kwargs.get("cwd"), identity)
            fds.append(sealed_fd)
            if record.network != "host":
                fds.append(hooks.network_fd())
                steps = isolation.enter_network(fds[-1]) + steps
            kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), *fds)
        return _spawn_native(record, where, meta, CLONE3, [*steps, program, *argv[1:]], kwargs)
    finally:
        for fd in fds:
            os.close(fd)  # the child holds its own copies


def _spawn_native(record: "TurnRecord", where: SpawnTarget, meta: MetadataStore, way: str, argv,
                  popen_kwargs: dict) -> "subprocess.Popen | None":
    """Start the process in the turn the native way `way` (CLONE3 or POSIX_SPAWN); None, having
    started nothing, when the shim must take this spawn: the kernel refuses clone3 into a cgroup
    (every later spawn takes the shim too), the turn is frozen (a vfork child frozen before exec
    would hold the caller until the thaw), it got v1 directories after `record` was read, or
    posix_spawn cannot honour the request.

    Raises:
        NoSuchTurn: the turn is not running (marked, or its directory gone).
        KernelError: the child could not join the turn's v1 cgroups for another reason.
        OSError: as Popen, for the target program (FileNotFoundError, PermissionError, ...).
    """
    global can_clone3, can_posix_spawn
    argv, kwargs = normalize_spawn(argv, popen_kwargs)
    kwargs.pop("preexec_fn", None)
    path, v1, env = where.cgroup_dir, where.v1_procs, where.environment_entries
    try:
        if way == CLONE3:
            proc = _start(meta, path, v1, env, argv, kwargs)
        else:
            proc = kspawn.spawn_into(path, v1, lambda fd: _may_spawn(meta, path, fd, bool(v1), argv), argv, env,
                                     kwargs, popen=posix_spawn.PosixSpawnPopen)
    except (_UseShim, posix_spawn.CannotHonour) as why:
        log.debug("spawn path for turn %r: shim (%s)", record.turn_id, why,
                  extra=turn_fields(record.task_id, record.turn_id))
        return None
    except kspawn.CloneUnsupported as err:
        if "seal" in kwargs:  # the sandbox's namespaces were refused, not clone3 into a cgroup
            log.info("a sealed clone refused by the kernel (%s); sealing with bubblewrap from now on", err)
            from . import seal

            seal.native_refused()
            return None
        log.info("%s into a cgroup refused by the kernel (%s); spawning through the shim", way, err)
        if way == CLONE3:
            can_clone3 = False
        else:
            can_posix_spawn = False
        return None
    except kspawn.CgroupJoinError as err:
        if err.errno in (errno.ENOENT, errno.ENODEV, errno.ESRCH):
            raise _gone(record) from None
        raise KernelError(f"join the v1 cgroups of turn {record.turn_id!r} through", ", ".join(v1), err) from None
    except FileNotFoundError as err:
        if err.filename in (path, *v1):
            raise _gone(record) from None
        raise
    except OSError as err:
        if err.errno == errno.ENODEV and err.filename is None:  # the cgroup was removed meanwhile
            raise _gone(record) from None
        raise
    if proc is None:
        raise _gone(record)
    return proc


_XATTR_KEY_BYTES = XATTR_KEY.encode()
# How often a spawn compares the record with the one it last saw before it reads and checks it
# under the lock from Python (each miss means the record changed in between: a state change).
CHECKED_ATTEMPTS = 3


def _start(meta: MetadataStore, path: str, v1: list[str], env: tuple[bytes, ...], argv,
           kwargs: dict) -> "subprocess.Popen | None":
    """Clone into the turn directory `path` if its record allows it (see _may_spawn); None if not.

    The usual way is one call into the extension: it takes the shared lock, compares the record's
    xattr with bytes that were already found to allow a spawn, and clones; no Python runs under
    the lock. A record seen for the first time (or changed since) is read and judged first.
    Records kept in files (no xattrs) are read and judged under the lock in Python.
    """
    if meta.use_xattrs:
        joins_v1 = bool(v1)
        for _ in range(CHECKED_ATTEMPTS):
            seen = _cleared.get(path)
            if seen is None or seen[1] != joins_v1:
                raw = xattr_or_none(path, XATTR_KEY)
                if raw is None:
                    break  # no record xattr: the locked way decides (a file record, a new turn)
                if not _allows(record_from_xattr(raw, path), joins_v1, argv):
                    return None  # a record never returns to "running": no lock needed to say no
                _remember(path, raw, joins_v1)
            else:
                raw = seen[0]
            proc = kspawn.spawn_if_unchanged(path, _XATTR_KEY_BYTES, raw, v1, argv, env, kwargs)
            if proc is not None:
                return proc
            _cleared.pop(path, None)
    return kspawn.spawn_into(path, v1, lambda fd: _may_spawn(meta, path, fd, bool(v1), argv), argv, env, kwargs)


# Turn directory -> (its record's xattr value, v1 joined): values that were found to say "running,
# not frozen" (see _allows). Equal bytes are an equal record, so the next spawn into that turn only
# compares bytes, under the lock, in the extension.
_cleared: dict[str, tuple[bytes, bool]] = {}
_CLEARED_MAX = 1024


def _remember(path: str, raw: bytes, joins_v1: bool) -> None:
    if len(_cleared) >= _CLEARED_MAX:
        _cleared.clear()
    _cleared[path] = (raw, joins_v1)


def _allows(current: "TurnRecord | None", joins_v1: bool, argv) -> bool:
    """Whether the turn's record lets a clone into it go ahead.

    The record is the whole answer. It says "not running" once a turn is marked. It says "frozen"
    before its cgroup is: manager.freeze_turn marks the turn (under the exclusive lock) before it
    writes cgroup.freeze, so while a spawn holds the shared lock an unmarked turn cannot become
    frozen before the child has exec'd. (A freeze written behind cgturn's back, or one of an
    ancestor, holds the spawning thread until the thaw: docs/design.md.)

    Raises _UseShim when the shim must take the spawn (frozen; v1 directories we do not join), and
    OSError(ENOMEM) when the record sets a memory limit under one page (lowered since the caller's
    record was read; shim.refuse_under_one_page).
    """
    if current is None or current.state != RUNNING:
        return False
    shim.refuse_under_one_page(current, str(argv[0]) if argv else "")
    if current.v1_dirs and not joins_v1:
        raise _UseShim("the turn got v1 directories")
    if current.frozen_by is not None:
        raise _UseShim("the turn is frozen")
    return True


def _may_spawn(meta: MetadataStore, path: str, fd: int, joins_v1: bool, argv) -> bool:
    """_allows for the record read now, under the shared lock on the turn directory (open at `fd`)."""
    raw = xattr_or_none(fd, XATTR_KEY) if meta.use_xattrs else None
    current = meta.load(Cgroup(path)) if raw is None else record_from_xattr(raw, path)
    if not _allows(current, joins_v1, argv):
        return False
    if raw is not None:
        _remember(path, raw, joins_v1)
    return True


def _gone(record: "TurnRecord") -> NoSuchTurn:
    return NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} ended while spawning")


class _UseShim(Exception):
    """The native path cannot take this spawn after all (found under the lock): nothing was started."""
