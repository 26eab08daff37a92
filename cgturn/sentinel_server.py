"""The sentinel process's loop: read the owner's channel, watch the owner, abandon tracked turns
that are due, expire leases.

It holds every tracked turn's hard deadline and inactivity timeout (`TurnClock`, the clocks of
cgturn.clocks plus sentinel_watch.SLACK) and abandons the turn through the same library path as the owner (a
TurnManager of its own, so the atomic first-transition-wins rule and the audit log hold).

Owner death: the sentinel holds a pidfd of the owner (5.3+) and also sees EOF on the socket. When the
owner is dead it abandons every running turn it tracks at once (reason `owner-died`, no grace);
completed turns are not tracked, so their survivors stay. Leases: at a lease's expiry it reads the
turn's record (the one truth: another process may have moved the lease) and kills the survivors
(reason `lease-expired`) if it has run out. A lease is the user's request, so it outlives the owner:
after the owner closed its channel or died, the sentinel stays until every lease it was given has run
out, been moved off it (cleared, or the turn ended another way), or its survivors all exited — an
emptied completed turn is removed then, as completion removes an empty turn. Completed turns it was
told about (`untrack`) are looked at on the next sweeps too, while it runs anyway: one whose survivors
all exited is removed, rather than lingering as `completed` with no pids until `cgturn reap`. It exits
when it tracks nothing, holds no lease, and the owner's channel is closed.

Watches (`cgturn run --cpu-time`, `--oom-kills-turn`; cgturn.sentinel_watch): a watched turn is
abandoned once its CPU use passes its limit (reason `cpu-time`) or at its first OOM kill (`oom`).
"""
from __future__ import annotations

import _socket  # as cgturn.sentinel: socket.py's enums are not worth a forked sentinel's start
import logging
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from . import clocks, ids, leases, processes, reasons
from .logfields import turn_fields
from .model import ABANDONED, COMPLETED
from .sentinel_protocol import MAX_MESSAGE, parse_message
from .sentinel_watch import OOM_LOOK, TurnClock, Watch
from .sweeps import SweepRounds

if TYPE_CHECKING:
    from .manager import TurnManager

log = logging.getLogger("cgturn.sentinel")

# How often the sentinel drops clocks of turns that ended without telling it (CLI stop, end_task)
# and audits the limit events of the turns it tracks, at most: one look reads a record and the
# turn's counters (~0.1 ms), so with thousands of tracked turns a sweep is done in steps of at most
# SWEEP_STEP seconds, round robin, and the next step waits long enough for the sweep to use at most
# SWEEP_DUTY of a core (10,000 tracked turns: a full round in minutes, while the loop stays responsive).
SWEEP_INTERVAL = 0.5
SWEEP_STEP = 0.005
SWEEP_DUTY = 0.005
# After a wake-up that read messages, the next wait lasts at most this long and asks the channel for
# its end only (POLLRDHUP: a datagram's POLLIN wake-up passes it by), so back-to-back turns' messages
# are read together and most sends wake no one (a wake-up cost a send 5-9 us here, 1.3 us without:
# scripts/bench_sentinel_send.py). The owner's death (pidfd) and close (POLLRDHUP) wake it at once.
BATCH_WINDOW = 0.005


class Sentinel:
    """The loop of the sentinel process: read the channel, watch the owner, abandon due turns.

    Args:
        manager: the sentinel's own TurnManager (sentinel=False) of the owner's managed root.
        sock: the sentinel's end of the owner's channel.
        owner_pid, owner_start: the owner (pid + start time in clock ticks).
    """

    def __init__(self, manager: "TurnManager", sock: _socket.socket, owner_pid: int, owner_start: int | None):
        self.manager = manager
        self._control = manager._control
        self.sock: _socket.socket | None = sock
        self.tracked: dict[tuple[str, str], TurnClock] = {}
        # The tracked turns with a deadline or an inactivity timeout: the only clocks a wake-up looks
        # at (most turns are tracked for owner death alone, and there may be thousands of them).
        self.timed: set[tuple[str, str]] = set()
        self._rounds = SweepRounds(SWEEP_INTERVAL, SWEEP_STEP, SWEEP_DUTY)
        self.leases: dict[tuple[str, str], float] = {}  # turn key -> monotonic time to look at its lease
        self.ended: set[tuple[str, str]] = set()  # turns the owner ended: removed here once emptied
        self.watches: dict[tuple[str, str], Watch] = {}  # turns with a CPU-time limit or an OOM watch
        self.owner_pidfd = processes.open_owner(owner_pid, owner_start)
        self.owner_dead = self.owner_pidfd is None
        self.orphaned = False  # the owner is dead and its running turns were abandoned
        self.kills: list[threading.Thread] = []
        self._batching = False  # the last wait read messages: the next one waits BATCH_WINDOW at most

    def run(self) -> None:
        """Serve until nothing is tracked and the owner's channel is closed, or the owner died."""
        while True:
            self._wait_and_read(self._timeout())
            if self.owner_dead and not self.orphaned:
                # Everything the owner sent before it died is read by now (_drain reads to EAGAIN/EOF).
                self._abandon_all(reasons.OWNER_DIED)
                self.orphaned = True
                if self.sock is not None:
                    self.sock.close()
                    self.sock = None
            self._fire_due()
            self._look_at_watches()
            self._expire_due_leases()
            self._sweep()
            if self.sock is None and not self.tracked and not self.leases and not self.watches:
                break
        if self.sock is not None:
            self.sock.close()
        for thread in self.kills:
            thread.join()

    def _timeout(self) -> float:
        if self.owner_dead and not self.orphaned:
            return 0.0
        now = time.monotonic()
        dues = [d[0] for k in self.timed if (d := self.tracked[k].due()) is not None] + list(self.leases.values())
        dues.extend(w.next_look for w in self.watches.values())
        nearest = min(dues, default=now + 3600)
        if self.tracked or self.leases or self.ended:
            nearest = min(nearest, self._rounds.next_at)
        return max(0.0, nearest - now)

    def _wait_and_read(self, timeout: float) -> None:
        poller = select.poll()
        if self.sock is not None:
            poller.register(self.sock.fileno(), select.POLLRDHUP if self._batching else select.POLLIN)
            if self._batching:
                timeout = min(timeout, BATCH_WINDOW)
        if self.owner_pidfd is not None and not self.owner_dead:
            poller.register(self.owner_pidfd, select.POLLIN)
        for fd, _ in poller.poll(int(timeout * 1000) + 1):
            if fd == self.owner_pidfd:
                self.owner_dead = True  # a pidfd polls readable once its process has exited
        if self.sock is not None:
            self._batching = self.drain() > 0

    def drain(self) -> int:
        """Read and handle every datagram waiting on the channel (to EAGAIN or EOF); how many were read."""
        read = 0
        while self.sock is not None:
            try:
                # SOCK_SEQPACKET keeps datagram boundaries; a longer one is cut and flagged MSG_TRUNC.
                data, _anc, flags, _addr = self.sock.recvmsg(MAX_MESSAGE, 0, _socket.MSG_DONTWAIT)
            except BlockingIOError:
                return read
            except OSError:
                data, flags = b"", 0
            if flags & _socket.MSG_TRUNC:
                log.error("dropped a message longer than %d bytes from the owner", MAX_MESSAGE)
                continue
            if not data:
                self.sock.close()
                self.sock = None
                # EOF: the owner closed its manager or died; a pidfd poll tells which.
                if self.owner_pidfd is not None and select.select([self.owner_pidfd], [], [], 0)[0]:
                    self.owner_dead = True
                return read
            read += 1
            try:
                self._handle(parse_message(data))
            except ValueError as err:
                # Acting on a damaged message could track or kill the wrong turn: drop it, keep serving.
                log.error("dropped a message from the owner: %s", err)
        return read

    def _handle(self, msg: dict[str, Any]) -> None:
        op, key = msg["op"], msg["key"]
        if op == "track":
            clock = TurnClock(msg["task"], msg["turn"], msg["deadline"], msg["inactivity"], msg["grace"], msg["last"])
            if clock.due() is not None:  # frozen time before the clocks started is not theirs
                clock.frozen.seen = self._frozen_state(key)[0]
            self.tracked[key] = clock
            if clock.deadline is not None or clock.inactivity is not None:
                self.timed.add(key)
            else:
                self.timed.discard(key)
        elif op == "touch":
            touched = self.tracked.get(key)
            if touched is not None:
                touched.last = max(touched.last, msg["at"])
        elif op == "watch":
            self.watches[key] = Watch(msg["task"], msg["turn"], msg["cpu_time"], msg["oom"], msg["grace"],
                                      time.monotonic())
        elif op == "untrack":
            self._forget(key)
            self.ended.add(key)  # looked at from the next sweep on: the owner removes an empty one itself
        elif op == "lease":
            if msg["expires_at"] is None:
                self.leases.pop(key, None)
            else:  # wall clock to monotonic: the record is checked against the wall clock when due
                self.leases[key] = time.monotonic() + max(0.0, msg["expires_at"] - time.time())

    def _fire_due(self) -> None:
        now = time.monotonic()
        for key in list(self.timed):
            clock = self.tracked[key]
            due = clock.due()
            if due is not None and due[0] <= now:
                # The clocks stop while the turn is frozen: the record is read only now.
                due = clock.due_after_look(self._frozen_state(key, clock.frozen.seen), now)
            if due is not None and due[0] <= now:
                self._forget(key)
                self._kill(clock, due[1], clock.grace)

    def _forget(self, key: tuple[str, str]) -> None:
        """Drop every clock and watch of the turn at `key`."""
        self.tracked.pop(key, None)
        self.timed.discard(key)
        self.watches.pop(key, None)

    def _look_at_watches(self) -> None:
        """Abandon the watched turns past their CPU-time limit or OOM-killed into; schedule the rest."""
        now = time.monotonic()
        for key, watch in list(self.watches.items()):
            if watch.next_look > now:
                continue
            try:
                rec = self._control.record(*key)
            except Exception:  # noqa: BLE001 - one unreadable record must not end the sentinel
                log.exception("cannot read the record of %r", key, extra=_key_fields(key))
                rec = None
            if rec is None or rec.state in (COMPLETED, ABANDONED):
                del self.watches[key]  # it ended: nothing left to watch
                continue
            usage = self._control.turn_usage_quietly(rec)
            verdict = None if usage is None else watch.verdict(usage)
            if usage is None:  # unreadable this time (logged): look again soon, not at the far bound
                watch.next_look = now + OOM_LOOK
                continue
            if verdict is None:
                watch.next_look = watch.after(usage.cpu_seconds, now)
                continue
            self._forget(key)
            self._kill(watch, verdict, watch.grace if verdict == reasons.CPU_TIME else 0.0)

    def _frozen_state(self, key: tuple[str, str], otherwise: float = 0.0) -> tuple[float, bool]:
        """`clocks.frozen_state` of the turn's record; `otherwise` when it cannot be read."""
        try:
            rec = self._control.record(*key)
        except Exception:  # noqa: BLE001 - an unreadable record must not keep a turn alive
            log.exception("cannot read the record of %r", key, extra=_key_fields(key))
            rec = None
        return clocks.frozen_state(rec, time.time(), otherwise)

    def _expire_due_leases(self) -> None:
        now = time.monotonic()
        for key, due in list(self.leases.items()):
            if due > now:
                continue
            del self.leases[key]
            try:
                rec = self._control.record(*key)
            except Exception:  # noqa: BLE001 - one unreadable record must not end the sentinel
                log.exception("cannot read the record of %r", key, extra=_key_fields(key))
                continue
            if leases.expired(rec, time.time()):
                self._start_thread(self._expire, key)
            elif rec is not None and rec.state == COMPLETED and rec.expires_at is not None:
                self.leases[key] = now + max(0.0, rec.expires_at - time.time())  # moved meanwhile

    def _expire(self, key: tuple[str, str]) -> None:
        try:
            result = self._control.expire_lease(*key)
            if not result.skipped:
                log.info("lease of %r expired: killed %s", key, result.killed,
                         extra=_key_fields(key, result.reason, pids=result.killed))
        except Exception:  # noqa: BLE001 - one failed kill must not end the sentinel
            log.exception("sentinel could not expire the lease of %r", key, extra=_key_fields(key, reasons.LEASE_EXPIRED))

    def _abandon_all(self, reason: str) -> None:
        self.watches.clear()  # the watched turns are tracked too: abandoned here
        self.timed.clear()
        for key, clock in list(self.tracked.items()):
            del self.tracked[key]
            self._kill(clock, reason, 0.0)

    def _kill(self, clock: TurnClock | Watch, reason: str, grace: float) -> None:
        self._start_thread(self._abandon, clock, reason, grace)

    def _start_thread(self, target: Callable[..., None], *args: Any) -> None:
        # One thread per kill: a turn's grace period must not delay another turn's deadline.
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.kills.append(thread)

    def _abandon(self, clock: TurnClock | Watch, reason: str, grace: float) -> None:
        try:
            result = self.manager.turn(clock.task, clock.turn).abandon(reason, grace=grace)
            if not result.skipped:
                log.info("abandoned %r/%r: %s, killed %s", clock.task, clock.turn, reason, result.killed,
                         extra=turn_fields(clock.task, clock.turn, result.reason, pids=result.killed))
        except Exception:  # noqa: BLE001 - one failed kill must not end the sentinel
            log.exception("sentinel could not abandon %r/%r", clock.task, clock.turn,
                          extra=turn_fields(clock.task, clock.turn, reason))

    def _sweep(self) -> None:
        if self._rounds.due(time.monotonic()):
            self._rounds.step(self._sweep_items, self._sweep_item)

    def _sweep_items(self) -> list[tuple[str, tuple[str, str]]]:
        """A sweep round: leases, ended turns (to forget once settled), tracked turns."""
        return ([("lease", k) for k in self.leases] + [("ended", k) for k in self.ended]
                + [("tracked", k) for k in self.tracked])

    def _sweep_item(self, item: tuple[str, tuple[str, str]]) -> None:
        """Forget what needs no more looking at: a lease of a turn gone, no longer completed, with the
        lease cleared or nothing left in it; an ended turn gone or emptied (an emptied completed turn
        is removed); the clock of a tracked turn that ended. A running tracked turn gets its limit
        events audited (even while its owner is stopped)."""
        kind, key = item
        if kind == "lease":
            if key in self.leases and self._settled(key, leased=True):
                del self.leases[key]
            return
        if kind == "ended":
            if key in self.ended and key not in self.leases and self._settled(key, leased=False):
                self.ended.discard(key)
            return
        if key not in self.tracked:
            return  # forgotten since the round began
        try:
            rec = self._control.record(*key)
        except Exception:  # noqa: BLE001 - one unreadable record must not end the sentinel
            log.exception("cannot read the record of %r", key, extra=_key_fields(key))
            return
        # Only an ended turn loses its clock: a turn whose record was garbled (state "corrupt") is
        # still a turn to kill when its owner dies.
        if rec is None or rec.state in (COMPLETED, ABANDONED):
            self._forget(key)
            return
        try:
            self._control.check_limits(*key, rec=rec)
        except Exception:  # noqa: BLE001 - auditing must never stop the sentinel
            log.exception("could not check the limits of %r", key, extra=_key_fields(key))

    def _settled(self, key: tuple[str, str], leased: bool) -> bool:
        """True when the turn at `key` needs no more looking at (removed here if it emptied)."""
        try:
            rec = self._control.record(*key)
            if rec is None or rec.state != COMPLETED or (leased and rec.expires_at is None):
                return True
            from . import recovery  # here, not before the sentinel's `ready`: its owner waits for that
            if recovery.remove_emptied(self._control, rec):
                log.info("completed turn %r emptied: removed", key, extra=_key_fields(key))
                return True
            return False
        except Exception:  # noqa: BLE001 - one unreadable turn must not end the sentinel
            log.exception("cannot look at the completed turn %r", key, extra=_key_fields(key))
            return True


def _key_fields(key: tuple[str, str], reason: str | None = None, **more: Any) -> dict[str, Any]:
    """Log fields for the turn at these encoded names (its original ids where they decode)."""
    return turn_fields(ids.decode(key[0]) or key[0], ids.decode(key[1]) or key[1], reason, **more)
