"""`cgturn run -- CMD`: run a command as a new turn and pass its exit status through.

Exit status: CMD's own code; 128+N if it died of signal N; 127 not found; 126 not executable; 124 when
`--timeout` abandoned the turn; 130/143/129 when `cgturn run` itself got SIGINT/SIGTERM/SIGHUP before
the turn completed (the turn is then abandoned, even if CMD exited first from the same Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time

from . import common

DEFAULT_TASK = "cli"
EXIT_TIMEOUT = 124
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def register(sub) -> None:
    p = sub.add_parser("run", help="run a command as a new turn")
    p.add_argument("--task", default=DEFAULT_TASK, help=f"task id (default {DEFAULT_TASK!r})")
    p.add_argument("--turn", help="turn id (default: a fresh one)")
    p.add_argument("--timeout", type=_positive, help="abandon the turn after S seconds (exit 124)")
    p.add_argument("--grace", type=_non_negative, default=2.0,
                   help="seconds between SIGTERM and SIGKILL when abandoning (default 2)")
    p.add_argument("--reap-on-exit", action="store_true",
                   help="abandon the turn when CMD exits, killing what it left running")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    p.set_defaults(handler=run)


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {text!r}")
    return value


def run(args) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("run needs a command after --")
    manager = common.make_manager(args)
    try:
        turn = manager.begin_turn(args.task, args.turn)
        return _supervise(turn, cmd, args.timeout, args.grace, args.reap_on_exit)
    finally:
        manager.close()


def _supervise(turn, cmd: list[str], timeout: float | None, grace: float, reap_on_exit: bool) -> int:
    received: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in FORWARDED}
    previous_fd = signal.set_wakeup_fd(wake_w)
    try:
        try:
            proc = turn.spawn(cmd)
        except FileNotFoundError:
            turn.abandon("not-found", grace=0)
            print(f"cgturn: {cmd[0]}: command not found", file=sys.stderr)
            return EXIT_NOT_FOUND
        except PermissionError:
            turn.abandon("not-executable", grace=0)
            print(f"cgturn: {cmd[0]}: permission denied", file=sys.stderr)
            return EXIT_NOT_EXECUTABLE
        code = _wait(proc, wake_r, received, timeout)
        if code is None:
            turn.abandon("timeout", grace=grace)
            return EXIT_TIMEOUT
        # CMD exited. A signal that reached us first (the same Ctrl-C, often) still abandons the turn:
        # block further delivery, let handlers of signals already delivered run, then decide.
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        pending = signal.sigpending() & set(FORWARDED)
        if received or pending:
            sig = (received or sorted(pending))[0]
            turn.abandon(f"signal:{signal.Signals(sig).name}", grace=grace)
            return 128 + sig
        if reap_on_exit:
            turn.abandon("reap-on-exit", grace=grace)
        else:
            turn.complete()
        return code if code >= 0 else 128 - code
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        os.close(wake_r)
        os.close(wake_w)


def _wait(proc, wake_fd: int, received: list[int], timeout: float | None) -> int | None:
    """Wait for CMD to exit, a forwarded signal, or the deadline. None on timeout; -1 on a signal."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pidfd = os.pidfd_open(proc.pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(wake_fd, select.POLLIN)
        while True:
            if received:
                proc.poll()
                return proc.returncode if proc.returncode is not None else -received[0]
            code = proc.poll()
            if code is not None:
                return code
            if deadline is None:
                wait_ms = None
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                wait_ms = max(1, int(remaining * 1000))
            for fd, _ in poller.poll(wait_ms):
                if fd == wake_fd:
                    os.read(wake_fd, 512)
    finally:
        os.close(pidfd)
