"""Turn records stored on the cgroup directory itself, so any process can read the whole picture.

Primary store: one JSON xattr (`user.cgturn`) on the turn's directory (cgroupfs supports user
xattrs since 5.7). Where the kernel refuses xattrs (older kernels, some delegations), records go to
`<state_dir>/meta/<task>/<turn>.json`, tagged with the directory's inode so a stale file left by an
earlier cgroup of the same name is never taken for the current one.

State changes take an exclusive flock(2) on the turn directory's fd (works on cgroupfs), so a
read-modify-write by the owner, a sentinel and the CLI cannot interleave.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
from contextlib import contextmanager

from ..kernel.cgroupfs import Cgroup
from ..model import TurnRecord

log = logging.getLogger("cgturn")

XATTR_KEY = "user.cgturn"
# errnos meaning "this filesystem/kernel/user cannot store xattrs here": fall back to files.
_XATTR_REFUSED = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.ENOSPC,
                            errno.E2BIG})


class MetadataStore:
    """Reads and writes TurnRecords for turn cgroups. `use_xattrs=False` forces the file fallback."""

    def __init__(self, state_dir: str, use_xattrs: bool = True):
        self.state_dir = state_dir
        self.use_xattrs = use_xattrs

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

    def save(self, cg: Cgroup, record: TurnRecord) -> None:
        raw = json.dumps(record.to_json(), ensure_ascii=False).encode()
        if self.use_xattrs:
            try:
                cg.set_xattr(XATTR_KEY, raw)
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


def _decode(raw: bytes) -> TurnRecord | None:
    try:
        return TurnRecord.from_json(json.loads(raw))
    except (ValueError, TypeError):
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
