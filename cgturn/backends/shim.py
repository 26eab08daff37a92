"""The shim spawn path on cgroup v2: works everywhere and honours every option cgturn accepts.

Popen starts a `/bin/sh` shim that blocks reading a pipe of its own (a "gate", see gates.py); the
parent writes the shim's pid into the turn's cgroup.procs, then writes "go"; the shim execs the target
(after the isolation steps of a network-less or sealed turn, isolation.py and seal.py). If the parent dies first,
the shim reads EOF (or finds no gate) and exits 125. So the process is in the turn before the target
runs one instruction and before `spawn` returns, Popen keeps its vfork path (thread-safe: no Python
code between fork and exec), and the parent never waits for the shell to start. preexec_fn would force
fork and is unsafe with threads; spawn-then-move without a gate missed 1-9 % of children here;
clone3(CLONE_INTO_CGROUP) from ctypes is unsafe with threads. (Turn.spawn sets `Popen.args` back to
what the caller asked to run.)
"""
from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
from typing import TYPE_CHECKING, Callable

from ..errors import NoSuchTurn
from ..kernel.cgroupfs import Cgroup
from ..limits import PAGE_SIZE, stored_under_one_page
from ..model import RUNNING, TurnRecord
from .base import ENV_SCOPE, ENV_TASK, ENV_TURN, prepare_spawn
from .metadata import MetadataStore
from .spawn_options import SpawnTarget

if TYPE_CHECKING:  # the backend makes the gates on its first shim spawn (gates.py, termios and all)
    from .gates import SpawnGates

# `$0` is the gate (the path of a pipe's read end); $1-$3 the turn's CGTURN_TASK, CGTURN_TURN and
# CGTURN_SCOPE; the rest the program and its arguments. Anything but "go" (EOF when the parent gave up
# or died, or no such fd) exits 125 without running the target, quietly: a parent that died is not the
# target's error. Exporting in the shim spares Popen a copy of the whole environment.
SPAWN_SHIM = (f'read go 2>/dev/null < "$0" && [ "$go" = go ] || exit 125; '
              f'export {ENV_TASK}="$1" {ENV_TURN}="$2" {ENV_SCOPE}="$3"; shift 3; exec "$@"')


@dataclasses.dataclass(frozen=True)
class ShimHooks:
    """What the shim path needs from the backend beyond the turn's SpawnTarget.

    Attributes:
        gates: the backend's spawn gates (made on first use).
        join_v1: moves a pid into the turn's v1 cgroups (a hybrid host's limits).
        network_fd: a new fd of the turn's network namespace, which the caller closes.
    """

    gates: Callable[[], SpawnGates]
    join_v1: Callable[[int], None]
    network_fd: Callable[[], int]


def spawn(record: TurnRecord, target: SpawnTarget, meta: MetadataStore, hooks: ShimHooks, argv,
          popen_kwargs: dict) -> subprocess.Popen:
    """Start `argv` in the turn through the gated shim.

    Raises:
        NoSuchTurn: the turn ended (marked, or its directory gone) while spawning; nothing ran.
        ValueError: a refused option, or an unknown user or group (before anything started).
        OSError: as Popen, for the target program (FileNotFoundError, PermissionError, ...).
    """
    writable = popen_kwargs.get("writable")
    if writable is not None and not record.sealed:
        raise ValueError("writable= applies to a sealed turn only (begin_turn(..., seal=True))")
    argv, program, kwargs, identity = prepare_spawn(argv, {k: v for k, v in popen_kwargs.items() if k != "writable"})
    from . import isolation  # here: spawn_paths imports this module for every spawn, native ones too

    # Run by the shim after "go", in this order: inside the turn, as the caller, before the target.
    sealed_fd = None
    if record.sealed:
        from . import seal  # a sealed turn's modules, not every spawn's

        steps, sealed_fd = seal.steps(writable, kwargs.get("cwd"), identity)
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), sealed_fd)
    else:
        steps = isolation.drop_privileges(identity)
    netns = None
    if record.network != "host":
        try:
            netns = hooks.network_fd()
        except BaseException:
            if sealed_fd is not None:
                os.close(sealed_fd)
            raise
        steps = isolation.enter_network(netns) + steps
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), netns)
    gates = hooks.gates()
    gate = gates.open()
    env = target.environment
    shim = ["/bin/sh", "-c", SPAWN_SHIM, gate.path, env[ENV_TASK], env[ENV_TURN], env[ENV_SCOPE]]
    if gate.pass_fds:
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), *gate.pass_fds)
    try:
        proc = subprocess.Popen([*shim, *steps, program, *argv[1:]], **kwargs)
    except BaseException:
        gates.discard(gate)
        raise
    finally:
        for fd in (netns, sealed_fd):
            if fd is not None:
                os.close(fd)  # the shim holds its own copy
    cg = Cgroup(target.cgroup_dir)
    try:
        # Our unreaped child, blocked on its gate: its pid cannot have been recycled.
        cg.move_in(proc.pid)
        # Checked after the move: an abandon marks the turn before it kills, so either we see
        # the mark here, or its kill comes after our move and takes the shim with it.
        current = meta.load(cg)
        joined = current is not None and current.state == RUNNING
        if joined:  # its limit may have been lowered since `record` was read: the target must not start
            refuse_under_one_page(current, program)
        if current is not None and joined and current.v1_dirs:  # the turn's v1 limits hold before the target runs too
            hooks.join_v1(proc.pid)
    except FileNotFoundError:
        joined = False
    except BaseException:
        _abort(gates, gate, proc)
        raise
    if not joined:
        _abort(gates, gate, proc)
        raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} ended while spawning")
    gates.release(gate, proc.pid)
    return proc


# A memory limit under one page: the kernel rounds it down to 0 pages (limits.PAGE_SIZE). The shim is
# OOM-killed at its first page fault after joining, before it can say why; glibc's posix_spawn child
# (CLONE_VFORK) was seen to hang there on Linux 6.12 with cgroup v2, its caller with it (the OOM killer
# skips a task in vfork: oom_badness, mm/oom_kill.c). So every path says ENOMEM before anything runs.
# Only a turn's own limit can be that small: the task and root budgets refuse such a size where they
# are set (cgroup2_limiter), so the record a spawn holds, or reads under the turn's lock anyway, is
# the whole answer and no limit file is read.
def refuse_under_one_page(record: TurnRecord | None, program: str) -> None:
    """Raise OSError(ENOMEM) when `record` (the turn's) sets a memory limit under one page."""
    if record is None or not record.limits:  # most turns: no limits, nothing to parse
        return
    size = stored_under_one_page(record.limits)
    if size is not None:
        raise OSError(errno.ENOMEM, f"cannot start {program!r} in turn {record.turn_id!r}: its memory limit is "
                                    f"{size} bytes, less than one page ({PAGE_SIZE}): nothing can run in it")


def _abort(gates: SpawnGates, gate, proc: subprocess.Popen) -> None:
    """Close the gate without "go" (the shim reads EOF and exits 125 without running the target)."""
    gates.discard(gate)
    proc.kill()
    proc.wait()
