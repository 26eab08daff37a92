"""Turn records stored on the cgroup directory itself, so any process can read the whole picture.

Primary store: one JSON xattr (`user.cgturn`) on the turn's directory (cgroupfs supports user
xattrs since 5.7). Where the kernel refuses xattrs (older kernels, some delegations), records go to
`<state_dir>/meta/<task>/<turn>.json`, tagged with the directory's inode so a stale file left by an
earlier cgroup of the same name is never taken for the current one.

State changes take an exclusive flock(2) on the turn directory's fd (works on cgroupfs), so a
read-modify-write by the owner, a sentinel and the CLI cannot interleave.

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
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from contextlib import contextmanager

from ..kernel.cgroupfs import Cgroup, get_xattr
from ..model import TurnRecord

log = logging.getLogger("cgturn")

XATTR_KEY = "user.cgturn"
GENERATION_KEY = "user.cgturn.generation"  # on the task directory: changes with every record write
MAX_CACHED_TASKS = 1024  # tasks whose parsed records a store keeps between listings
# errnos meaning "this filesystem/kernel/user cannot store xattrs here": fall back to files.
_XATTR_REFUSED = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.ENOSPC,
                            errno.E2BIG})


class MetadataStore:
    """Reads and writes TurnRecords for turn cgroups. `use_xattrs=False` forces the file fallback."""

    def __init__(self, state_dir: str, use_xattrs: bool = True):
        self.state_dir = state_dir
        self.use_xattrs = use_xattrs
        # task directory -> (generation token, {(turn name, inode): record}); see the module doc.
        # Records in it are shared between listings: callers must not modify them.
        self._parsed: dict[str, tuple[bytes, dict[tuple[str, int], TurnRecord]]] = {}

    def _file(self, cg: Cgroup) -> str:
        task, turn = os.path.split(cg.path)
        return os.path.join(self.state_dir, "meta", os.path.basename(task), turn + ".json")

    def load(self, cg: Cgroup) -> TurnRecord | None:
        """The record of the turn at `cg`, or None (not yet written, or the cgroup is gone)."""
        if self.use_xattrs:
            try:
                raw = cg.get_xattr(XATTR_KEY)
            except OSError as err:
                if err.errno not in _XATTR_REFUSED:
                    return None
                raw = None
            if raw is not None:
                return _decode(raw)
        try:
            with open(self._file(cg), "rb") as f:
                data = json.loads(f.read())
            if data.pop("_inode", None) != cg.inode():
                return None  # left behind by an earlier cgroup of the same name
            return TurnRecord.from_json(data)
        except (OSError, ValueError):
            return None

    def load_task(self, task_path: str, entries: list[tuple[str, int]]) -> dict[str, TurnRecord]:
        """Records of the turns `entries` ((name, inode) pairs) of one task directory, by name.

        Reuses what an earlier call parsed while the task's generation token is unchanged (the
        token is read before any record, so a write racing this call is seen by the next one).
        Turns without a readable record are left out.
        """
        token = self._generation(task_path)
        cached = self._parsed.get(task_path)
        reusable = cached[1] if cached is not None and token is not None and cached[0] == token else {}
        found: dict[tuple[str, int], TurnRecord] = {}
        for name, inode in entries:
            rec = reusable.get((name, inode))
            if rec is None:
                rec = self.load(Cgroup(f"{task_path}/{name}"))
            if rec is not None:
                found[(name, inode)] = rec
        if token is None:
            self._parsed.pop(task_path, None)
        else:
            if len(self._parsed) >= MAX_CACHED_TASKS and task_path not in self._parsed:
                # Listing one task at a time never prunes tasks that are gone: start afresh
                # rather than grow without bound in a long-running process.
                self._parsed.clear()
            self._parsed[task_path] = (token, found)
        return {name: rec for (name, _), rec in found.items()}

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

    def _bump_generation(self, cg: Cgroup) -> None:
        """Give the task directory above `cg` a fresh token, after a record write. Should that
        fail, remove the token so no reader can trust what it parsed before."""
        task_path = os.path.dirname(cg.path)
        try:
            os.setxattr(task_path, GENERATION_KEY, os.urandom(8).hex().encode())
        except OSError as err:
            try:
                os.removexattr(task_path, GENERATION_KEY)
            except OSError:
                pass
            log.warning("could not stamp %s after a record write (%s); listings re-read its records",
                        task_path, os.strerror(err.errno or 0))

    def save(self, cg: Cgroup, record: TurnRecord) -> None:
        raw = json.dumps(record.to_json(), ensure_ascii=False).encode()
        if self.use_xattrs:
            try:
                cg.set_xattr(XATTR_KEY, raw)
                self._bump_generation(cg)
                return
            except OSError as err:
                if err.errno not in _XATTR_REFUSED:
                    raise
                log.warning("xattrs refused on %s (%s); keeping turn records under %s/meta",
                            cg.path, os.strerror(err.errno), self.state_dir)
                self.use_xattrs = False
        path = self._file(cg)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = record.to_json()
        data["_inode"] = cg.inode()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)
        os.replace(tmp, path)

    def forget(self, cg: Cgroup) -> None:
        """Drop the fallback file of a removed turn (the xattr goes with the directory)."""
        try:
            os.unlink(self._file(cg))
        except FileNotFoundError:
            pass
        try:
            os.rmdir(os.path.dirname(self._file(cg)))
        except OSError:
            pass


_DECODER = json.JSONDecoder()


def _decode(raw: bytes) -> TurnRecord | None:
    """The record in an xattr value; None if it is not one. (raw_decode skips json.loads' wrappers,
    a fifth of the Python cost of listing 1000 turns.)"""
    try:
        text = raw.decode()
        data, end = _DECODER.raw_decode(text)
        if end != len(text):
            return None
        return TurnRecord.from_json(data)
    except (ValueError, TypeError, AttributeError):
        return None


@contextmanager
def locked(cg: Cgroup):
    """Hold an exclusive flock on the cgroup directory. Yields False if the directory is gone."""
    try:
        fd = os.open(cg.path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)
