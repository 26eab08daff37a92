"""`python -m cgturn.sentinel_main`: the sentinel process's entry point — its arguments, its logging,
its scheduling policy, the pressure guard it may arm, and the handshake with its owner.

The owner starts it (cgturn.sentinel); its loop is cgturn.sentinel_server. A module of its own,
imported by nothing, because running an imported module with -m executes it twice (runpy warns); and
the one place that composes the sentinel with the pressure guard, so the guard's and the sentinel's
modules import each other in one direction only (the guard starts the sentinel).
"""
from __future__ import annotations

import _socket  # as cgturn.sentinel: socket.py's enums are not worth a forked sentinel's start
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from . import sentinel_protocol as protocol
from . import statefiles
from .sentinel_server import Sentinel

if TYPE_CHECKING:
    import argparse

    from .guard_runner import GuardRunner
    from .sentinel_locks import Held

log = logging.getLogger("cgturn.sentinel")

LOG_FILE = "sentinel.log"


def build_parser() -> "argparse.ArgumentParser":
    """The sentinel's command line (what cgturn.sentinel_start passes an exec'd sentinel)."""
    import argparse  # an exec'd sentinel's only: a forked one is handed its options (serve)

    p = argparse.ArgumentParser(prog="python -m cgturn.sentinel_main",
                                description="the sentinel: enforces turn deadlines from outside the owner")
    p.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET channel from the owner")
    p.add_argument("--protocol", type=int, dest="protocol_version", help="the protocol version the owner speaks (cgturn.sentinel_protocol)")
    p.add_argument("--owner-pid", type=int, required=True)
    p.add_argument("--owner-start", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--root")
    p.add_argument("--guard", help="a PressureGuard's settings (JSON) to arm in this process")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the exec'd sentinel process: `serve` with its command line's options.

    Args:
        argv: the command line without the program (default: sys.argv[1:]).

    Returns:
        The exit status: 0 after serving, 1 when it could not start (the owner was told why).
    """
    return serve(**vars(build_parser().parse_args(argv)))


def serve(fd: int, protocol_version: int | None, owner_pid: int, owner_start: int, backend: str, state_dir: str,
          root: str | None = None, guard: str | None = None) -> int:
    """The sentinel: tell the owner `ready` (or why not) on `fd`, then serve until done. A forked
    sentinel calls it with the options themselves (cgturn.sentinel_start): no parser to build.

    Args:
        fd, protocol_version, owner_pid, owner_start, backend, state_dir, root, guard: as the command
            line's `--fd`, `--protocol`, ... (build_parser).

    Returns:
        The exit status: 0 after serving, 1 when it could not start (the owner was told why).
    """
    _batch_policy()
    sock = _socket.socket(fileno=fd)
    log_problem = _setup_logging(state_dir)
    if (problem := protocol.version_problem(protocol_version)) is not None:
        # Another cgturn started this one (an upgrade under a running owner): refuse, never half serve.
        message = f"the owner speaks {problem}"
        log.error("sentinel refuses to start: %s", message)
        _tell_owner(sock, protocol.error(message))
        return 1
    try:
        from .manager import TurnManager
        mgr = TurnManager(root=root, backend=backend, state_dir=state_dir, sentinel=False)
    except Exception as err:  # noqa: BLE001 - reported to the owner, who raises SentinelUnavailable
        log.exception("sentinel cannot start")
        _tell_owner(sock, protocol.error(f"{type(err).__name__}: {err}"))
        return 1
    with mgr:
        runner = None
        if guard:
            try:
                runner = _arm_guard(mgr, guard, owner_pid)
            except Exception as err:  # noqa: BLE001 - reported to the owner, who raises GuardUnavailable
                log.error("pressure guard cannot start: %s", err)
                _tell_owner(sock, protocol.error(str(err), guard=True))
                return 1
        try:
            server = Sentinel(mgr, sock, owner_pid, owner_start)
        except Exception as err:  # noqa: BLE001 - reported to the owner and logged: never a silent exit
            log.exception("sentinel cannot start")
            _tell_owner(sock, protocol.error(f"{type(err).__name__}: {err}"))
            return 1
        _tell_owner(sock, protocol.ready(log_problem))
        # Held from just after `ready` to the end (cgturn.sentinel_locks): made while the owner goes on
        # (a `cgturn run` starts its command), not while it waits; what the owner sends meanwhile
        # waits in the channel. A reader finds the file locked, or unlocked once this sentinel died.
        held = _hold_lock(state_dir, owner_pid, owner_start)
        try:
            server.run()
        except Exception:
            # Its lock file stays, unlocked once this process is gone: the exporter counts the owner's
            # running turns as unwatched (cgturn_turns_unwatched), and the log says why.
            log.exception("sentinel of owner %d failed; its running turns are no longer watched", owner_pid)
            raise
        else:
            if held is not None:
                held.release()
        finally:
            if runner is not None:
                runner.stop()
                runner.join()
    return 0


def _hold_lock(state_dir: str, owner_pid: int, owner_start: int | None) -> "Held | None":
    """This sentinel's lock file, held (None when it cannot be made: logged). Its modules are
    imported here, after `ready`, so the owner never waits for them."""
    from . import sentinel_locks

    return None if owner_start is None else sentinel_locks.hold(state_dir, owner_pid, owner_start)


def _batch_policy() -> None:
    """Run the sentinel under SCHED_BATCH (sched(7)) when it runs under SCHED_OTHER: the same CPU
    share, but its wake-ups (by a track at a begin_turn or an untrack at a completion while it is
    idle: sentinel_server.BATCH_WINDOW) no longer preempt the owner that sent them, which measured as
    most of the sentinel's cost per turn on a 2-CPU host. Its own due times still wake it; it runs
    at the next scheduling point, well inside the slack. A real-time policy inherited from the owner
    is kept."""
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (OSError, AttributeError) as err:  # not Linux, or refused: tracking works without it
        log.debug("sentinel keeps its scheduling policy: %s", err)


def _arm_guard(mgr, guard: str, owner_pid: int) -> "GuardRunner":
    """Arm the pressure guard (or stand by while another guard owns the root) and start its thread.
    Its modules are imported here, by a sentinel that has a guard to arm: a sentinel's start is
    part of `cgturn run`'s, and most sentinels arm none."""
    from .guard import PressureGuard
    from .guard_runner import GuardRunner

    runner = GuardRunner(PressureGuard.from_json(json.loads(guard)), mgr, owner_pid=owner_pid)
    if not runner.arm(standby=True):
        log.info("pressure guard on standby: process %s owns this managed root", (runner.owned_by or {}).get("owner_pid"))
    runner.start()
    return runner


def _setup_logging(state_dir: str) -> str | None:
    """Log to `<state_dir>/sentinel.log`, else to stderr (/dev/null when started by an owner); returns
    why the file could not be used, or None. Never raises: tracking must not depend on a log."""
    path = os.path.join(state_dir, LOG_FILE)
    problem = None
    try:
        os.makedirs(state_dir, exist_ok=True)
        fd = statefiles.open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        handler: logging.Handler = logging.StreamHandler(open(fd, "a", encoding="utf-8", errors="backslashreplace"))
    except OSError as err:
        problem = f"cannot write {path}: {err.strerror or err}"
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s sentinel[{os.getpid()}] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    if problem:
        log.warning("%s; logging to stderr", problem)
    return problem


def _tell_owner(sock: _socket.socket, message: dict) -> None:
    try:
        sock.send(protocol.encode(message), _socket.MSG_DONTWAIT)
    except OSError:
        pass  # the owner is gone: the owner-death path handles that


if __name__ == "__main__":
    sys.exit(main())
