"""Starting the sentinel process (cgturn.sentinel's client starts it, cgturn.sentinel_main is its
program): forked from the owner while the owner runs one thread — no second interpreter start and
import of cgturn, which were most of `cgturn run`'s start-up — else exec'd as
`python -m cgturn.sentinel_main`. Either way it runs in its own session, stdio on /dev/null, holding
only its end of the channel, and the owner waits for its `ready` before any turn is tracked.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from . import processes
from . import sentinel_protocol as protocol

if TYPE_CHECKING:
    from .manager import TurnManager

# The sentinel's program, run with `python -m` or, forked, in the child.
PROGRAM = "cgturn.sentinel_main"
# The forked sentinel's name (/proc/PID/comm: `ps -e`, `top`, `pgrep cgturn-sentinel`).
SENTINEL_NAME = "cgturn-sentinel"


def start(manager: "TurnManager", fd: int) -> "subprocess.Popen[bytes] | ForkedSentinel":
    """Start the sentinel in its own session, outside any turn, holding `fd`: forked from this very
    process when it runs one thread (no second interpreter start and import of cgturn: most of
    `cgturn run`'s start-up), else `python -m cgturn.sentinel_main` (fork(2) copies only the calling
    thread, so another thread's locks, held at the fork, would stay held in the child for ever)."""
    me = os.getpid()
    options = {"fd": fd, "protocol_version": protocol.VERSION, "owner_pid": me,
               "owner_start": processes.start_time(me), "backend": manager.backend_name,
               "state_dir": manager.state_dir, "root": manager.root,
               "guard": None if manager.guard is None else json.dumps(manager.guard.to_json())}
    _reap_forked()
    if _single_threaded():
        return _fork(options)
    args = ["--fd", str(fd), "--protocol", str(protocol.VERSION), "--owner-pid", str(me),
            "--owner-start", str(options["owner_start"]), "--backend", manager.backend_name,
            "--state-dir", manager.state_dir]
    if manager.root is not None:
        args += ["--root", manager.root]
    if manager.guard is not None:
        args += ["--guard", str(options["guard"])]
    env = dict(os.environ)
    # The sentinel must import this very cgturn, installed or not.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    # stdio on /dev/null: a sentinel must never hold a pipe its owner's caller waits on.
    return subprocess.Popen([sys.executable, "-m", PROGRAM, *args], pass_fds=(fd,), env=env,
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _single_threaded() -> bool:
    """True when this process runs one thread, C libraries' threads counted (unknown: False)."""
    return processes.own_thread_count() == 1


def _fork(options: dict[str, Any]) -> "ForkedSentinel":
    """fork(2) the sentinel: the child leaves this process's session, stdio, descriptors (all but
    its end of the channel, `options["fd"]`), signal handlers and logging behind, as an exec'd
    interpreter would not have them, then serves as cgturn.sentinel_main and exits with its status,
    never returning into the caller's code."""
    pid = os.fork()
    if pid == 0:  # the child: never return from here
        status = 1
        try:
            _leave_owner(options["fd"])
            # Serve as the exec'd sentinel does, `python -m cgturn.sentinel_main`, minus the
            # interpreter start and the parse of a command line (argparse alone was a quarter of a
            # forked sentinel's start): named, as `-m` names it, not imported by this module (the
            # guard, which it arms, starts the sentinel through this one). Not runpy.run_module: it
            # needs a loader with get_code, and an import hook (pytest's) may have none.
            status = importlib.import_module(PROGRAM).serve(**options)
        except SystemExit as done:
            status = done.code if isinstance(done.code, int) else 1
        except BaseException:  # noqa: BLE001 - nothing of the owner's may run on in this process
            status = 1
        finally:
            os._exit(status)
    forked = ForkedSentinel(pid)
    _FORKED.append(forked)
    return forked


def _leave_owner(fd: int) -> None:
    """In the forked child: what `subprocess.Popen(start_new_session=True, stdio /dev/null,
    pass_fds=(fd,))` and a fresh interpreter give the exec'd sentinel."""
    os.setsid()
    # The owner's objects stay where the fork left them, shared with the owner page by page until
    # written: the collector must never walk them (a full collection would touch, and so copy, every
    # page of the owner's heap into this process). gc.freeze(): "avoid copy-on-write" (gc docs).
    gc.freeze()
    # Its command line stays the owner's (a fork keeps argv): its name says what it is.
    processes.set_own_name(SENTINEL_NAME)
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    # Every other descriptor of the owner goes (close_range(2) where the kernel has it): the
    # sentinel must hold no pipe the owner's caller waits on, and no file the owner's objects,
    # copied into this process, would write to.
    os.closerange(3, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    try:
        signal.set_wakeup_fd(-1)  # an event loop's wake-up descriptor is closed now
    except ValueError:
        pass  # not the main thread: no wake-up fd can be set here either
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)  # the owner's Python handlers are the owner's business
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = logging.getLogger()
    for logger in [root, *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
        logger.disabled = False
    root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)


# Forked sentinels not reaped yet; each start reaps the ones that exited (as subprocess.Popen does).
_FORKED: list["ForkedSentinel"] = []


def _reap_forked() -> None:
    for forked in list(_FORKED):
        if forked.poll() is not None:
            with contextlib.suppress(ValueError):
                _FORKED.remove(forked)


class ForkedSentinel:
    """A sentinel forked from this process: the part of subprocess.Popen that SentinelClient and its
    callers use (`pid`, `returncode`, `poll`, `wait`, `kill`).

    Args:
        pid: the child's pid (it stays ours until reaped, so signalling it never hits another process).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<ForkedSentinel pid={self.pid} returncode={self.returncode}>"

    def poll(self) -> int | None:
        """The exit status once the sentinel has exited (reaping it), else None."""
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else (SIGCHLD ignored, os.wait()): gone
                    self.returncode = 0
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the sentinel to exit; its exit status.

        Raises:
            subprocess.TimeoutExpired: it still runs after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(["cgturn sentinel", str(self.pid)], timeout or 0.0)
            _wait_exit(self.pid, remaining)
        return code

    def kill(self) -> None:
        """SIGKILL the sentinel unless it has been reaped."""
        with self._lock:
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)


def _wait_exit(pid: int, timeout: float | None) -> None:
    """Block until `pid` exits or `timeout` passes (a pidfd turns readable at exit, pidfd_open(2))."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # reaped by someone else meanwhile: the next poll() sees it
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(None if timeout is None else max(1, int(timeout * 1000)))
    finally:
        os.close(fd)
