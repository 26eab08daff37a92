"""The registry's SQLite file: turn records and the processes spawned or adopted into turns.

One connection per process (reopened after fork), WAL mode, short `BEGIN IMMEDIATE` transactions, so
the owner, a sentinel and the CLI can share it and a state transition cannot interleave with another.
SQLite's locks are fcntl(2) locks on the database and its `-wal`/`-shm` files, which a read-only fd
can take: the file is made 0600 (SQLite gives the other two the database's mode), so no other user
can open it, hold its lock or read it. A lock held past BUSY_TIMEOUT is a LockTimeout.
Every turn row carries its record format (column `format`, record_format.py): a row written before the
column existed (NULL) is format 1, a row newer than this code reads as a CORRUPT turn.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
import stat
import threading
from typing import Iterator

from ..errors import LockTimeout, RegistryUnavailable, translate
from ..model import STORED_FIELDS, TurnRecord, corrupt_record
from .record_format import FORMAT_KEY, RECORD_FORMAT, format_problem

BUSY_TIMEOUT = 10.0
DB_MODE = 0o600  # the owner's alone: see the module docstring
_SQL_TYPES = {"str": "TEXT", "int": "INTEGER", "float": "REAL", "bool": "INTEGER"}


def _turn_columns() -> list[tuple[str, str]]:
    """(name, SQL type) of every TurnRecord field, then the record's format: the turns table follows
    the dataclass."""
    out = []
    for f in dataclasses.fields(TurnRecord):
        if f.name not in STORED_FIELDS:
            continue
        kind = str(f.type).split("|")[0].strip()
        out.append((f.name, _SQL_TYPES.get(kind, "TEXT")))
    out.append((FORMAT_KEY, "INTEGER"))
    return out


def _make_private(path: str) -> None:
    """Create the database file DB_MODE before SQLite does (it would make it 0644), or take group
    and other access away from one made so by an earlier cgturn, with its -wal and -shm files."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, DB_MODE))
        return
    except FileExistsError:
        pass
    except OSError:
        return  # SQLite's open reports what is wrong
    for name in (path, f"{path}-wal", f"{path}-shm"):
        try:
            st = os.stat(name, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077 and st.st_uid == os.geteuid():
                os.chmod(name, DB_MODE)
        except OSError:
            pass


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if SQLite has not already: a COMMIT that fails with SQLITE_FULL
    (a full state directory) rolls the transaction back itself, and a second ROLLBACK would raise
    "no transaction is active" in place of the error that matters (sqlite.org/lang_transaction.html)."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # the error being raised says what went wrong


class RegistryDatabase:
    """The registry's SQLite file: one connection per process (reopened after fork), WAL mode.

    Writes run in `BEGIN IMMEDIATE` transactions, which take the database's write lock up front, so
    a read-check-write (a state transition) cannot interleave with another process's.
    """

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._conn_pid = -1
        self._depth = 0  # open write() blocks of the thread holding _lock: only the outermost commits
        self.columns = [name for name, _ in _turn_columns()]

    def _connect(self) -> sqlite3.Connection:
        """The process's connection; the first one creates the state directory, file and schema."""
        if self._conn is None or self._conn_pid != os.getpid():
            # A connection inherited across fork must not be used by the child (sqlite docs, "howtocorrupt").
            directory = os.path.dirname(self.path)
            try:
                os.makedirs(directory, mode=0o755, exist_ok=True)
            except OSError as err:
                raise translate("mkdir", directory, err) from err
            _make_private(self.path)
            try:
                conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None,
                                       check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as err:
                raise RegistryUnavailable(f"cannot open registry {self.path}: {err}") from err
            self._conn, self._conn_pid = conn, os.getpid()
            self._init_schema(conn)
        return self._conn

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """A short write transaction holding the database write lock (BEGIN IMMEDIATE). Inside another
        write() of the same thread it joins that transaction (the outermost commits or rolls back)."""
        with self._lock:
            conn = self._connect()
            if self._depth:
                self._depth += 1
                try:
                    yield conn
                finally:
                    self._depth -= 1
                return
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as err:
                if "locked" in str(err) or "busy" in str(err):  # SQLITE_BUSY after BUSY_TIMEOUT
                    raise LockTimeout(self.path, "write the registry", BUSY_TIMEOUT) from err
                raise RegistryUnavailable(f"cannot write registry {self.path}: {err}") from err
            except sqlite3.Error as err:
                raise RegistryUnavailable(f"cannot write registry {self.path}: {err}") from err
            self._depth = 1
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                _rollback(conn)
                if isinstance(exc, sqlite3.Error):
                    raise RegistryUnavailable(f"cannot write registry {self.path}: {exc}") from exc
                raise
            finally:
                self._depth = 0

    def read(self, sql: str, args: tuple = ()) -> list[tuple]:
        """Rows of a query; [] when no registry exists yet (a reader creates nothing)."""
        with self._lock:
            if self._conn is None and not os.path.exists(self.path):
                return []
            try:
                return self._connect().execute(sql, args).fetchall()
            except sqlite3.Error as err:
                raise RegistryUnavailable(f"cannot read registry {self.path}: {err}") from err

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        cols = ", ".join(f"{name} {kind}" for name, kind in _turn_columns())
        conn.execute("BEGIN IMMEDIATE")
        try:
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
            conn.execute("COMMIT")
        except BaseException as exc:
            _rollback(conn)
            self._conn = None
            if isinstance(exc, sqlite3.Error):
                raise RegistryUnavailable(f"cannot set up registry {self.path}: {exc}") from exc
            raise

    # rows <-> records

    def to_record(self, row: tuple) -> TurnRecord:
        """The record in a row of `columns`; a CORRUPT record (its `problem` says why) when the row's
        format is one this code cannot read."""
        data = dict(zip(self.columns, row))
        problem = format_problem(data.pop(FORMAT_KEY))
        if problem is not None:
            return corrupt_record(data["task_key"], data["turn_key"], problem, data.get("started_at") or 0.0)
        return TurnRecord(**data)

    def load(self, conn, task_key: str, turn_key: str) -> TurnRecord | None:
        row = conn.execute(f"SELECT {', '.join(self.columns)} FROM turns WHERE task_key=? AND turn_key=?",
                           (task_key, turn_key)).fetchone()
        return self.to_record(row) if row else None

    def save(self, conn, rec: TurnRecord) -> None:
        data = {**rec.to_json(), FORMAT_KEY: RECORD_FORMAT}
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


class RefusedDeletes:
    """Rows of killed, emptied turns whose deletion the database refused (a full or read-only state
    directory): hidden from this process's reads, deleted by `retry` once writes work again. Only the
    same turn goes (its `started_at`): a turn begun since under the same names stays.

    Args:
        db: the database the rows are in.
    """

    def __init__(self, db: RegistryDatabase):
        self._db = db
        self._rows: dict[tuple[str, str], float] = {}

    def add(self, rec: TurnRecord) -> None:
        self._rows[(rec.task_key, rec.turn_key)] = rec.started_at

    def hides(self, rec: TurnRecord) -> bool:
        return self._rows.get((rec.task_key, rec.turn_key)) == rec.started_at

    def retry(self) -> None:
        """Delete the rows, if the database takes writes again; else keep them for the next try."""
        if not self._rows:
            return
        try:
            with self._db.write() as conn:
                for (task_key, turn_key), started_at in list(self._rows.items()):
                    old = self._db.load(conn, task_key, turn_key)
                    if old is None or old.started_at == started_at:
                        self._db.forget(conn, task_key, turn_key)
        except (RegistryUnavailable, LockTimeout):
            return
        self._rows.clear()
