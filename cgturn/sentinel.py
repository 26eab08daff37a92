"""The sentinel: one helper process per TurnManager that enforces turn deadlines from outside the owner.

An in-process watchdog cannot help when the owner itself is SIGSTOPped, wedged with the GIL held,
swapping, or dead. The sentinel is a separate process (`python -m cgturn.sentinel_main`, its own session,
stdio on /dev/null) that holds every guarded turn's hard deadline and inactivity timeout and abandons
the turn through the same library path as the owner (a TurnManager of its own, so the atomic
first-transition-wins rule and the audit log hold).

Channel: an AF_UNIX SOCK_SEQPACKET socketpair; each datagram is one JSON message (`guard`, `touch`,
`unguard`, `lease`). Times are CLOCK_MONOTONIC, which is one clock for every process of the host. Touches are
rate-limited in the owner (one per TOUCH_INTERVAL per turn), so a stopped owner simply reports none
and its turn dies on time; the sentinel adds SLACK to every due time so the owner's own watchdog,
which knows the exact activity, normally acts first. Each message is one send(2) on a non-blocking
socket, and the sentinel runs under SCHED_BATCH, so receiving it does not preempt the owner (see
`_batch_policy` and docs/performance.md).

Start-up handshake: the sentinel's first datagram to the owner is `ready` (sent once it can guard:
its TurnManager is up and the owner's pidfd is open) or `error`; `attach` waits for it (READY_TIMEOUT)
and raises SentinelUnavailable otherwise, so an owner never believes itself guarded when it is not.
The sentinel never depends on the state directory to live: when it cannot write `sentinel.log` there
(read-only, not a directory, a FIFO in its place) it logs to its stderr instead and says so in `ready`,
and the owner logs a warning.

Owner death: the sentinel holds a pidfd of the owner (5.3+) and also sees EOF on the socket. When the
owner is dead it abandons every running turn it guards at once (reason `owner-died`, no grace);
completed turns are not guarded, so their survivors stay.

Leases: when the owner completes a turn with a lease (or moves one), it sends `lease` with the expiry
(wall clock). At that time the sentinel reads the turn's record — the one truth, another process may
have moved the lease — and kills the survivors (reason `lease-expired`) if it has run out. Leases are
the sentinel's to carry out while it runs; `cgturn reap` and recovery carry out the rest. It exits when it guards nothing and the
owner's channel is closed.

This module is both the owner-side client (`attach`, `SentinelClient`) and the process (`main`).

Why one module of ~670 lines: the client and the process speak one message protocol (guard, touch,
unguard, lease, ready), kept side by side so that neither can drift from the other; the pressure
guard it may run is cgturn/guard.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import clocks, ids, leases, processes, reasons, statefiles
from .errors import GuardUnavailable, SentinelUnavailable
from .logfields import turn_fields
from .model import ABANDONED, COMPLETED

if TYPE_CHECKING:
    from .manager import TurnManager

log = logging.getLogger("cgturn.sentinel")

# One touch per turn per TOUCH_INTERVAL reaches the sentinel: a touch is a compare in the hot path.
TOUCH_INTERVAL = 0.1
# Added to every due time in the sentinel: covers the touch rate limit and lets the in-process
# watchdog (which fires the interrupt and knows the exact activity) act first when it can.
SLACK = 0.25
# How often the sentinel drops guards of turns that ended without telling it (CLI stop, end_task).
SWEEP_INTERVAL = 0.5
# How long `close()` waits for an idle sentinel to exit before leaving it to finish on its own.
CLOSE_WAIT = 2.0
# The largest datagram either end accepts. Ids are at most ids.MAX_ID_BYTES each, so a guard (two
# ids, each byte escaped as \u00XX at worst) always fits; anything larger is refused, never cut.
MAX_MESSAGE = 65536
OWNER_DIED = reasons.OWNER_DIED
REASON_INACTIVITY = reasons.TIMEOUT
REASON_DEADLINE = reasons.DEADLINE
_SEND_TIMEOUT = 2.0
# How long attach waits for the sentinel's `ready`: an interpreter start and cgturn's imports, on a
# loaded host.
READY_TIMEOUT = 10.0
LOG_FILE = "sentinel.log"
_ATTACH_LOCK = threading.Lock()


# --- owner side ------------------------------------------------------------------------------------

def attach(manager: TurnManager) -> "SentinelClient | None":
    """The sentinel client of `manager`, starting the sentinel on first use; None when switched off.

    Args:
        manager: a TurnManager; `manager.sentinel_enabled` (keyword `sentinel=`, env CGTURN_SENTINEL)
            decides whether a sentinel may be started.

    Returns:
        The SentinelClient registered as a listener of the manager, or None when disabled.

    Raises:
        SentinelUnavailable: the sentinel did not report `ready` (it failed, or it could not be run).
    """
    if not getattr(manager, "sentinel_enabled", False):
        return None
    with _ATTACH_LOCK:
        for listener in manager.listeners:
            if isinstance(listener, SentinelClient) and not listener.closed:
                return listener
        client = SentinelClient(manager)
        manager.add_listener(client)
        client.guard_owned_turns()
        return client


attach_sentinel = attach  # the name the package exports


class SentinelClient:
    """The owner's end of the channel; a TurnManager listener (begin/touch/end/close reach it)."""

    def __init__(self, manager):
        self._manager = manager
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Non-blocking: a send is one sendto(2) (a socket with a timeout polls before each one);
        # `_send` waits for room itself, up to _SEND_TIMEOUT, only when the buffer is full.
        self._sock.setblocking(False)
        self._last_touch: dict[tuple[str, str], float] = {}
        self._next_prune = 0.0
        self.closed = False
        try:
            self.process = _start_process(manager, theirs.fileno())
        except OSError as err:
            self._sock.close()
            raise SentinelUnavailable(f"cannot start the sentinel: {err}") from err
        finally:
            theirs.close()
        self._await_ready()

    def _await_ready(self) -> None:
        """Wait for the sentinel's `ready`; on anything else stop it and raise SentinelUnavailable."""
        deadline = time.monotonic() + READY_TIMEOUT
        problem = f"no word from it within {READY_TIMEOUT:g} s"
        while (remaining := deadline - time.monotonic()) > 0:
            if not select.select([self._sock], [], [], remaining)[0]:
                continue
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            try:
                msg = json.loads(data) if data else {}
            except ValueError:
                msg = {}
            if isinstance(msg, dict) and msg.get("op") == "ready":
                if msg.get("log_problem"):
                    log.warning("sentinel %d logs to nowhere: %s", self.process.pid, msg["log_problem"])
                return
            if not data:
                problem = "it exited before it was ready"
            elif isinstance(msg, dict) and msg.get("op") == "error":
                problem = str(msg.get("message"))
                if msg.get("guard"):
                    self._stop_unready()
                    raise GuardUnavailable(problem)
            else:
                problem = f"unexpected first message {data[:80]!r}"
            break
        self._stop_unready()
        raise SentinelUnavailable(f"the sentinel could not start ({problem}): turns are not guarded against "
                                  f"the death of process {os.getpid()} (CGTURN_SENTINEL=0 runs without one)")

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

    def guard(self, turn, deadline: float | None = None, inactivity: float | None = None,
              grace: float = 2.0) -> None:
        """Ask the sentinel to abandon `turn` at `deadline` (monotonic) or after `inactivity` seconds
        without a touch; with neither, it is abandoned only when the owner dies."""
        self._send(_guard_message(turn.task_id, turn.turn_id, deadline, inactivity, grace, turn.last_activity),
                   block=True)

    def guard_owned_turns(self) -> None:
        """Guard (for owner death only) the running turns this process began before attaching."""
        for task_id, turn_id in self._manager.running_turns_of_caller():
            self._send(_guard_message(task_id, turn_id, None, None, 0.0, time.monotonic()), block=True)

    # TurnManager listener hooks -------------------------------------------------------------------

    def turn_begun(self, turn) -> None:
        self.guard(turn, grace=0.0)

    def turn_touched(self, turn) -> None:
        ids_ = (turn.task_id, turn.turn_id)
        now = turn.last_activity
        if now - self._last_touch.get(ids_, float("-inf")) < TOUCH_INTERVAL:
            return
        if self._send({"op": "touch", "key": _key(*ids_), "at": now}, block=False):
            self._last_touch[ids_] = now

    def lease_set(self, rec) -> None:
        self._send({"op": "lease", "key": [rec.task_key, rec.turn_key], "expires_at": rec.expires_at}, block=True)

    def turn_ended(self, event) -> None:
        self._send({"op": "unguard", "key": [event.task_key, event.turn_key]}, block=True)
        # Forget rate-limit stamps of long-idle turns, so the dict does not grow with every turn;
        # at most once a second, not a pass over every touched turn at every completion.
        now = time.monotonic()
        if self._last_touch and now >= self._next_prune:
            self._next_prune = now + 1.0
            horizon = now - 60
            self._last_touch = {k: v for k, v in self._last_touch.items() if v > horizon}

    def manager_closed(self) -> None:
        self.close()

    def close(self, wait: float = CLOSE_WAIT) -> None:
        """Close the channel (the sentinel sees EOF); wait up to `wait` s for it to exit if idle."""
        if self.closed:
            return
        self.closed = True
        self._sock.close()
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            # Still guarding running turns of a live owner: it exits once they end.
            log.debug("sentinel %d still guarding after close", self.process.pid)

    def _send(self, message: dict, block: bool) -> bool:
        if self.closed:
            return False
        data = json.dumps(message).encode()
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"sentinel message of {len(data)} bytes; the limit is {MAX_MESSAGE}")
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


def _key(task_id: str, turn_id: str) -> list[str]:
    return [ids.encode(task_id), ids.encode(turn_id)]


def _guard_message(task_id: str, turn_id: str, deadline: float | None, inactivity: float | None,
                   grace: float, last: float) -> dict:
    return {"op": "guard", "key": _key(task_id, turn_id), "task": task_id, "turn": turn_id,
            "deadline": deadline, "inactivity": inactivity, "grace": grace, "last": last}


def _start_process(manager, fd: int) -> subprocess.Popen:
    """Start `python -m cgturn.sentinel_main` in its own session, outside any turn, holding `fd`."""
    me = os.getpid()
    argv = [sys.executable, "-m", "cgturn.sentinel_main", "--fd", str(fd), "--owner-pid", str(me),
            "--owner-start", str(processes.start_time(me)), "--backend", manager.backend_name,
            "--state-dir", manager.state_dir]
    if manager.root is not None:
        argv += ["--root", manager.root]
    if getattr(manager, "guard", None) is not None:
        argv += ["--guard", json.dumps(manager.guard.to_json())]
    env = dict(os.environ)
    # The sentinel must import this very cgturn, installed or not.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    # stdio on /dev/null: a sentinel must never hold a pipe its owner's caller waits on.
    return subprocess.Popen(argv, pass_fds=(fd,), env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# --- the sentinel process --------------------------------------------------------------------------

@dataclass
class Guard:
    """One guarded turn: its deadlines as the sentinel sees them."""

    task: str
    turn: str
    deadline: float | None
    inactivity: float | None
    grace: float
    last: float
    # Frozen time the clocks leave out, learnt from the turn's record when a due time arrives.
    paused: clocks.PausedTime = field(default_factory=clocks.PausedTime)

    def due(self) -> tuple[float, str] | None:
        """(monotonic time at which to abandon, reason), or None when only owner death ends it."""
        options = []
        if self.deadline is not None:
            options.append((self.deadline + self.paused.deadline + SLACK, REASON_DEADLINE))
        if self.inactivity is not None:
            options.append((self.last + self.inactivity + self.paused.idle_credit(self.last) + SLACK,
                            REASON_INACTIVITY))
        return min(options) if options else None


class Sentinel:
    """The loop of the sentinel process: read the channel, watch the owner, abandon due turns."""

    def __init__(self, manager, sock: socket.socket, owner_pid: int, owner_start: int):
        self.manager = manager
        self.sock: socket.socket | None = sock
        self.guards: dict[tuple[str, str], Guard] = {}
        self.leases: dict[tuple[str, str], float] = {}  # turn key -> monotonic time to look at its lease
        self.owner_pidfd = _open_owner(owner_pid, owner_start)
        self.owner_dead = self.owner_pidfd is None
        self.kills: list[threading.Thread] = []
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL

    def run(self) -> None:
        """Serve until nothing is guarded and the owner's channel is closed, or the owner died."""
        while True:
            self._wait_and_read(self._timeout())
            if self.owner_dead:
                # Everything the owner sent before it died is read by now (_drain reads to EAGAIN/EOF).
                self._abandon_all(OWNER_DIED)
                break
            self._fire_due()
            self._expire_due_leases()
            self._sweep()
            if self.sock is None and not self.guards:
                break
        if self.sock is not None:
            self.sock.close()
        for thread in self.kills:
            thread.join()

    def _timeout(self) -> float:
        if self.owner_dead:
            return 0.0
        now = time.monotonic()
        dues = [d[0] for g in self.guards.values() if (d := g.due()) is not None] + list(self.leases.values())
        nearest = min(dues, default=now + 3600)
        if self.guards:
            nearest = min(nearest, self._next_sweep)
        return max(0.0, nearest - now)

    def _wait_and_read(self, timeout: float) -> None:
        poller = select.poll()
        if self.sock is not None:
            poller.register(self.sock.fileno(), select.POLLIN)
        if self.owner_pidfd is not None and not self.owner_dead:
            poller.register(self.owner_pidfd, select.POLLIN)
        for fd, _ in poller.poll(int(timeout * 1000) + 1):
            if fd == self.owner_pidfd:
                self.owner_dead = True  # a pidfd polls readable once its process has exited
        if self.sock is not None:
            self._drain()

    def _drain(self) -> None:
        while self.sock is not None:
            try:
                # SOCK_SEQPACKET keeps datagram boundaries; a longer one is cut and flagged MSG_TRUNC.
                data, _anc, flags, _addr = self.sock.recvmsg(MAX_MESSAGE, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data, flags = b"", 0
            if flags & socket.MSG_TRUNC:
                log.error("dropped a message longer than %d bytes from the owner", MAX_MESSAGE)
                continue
            if not data:
                self.sock.close()
                self.sock = None
                # EOF: the owner closed its manager or died; a pidfd poll tells which.
                if self.owner_pidfd is not None and select.select([self.owner_pidfd], [], [], 0)[0]:
                    self.owner_dead = True
                return
            try:
                self._handle(parse_message(data))
            except ValueError as err:
                # Acting on a damaged message could guard or kill the wrong turn: drop it, keep serving.
                log.error("dropped a malformed message from the owner: %s", err)

    def _handle(self, msg: dict) -> None:
        op, key = msg["op"], msg["key"]
        if op == "guard":
            guard = Guard(msg["task"], msg["turn"], msg["deadline"], msg["inactivity"], msg["grace"], msg["last"])
            if guard.due() is not None:  # frozen time before the clocks started is not theirs
                guard.paused.seen = self._frozen_total(key)[0]
            self.guards[key] = guard
        elif op == "touch":
            touched = self.guards.get(key)
            if touched is not None:
                touched.last = max(touched.last, msg["at"])
        elif op == "unguard":
            self.guards.pop(key, None)
        elif op == "lease":
            if msg["expires_at"] is None:
                self.leases.pop(key, None)
            else:  # wall clock to monotonic: the record is checked against the wall clock when due
                self.leases[key] = time.monotonic() + max(0.0, msg["expires_at"] - time.time())

    def _fire_due(self) -> None:
        now = time.monotonic()
        for key, guard in list(self.guards.items()):
            due = guard.due()
            if due is not None and due[0] <= now:
                due = self._due_after_pauses(key, guard, now)
            if due is not None and due[0] <= now:
                del self.guards[key]
                self._kill(guard, due[1], guard.grace)

    def _expire_due_leases(self) -> None:
        now = time.monotonic()
        for key, due in list(self.leases.items()):
            if due > now:
                continue
            del self.leases[key]
            try:
                rec = self.manager.backend.load(*key)
            except Exception:  # noqa: BLE001 - one unreadable record must not end the sentinel
                log.exception("cannot read the record of %r", key, extra=_key_fields(key))
                continue
            if leases.expired(rec, time.time()):
                self._start_thread(self._expire, key)
            elif rec is not None and rec.state == COMPLETED and rec.expires_at is not None:
                self.leases[key] = now + max(0.0, rec.expires_at - time.time())  # moved meanwhile

    def _expire(self, key) -> None:
        try:
            result = self.manager.expire_lease(*key)
            if not result.skipped:
                log.info("lease of %r expired: killed %s", key, result.killed,
                         extra=_key_fields(key, result.reason, pids=result.killed))
        except Exception:  # noqa: BLE001 - one failed kill must not end the sentinel
            log.exception("sentinel could not expire the lease of %r", key, extra=_key_fields(key, reasons.LEASE_EXPIRED))

    def _due_after_pauses(self, key, guard: Guard, now: float) -> tuple[float, str] | None:
        """The guard's due time once the turn's frozen time is left out (its clocks stop while it is
        frozen); read from the record only here, when a due time has arrived."""
        total, frozen = self._frozen_total(key, guard.paused.seen)
        guard.paused.look(total, guard.last, now - guard.last)
        due = guard.due()
        if due is not None and frozen:
            due = (max(due[0], now + clocks.FROZEN_RECHECK), due[1])
        return due

    def _frozen_total(self, key, otherwise: float = 0.0) -> tuple[float, bool]:
        """(seconds the turn has spent frozen, frozen now) from its record; `otherwise` when unreadable."""
        try:
            rec = self.manager.backend.load(*key)
        except Exception:  # noqa: BLE001 - an unreadable record must not keep a turn alive
            log.exception("cannot read the record of %r", key, extra=_key_fields(key))
            rec = None
        if rec is None:
            return otherwise, False
        return clocks.frozen_total(rec, time.time()), rec.frozen_at is not None

    def _abandon_all(self, reason: str) -> None:
        for key, guard in list(self.guards.items()):
            del self.guards[key]
            self._kill(guard, reason, 0.0)

    def _kill(self, guard: Guard, reason: str, grace: float) -> None:
        self._start_thread(self._abandon, guard, reason, grace)

    def _start_thread(self, target, *args) -> None:
        # One thread per kill: a turn's grace period must not delay another turn's deadline.
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.kills.append(thread)

    def _abandon(self, guard: Guard, reason: str, grace: float) -> None:
        try:
            result = self.manager.turn(guard.task, guard.turn).abandon(reason, grace=grace)
            if not result.skipped:
                log.info("abandoned %r/%r: %s, killed %s", guard.task, guard.turn, reason, result.killed,
                         extra=turn_fields(guard.task, guard.turn, result.reason, pids=result.killed))
        except Exception:  # noqa: BLE001 - one failed kill must not end the sentinel
            log.exception("sentinel could not abandon %r/%r", guard.task, guard.turn,
                          extra=turn_fields(guard.task, guard.turn, reason))

    def _sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL
        for key, guard in list(self.guards.items()):
            # Only an ended turn loses its guard: a turn whose record was garbled (state "corrupt")
            # is still a turn to kill when its owner dies.
            if self.manager.turn_state(*key) in (None, COMPLETED, ABANDONED):
                del self.guards[key]
                continue
            try:  # a limit the kernel enforced is audited even while the owner is stopped
                self.manager.check_limits(*key)
            except Exception:  # noqa: BLE001 - auditing must never stop the guard
                log.exception("could not check the limits of %r", key, extra=_key_fields(key))


def _key_fields(key: tuple[str, str], reason: str | None = None, **more: Any) -> dict[str, Any]:
    """Log fields for the turn at these encoded names (its original ids where they decode)."""
    return turn_fields(ids.decode(key[0]) or key[0], ids.decode(key[1]) or key[1], reason, **more)


def parse_message(data: bytes) -> dict:
    """One datagram from the owner, checked field by field (`key` becomes a tuple of the two encoded
    names). Raises ValueError for anything else: bad UTF-8 or JSON, a missing or mistyped field."""
    try:
        msg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as err:
        raise ValueError(str(err)) from None
    if not isinstance(msg, dict) or msg.get("op") not in ("guard", "touch", "unguard", "lease"):
        raise ValueError("not a guard, touch, unguard or lease message")
    key = msg.get("key")
    if not (isinstance(key, list) and len(key) == 2 and all(isinstance(k, str) and k for k in key)):
        raise ValueError(f"bad key {key!r:.80}")
    out = {"op": msg["op"], "key": tuple(key)}
    if msg["op"] == "guard":
        for name in ("task", "turn"):
            out[name] = ids.validate(msg.get(name), name)
        if [ids.encode(out["task"]), ids.encode(out["turn"])] != key:
            raise ValueError("key does not match the ids")
        out["deadline"] = _number(msg, "deadline", optional=True)
        out["inactivity"] = _number(msg, "inactivity", optional=True)
        out["grace"] = _number(msg, "grace", optional=True) or 0.0
        last = _number(msg, "last", optional=True)
        out["last"] = time.monotonic() if last is None else last
    elif msg["op"] == "touch":
        out["at"] = _number(msg, "at")
    elif msg["op"] == "lease":
        out["expires_at"] = _number(msg, "expires_at", optional=True)
    return out


def _number(msg: dict, field: str, optional: bool = False) -> float | None:
    value = msg.get(field)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{field} is not a finite number >= 0: {value!r:.40}")
    return float(value)


def _open_owner(pid: int, start: int) -> int | None:
    """A pidfd of the owner, or None when it is already gone (or a reused pid)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    # Checked after opening: the pidfd now pins this very process, so a later start-time match holds.
    # Cannot look is not known to be dead: the pidfd will tell when it exits.
    if not processes.alive_or_unknown(pid, start):
        os.close(fd)
        return None
    return fd


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cgturn.sentinel_main", description=__doc__.splitlines()[0])
    p.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET channel from the owner")
    p.add_argument("--owner-pid", type=int, required=True)
    p.add_argument("--owner-start", type=int, required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--root")
    p.add_argument("--guard", help="a PressureGuard's settings (JSON) to arm in this process")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the sentinel process. Returns its exit status."""
    args = build_parser().parse_args(argv)
    _batch_policy()
    sock = socket.socket(fileno=args.fd)
    log_problem = _setup_logging(args.state_dir)
    try:
        from .manager import TurnManager
        mgr = TurnManager(root=args.root, backend=args.backend, state_dir=args.state_dir, sentinel=False)
    except Exception as err:  # noqa: BLE001 - reported to the owner, who raises SentinelUnavailable
        log.exception("sentinel cannot start")
        _tell_owner(sock, {"op": "error", "message": f"{type(err).__name__}: {err}"})
        return 1
    with mgr:
        runner = None
        if args.guard:
            try:
                runner = _arm_guard(mgr, args)
            except Exception as err:  # noqa: BLE001 - reported to the owner, who raises GuardUnavailable
                log.error("pressure guard cannot start: %s", err)
                _tell_owner(sock, {"op": "error", "guard": True, "message": str(err)})
                return 1
        guard = Sentinel(mgr, sock, args.owner_pid, args.owner_start)
        _tell_owner(sock, {"op": "ready", "log_problem": log_problem})
        try:
            guard.run()
        finally:
            if runner is not None:
                runner.stop()
                runner.join()
    return 0


def _batch_policy() -> None:
    """Run the sentinel under SCHED_BATCH (sched(7)) when it runs under SCHED_OTHER: the same CPU
    share, but its wake-ups (one per message: a guard at every begin_turn, an unguard at every
    completion) no longer preempt the owner that sent them, which measured as most of the sentinel's
    cost per turn on a 2-CPU host. Its own due times still wake it; it runs at the next scheduling
    point, well inside SLACK. A real-time policy inherited from the owner is kept."""
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (OSError, AttributeError) as err:  # not Linux, or refused: guarding works without it
        log.debug("sentinel keeps its scheduling policy: %s", err)


def _arm_guard(mgr, args):
    """Arm the pressure guard (or stand by while another guard owns the root) and start its thread."""
    from .guard import GuardRunner, PressureGuard

    runner = GuardRunner(PressureGuard.from_json(json.loads(args.guard)), mgr, owner_pid=args.owner_pid)
    if not runner.arm(standby=True):
        log.info("pressure guard on standby: process %s owns this managed root", (runner.owned_by or {}).get("owner_pid"))
    runner.start()
    return runner


def _setup_logging(state_dir: str) -> str | None:
    """Log to `<state_dir>/sentinel.log`, else to stderr (/dev/null when started by an owner); returns
    why the file could not be used, or None. Never raises: guarding must not depend on a log."""
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


def _tell_owner(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode(), socket.MSG_DONTWAIT)
    except OSError:
        pass  # the owner is gone: the owner-death path handles that
