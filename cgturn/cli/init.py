"""`cgturn init [--] CMD [ARG...]`: a container's entrypoint, so turns inside the container get limits.

It does what a container init does — what tini and `docker --init` do: it runs as PID 1, starts CMD in
a process group of its own, forwards to CMD every signal it gets (but SIGCHLD and the synchronous
ones), reaps every zombie reparented to it, and exits with CMD's status (128+N when CMD died of
signal N; 127 when CMD is not found, 126 when it cannot be executed). Before CMD starts, it proves
it is a container's init at its own cgroup-namespace root and then prepares that root (see
`cgturn.init_setup`): the root's processes move into the leaf `init`, the controllers the container
was given are enabled, the managed root `<mount>/cgturn` is made and recovered, and CMD gets
`CGTURN_ROOT` naming it.

Why not tini or catatonit with a wrapper: both are PID 1 and nothing else, and the cgroup step must
happen in PID 1 itself, before anything else runs — a wrapper started by them would run in the root
it has to empty, beside the init it cannot move away from, and a process started before them (the
runtime's own) must be proven absent, which only PID 1 can see.

Exit 2 with one line, nothing moved, when the proof fails (not PID 1, no private cgroup namespace,
the host's root, processes of another PID namespace in the root, a read-only cgroupfs) —
unless `--plain-if-refused`: then that line is a warning and CMD runs under the same PID-1 loop with
no cgroup step (turns inside work, without limits, as they would without `cgturn init`).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from ..errors import CgturnError, InitRefused
from . import common

EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
# Signals a container init keeps for itself: SIGCHLD (reaping), those that cannot be caught, and the
# synchronous ones that mean a fault in the init itself (tini's list, src/tini.c).
_NOT_FORWARDED = {signal.SIGCHLD, signal.SIGKILL, signal.SIGSTOP, signal.SIGFPE, signal.SIGILL, signal.SIGSEGV,
                  signal.SIGBUS, signal.SIGABRT, signal.SIGTRAP, signal.SIGSYS, signal.SIGTTIN, signal.SIGTTOU}
FORWARDED = frozenset(signal.valid_signals()) - _NOT_FORWARDED
# Python ignores SIGPIPE and SIGXFSZ; exec keeps an ignored signal ignored, so CMD gets them back at
# their defaults, as subprocess's restore_signals does.
_RESTORED = (signal.SIGPIPE, signal.SIGXFSZ)
# How long the loop sleeps between checks when no signal comes: only a safety net, since a blocked
# SIGCHLD is pending (and wakes sigtimedwait) whenever a child exits.
_TICK = 5.0


def register(sub) -> None:
    p = sub.add_parser("init", help="container entrypoint: PID 1, cgroup delegation, then CMD")
    p.add_argument("--plain-if-refused", action="store_true",
                   help="when the cgroup step is refused, warn and run CMD without it (no limits)")
    p.add_argument("-v", "--verbose", action="store_true", help="say on stderr what was moved and enabled")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")
    p.set_defaults(handler=run)


def run(args) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("init needs a command after --")
    # Blocked from the start, so a signal that comes while the root is prepared is not lost: it is
    # pending, and forwarded once CMD runs. A blocked signal is queued even for a namespace's init,
    # which the kernel otherwise spares signals it has no handler for (kernel/signal.c, sig_ignored).
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED | {signal.SIGCHLD})
    env = dict(os.environ)
    try:
        from .. import init_container

        prepared = init_container(state_dir=args.state_dir)
    except InitRefused as err:
        if not args.plain_if_refused:
            print(f"cgturn init: refused: {err}", file=sys.stderr)
            return common.EXIT_USAGE
        print(f"cgturn init: no cgroup step ({err}): turns inside get no limits", file=sys.stderr)
    except CgturnError as err:
        print(f"cgturn init: preparing the cgroup namespace failed: {err}", file=sys.stderr)
        return common.EXIT_FAILED
    else:
        env["CGTURN_ROOT"] = prepared.managed_root
        if args.verbose:
            refused = "".join(f"; not enabled {name}: {why}" for name, why in prepared.refused.items())
            print(f"cgturn init: moved {len(prepared.moved)} process(es) into {prepared.leaf}; enabled "
                  f"{' '.join(prepared.enabled) or 'no controller'}; managed root {prepared.managed_root}; "
                  f"reaped {len(prepared.recovered)} turn(s){refused}", file=sys.stderr)
    try:
        child = _spawn(cmd, env)
    except FileNotFoundError as err:
        print(f"cgturn init: cannot run {cmd[0]}: {err.strerror}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except OSError as err:
        print(f"cgturn init: cannot run {cmd[0]}: {err.strerror or err}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    return supervise(child)


def _spawn(cmd: list[str], env: dict[str, str]) -> int:
    """Start CMD in a process group of its own with an empty signal mask; give it the terminal."""
    pid = os.posix_spawnp(cmd[0], cmd, env, setpgroup=0, setsigmask=(), setsigdef=_RESTORED)
    if os.isatty(0):
        # CMD reads the terminal, so its group must be the foreground one; SIGTTOU is blocked here,
        # which lets a background caller do it too (termios(3), tcsetpgrp).
        try:
            os.tcsetpgrp(0, pid)
        except OSError:
            pass
    return pid


def supervise(child: int) -> int:
    """The PID-1 loop: forward signals to `child`, reap every zombie, return `child`'s exit status.

    Args:
        child: the pid of CMD, started with the forwarded signals and SIGCHLD blocked in this process.

    Returns:
        CMD's exit code, or 128+N when it died of signal N.
    """
    waited = FORWARDED | {signal.SIGCHLD}
    while True:
        info = signal.sigtimedwait(waited, _TICK)
        if info is not None and info.si_signo != signal.SIGCHLD:
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass  # CMD is gone: its status is reaped below
        status = _reap_all(child)
        if status is not None:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


def _reap_all(child: int) -> int | None:
    """Reap every exited child (orphans reparented to PID 1 included); `child`'s wait status if it was one."""
    found = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == child:
            found = status
