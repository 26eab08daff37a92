"""The sentinel's owner side: `attach` starts one helper process per TurnManager that enforces turn
deadlines from outside the owner, and `SentinelClient` is the owner's end of its channel.

An in-process watchdog cannot help when the owner itself is SIGSTOPped, wedged with the GIL held,
swapping, or dead. The sentinel is a separate process (forked from the owner while it runs one
thread, else `python -m cgturn.sentinel_main`; its own session, stdio on /dev/null) that holds every tracked turn's hard deadline and inactivity timeout;
its loop is cgturn.sentinel_server and the messages both ends speak are cgturn.sentinel_protocol.

Touches are rate-limited in the owner (one per TOUCH_INTERVAL per turn), so a stopped owner simply
reports none and its turn dies on time; the sentinel adds a slack to every due time so the owner's
own watchdog, which knows the exact activity, normally acts first. Each message is one send(2) on a
non-blocking socket; the sentinel runs under SCHED_BATCH, so receiving it does not preempt the
owner, and reads messages that come back to back in windows, so most sends wake no one
(sentinel_server.BATCH_WINDOW, docs/performance.md).

Start-up handshake: the sentinel's first datagram to the owner is `ready` (sent once it can track
turns: its TurnManager is up and the owner's pidfd is open) or `error`; `attach` waits for it
(READY_TIMEOUT) and raises SentinelUnavailable otherwise, so an owner never believes its turns tracked
when they are not. A sentinel that cannot write `sentinel.log` says so in `ready`, and the owner logs
a warning. Leases: when the owner completes a turn with a lease (or moves one), it sends `lease`.
"""
from __future__ import annotations

# socket.py's C core: the same socket objects, without the enums socket.py converts at its import
# (~1.3 ms of every `cgturn run`, whose channel is the only socket it opens).
import _socket
import logging
import os
import select
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

from . import sentinel_protocol as protocol
from . import sentinel_start
from .errors import GuardUnavailable, SentinelUnavailable
from .sentinel_protocol import MAX_MESSAGE

if TYPE_CHECKING:
    from .manager import TurnManager

log = logging.getLogger("cgturn.sentinel")

__all__ = ["attach", "attach_sentinel", "SentinelClient", "MAX_MESSAGE", "await_ready"]

# One touch per turn per TOUCH_INTERVAL reaches the sentinel: a touch is a compare in the hot path.
TOUCH_INTERVAL = 0.1
# How long `close()` waits for an idle sentinel to exit before leaving it to finish on its own.
CLOSE_WAIT = 2.0
_SEND_TIMEOUT = 2.0
# How long attach waits for the sentinel's `ready`: an interpreter start and cgturn's imports (where it
# cannot be forked), on a loaded host. 10 s was missed by the emulated test host at load 7-52 (an SSH
# user's `cgturn run` and `run --memory`, exit 125 "no word from it"); a sentinel that is up answers in
# milliseconds, so the bound only says how long a stuck start is waited for.
READY_TIMEOUT = 30.0
_ATTACH_LOCK = threading.Lock()


def attach(manager: TurnManager, wait: bool = True) -> "SentinelClient | None":
    """The sentinel client of `manager`, starting the sentinel on first use; None when switched off.

    Args:
        manager: a TurnManager; `manager.sentinel_enabled` (keyword `sentinel=`, env CGTURN_SENTINEL)
            decides whether a sentinel may be started.
        wait: wait for the sentinel's `ready` (a started one's included). False: return a client
            whose sentinel may still be starting; what it is sent meanwhile waits in the channel,
            and the next attach that waits (a Supervisor's start) waits for `ready`.

    Returns:
        The SentinelClient registered as a listener of the manager, or None when disabled.

    Raises:
        SentinelUnavailable: the sentinel did not report `ready` (it failed, it speaks another
            protocol version, or it could not be run).
        GuardUnavailable: the sentinel could not arm the manager's pressure guard.
    """
    if not getattr(manager, "sentinel_enabled", False):
        return None
    with _ATTACH_LOCK:
        for listener in manager.listeners:
            if isinstance(listener, SentinelClient) and not listener.closed:
                if wait:
                    listener.wait_ready()
                return listener
        client = SentinelClient(manager, wait=wait)
        manager.add_listener(client)
        client.track_owned_turns()
        return client


attach_sentinel = attach  # the name the package exports


def await_ready(sock: _socket.socket, timeout: float) -> dict[str, Any]:
    """Wait for the sentinel's first datagram on `sock` and return it if it is `ready`.

    Args:
        sock: the owner's end of the channel.
        timeout: seconds to wait.

    Returns:
        The `ready` message (cgturn.sentinel_protocol.parse_reply).

    Raises:
        GuardUnavailable: the sentinel reported that the pressure guard could not arm.
        SentinelUnavailable: anything else: silence, EOF, an `error`, another protocol version.
    """
    deadline = time.monotonic() + timeout
    problem = f"no word from it within {timeout:g} s"
    while (remaining := deadline - time.monotonic()) > 0:
        if not select.select([sock], [], [], remaining)[0]:
            continue
        try:
            data = sock.recv(MAX_MESSAGE)
        except OSError:
            data = b""
        if not data:
            problem = "it exited before it was ready"
            break
        try:
            msg = protocol.parse_reply(data)
        except ValueError as err:
            problem = str(err)
            break
        if msg["op"] == "ready":
            return msg
        if msg["guard"]:
            raise GuardUnavailable(msg["message"])
        problem = msg["message"]
        break
    raise SentinelUnavailable(f"the sentinel could not start ({problem}): turns are not guarded against "
                              f"the death of process {os.getpid()} (CGTURN_SENTINEL=0 runs without one)")


class SentinelClient:
    """The owner's end of the channel; a TurnManager listener (begin/touch/end/close reach it).

    Args:
        manager: the TurnManager whose turns the sentinel tracks.
        wait: wait for the sentinel's `ready` here (else in `wait_ready`).

    Raises:
        SentinelUnavailable, GuardUnavailable: as `attach`.
    """

    def __init__(self, manager: "TurnManager", wait: bool = True):
        self._manager = manager
        self._sock, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        # Non-blocking: a send is one sendto(2) (a socket with a timeout polls before each one);
        # `_send` waits for room itself, up to _SEND_TIMEOUT, only when the buffer is full.
        self._sock.setblocking(False)
        self._last_touch: dict[tuple[str, str], float] = {}
        self._next_prune = 0.0
        self._leased_until = 0.0  # wall clock: the latest lease sent (the sentinel stays for it)
        self.closed = False
        self.ready = False  # its `ready` was received
        try:
            self.process = sentinel_start.start(manager, theirs.fileno())
        except OSError as err:
            self._sock.close()
            raise SentinelUnavailable(f"cannot start the sentinel: {err}") from err
        finally:
            theirs.close()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for the sentinel's `ready` unless it came already.

        Raises:
            SentinelUnavailable, GuardUnavailable: as `attach` (the client is then closed).
        """
        if self.ready:
            return
        if self.closed:
            raise SentinelUnavailable(f"the sentinel's channel is closed: turns are not guarded against the "
                                      f"death of process {os.getpid()}")
        try:
            ready = await_ready(self._sock, READY_TIMEOUT)
        except (SentinelUnavailable, GuardUnavailable):
            self._stop_unready()
            raise
        self.ready = True
        if ready["log_problem"]:
            log.warning("sentinel %d logs to nowhere: %s", self.process.pid, ready["log_problem"])

    def _stop_unready(self) -> None:
        self.closed = True
        self._sock.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def __repr__(self) -> str:
        return f"<SentinelClient pid={self.process.pid} {'closed' if self.closed else 'open'}>"

    @property
    def pid(self) -> int:
        """Pid of the sentinel process."""
        return self.process.pid

    def track(self, turn: Any, deadline: float | None = None, inactivity: float | None = None,
              grace: float = 2.0) -> None:
        """Ask the sentinel to abandon `turn` at a deadline or after a time without a touch.

        With neither, the turn is abandoned only when the owner dies.

        Args:
            turn: the Turn (its ids and `last_activity` are sent).
            deadline: monotonic time of the hard deadline.
            inactivity: seconds without a touch.
            grace: seconds between SIGTERM and SIGKILL for that abandon.

        Raises:
            ValueError: the message would exceed the protocol's MAX_MESSAGE (nothing is sent).
        """
        self._send(protocol.track(turn.task_id, turn.turn_id, deadline, inactivity, grace, turn.last_activity),
                   block=True)


    def watch(self, turn: Any, cpu_time: float | None = None, oom: bool = False, grace: float = 2.0) -> bool:
        """Ask the sentinel to abandon `turn` once its CPU use passes `cpu_time` seconds (reason
        `cpu-time`, with `grace`) and, when `oom`, at its first OOM kill (reason `oom`, no grace).

        Args:
            turn: the Turn (its ids are sent).
            cpu_time: CPU seconds of the turn's cgroup; None: no CPU-time limit.
            oom: abandon the whole turn at its first OOM kill.
            grace: seconds between SIGTERM and SIGKILL for the CPU-time abandon.

        Returns:
            True when the sentinel got the message (False: the channel is closed or broken).
        """
        return self._send(protocol.watch(turn.task_id, turn.turn_id, cpu_time, oom, grace), block=True)

    def track_owned_turns(self) -> None:
        """Track (for owner death only) the running turns this process began before attaching."""
        for task_id, turn_id in self._manager._control.running_turns_of_caller():
            self._send(protocol.track(task_id, turn_id, None, None, 0.0, time.monotonic()), block=True)

    # TurnManager listener hooks -------------------------------------------------------------------

    def turn_begun(self, turn: Any) -> None:
        """Listener hook: a turn began; track it for owner death.

        Args:
            turn: the Turn.
        """
        self.track(turn, grace=0.0)

    def turn_touched(self, turn: Any) -> None:
        """Listener hook: forward the activity, at most once per TOUCH_INTERVAL per turn, never blocking.

        Args:
            turn: the Turn touched (its `last_activity` is sent).
        """
        names = (turn.task_id, turn.turn_id)
        now = turn.last_activity
        if now - self._last_touch.get(names, float("-inf")) < TOUCH_INTERVAL:
            return
        if self._send(protocol.touch(*names, now), block=False):
            self._last_touch[names] = now

    def lease_set(self, rec: Any) -> None:
        """Listener hook: a completed turn's lease was set or moved.

        Args:
            rec: the turn's record (its `expires_at` is sent).
        """
        if self._send(protocol.lease(rec.task_key, rec.turn_key, rec.expires_at), block=True) and rec.expires_at:
            self._leased_until = max(self._leased_until, rec.expires_at)

    def turn_ended(self, event: Any) -> None:
        """Listener hook: a turn ended; the sentinel forgets its clocks.

        Args:
            event: the TurnEnded event.
        """
        self._send(protocol.untrack(event.task_key, event.turn_key), block=True)
        # Forget rate-limit stamps of long-idle turns, so the dict does not grow with every turn;
        # at most once a second, not a pass over every touched turn at every completion.
        now = time.monotonic()
        if self._last_touch and now >= self._next_prune:
            self._next_prune = now + 1.0
            horizon = now - 60
            self._last_touch = {k: v for k, v in self._last_touch.items() if v > horizon}

    def manager_closed(self) -> None:
        """Listener hook: the manager closed; close the channel."""
        self.close()

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """Close the channel (the sentinel sees EOF) and wait for an idle sentinel to exit.

        Args:
            wait: seconds to wait; a sentinel still tracking running turns of a live owner stays, and
                exits once they end. A sentinel holding a lease stays until it is over (no wait).
        """
        if self.closed:
            return
        self.closed = True
        self._sock.close()
        if self._leased_until > time.time():
            return  # it enforces the lease after we are gone: do not hold our caller meanwhile
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            # Still tracking running turns of a live owner: it exits once they end.
            log.debug("sentinel %d still tracking after close", self.process.pid)

    def _send(self, message: dict, block: bool) -> bool:
        if self.closed:
            return False
        data = protocol.encode(message)
        try:
            try:
                self._sock.send(data)  # SOCK_SEQPACKET: the whole datagram, or EAGAIN
                return True
            except BlockingIOError:
                if not block:
                    # A touch must never stall the owner: drop it when the buffer is full (the
                    # next touch retries, as its rate-limit stamp was not updated).
                    return False
            deadline = time.monotonic() + _SEND_TIMEOUT
            poller = select.poll()  # not select(): the fd may be above FD_SETSIZE in a busy gateway
            poller.register(self._sock.fileno(), select.POLLOUT)
            while (remaining := deadline - time.monotonic()) > 0:
                if poller.poll(max(1, int(remaining * 1000))):
                    try:
                        self._sock.send(data)
                        return True
                    except BlockingIOError:
                        continue
            return False
        except (BlockingIOError, TimeoutError):
            return False
        except OSError as err:
            log.error("sentinel channel broken (%s); deadlines are enforced in-process only", err)
            self.closed = True
            return False
