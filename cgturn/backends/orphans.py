"""The child subreaper of the registry backend, and the thread that collects the orphans it inherits.

prctl(2) PR_SET_CHILD_SUBREAPER (3.4+) makes orphans of turn processes reparent to this process
instead of PID 1, so they stay visible; a daemon thread collects (waits for, so no zombie is left)
those it attributed to a turn (by the turn environment they carried while alive). "Collect" is this
module's word for waiting for an orphan's exit; "reap" is cgturn's crash recovery (`cgturn reap`).
It never calls waitpid(-1) and never waits for a process a Popen of ours started: that exit status
belongs to the Popen.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time

from ..kernel import libc, procfs
from .base import Member, turn_tag

log = logging.getLogger("cgturn")

# The collector looks at its process's children this often while orphans can arrive (a child it spawned
# or an orphan it adopted is alive: orphans arrive without notice), and this often when idle.
COLLECT_INTERVAL = 0.05
COLLECT_IDLE_INTERVAL = 1.0
BUSY_GRACE = 4  # quick sweeps after the last sign of activity, in intervals



# --- process-wide state: the subreaper flag and the children Popen owns ---------------------------

# Children spawned by any RegistryBackend of this process, pid -> start time. The collector never waits
# for them: their exit status belongs to the Popen that started them. The lock is held across
# Popen() and the insert, so the collector cannot classify a fresh child before it is listed here.
SPAWN_LOCK = threading.Lock()
_SPAWNED: dict[int, int] = {}
_SUBREAPER_LOCK = threading.Lock()
_subreaper_users = 0
_subreaper_was_set = False


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper (prctl PR_GET_CHILD_SUBREAPER)."""
    return libc.is_child_subreaper()


def acquire_subreaper() -> None:
    """Make this process a child subreaper; counted, so the last user restores the previous flag."""
    global _subreaper_users, _subreaper_was_set
    with _SUBREAPER_LOCK:
        if _subreaper_users == 0:
            _subreaper_was_set = is_child_subreaper()
            if not _subreaper_was_set:
                libc.set_child_subreaper(True)
        _subreaper_users += 1


def release_subreaper() -> None:
    global _subreaper_users
    with _SUBREAPER_LOCK:
        _subreaper_users -= 1
        if _subreaper_users == 0 and not _subreaper_was_set:
            libc.set_child_subreaper(False)


def note_spawned(pid: int, started: int | None) -> None:
    """Mark a direct child as Popen's (caller holds SPAWN_LOCK); prune entries that are gone."""
    me = os.getpid()
    for old, old_start in list(_SPAWNED.items()):
        st = procfs.stat(old)
        if st is None or st.start_time != old_start or st.ppid != me:
            del _SPAWNED[old]
    if started is not None:
        _SPAWNED[pid] = started


class OrphanCollector(threading.Thread):
    """Collects orphans of this registry's turns that reparented to this (subreaper) process.

    A child is attributed when it is first seen alive with this scope in its environment and is not
    one of our Popen children. Only attributed children are ever waited for, each by its pidfd
    (waitid P_PIDFD, 5.4+), so no other exit status is taken and a recycled pid is never waited for.
    """

    def __init__(self, scope: str, interval: float = COLLECT_INTERVAL, idle_interval: float = COLLECT_IDLE_INTERVAL):
        super().__init__(name="cgturn-orphans", daemon=True)
        self.scope = scope
        self.interval, self.idle_interval = interval, idle_interval
        self.attributed: dict[Member, int] = {}   # orphan -> pidfd
        self.ignored: set[Member] = set()          # children judged not ours to collect
        self.expected: set[Member] = set()         # members this process killed: ours if they come
        self._expected_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = threading.Event()
        self._busy_until = time.monotonic() + BUSY_GRACE * interval

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.sweep()
                self._sleep()
        except Exception:  # noqa: BLE001 - a dying collector must say why, not vanish
            log.exception("cgturn orphan collector thread failed")

    def sweep(self) -> None:
        """Attribute new orphans among our children, then collect attributed ones that exited."""
        self._attribute()
        for member, fd in list(self.attributed.items()):
            done: object
            try:
                done = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                done = True  # someone else waited for it (or it was never ours): forget it
            if done is not None:
                os.close(fd)
                del self.attributed[member]

    def _attribute(self) -> None:
        """Classify children of ours not seen before: turn orphans are attributed, others ignored.

        The /proc scan runs without SPAWN_LOCK (spawn must not wait for it); only the check against
        _SPAWNED takes it, and spawn holds it across Popen() and the insert, so a fresh Popen child
        is always listed by the time it is checked.
        """
        me = os.getpid()
        for pid in procfs.children_of(me):
            st = procfs.stat(pid)
            if st is None or st.ppid != me:
                continue
            member = (pid, st.start_time)
            if member in self.attributed or member in self.ignored:
                continue
            with SPAWN_LOCK:
                if _SPAWNED.get(pid) == st.start_time:
                    continue
            with self._expected_lock:
                expected = member in self.expected
                self.expected.discard(member)
            if expected:
                # A turn member we killed that reparented to us (its parent died in the same kill).
                fd = procfs.open_pidfd(pid, st.start_time)
                if fd is not None:
                    self.attributed[member] = fd
                continue
            if st.state in ("Z", "X"):
                # Exited before we saw it alive: its environment is gone, so we cannot know
                # whose it is, and it may be a child some Popen will wait for.
                self.ignored.add(member)
                continue
            env = procfs.environ(pid)
            if not env:
                # Unreadable, or read in the middle of an execve(2): the new image's environment is
                # not in place yet and reads empty. Looked at again on the next sweep, not ignored.
                continue
            if turn_tag(env, self.scope) is None:
                self.ignored.add(member)
                continue
            fd = procfs.open_pidfd(pid, st.start_time)
            if fd is not None:
                self.attributed[member] = fd
        self.ignored = {m for m in self.ignored if procfs.start_time(m[0]) == m[1]}
        with self._expected_lock:
            self.expected = {m for m in self.expected if procfs.start_time(m[0]) == m[1]}

    def _busy(self) -> bool:
        """Whether orphans can arrive: a child we spawned, or an orphan we hold, is still around.

        Turn orphans reparent to us only from our own descendants, i.e. from these. Quick sweeps go
        on for a few intervals after the last of them (or a spawn) was seen, since its orphans
        reparented to us as it exited, possibly just after the last sweep looked.
        """
        if self._busy_now():
            self._busy_until = time.monotonic() + BUSY_GRACE * self.interval
            return True
        return time.monotonic() < self._busy_until

    def _busy_now(self) -> bool:
        if self.attributed:
            return True
        me = os.getpid()
        with SPAWN_LOCK:
            spawned = list(_SPAWNED.items())
        for pid, started in spawned:
            st = procfs.stat(pid)
            if st is not None and st.start_time == started and st.ppid == me:
                return True
        return False

    def _sleep(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in self.attributed.values():
            poller.register(fd, select.POLLIN)
        poller.poll((self.interval if self._busy() else self.idle_interval) * 1000)
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)

    def expect(self, members) -> None:
        """Members this process just killed: collect them if they turn up as our (dead) children."""
        with self._expected_lock:
            self.expected.update(members)
        self.nudge()

    def nudge(self) -> None:
        """Wake the thread now (a process was just spawned) and keep it sweeping quickly."""
        self._busy_until = time.monotonic() + BUSY_GRACE * self.interval
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def stop(self) -> None:
        """Stop the thread, do a last sweep, and release its pidfds."""
        self._stopping.set()
        self.nudge()
        self.join(timeout=5.0)
        if not self.is_alive():
            with contextlib.suppress(Exception):
                self.sweep()
            for fd in self.attributed.values():
                os.close(fd)
            self.attributed.clear()
            os.close(self._wake_r)
            os.close(self._wake_w)
