"""Turn records stored on the cgroup directory itself, so any process can read the whole picture.

Primary store: one JSON xattr (`user.cgturn`) on the turn's directory (cgroupfs supports user
xattrs since 5.7). Where the kernel refuses xattrs (older kernels, some delegations), records go to
`<state_dir>/meta/<task>/<turn>.json`, tagged with the directory's inode so a stale file left by an
earlier cgroup of the same name is never taken for the current one.

State changes take an exclusive flock(2) on the turn directory's fd (works on cgroupfs), so a
read-modify-write by the owner, a sentinel and the CLI cannot interleave. The directory is private
(cgroupfs.PRIVATE_MODE), so no other user can take that lock or read the record, and the wait for
it is bounded (dirlock: LockTimeout, nothing written).

Listing many turns over and over (`watch`, the metrics exporter, a gateway's dashboard) would re-read
and re-parse every record each time, although records change only at a turn's few state changes.
So every record write also stamps the task directory with a fresh generation token
(`user.cgturn.generation`, written after the record), and `load_task` keeps the records it parsed
together with the token it read before reading them: while the token is unchanged, no record of that
task has been written since, and the parsed records are reused (one getxattr per task instead of one
getxattr and a JSON parse per turn). A turn cgroup that was removed and made again has a new inode,
which is part of the key, so it is never confused with its predecessor. (A writer killed between its
two writes leaves the token unchanged: a long-running lister then shows that one state change only
after the task's next record write.)

A record is a note, the directory is the truth: a record is used only if it agrees with the
directory it was read from (its ids encode to the directory's names, its fields have their types).
A missing, unreadable or disagreeing record reads as a CORRUPT turn of that directory — listed,
and killed by any abandon — never as the turn it names. Records carry their format version
(record_format.py): one written before versions existed reads as format 1, one newer than this code
reads as CORRUPT with a `problem` naming the version.
"""
# size: a little over the limit: the record store, the one verification of what it reads back, and the memory of its own last write beside the reads that memory spares.
from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import time

from .. import ids
from ..kernel.cgroupfs import Cgroup, get_xattr
from ..model import CORRUPT, NETWORKS, STATES, STORED_FIELDS, TurnRecord, corrupt_record
from .record_format import FORMAT_KEY, RECORD_FORMAT, format_problem

log = logging.getLogger("cgturn")

XATTR_KEY = "user.cgturn"
GENERATION_KEY = "user.cgturn.generation"  # on the task directory: changes with every record write
MAX_CACHED_TASKS = 1024  # tasks whose parsed records a store keeps between listings
MAX_WRITTEN = 1024  # turns whose last written record a store keeps (MetadataStore._written)
_FILE_STEM_MAX = 200  # longest turn name used as is in a fallback file name (see MetadataStore._file)
NO_RECORD = "no record"
# A turn directory gets its record right after its mkdir; one without a record for longer than this
# lost its creator in between, and reads as CORRUPT (listed, killable, replaceable).
CREATING_GRACE = 10.0
# errnos meaning "this filesystem cannot store xattrs at all": decided once, files from then on.
_XATTR_UNSUPPORTED = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP})
# errnos refusing one write (this directory's permissions, this value's size): that record goes to a
# file, the next one tries the xattr again.
_XATTR_REFUSED = _XATTR_UNSUPPORTED | frozenset({errno.EPERM, errno.EACCES, errno.ENOSPC, errno.E2BIG})


class MetadataStore:
    """Reads and writes TurnRecords for turn cgroups. `use_xattrs=False` forces the file fallback."""

    def __init__(self, state_dir: str, use_xattrs: bool = True):
        self.state_dir = state_dir
        self.use_xattrs = use_xattrs
        # task directory -> (generation token, {(turn name, inode): record}); see the module doc.
        # Records in it are shared between listings: callers must not modify them.
        self._parsed: dict[str, tuple[bytes, dict[tuple[str, int], TurnRecord]]] = {}
        # turn directory -> (the xattr value this store last wrote there, the fields it encodes): a
        # read under the turn's lock that finds those very bytes (the owner's complete after its
        # begin) builds the record from them instead of decoding and verifying the bytes again. Parsing is a pure
        # function of the bytes and the path, so the copy is what decoding would give.
        self._written: dict[str, tuple[bytes, dict]] = {}
        # Turn directories whose record this store read from a fallback file: its next xattr write
        # there removes the file, so a turn whose last write was this store's xattr has no file.
        self._filed: set[str] = set()

    def _file(self, cg: Cgroup) -> str:
        task, turn = os.path.split(cg.path)
        if len(turn) > _FILE_STEM_MAX:
            # A turn name may take all of NAME_MAX (255 bytes): "<name>.json.<pid>.tmp" would not fit.
            # Shortened names always contain "~", which names of this length never do: no clash.
            import hashlib

            turn = f"{turn[:_FILE_STEM_MAX - 65]}~{hashlib.sha256(turn.encode()).hexdigest()}"
        return os.path.join(self.state_dir, "meta", os.path.basename(task), turn + ".json")

    def load(self, cg: Cgroup) -> TurnRecord | None:
        """The record of the turn at `cg`; a CORRUPT record when the directory has no trustworthy
        one; None when the directory is gone."""
        rec, problem = self._read(cg)
        if rec is not None:
            return rec
        try:
            created = os.stat(cg.path).st_ctime
        except FileNotFoundError:
            return None
        if problem == NO_RECORD and time.time() - created < CREATING_GRACE:
            return None  # its creator is between mkdir and the record write: not a turn yet
        return corrupt_record(os.path.basename(os.path.dirname(cg.path)), cg.name, problem, created)

    def _read(self, cg: Cgroup) -> tuple[TurnRecord | None, str]:
        """(the verified record, "") or (None, why there is none)."""
        if self.use_xattrs:
            try:
                raw = cg.get_xattr(XATTR_KEY)
            except OSError as err:
                if err.errno not in _XATTR_REFUSED:
                    return None, f"record unreadable: {os.strerror(err.errno or 0)}"
                raw = None
            if raw is not None:
                mine = self._written.get(cg.path)
                if mine is not None and mine[0] == raw:
                    return TurnRecord(**mine[1]), ""
                return verified(*_decode(raw), path=cg.path)
        try:
            with open(self._file(cg), "rb") as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return None, NO_RECORD
        except (OSError, ValueError, RecursionError) as err:
            return None, f"record file unreadable: {err}"
        if not isinstance(data, dict) or data.pop("_inode", None) != _inode(cg):
            return None, NO_RECORD  # a file left behind by an earlier cgroup of the same name
        self._note_file(cg.path)
        return verified(*_from_json(data), path=cg.path)

    def load_task(self, task_path: str, entries: list[tuple[str, int]]) -> dict[str, TurnRecord]:
        """Records of the turns `entries` ((name, inode) pairs) of one task directory, by name.

        Reuses what an earlier call parsed while the task's generation token is unchanged (the
        token is read before any record, so a write racing this call is seen by the next one).
        Turns without a trustworthy record are in it as CORRUPT records.
        """
        token = self._generation(task_path)
        cached = self._parsed.get(task_path)
        reusable = cached[1] if cached is not None and token is not None and cached[0] == token else {}
        found: dict[tuple[str, int], TurnRecord] = {}
        corrupt: dict[str, TurnRecord] = {}
        for name, inode in entries:
            rec = reusable.get((name, inode))
            if rec is None:
                rec = self.load(Cgroup(f"{task_path}/{name}"))
            if rec is not None and rec.state != CORRUPT:
                found[(name, inode)] = rec
            elif rec is not None:
                corrupt[name] = rec  # never cached: the next listing looks again
        if token is None:
            self._parsed.pop(task_path, None)
        else:
            if len(self._parsed) >= MAX_CACHED_TASKS and task_path not in self._parsed:
                # Listing one task at a time never prunes tasks that are gone: start afresh
                # rather than grow without bound in a long-running process.
                self._parsed.clear()
            self._parsed[task_path] = (token, found)
        return {**{name: rec for (name, _), rec in found.items()}, **corrupt}

    def forget_tasks_except(self, task_paths) -> None:
        """Drop cached records of task directories not in `task_paths` (they are gone)."""
        keep = set(task_paths)
        for path in list(self._parsed):  # list(): a snapshot, other threads may list at once
            if path not in keep:
                self._parsed.pop(path, None)

    def _generation(self, task_path: str) -> bytes | None:
        """The task directory's generation token; None (no reuse) without xattrs or a token."""
        if not self.use_xattrs:
            return None
        try:
            return get_xattr(task_path, GENERATION_KEY)
        except OSError:
            return None

    def stamp(self, cg: Cgroup) -> None:
        """Give the task directory above `cg` the fresh generation token a `save(stamp=False)` left out."""
        if self.use_xattrs:
            self._bump_generation(cg)

    def _bump_generation(self, cg: Cgroup) -> None:
        """Give the task directory above `cg` a fresh token, after a record write. Should that
        fail, remove the token so no reader can trust what it parsed before."""
        task = Cgroup(os.path.dirname(cg.path))
        try:
            task.set_xattr(GENERATION_KEY, _new_token())
        except OSError as err:
            try:
                task.remove_xattr(GENERATION_KEY)
            except OSError:
                pass
            log.warning("could not stamp %s after a record write (%s); listings re-read its records",
                        task.path, os.strerror(err.errno or 0))

    def save(self, cg: Cgroup, record: TurnRecord, new: bool = False, stamp: bool = True) -> None:
        """Store `record` on `cg`: as its xattr, else (refused for this write) as a state-dir file.

        Args:
            new: the first record of a directory just made in a task directory that was there
                before. The task is not stamped: a lister's cache is keyed by the turn directory's
                inode too, so it holds nothing for this one. (A task without any stamp is never
                cached, which is why a new task directory's first record stamps it.)
            stamp: False: the caller calls `stamp` itself, right after what follows at once (a
                kill's first signal), or only if the turn stays (a removal: a removed turn's
                directory is gone from every later listing). A listing made in between shows the
                turn as it was before this write, as one made just before it would. This store's
                own parsed records of the task are dropped now.
        """
        fields = record.to_json()
        raw = _ENCODER.encode({FORMAT_KEY: RECORD_FORMAT, **fields}).encode("utf-8", "surrogateescape")
        if self.use_xattrs:
            try:
                self._written.pop(cg.path, None)
                cg.set_xattr(XATTR_KEY, raw)
                self._remember(cg.path, raw, record, fields)
                if not stamp:
                    self._parsed.pop(os.path.dirname(cg.path), None)
                elif not new:
                    self._bump_generation(cg)
                if cg.path in self._filed:
                    # Read from a file under this same lock: the xattr now says more, the file goes
                    # (`forget` counts on it). A file this store never read is not looked for here
                    # (a failing unlink on every state change): the xattr is read first, so it is
                    # never consulted, and `forget` of another store removes it with the turn.
                    self._filed.discard(cg.path)
                    self._unlink_quietly(self._file(cg))
                return
            except OSError as err:
                if err.errno not in _XATTR_REFUSED:
                    raise
                if err.errno in _XATTR_UNSUPPORTED:
                    log.warning("xattrs unsupported on %s (%s); keeping turn records under %s/meta",
                                cg.path, os.strerror(err.errno), self.state_dir)
                    self.use_xattrs = False
                else:
                    log.info("record xattr refused on %s (%s); this record goes to %s/meta",
                             cg.path, os.strerror(err.errno), self.state_dir)
                    # An older xattr would be read before the file: it must not outlive this write.
                    cg.remove_xattr(XATTR_KEY)
                    self._bump_generation(cg)
        path = self._file(cg)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = {FORMAT_KEY: RECORD_FORMAT, **record.to_json(), "_inode": _inode(cg)}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
            json.dump(data, f, ensure_ascii=False)
        os.replace(tmp, path)
        self._note_file(cg.path)

    def _note_file(self, path: str) -> None:
        """The turn at `path` has a record file (read or written here): see `_filed`."""
        if self.use_xattrs:  # without xattrs every record is a file, and `forget` always unlinks
            if len(self._filed) >= MAX_WRITTEN:
                self._filed.clear()
                self._written.clear()  # what _filed forgets, forget must look for again
            self._filed.add(path)

    def _remember(self, path: str, raw: bytes, record: TurnRecord, fields: dict) -> None:
        """Keep what was just written at `path`: `fields`, `record`'s stored fields (its own dict, not
        the record, which the caller may go on changing). Only
        a record that was made for this directory or read from it verified is kept: a CORRUPT one
        (`problem` set) would verify no better when read back."""
        if record.problem is not None or record.state == CORRUPT:
            return
        if len(self._written) >= MAX_WRITTEN and path not in self._written:
            self._written.clear()  # turns that outlive many others are read the long way
        self._written[path] = (raw, fields)

    def forget(self, cg: Cgroup) -> None:
        """Drop the fallback file of a removed turn (the xattr goes with the directory), and its task's
        file directory when that was the last file in it.

        A turn whose last record write was this store's xattr has no file to drop (a file read
        before it went with that write), so nothing is unlinked. A file another process wrote
        after that (its own xattr write refused) stays behind, as any that cannot be removed:
        it names the removed directory's inode, so it is never read as a later turn's.
        """
        self._filed.discard(cg.path)
        if self._written.pop(cg.path, None) is not None:
            return
        path = self._file(cg)
        if self._unlink_quietly(path):
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass

    @staticmethod
    def _unlink_quietly(path: str) -> bool:
        """unlink a record file; True if one was removed. A read-only or failing state directory must
        not fail a kill that is done (the file names a directory that no longer exists: its inode is
        in it, so it is never read as that turn's, and the next turn of that name writes over it)."""
        try:
            os.unlink(path)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False  # no file: its task's directory, if any, holds other turns' files
        except OSError as err:
            log.warning("cannot remove the record file %s of a removed turn: %s", path, err)
            return False


_TOKENS: tuple[int, bytes, "itertools.count[int]"] | None = None


def _new_token() -> bytes:
    """A generation token no other write has used: a random prefix per process (made again in a
    forked child) and a counter; cheaper than random bytes per write (a getrandom(2) each)."""
    global _TOKENS
    pid = os.getpid()
    if _TOKENS is None or _TOKENS[0] != pid:
        _TOKENS = (pid, os.urandom(6).hex().encode(), itertools.count())
    return b"%s-%x" % (_TOKENS[1], next(_TOKENS[2]))


def record_from_xattr(raw: bytes, path: str) -> TurnRecord | None:
    """The record in the `user.cgturn` value `raw` read from the turn directory at `path`, if it is
    that directory's record (as `MetadataStore.load` verifies it); None otherwise."""
    return verified(*_decode(raw), path=path)[0]


_DECODER = json.JSONDecoder()
_ENCODER = json.JSONEncoder(ensure_ascii=False)  # json.dumps with a keyword builds one per call
_STR_FIELDS = ("task_id", "turn_id", "task_key", "turn_key", "state")
_INT_FIELDS = ("owner_pid", "owner_start", "killer_pid", "killer_start")
FROZEN_BY = ("user", "guard")  # who may have frozen a turn (TurnRecord.frozen_by)


_UNREADABLE = "record unreadable"


def _decode(raw: bytes) -> tuple[TurnRecord | None, str]:
    """(the record in an xattr value, "") or (None, why it is not one). (raw_decode skips json.loads'
    wrappers, a fifth of the Python cost of listing 1000 turns.)"""
    try:
        text = raw.decode()
        data, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return None, _UNREADABLE
    if end != len(text) or not isinstance(data, dict):
        return None, _UNREADABLE
    return _from_json(data)


def _from_json(data: dict) -> tuple[TurnRecord | None, str]:
    """(a TurnRecord from stored JSON of a format this code reads, whose fields have their types, "")
    or (None, why not)."""
    problem = format_problem(data.pop(FORMAT_KEY, None))
    if problem is not None:
        return None, problem
    rec = _typed(data)
    return (rec, "") if rec is not None else (None, _UNREADABLE)


# The exact types of the values of records that passed `_checked` with every stored field in its order
# (as this version writes them): a record whose values have the same types passes every type check
# there again, so only its values are checked. A few such shapes (None or a number in the optional
# fields) cover a whole listing, which spares ~4 us a record of 10,000.
_PASSED_TYPES: set[tuple[type, ...]] = set()
_MAX_PASSED_TYPES = 64


def _typed(data: dict) -> TurnRecord | None:
    """A TurnRecord from stored fields that have their types; None otherwise."""
    if tuple(data) != STORED_FIELDS:
        return _checked(data)
    values = tuple(data.values())
    types = tuple(map(type, values))
    if types in _PASSED_TYPES:
        shaped = TurnRecord(*values)  # the fields in their order, as `problem`, the last one, is not stored
        return shaped if _values_allowed(shaped) else None
    rec = _checked(data)
    if rec is not None:
        if len(_PASSED_TYPES) >= _MAX_PASSED_TYPES:
            _PASSED_TYPES.clear()
        _PASSED_TYPES.add(types)
    return rec


def _values_allowed(rec: TurnRecord) -> bool:
    """The checks of `_checked` that look at values, not only at types."""
    return rec.state in STATES and (rec.frozen_by is None or rec.frozen_by in FROZEN_BY) and rec.network in NETWORKS


def _checked(data: dict) -> TurnRecord | None:
    """`_typed`, every check made."""
    try:
        rec = TurnRecord.from_json(data)
    except TypeError:
        return None
    if not all(isinstance(getattr(rec, name), str) for name in _STR_FIELDS):
        return None
    if not all(getattr(rec, name) is None or type(getattr(rec, name)) is int for name in _INT_FIELDS):
        return None
    if not isinstance(rec.started_at, (int, float)) or rec.state not in STATES:
        return None
    if not (rec.reason is None or isinstance(rec.reason, str)) or not (rec.limits is None or isinstance(rec.limits, str)):
        return None
    if not (rec.frozen_by is None or rec.frozen_by in FROZEN_BY) \
            or not (rec.frozen_at is None or isinstance(rec.frozen_at, (int, float))) \
            or not isinstance(rec.frozen_seconds, (int, float)) \
            or not (rec.expires_at is None or isinstance(rec.expires_at, (int, float))) \
            or not (rec.keys is None or isinstance(rec.keys, str)):
        return None
    if not isinstance(rec.sealed, bool) or rec.network not in NETWORKS:
        return None
    if not isinstance(rec.v1_dirs, bool) or type(rec.audited_oom_kills) is not int \
            or type(rec.audited_pids_max_hits) is not int:
        return None
    return rec


def verified(rec: TurnRecord | None, problem: str = _UNREADABLE, *, path: str) -> tuple[TurnRecord | None, str]:
    """(rec, "") when `rec` is the record of the turn directory at `path`; (None, why) otherwise
    (`problem`, why there is no record, when `rec` is None).

    The ids must be valid and encode to the directory's names, and the stored keys must be those
    names: a record copied from another turn's directory names that turn, not this one.
    """
    if rec is None:
        return None, problem or _UNREADABLE
    turn_key = os.path.basename(path)
    task_key = os.path.basename(os.path.dirname(path))
    if not (rec.task_key == task_key and rec.turn_key == turn_key
            and ids.names(rec.task_id, task_key, "task") and ids.names(rec.turn_id, turn_key, "turn")):
        return None, f"record names turn {rec.turn_id!r} of task {rec.task_id!r}, not this directory"
    return rec, ""


def _inode(cg: Cgroup) -> int | None:
    try:
        return cg.inode()
    except OSError:
        return None
