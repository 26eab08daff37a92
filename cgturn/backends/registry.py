"""The registry backend: the fallback where cgroup v2 is not usable (or `backend="registry"`).

Ownership is a SQLite registry (`<state_dir>/registry.sqlite3`, WAL mode, short transactions) that
any process on the host (owner, sentinel, CLI) shares. A turn owns:

- the processes spawned or adopted into it, recorded as (pid, start time) so a reused pid never
  matches a stale row;
- their descendants (one ppid map built from /proc per call);
- any process whose initial environment names this registry and the turn (CGTURN_SCOPE, CGTURN_TASK,
  CGTURN_TURN): double-forked/setsid daemons that reparented away keep it, so they are found
  wherever they went — and their descendants.

PID 1, the caller and its ancestors are never members and never signalled.

There is no kernel-side container, so kills are best effort against forks: every member is held by
a pidfd and SIGSTOPped, membership is re-collected until a pass finds nothing new, then SIGKILL (a
fork racing the stop either fails with a pending signal or hands the stop to the child; see
copy_process in kernel/fork.c).

The backend makes its process a child subreaper (prctl(2) PR_SET_CHILD_SUBREAPER, 3.4+), so orphans
of turn processes reparent to it instead of to PID 1, and a daemon thread reaps the orphans it
attributed to this registry by their environment while they were alive. It never calls
waitpid(-1) and never waits for a process this backend spawned (a Popen owns that exit status).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import logging
import os
import select
import signal
import sqlite3
import subprocess
import threading
import time
from typing import Callable, Iterable, Iterator

from ..errors import CgturnError, TurnExists, translate
from ..kernel import procfs
from ..model import ABANDONED, COMPLETED, RUNNING, TurnRecord
from .base import ENV_SCOPE, ENV_TASK, ENV_TURN, Backend, Member, prepare_spawn

log = logging.getLogger("cgturn")

DB_NAME = "registry.sqlite3"
# Rounds of "collect members, SIGSTOP the new ones" before the final SIGKILL; a fork storm is
# bounded by it (each round stops a generation, and a stopped process cannot fork).
FREEZE_PASSES = 50
# How often wait_empty re-collects members even when no pidfd fired: an escaper found only by its
# environment, or a child forked since the last look, has no pidfd in the poll set yet.
RESCAN_INTERVAL = 0.02
# pidfds polled at once by wait_empty; the periodic re-scan covers the rest.
MAX_POLL_FDS = 256
# The reaper looks at its process's children this often while orphans can arrive (a child it spawned
# or an orphan it adopted is alive: orphans arrive without notice), and this often when idle.
REAPER_INTERVAL = 0.05
REAPER_IDLE_INTERVAL = 1.0
BUSY_GRACE = 4  # quick sweeps after the last sign of activity, in intervals
BUSY_TIMEOUT = 10.0

_PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux 3.4+
_PR_GET_CHILD_SUBREAPER = 37

_SQL_TYPES = {"str": "TEXT", "int": "INTEGER", "float": "REAL"}
_KEYS = ("task_key", "turn_key")


class RegistryUnavailable(CgturnError):
    """The registry database cannot be opened or written (permissions, corrupt file, full disk)."""


# --- process-wide state: the subreaper flag and the children Popen owns ---------------------------

# Children spawned by any RegistryBackend of this process, pid -> start time. The reaper never waits
# for them: their exit status belongs to the Popen that started them. The lock is held across
# Popen() and the insert, so the reaper cannot classify a fresh child before it is listed here.
_SPAWN_LOCK = threading.Lock()
_SPAWNED: dict[int, int] = {}
_SUBREAPER_LOCK = threading.Lock()
_subreaper_users = 0
_subreaper_was_set = False


def _prctl(option: int, arg) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.prctl(option, arg, 0, 0, 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper (prctl PR_GET_CHILD_SUBREAPER)."""
    value = ctypes.c_int(0)
    _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value))
    return bool(value.value)


def _acquire_subreaper() -> None:
    """Make this process a child subreaper; counted, so the last user restores the previous flag."""
    global _subreaper_users, _subreaper_was_set
    with _SUBREAPER_LOCK:
        if _subreaper_users == 0:
            _subreaper_was_set = is_child_subreaper()
            if not _subreaper_was_set:
                _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        _subreaper_users += 1


def _release_subreaper() -> None:
    global _subreaper_users
    with _SUBREAPER_LOCK:
        _subreaper_users -= 1
        if _subreaper_users == 0 and not _subreaper_was_set:
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)


def _note_spawned(pid: int, started: int | None) -> None:
    """Mark a direct child as Popen's (caller holds _SPAWN_LOCK); prune entries that are gone."""
    me = os.getpid()
    for old, old_start in list(_SPAWNED.items()):
        st = procfs.stat(old)
        if st is None or st.start_time != old_start or st.ppid != me:
            del _SPAWNED[old]
    if started is not None:
        _SPAWNED[pid] = started


# --- /proc snapshot -------------------------------------------------------------------------------

class _Snapshot:
    """One pass over /proc: every process's stat, children by parent, and turn environments.

    Built once per membership query, so a process is judged against one consistent ppid map.
    """

    def __init__(self, scope: str):
        self.stats: dict[int, procfs.ProcStat] = {}
        self.children: dict[int, list[int]] = {}
        # pid -> (task_key, turn_key) for processes whose environment names `scope`
        self.tagged: dict[int, tuple[str, str]] = {}
        for pid in procfs.all_pids():
            st = procfs.stat(pid)
            if st is None:
                continue
            self.stats[pid] = st
            self.children.setdefault(st.ppid, []).append(pid)
            if pid == 2 or st.ppid == 2 or st.state in ("Z", "X"):
                continue  # kernel threads have no environment; a zombie's is gone
            tag = _turn_tag(procfs.environ(pid), scope)
            if tag is not None:
                self.tagged[pid] = tag

    def live(self, pid: int, started: int | None = None) -> bool:
        """True if `pid` is in the snapshot, not a zombie, and (when given) started at `started`."""
        st = self.stats.get(pid)
        return (st is not None and st.state not in ("Z", "X")
                and (started is None or st.start_time == started))

    def member(self, pid: int) -> Member:
        return pid, self.stats[pid].start_time


def _turn_tag(env: dict[str, str] | None, scope: str) -> tuple[str, str] | None:
    """(task_key, turn_key) from a process environment carrying this scope, else None."""
    if not env or env.get(ENV_SCOPE) != scope:
        return None
    task, turn = env.get(ENV_TASK), env.get(ENV_TURN)
    return (task, turn) if task and turn else None


# --- the database ---------------------------------------------------------------------------------

def _turn_columns() -> list[tuple[str, str]]:
    """(name, SQL type) of every TurnRecord field: the turns table follows the dataclass."""
    out = []
    for f in dataclasses.fields(TurnRecord):
        kind = str(f.type).split("|")[0].strip()
        out.append((f.name, _SQL_TYPES.get(kind, "TEXT")))
    return out


class _Database:
    """The registry's SQLite file: one connection per process (reopened after fork), WAL mode.

    Writes run in `BEGIN IMMEDIATE` transactions, which take the database's write lock up front, so
    a read-check-write (a state transition) cannot interleave with another process's.
    """

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._conn_pid = -1
        self.columns = [name for name, _ in _turn_columns()]
        self._init_schema()

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None or self._conn_pid != os.getpid():
            # A connection inherited across fork must not be used by the child (sqlite docs, "howtocorrupt").
            try:
                conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None,
                                       check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as err:
                raise RegistryUnavailable(f"cannot open registry {self.path}: {err}") from err
            self._conn, self._conn_pid = conn, os.getpid()
        return self._conn

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A short write transaction holding the database write lock (BEGIN IMMEDIATE)."""
        with self._lock:
            conn = self._connect()
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as err:
                raise RegistryUnavailable(f"cannot write registry {self.path}: {err}") from err
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise RegistryUnavailable(f"cannot write registry {self.path}: {exc}") from exc
                raise

    def read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._connect().execute(sql, args).fetchall()
            except sqlite3.Error as err:
                raise RegistryUnavailable(f"cannot read registry {self.path}: {err}") from err

    def _init_schema(self) -> None:
        cols = ", ".join(f"{name} {kind}" for name, kind in _turn_columns())
        with self.write() as conn:
            conn.execute(f"CREATE TABLE IF NOT EXISTS turns ({cols}, PRIMARY KEY (task_key, turn_key))")
            conn.execute("CREATE TABLE IF NOT EXISTS processes ("
                         "seq INTEGER PRIMARY KEY AUTOINCREMENT, pid INTEGER NOT NULL, "
                         "start_time INTEGER NOT NULL, task_key TEXT NOT NULL, turn_key TEXT NOT NULL, "
                         "argv TEXT NOT NULL, UNIQUE (task_key, turn_key, pid, start_time))")
            conn.execute("CREATE INDEX IF NOT EXISTS processes_turn ON processes (task_key, turn_key)")
            # A database made by an older cgturn lacks columns for newer TurnRecord fields.
            have = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
            for name, kind in _turn_columns():
                if name not in have:
                    conn.execute(f"ALTER TABLE turns ADD COLUMN {name} {kind}")

    # rows <-> records

    def to_record(self, row: tuple) -> TurnRecord:
        return TurnRecord(**dict(zip(self.columns, row)))

    def load(self, conn, task_key: str, turn_key: str) -> TurnRecord | None:
        row = conn.execute(f"SELECT {', '.join(self.columns)} FROM turns WHERE task_key=? AND turn_key=?",
                           (task_key, turn_key)).fetchone()
        return self.to_record(row) if row else None

    def save(self, conn, rec: TurnRecord) -> None:
        data = rec.to_json()
        marks = ", ".join("?" for _ in self.columns)
        conn.execute(f"INSERT OR REPLACE INTO turns ({', '.join(self.columns)}) VALUES ({marks})",
                     tuple(data[name] for name in self.columns))

    def forget(self, conn, task_key: str, turn_key: str) -> None:
        conn.execute("DELETE FROM turns WHERE task_key=? AND turn_key=?", (task_key, turn_key))
        conn.execute("DELETE FROM processes WHERE task_key=? AND turn_key=?", (task_key, turn_key))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._conn_pid == os.getpid():
                self._conn.close()
            self._conn = None


# --- the backend ----------------------------------------------------------------------------------

class RegistryBackend(Backend):
    """Turns recorded in SQLite; membership from records, the process tree and turn environments.

    Args:
        state_dir: where `registry.sqlite3` lives (created if missing).
        subreaper: make this process a child subreaper and reap the turn orphans that reparent to
            it (default). Off, orphans go to the nearest other subreaper or PID 1.

    Raises:
        RegistryUnavailable: the database cannot be opened.
        PermissionDenied / KernelError: the state directory cannot be created.
    """

    name = "registry"

    def __init__(self, state_dir: str, subreaper: bool = True):
        try:
            os.makedirs(state_dir, mode=0o755, exist_ok=True)
        except OSError as err:
            raise translate("mkdir", state_dir, err) from err
        self.db_path = os.path.abspath(os.path.join(state_dir, DB_NAME))
        self.db = _Database(self.db_path)
        self._reaper: _Reaper | None = None
        if subreaper:
            _acquire_subreaper()
            self._reaper = _Reaper(self.scope)
            self._reaper.start()

    @property
    def scope(self) -> str:
        return self.db_path

    @property
    def location(self) -> str:
        return self.db_path

    def env_for(self, record: TurnRecord) -> dict[str, str]:
        """The environment that ties a process (and what it leaves behind) to its turn."""
        return {ENV_TASK: record.task_key, ENV_TURN: record.turn_key, ENV_SCOPE: self.scope}

    # --- records and state ------------------------------------------------------------------------

    def create_turn(self, record: TurnRecord) -> None:
        with self.db.write() as conn:
            old = self.db.load(conn, record.task_key, record.turn_key)
            if old is not None:
                if old.state != COMPLETED or self._collect(old, _Snapshot(self.scope)):
                    raise TurnExists(f"turn {record.turn_id!r} already exists in task {record.task_id!r}")
                self.db.forget(conn, old.task_key, old.turn_key)  # completed, nothing alive: replace
            self.db.save(conn, record)

    def load(self, task_key: str, turn_key: str) -> TurnRecord | None:
        rows = self.db.read(f"SELECT {', '.join(self.db.columns)} FROM turns WHERE task_key=? AND turn_key=?",
                            (task_key, turn_key))
        return self.db.to_record(rows[0]) if rows else None

    def records(self, task_key: str | None = None) -> list[TurnRecord]:
        sql = f"SELECT {', '.join(self.db.columns)} FROM turns"
        rows = (self.db.read(sql + " WHERE task_key=? ORDER BY started_at", (task_key,)) if task_key is not None
                else self.db.read(sql + " ORDER BY started_at"))
        return [self.db.to_record(row) for row in rows]

    def transition(self, task_key, turn_key, allowed_from: Iterable[str], to_state, updates):
        allowed = set(allowed_from)
        with self.db.write() as conn:
            rec = self.db.load(conn, task_key, turn_key)
            if rec is None or rec.state not in allowed:
                return False, rec
            rec.state = to_state
            for name, value in updates.items():
                setattr(rec, name, value)
            self.db.save(conn, rec)
            return True, rec

    # --- membership -------------------------------------------------------------------------------

    def spawn(self, record, argv, popen_kwargs) -> subprocess.Popen:
        argv, program, kwargs = prepare_spawn(argv, popen_kwargs, self.env_for(record))
        with _SPAWN_LOCK:
            proc = subprocess.Popen([program, *argv[1:]], **kwargs)
            # Our unreaped child: its pid cannot be recycled yet, so this start time is its own.
            started = procfs.start_time(proc.pid)
            _note_spawned(proc.pid, started)
        if started is not None:
            self._record_process(record, proc.pid, started, argv)
        if self._reaper is not None:
            self._reaper.nudge()  # orphans may come from now on: look often
        return proc

    def adopt(self, record, pid) -> None:
        started = procfs.start_time(pid)
        if started is None:
            raise translate("adopt", f"/proc/{pid}", ProcessLookupError(errno.ESRCH, os.strerror(errno.ESRCH)))
        st = procfs.stat(pid)
        if st is not None and st.ppid == os.getpid():
            with _SPAWN_LOCK:  # our own child: some Popen may be waiting for it, never reap it
                _note_spawned(pid, started)
        self._record_process(record, pid, started, procfs.cmdline(pid).split(" "))

    def _record_process(self, record: TurnRecord, pid: int, started: int, argv: list[str]) -> None:
        with self.db.write() as conn:
            conn.execute("INSERT OR IGNORE INTO processes (pid, start_time, task_key, turn_key, argv) "
                         "VALUES (?, ?, ?, ?, ?)",
                         (pid, started, record.task_key, record.turn_key, json.dumps(argv)))

    def recorded(self, record: TurnRecord) -> list[Member]:
        """(pid, start time) of every process recorded (spawned or adopted) in the turn, dead or alive."""
        rows = self.db.read("SELECT pid, start_time FROM processes WHERE task_key=? AND turn_key=? ORDER BY seq",
                            (record.task_key, record.turn_key))
        return [(pid, start) for pid, start in rows]

    def members(self, record) -> list[Member]:
        return sorted(self._collect(record, _Snapshot(self.scope)))

    def _collect(self, record: TurnRecord, snap: _Snapshot, protected: set[int] | None = None) -> set[Member]:
        """Live members: recorded + environment-tagged processes, and their descendants.

        Protected pids (PID 1, the caller, its ancestors) are neither members nor walked through, so
        a turn never reaches the caller's other children. Pass `protected=set()` to see everything.
        """
        protected = procfs.protected_pids() if protected is None else protected
        seeds = [pid for pid, start in self.recorded(record) if snap.live(pid, start)]
        key = (record.task_key, record.turn_key)
        seeds += [pid for pid, tag in snap.tagged.items() if tag == key]
        found: set[int] = set()
        stack = [pid for pid in seeds if pid not in protected]
        while stack:
            pid = stack.pop()
            if pid in found or not snap.live(pid):
                continue
            found.add(pid)
            stack.extend(child for child in snap.children.get(pid, ()) if child not in protected)
        return {snap.member(pid) for pid in found}

    def contains_caller(self, record) -> bool:
        me = os.getpid()
        mine = procfs.start_time(me)
        if (me, mine) in self.recorded(record):
            return True
        # Walk through the caller's ancestors (one of them may be the member the caller descends
        # from), but never from PID 1, whose descendants are everything.
        return (me, mine) in self._collect(record, _Snapshot(self.scope), protected={1})

    # --- killing ----------------------------------------------------------------------------------

    def _send(self, fd: int, pid: int, sig: int, protected: set[int]) -> bool:
        """Signal through a pidfd, never a protected pid (PID 1, the caller, its ancestors)."""
        if pid in protected:
            log.error("refusing to send signal %d to protected pid %d", sig, pid)
            return False
        return procfs.pidfd_signal(fd, sig)

    def signal_members(self, record, sig) -> list[int]:
        protected = procfs.protected_pids()
        sent = []
        for pid, start in self._collect(record, _Snapshot(self.scope), protected):
            fd = procfs.open_pidfd(pid, start)
            if fd is None:
                continue
            try:
                if self._send(fd, pid, sig, protected):
                    sent.append(pid)
            finally:
                os.close(fd)
        return sorted(sent)

    def _freeze(self, record: TurnRecord, protected: set[int]) -> dict[Member, tuple[int, bool]]:
        """SIGSTOP members until a pass finds none new. Returns member -> (pidfd, was stopped before).

        The pidfds stay open so the final signal reaches exactly the process that was stopped.
        """
        held: dict[Member, tuple[int, bool]] = {}
        try:
            for _ in range(FREEZE_PASSES):
                new = False
                for member in self._collect(record, _Snapshot(self.scope), protected):
                    if member in held:
                        continue
                    fd = procfs.open_pidfd(*member)
                    if fd is None:
                        continue
                    st = procfs.stat(member[0])
                    held[member] = (fd, st is not None and st.state in ("T", "t"))
                    if self._send(fd, member[0], signal.SIGSTOP, protected):
                        new = True
                if not new:
                    break
            else:
                log.warning("turn %r still gaining processes after %d stop passes", record.turn_id, FREEZE_PASSES)
        except BaseException:
            _close_all(held)
            raise
        return held

    def kill_members(self, record) -> list[int]:
        protected = procfs.protected_pids()
        held = self._freeze(record, protected)
        killed = []
        try:
            for (pid, _), (fd, _) in held.items():
                if self._send(fd, pid, signal.SIGKILL, protected):
                    killed.append(pid)
        finally:
            _close_all(held)
        return sorted(killed)

    def kill_where(self, record, doomed: Callable[[int, int], bool]) -> list[int]:
        protected = procfs.protected_pids()
        held = self._freeze(record, protected)
        killed = []
        try:
            for (pid, start), (fd, was_stopped) in held.items():
                if doomed(pid, start):
                    if self._send(fd, pid, signal.SIGKILL, protected):
                        killed.append(pid)
                elif not was_stopped:  # leave a process stopped by someone else (^Z) stopped
                    self._send(fd, pid, signal.SIGCONT, protected)
        finally:
            _close_all(held)
        return sorted(killed)

    def wait_empty(self, record, timeout) -> bool:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            members = self.members(record)
            if not members:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            _wait_any_exit(members[:MAX_POLL_FDS], min(remaining, RESCAN_INTERVAL))

    def remove(self, record) -> bool:
        with self.db.write() as conn:
            if self._collect(record, _Snapshot(self.scope)):
                return False
            self.db.forget(conn, record.task_key, record.turn_key)
        return True

    def remove_task(self, task_key) -> bool:
        rows = self.db.read("SELECT COUNT(*) FROM turns WHERE task_key=?", (task_key,))
        return rows[0][0] == 0

    # --- observation --------------------------------------------------------------------------------

    def usage(self, record, pids):
        """CPU seconds (user + system) and summed RSS of the live members (psutil)."""
        import psutil

        cpu, rss = 0.0, 0
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                times = proc.cpu_times()
                cpu += times.user + times.system
                rss += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return cpu, rss

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
            _release_subreaper()
        self.db.close()


def _close_all(held: dict[Member, tuple[int, bool]]) -> None:
    for fd, _ in held.values():
        os.close(fd)
    held.clear()


def _wait_any_exit(members: list[Member], timeout: float) -> None:
    """Sleep until one of `members` exits (pidfd POLLIN, 5.3+) or `timeout` passes."""
    fds = []
    try:
        poller = select.poll()
        for pid, start in members:
            fd = procfs.open_pidfd(pid, start)
            if fd is None:
                return  # already gone: let the caller re-collect right away
            fds.append(fd)
            poller.register(fd, select.POLLIN)
        poller.poll(timeout * 1000)
    finally:
        for fd in fds:
            os.close(fd)


# --- the orphan reaper ----------------------------------------------------------------------------

class _Reaper(threading.Thread):
    """Reaps orphans of this registry's turns that reparented to this (subreaper) process.

    A child is attributed when it is first seen alive with this scope in its environment and is not
    one of our Popen children. Only attributed children are ever waited for, each by its pidfd
    (waitid P_PIDFD, 5.4+), so no other exit status is taken and a recycled pid is never waited for.
    """

    def __init__(self, scope: str, interval: float = REAPER_INTERVAL, idle_interval: float = REAPER_IDLE_INTERVAL):
        super().__init__(name="cgturn-reaper", daemon=True)
        self.scope = scope
        self.interval, self.idle_interval = interval, idle_interval
        self.attributed: dict[Member, int] = {}   # orphan -> pidfd
        self.ignored: set[Member] = set()          # children judged not ours to reap
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = threading.Event()
        self._busy_until = time.monotonic() + BUSY_GRACE * interval

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.sweep()
                self._sleep()
        except Exception:  # noqa: BLE001 - a dying reaper must say why, not vanish
            log.exception("cgturn reaper thread failed")

    def sweep(self) -> None:
        """Attribute new orphans among our children, then reap attributed ones that exited."""
        self._attribute()
        for member, fd in list(self.attributed.items()):
            try:
                done = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                done = True  # someone else reaped it (or it was never ours): forget it
            if done is not None:
                os.close(fd)
                del self.attributed[member]

    def _attribute(self) -> None:
        me = os.getpid()
        with _SPAWN_LOCK:
            for pid in procfs.all_pids():
                st = procfs.stat(pid)
                if st is None or st.ppid != me:
                    continue
                member = (pid, st.start_time)
                if member in self.attributed or member in self.ignored or _SPAWNED.get(pid) == st.start_time:
                    continue
                if st.state in ("Z", "X"):
                    # Exited before we saw it alive: its environment is gone, so we cannot know
                    # whose it is, and it may be a child some Popen will wait for.
                    self.ignored.add(member)
                    continue
                if _turn_tag(procfs.environ(pid), self.scope) is None:
                    self.ignored.add(member)
                    continue
                fd = procfs.open_pidfd(pid, st.start_time)
                if fd is not None:
                    self.attributed[member] = fd
            self.ignored = {m for m in self.ignored if procfs.start_time(m[0]) == m[1]}

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
        with _SPAWN_LOCK:
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
