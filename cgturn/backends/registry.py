"""The registry backend: the fallback where cgroup v2 is not usable (or `backend="registry"`).

Ownership is a SQLite registry (`<state_dir>/registry.sqlite3`, WAL mode, short transactions) that
any process on the host (owner, sentinel, CLI) shares. A turn owns:

- the processes spawned or adopted into it, recorded as (pid, start time) so a reused pid never
  matches a stale row;
- their descendants (one ppid map built from /proc per call);
- any process whose initial environment names this registry and the turn (CGTURN_SCOPE, CGTURN_TASK,
  CGTURN_TURN): double-forked/setsid daemons that reparented away keep it, so they are found
  wherever they went — and their descendants.

PID 1, the caller and its ancestors are never members and never signalled. A kill never waits on the
database: on a full or read-only state directory (RegistryUnavailable) it kills from what is known —
the processes this process recorded, their descendants, and every process whose environment names the
turn — and a row it cannot delete is hidden in this process and deleted by its next write that works
(a warning says so; another process still lists the turn until then, with no processes). Membership (one pass over
/proc) is registry_members.py; stopping and killing members (SIGSTOP passes, then SIGKILL: best
effort against forks, there is no kernel-side container) is registry_killer.py.

The backend makes its process a child subreaper (prctl(2) PR_SET_CHILD_SUBREAPER, 3.4+), so orphans
of turn processes reparent to it instead of to PID 1, and a daemon thread collects the orphans it
attributed to this registry by their environment while they were alive (orphans.py). It never calls
waitpid(-1) and never waits for a process this backend spawned (a Popen owns that exit status). The
database is registry_db.py.
"""
# size: a little over the limit: one Backend class whose every hook is a few lines; membership, killing and the database are modules of their own.
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
from typing import Iterable

from ..errors import IsolationUnavailable, NoSuchProcess, NoSuchTurn, RegistryUnavailable, TurnExists
from ..kernel import procfs
from ..limits import Usage
from ..logfields import turn_fields
from ..model import COMPLETED, RUNNING, TurnRecord, TurnView
from . import isolation
from .base import (ENV_SCOPE, ENV_TASK, ENV_TURN, Backend, Member, prepare_spawn, scope_tag, turn_environment,
                   with_environment)
from .capabilities import no_limits_error
from .orphans import SPAWN_LOCK, OrphanCollector, acquire_subreaper, note_spawned, release_subreaper
from .registry_db import RefusedDeletes, RegistryDatabase
from .registry_killer import RegistryKiller
from .registry_members import Snapshot, collect, usage, wait_any_exit

log = logging.getLogger("cgturn")

DB_NAME = "registry.sqlite3"
# How often wait_empty re-collects members even when no pidfd fired: an escaper found only by its
# environment, or a child forked since the last look, has no pidfd in the poll set yet.
RESCAN_INTERVAL = 0.02
# pidfds polled at once by wait_empty; the periodic re-scan covers the rest.
MAX_POLL_FDS = 256
# Turns whose recorded processes this process keeps (for a kill the database cannot serve) before it
# drops those whose rows are gone: turns another process ended and removed.
KNOWN_PRUNE_AT = 256


# --- the backend ----------------------------------------------------------------------------------

class RegistryBackend(Backend):
    """Turns recorded in SQLite; membership from records, the process tree and turn environments.

    Args:
        state_dir: where `registry.sqlite3` lives (created if missing).
        subreaper: once this backend creates or adopts into a turn, make this process a child
            subreaper and reap the turn orphans that reparent to it (default). Off, orphans go to
            the nearest other subreaper or PID 1.

    Raises:
        RegistryUnavailable: the database cannot be opened.
        PermissionDenied / KernelError: the state directory cannot be created.
    """

    name = "registry"
    limiter = None  # limits need cgroups

    def __init__(self, state_dir: str, subreaper: bool = True):
        # Nothing is created here: the database (and the state directory) come with the first write.
        self.db_path = os.path.abspath(os.path.join(state_dir, DB_NAME))
        self.db = RegistryDatabase(self.db_path)
        self._orphans: OrphanCollector | None = None
        # Becoming a subreaper changes where the whole process's orphans go, so only a process that
        # owns turns does it (on its first turn), never a read-only user such as `cgturn ps`.
        self._wants_subreaper = subreaper
        self._saved_env: dict[str, str | None] | None = None  # the caller's CGTURN_* before enter()
        # Processes this process recorded, per turn: what a kill still knows when the database cannot
        # be read.
        self._known: dict[tuple[str, str], set[Member]] = {}
        self._unreadable: set[tuple[str, str]] = set()  # turns whose processes the database would not list
        self._unforgotten = RefusedDeletes(self.db)  # killed turns' rows the database would not delete
        self.killer = RegistryKiller(lambda rec, protected: self._collect(rec, Snapshot(self.scope), protected),
                                     self._expect_orphans)

    def _ensure_collector(self) -> None:
        if self._wants_subreaper and self._orphans is None:
            acquire_subreaper()
            self._orphans = OrphanCollector(self.scope)
            self._orphans.start()

    @property
    def scope(self) -> str:
        return self.db_path

    @property
    def location(self) -> str:
        return self.db_path

    def env_for(self, record: TurnRecord) -> dict[str, str]:
        return turn_environment(record, self.scope)

    def ensure_root(self) -> bool:
        """Nothing to make ahead: the database comes with the first write."""
        return False

    def remove_root(self) -> bool:
        """The database stays (it is the state directory's); nothing is left to remove."""
        return True

    # --- records and state ------------------------------------------------------------------------

    def create_turn(self, record: TurnRecord, limits=None) -> None:
        if limits is not None and not limits.is_empty():
            raise no_limits_error(self.name)
        if record.sealed or record.network != "host":  # both need the turn's cgroup and namespaces
            raise IsolationUnavailable("the registry backend cannot seal a turn or give it a network of its own")
        self._ensure_collector()
        self._unforgotten.retry()
        if len(self._known) > KNOWN_PRUNE_AT:  # turns another process ended and removed: forget them
            alive = set(self.db.read("SELECT task_key, turn_key FROM turns"))
            self._known = {names: members for names, members in self._known.items() if names in alive}
        with self.db.write() as conn:
            old = self.db.load(conn, record.task_key, record.turn_key)
            if old is not None:
                if old.state != COMPLETED or self._collect(old, Snapshot(self.scope)):
                    raise TurnExists(f"turn {record.turn_id!r} already exists in task {record.task_id!r}")
                self.db.forget(conn, old.task_key, old.turn_key)  # completed, nothing alive: replace
            self.db.save(conn, record)

    def load(self, task_key: str, turn_key: str) -> TurnRecord | None:
        rows = self.db.read(f"SELECT {', '.join(self.db.columns)} FROM turns WHERE task_key=? AND turn_key=?",
                            (task_key, turn_key))
        rec = self.db.to_record(rows[0]) if rows else None
        return None if rec is None or self._unforgotten.hides(rec) else rec

    def records(self, task_key: str | None = None) -> list[TurnRecord]:
        sql = f"SELECT {', '.join(self.db.columns)} FROM turns"
        rows = (self.db.read(sql + " WHERE task_key=? ORDER BY started_at", (task_key,)) if task_key is not None
                else self.db.read(sql + " ORDER BY started_at"))
        return [rec for rec in map(self.db.to_record, rows) if not self._unforgotten.hides(rec)]

    def transition(self, task_key, turn_key, allowed_from: Iterable[str], to_state, updates, when=None,
                   stamp_later: bool = False):
        # `stamp_later` changes nothing here: a listing reads the database, which this write updates.
        self._unforgotten.retry()
        with self.db.write() as conn:
            rec = self.db.load(conn, task_key, turn_key)
            if rec is not None and self._unforgotten.hides(rec):
                rec = None
            if rec is None or (when is not None and not when(rec)) or not rec.advance(set(allowed_from), to_state, updates):
                return False, rec
            self.db.save(conn, rec)
            return True, rec

    @contextlib.contextmanager
    def task_lock(self, task_key):
        """The database's write lock (one write transaction; the spawn's own writes join it)."""
        with self.db.write():
            yield

    # --- membership -------------------------------------------------------------------------------

    def spawn(self, record, argv, popen_kwargs) -> subprocess.Popen:
        argv, program, kwargs, identity = prepare_spawn(argv, popen_kwargs)
        kwargs = with_environment(kwargs, self.env_for(record))
        # setpriv drops privileges and execs the target in the same process, so the pid recorded below
        # is the target's; both backends then give user=/group= the same meaning (isolation.py).
        steps = isolation.drop_privileges(identity)
        if not self._running(record):
            raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} is not running; cannot spawn")
        with SPAWN_LOCK:
            proc = subprocess.Popen([*steps, program, *argv[1:]], **kwargs)
            # Our child, not yet waited for: its pid cannot be recycled yet, so this start time is its own.
            started = procfs.start_time(proc.pid)
            note_spawned(proc.pid, started)
        if started is not None:
            self._record_process(record, proc.pid, started, argv)
        if self._orphans is not None:
            self._orphans.nudge()  # orphans may come from now on: look often
        # Checked again once recorded: an abandon marks the turn before it collects members, so
        # either it found this process by its record, or its mark is seen here. (Between fork and
        # exec the child shows the parent's environment, so the kill's scan alone can miss it.)
        if not self._running(record):
            proc.kill()
            proc.wait()
            raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} ended while spawning")
        return proc

    def _running(self, record: TurnRecord) -> bool:
        current = self.load(record.task_key, record.turn_key)
        return current is not None and current.state == RUNNING

    def adopt(self, record, pid) -> None:
        self._ensure_collector()
        st = procfs.stat(pid)
        if st is None:
            raise NoSuchProcess(pid, f"cannot adopt process {pid}: it does not exist")
        started = st.start_time
        if st is not None and st.ppid == os.getpid():
            with SPAWN_LOCK:  # our own child: some Popen may be waiting for it, never collect it
                note_spawned(pid, started)
        self._record_process(record, pid, started, procfs.cmdline(pid).split(" "))

    def _record_process(self, record: TurnRecord, pid: int, started: int, argv: list[str]) -> None:
        self._known.setdefault((record.task_key, record.turn_key), set()).add((pid, started))
        with self.db.write() as conn:
            conn.execute("INSERT OR IGNORE INTO processes (pid, start_time, task_key, turn_key, argv) "
                         "VALUES (?, ?, ?, ?, ?)",
                         (pid, started, record.task_key, record.turn_key, json.dumps(argv)))

    def recorded(self, record: TurnRecord) -> list[Member]:
        """(pid, start time) of every process recorded (spawned or adopted) in the turn, dead or alive;
        when the database cannot be read, those this process recorded (a kill must not wait on it)."""
        try:
            rows = self.db.read("SELECT pid, start_time FROM processes WHERE task_key=? AND turn_key=? ORDER BY seq",
                                (record.task_key, record.turn_key))
        except RegistryUnavailable as err:
            known = sorted(self._known.get((record.task_key, record.turn_key), ()))
            if (record.task_key, record.turn_key) in self._unreadable:
                return known
            self._unreadable.add((record.task_key, record.turn_key))  # said once per turn: kills re-collect often
            log.warning("cannot read the processes of turn %r of task %r from the registry (%s): using the %d "
                        "this process recorded and the turn's environment", record.turn_id, record.task_id, err,
                        len(known), extra=turn_fields(record.task_id, record.turn_id, record.reason))
            return known
        return [(pid, start) for pid, start in rows]

    def members(self, record) -> list[Member]:
        return sorted(self._collect(record, Snapshot(self.scope)))

    def _collect(self, record: TurnRecord, snap: Snapshot, protected: set[int] | None = None) -> set[Member]:
        """Live members (registry_members.collect); protected pids default to PID 1, the caller and
        its ancestors. Pass `protected=set()` to see everything."""
        protected = procfs.protected_pids() if protected is None else protected
        return collect(self.recorded(record), (record.task_key, record.turn_key), snap, protected)

    def turn_of(self, pid: int) -> tuple[str, str] | None:
        started = procfs.start_time(pid)
        rows = self.db.read("SELECT task_key FROM processes WHERE pid=? AND start_time=?", (pid, started))
        if rows:
            return self.scope, rows[0][0]
        return scope_tag(procfs.environ(pid))

    def enter(self, record) -> None:
        self._ensure_collector()
        me = os.getpid()
        if self._saved_env is None:
            self._saved_env = {name: os.environ.get(name) for name in (ENV_TASK, ENV_TURN, ENV_SCOPE)}
        self._forget_caller()
        # Recorded, so the turn contains the caller (abandoning it is refused); in os.environ, so
        # every process started from now on carries the turn.
        self._record_process(record, me, procfs.start_time(me), ["(entered)"])  # type: ignore[arg-type]  # we exist
        os.environ.update(self.env_for(record))

    def leave(self) -> None:
        self._forget_caller()
        if self._saved_env is not None:
            for name, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            self._saved_env = None

    def _forget_caller(self) -> None:
        me = os.getpid()
        with self.db.write() as conn:
            conn.execute("DELETE FROM processes WHERE pid=? AND start_time=?", (me, procfs.start_time(me)))

    def contains_caller(self, record) -> bool:
        me = os.getpid()
        mine = procfs.start_time(me)
        if (me, mine) in self.recorded(record):
            return True
        # Walk through the caller's ancestors (one of them may be the member the caller descends
        # from), but never from PID 1, whose descendants are everything.
        return (me, mine) in self._collect(record, Snapshot(self.scope), protected={1})

    def checked_members_at(self, task_key, turn_key) -> None:
        return None  # the recorded members answer: the record is needed

    # --- killing ----------------------------------------------------------------------------------

    def _expect_orphans(self, killed) -> None:
        """Tell the collector that these killed members are ours to collect if they end up our children:
        a member whose parent died in the same kill reparents to us already dead, so the collector
        never sees it alive to check its environment."""
        if self._orphans is not None:
            self._orphans.expect(killed)

    def signal_members(self, record, sig) -> list[int]:
        return self.killer.signal(record, sig)

    def kill_members(self, record, checked=None) -> list[int]:
        return self.killer.kill(record)  # signals member by member: reads and checks them itself

    def freeze_members(self, record, frozen: bool) -> list[int]:
        return self.killer.freeze(record, frozen)

    def kill_where(self, record, doomed) -> list[int]:
        return self.killer.kill_where(record, doomed)

    def wait_empty(self, record, timeout, signalled_at=None) -> bool:  # woken by exits (pidfds): no spin to bound
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            members = self.members(record)
            if not members:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            wait_any_exit(members[:MAX_POLL_FDS], min(remaining, RESCAN_INTERVAL))

    def remove(self, record) -> bool:
        """Delete an emptied turn's row (False while it has members). A database that refuses the
        write (RegistryUnavailable: a full or read-only state directory) does not keep a kill from
        finishing: the row is hidden in this process and deleted by its next write that works."""
        self._unforgotten.retry()
        try:
            with self.db.write() as conn:
                if self._collect(record, Snapshot(self.scope)):
                    return False
                self.db.forget(conn, record.task_key, record.turn_key)
        except RegistryUnavailable as err:
            if self._collect(record, Snapshot(self.scope)):
                return False
            self._unforgotten.add(record)
            log.warning("cannot remove the record of turn %r of task %r, which is empty (%s): this process "
                        "deletes it once the registry takes writes again; others list it until then",
                        record.turn_id, record.task_id, err,
                        extra=turn_fields(record.task_id, record.turn_id, record.reason))
        self._known.pop((record.task_key, record.turn_key), None)
        self._unreadable.discard((record.task_key, record.turn_key))
        return True

    def task_keys(self) -> list[str]:
        return [row[0] for row in self.db.read("SELECT DISTINCT task_key FROM turns")]

    def remove_task(self, task_key, force: bool = False) -> bool:
        rows = self.db.read("SELECT COUNT(*) FROM turns WHERE task_key=?", (task_key,))
        return rows[0][0] == 0

    def strays(self) -> list[tuple[str, int]]:
        """None: a process of a turn is found wherever it went (by record, descent or environment),
        so no process is inside the registry's territory but in no turn."""
        return []

    def kill_stray(self, where: str, pid: int) -> bool:
        """Never signals: the registry finds no strays (see `strays`)."""
        return False

    # --- observation --------------------------------------------------------------------------------

    def turn_usage(self, record) -> Usage:
        """CPU seconds of the live members; the kernel enforces no limit here, so no counters."""
        cpu, _ = usage([pid for pid, _ in self.members(record)])
        return Usage(cpu_seconds=cpu)

    def turn_frozen(self, record) -> bool:
        """False: without cgroup.freeze the kernel holds no freeze state (SIGSTOP is per process;
        the record's `frozen_by` says who stopped the turn)."""
        return False

    def cgroup_dir(self, record) -> None:
        """None: a registry turn has no cgroup."""
        return None

    def views(self, task_key=None, detail=False) -> list[TurnView]:
        out = []
        for rec in self.records(task_key):
            pids = sorted(pid for pid, _ in self.members(rec))
            cpu, mem = usage(pids)
            out.append(TurnView(rec, pids, cpu, mem, path=self.location))
        return out

    def close(self) -> None:
        if self._orphans is not None:
            self._orphans.stop()
            self._orphans = None
            release_subreaper()
        self.db.close()
