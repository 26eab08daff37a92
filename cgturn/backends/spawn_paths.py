"""Which way `Turn.spawn` starts a process on cgroup v2, and the native way itself.

Paths, preferred first:
- "clone3": the C extension `cgturn._spawn` clones the child straight into the turn's cgroup
  (clone3 CLONE_INTO_CGROUP, Linux 5.7+) and execs the target: no shim, no migration (kernel/spawn.py).
- "shim": the gated /bin/sh shim (cgroup2.py, gates.py): works everywhere, honours every option.

A request goes to the first path that can honour it: the native path honours the Popen options in
`CLONE3_OPTIONS` on a turn without isolation (sealed, network); anything else (preexec_fn, user=,
group=, options added later) goes to the shim unchanged. On hybrid hosts a turn with v1 directories
is joined by the child itself before it execs: it writes "0" (itself) to each v1 cgroup.procs,
opened by the parent (open and write are async-signal-safe), so v1 limits hold before the target runs.

The abandon race (issue 16): the spawn holds a shared flock on the turn directory across its state
check and the clone; `transition` (which marks a turn abandoned) takes it exclusively. So either the
spawn sees the mark and starts nothing, or its child is in the turn before the mark and the kill
that follows the mark takes it.

Capabilities are decided once, without writing (`can_clone3`: the extension is importable), and
switched off on the first refusal by the kernel (clone3 or CLONE_INTO_CGROUP missing, or a seccomp
filter). Tests set the flag to force the shim (trio's `can_try_pidfd_open`).
"""
from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING

from ..errors import KernelError, NoSuchTurn
from ..logfields import turn_fields
from ..kernel import spawn as kspawn
from ..kernel.cgroupfiles import FREEZE_FILE
from ..model import RUNNING
from .base import normalize_spawn

if TYPE_CHECKING:
    import subprocess

    from ..model import TurnRecord
    from .cgroup2 import Cgroup2Backend

log = logging.getLogger("cgturn")

CLONE3, SHIM = "clone3", "shim"
CLONE3_OPTIONS = frozenset({
    "stdin", "stdout", "stderr", "cwd", "env", "close_fds", "pass_fds", "start_new_session", "process_group",
    "umask", "restore_signals", "text", "universal_newlines", "encoding", "errors", "bufsize", "shell",
    "preexec_fn",  # None only (checked below)
})

can_clone3 = kspawn.clone3_built()


def available() -> list[str]:
    """The spawn paths usable here, preferred first (what `cgturn doctor` shows)."""
    return ([CLONE3] if can_clone3 else []) + [SHIM]


def choose(record: "TurnRecord", popen_kwargs: dict) -> str:
    """The first path that can honour this request, logged at debug level."""
    path, why = _choose(record, popen_kwargs)
    log.debug("spawn path for turn %r: %s (%s)", record.turn_id, path, why,
              extra=turn_fields(record.task_id, record.turn_id))
    return path


def _choose(record: "TurnRecord", popen_kwargs: dict) -> tuple[str, str]:
    if not can_clone3:
        return SHIM, "clone3 unavailable"
    if getattr(record, "sealed", False) or getattr(record, "network", "host") not in (None, "host"):
        return SHIM, "an isolated turn"
    others = sorted(k for k, v in popen_kwargs.items() if k not in CLONE3_OPTIONS and v is not None)
    if others:
        return SHIM, f"clone3 cannot honour {', '.join(others)}"
    if popen_kwargs.get("preexec_fn") is not None:
        return SHIM, "clone3 cannot honour preexec_fn"
    return CLONE3, "all options honoured"


def spawn_clone3(backend: "Cgroup2Backend", record: "TurnRecord", argv, popen_kwargs: dict) -> "subprocess.Popen | None":
    """Start the process in the turn with clone3; None, having started nothing, when the shim must
    take this spawn: the kernel refuses clone3 into a cgroup (every later spawn takes the shim too),
    the turn is frozen (a vfork child frozen before exec would hold the caller until the thaw), or
    it got v1 directories after `record` was read.

    Raises:
        NoSuchTurn: the turn is not running (marked, or its directory gone).
        KernelError: the child could not join the turn's v1 cgroups for another reason.
        OSError: as Popen, for the target program (FileNotFoundError, PermissionError, ...).
    """
    global can_clone3
    argv, kwargs = normalize_spawn(argv, popen_kwargs)
    kwargs.pop("preexec_fn", None)
    cg = backend._cg(record)
    v1 = [f"{path}/cgroup.procs" for path in backend.layout.v1_dirs(record.task_key, record.turn_key).values()] \
        if record.v1_dirs else []

    def may_spawn() -> bool:  # under the shared lock: no transition can happen meanwhile
        current = backend.meta.load(cg)
        if current is None or current.state != RUNNING:
            return False
        if current.v1_dirs and not v1:
            raise _UseShim("the turn got v1 directories")
        # A freeze is written before its mark (manager.freeze_turn): the file tells it sooner.
        if current.frozen_by is not None or cg.read(FREEZE_FILE).strip() == "1":
            raise _UseShim("the turn is frozen")
        return True

    gone = NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} ended while spawning")
    try:
        proc = kspawn.spawn_into(cg.path, v1, may_spawn, argv, backend.env_for(record), kwargs)
    except _UseShim as why:
        log.debug("spawn path for turn %r: shim (%s)", record.turn_id, why,
                  extra=turn_fields(record.task_id, record.turn_id))
        return None
    except kspawn.CloneUnsupported as err:
        log.info("clone3 into a cgroup refused by the kernel (%s); spawning through the shim", err)
        can_clone3 = False
        return None
    except kspawn.CgroupJoinError as err:
        if err.errno in (errno.ENOENT, errno.ENODEV, errno.ESRCH):
            raise gone from None
        raise KernelError(f"join the v1 cgroups of turn {record.turn_id!r} through", ", ".join(v1), err) from None
    except FileNotFoundError as err:
        if err.filename in (cg.path, *v1) or err.filename == cg.file(FREEZE_FILE):
            raise gone from None
        raise
    except OSError as err:
        if err.errno == errno.ENODEV:  # the cgroup was removed between the check and the clone
            raise gone from None
        raise
    if proc is None:
        raise gone
    return proc


class _UseShim(Exception):
    """The native path cannot take this spawn after all (found under the lock): nothing was started."""
