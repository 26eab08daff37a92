"""Sentinel lock files: how anyone can tell that an owner's sentinel died while the owner lives.

A sentinel that died (SIGKILL, OOM kill) leaves its owner's running turns unguarded: should the owner
die next, they run on and nobody abandons them. To make that visible before it happens, each sentinel
holds `<state_dir>/sentinels/<owner pid>-<owner start>-<sentinel pid>` with an open-file-description
write lock from just after it reports `ready` to its exit (cgturn.kernel.ofdlock: the kernel drops
the lock at the sentinel's death, whatever kills it), and removes the file when it exits normally.
So a file that is present and unlocked is a sentinel that died; an owner that lives and has such
files but no locked one is *unwatched* (the exporter's `cgturn_turns_unwatched`).

Why this design:
- One file per sentinel, not per owner: an owner may run two sentinels at once (two managers, or a
  sentinel that still tracks a closed manager's turns while a new one starts) and starts a new one
  after the channel to a dead one broke. A new sentinel tracks every running turn of its owner, so an
  owner is watched while *any* of its sentinels lives.
- Nothing anyone else can open: the directory is 0700 and each file 0600, created with O_EXCL and
  O_NOFOLLOW, so no other user can take the lock, stall the sentinel on it, or plant a file (an earlier
  issue: one flock by any local user stalled the owner). The sentinel never waits for the lock.
- Readers never lock or write: they ask F_OFD_GETLK. A file is made under a hidden name, locked, then
  renamed into place, and removed before its lock is dropped, so a reader never sees a live sentinel's
  file unlocked. Nothing is written into the file: its name and its lock say it all.
- Cheap, and off the owner's wait: five system calls (open and fstat of the directory, the file's
  open, fcntl, rename) and this module's import, made after the sentinel reported `ready` while the
  owner goes on (cgturn.sentinel_main). A sentinel that dies in that moment leaves no file and is not
  seen; one that cannot make the file logs why and tracks turns all the same.
- Files of dead owners are removed by `cgturn reap` (`sweep`); readers ignore them until then.
"""
from __future__ import annotations

import errno
import logging
import os
import stat

from . import processes
from .errors import AccessDenied
from .kernel import ofdlock

log = logging.getLogger("cgturn.sentinel")

DIR = "sentinels"
PRIVATE = 0o700
_HIDDEN = "."  # prefix of a file not yet locked (renamed into place once it is)


def file_name(owner_pid: int, owner_start: int, sentinel_pid: int) -> str:
    """The name of the lock file of sentinel `sentinel_pid` of the owner (pid, start time in ticks)."""
    return f"{owner_pid}-{owner_start}-{sentinel_pid}"


def parse_name(name: str) -> tuple[int, int, int] | None:
    """(owner pid, owner start, sentinel pid) of a lock file's name, or None when it is none
    (a hidden one being made included)."""
    parts = name.split("-")
    if len(parts) != 3 or not all(p.isdigit() and p.isascii() for p in parts):
        return None
    owner_pid, owner_start, sentinel_pid = (int(p) for p in parts)
    return owner_pid, owner_start, sentinel_pid


class Held:
    """A sentinel's lock file, held locked until `release`.

    Args:
        dir_fd: the sentinels directory (kept open, so the file is removed where it was made).
        fd: the locked file.
        name: its name in the directory.
    """

    def __init__(self, dir_fd: int, fd: int, name: str):
        self.dir_fd, self.fd, self.name = dir_fd, fd, name

    def release(self) -> None:
        """Remove the file, then drop its lock: a reader never finds it present and unlocked."""
        try:
            os.unlink(self.name, dir_fd=self.dir_fd)
        except OSError as err:
            if err.errno != errno.ENOENT:  # `cgturn reap` took it: its owner died before this sentinel
                log.warning("cannot remove the sentinel lock file %s: %s", self.name, err.strerror or err)
        os.close(self.fd)
        os.close(self.dir_fd)


def hold(state_dir: str, owner_pid: int, owner_start: int) -> Held | None:
    """Make and lock this sentinel's file (called by the sentinel process for its owner). Never raises:
    a sentinel tracks turns without it, and only the exporter's view of it is lost (logged).

    Returns:
        The held file, or None when it could not be made or locked.
    """
    name = file_name(owner_pid, owner_start, os.getpid())
    try:
        dir_fd = _open_dir(os.path.join(state_dir, DIR), create=True)
    except OSError as err:
        log.warning("cannot hold a sentinel lock file in %s (a death of this sentinel will not show in "
                    "cgturn_turns_unwatched): %s", os.path.join(state_dir, DIR), err.strerror or err)
        return None
    try:
        fd = _make_locked(dir_fd, name)
    except OSError as err:
        os.close(dir_fd)
        log.warning("cannot hold the sentinel lock file %s (a death of this sentinel will not show in "
                    "cgturn_turns_unwatched): %s", name, err.strerror or err)
        return None
    return Held(dir_fd, fd, name)


def _make_locked(dir_fd: int, name: str) -> int:
    """Create `name` locked: made under a hidden name (O_EXCL: a file this call made, so no one
    else's), locked, then renamed into place. Raises OSError."""
    hidden = _HIDDEN + name
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(hidden, flags, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        # Left by an earlier process with this pid that died while making it (a pid names one live
        # process, and the directory is this user's alone): stale, so replace it.
        os.unlink(hidden, dir_fd=dir_fd)
        fd = os.open(hidden, flags, 0o600, dir_fd=dir_fd)
    try:
        if not ofdlock.try_lock(fd):  # only root could have opened it meanwhile
            raise OSError(errno.EAGAIN, "locked by another process")
        os.rename(hidden, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(hidden, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    return fd


def _open_dir(path: str, create: bool) -> int:
    """The sentinels directory, open; made 0700 when `create` and missing. Refused (OSError EPERM)
    unless it is a directory (not a link to one) that no one but its owner may enter or write, owned
    by this user when this user makes files in it.

    Raises:
        FileNotFoundError: it is missing and not `create`.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(path, PRIVATE)
        except FileExistsError:
            pass  # another sentinel made it meanwhile: checked below as any other
        fd = os.open(path, flags)
    st = os.fstat(fd)
    if st.st_mode & 0o077 or (create and st.st_uid != os.geteuid()):
        os.close(fd)
        raise OSError(errno.EPERM, f"not a private directory of this user (mode {stat.filemode(st.st_mode)}, "
                                   f"uid {st.st_uid})", path)
    return fd


def unwatched_owners(state_dir: str) -> set[int]:
    """The pids of live owners that ran a sentinel and have none alive now: every lock file of theirs
    is present and unlocked. Reads only: it takes no lock and writes nothing.

    A file that cannot be opened (another user's directory, for an exporter that is neither root nor
    that user) or an owner that cannot be looked at counts as watched: the answer can only
    under-report.
    """
    try:
        dir_fd = _open_dir(os.path.join(state_dir, DIR), create=False)
    except FileNotFoundError:
        return set()  # no sentinel ever ran with this state directory
    except OSError as err:
        log.debug("cannot read the sentinel lock files of %s: %s", state_dir, err)
        return set()
    watched: dict[tuple[int, int], bool] = {}
    try:
        for name in os.listdir(dir_fd):
            parsed = parse_name(name)
            if parsed is None or watched.get(owner := parsed[:2]):
                continue
            watched[owner] = _held_or_unknown(dir_fd, name)
    except OSError as err:
        log.debug("cannot list the sentinel lock files of %s: %s", state_dir, err)
        return set()
    finally:
        os.close(dir_fd)
    return {pid for (pid, start), held in watched.items() if not held and _alive(pid, start)}


def _held_or_unknown(dir_fd: int, name: str) -> bool:
    """Whether the file `name` is locked by its sentinel; True when it cannot be told, or is gone
    (its sentinel just exited normally)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return True
    try:
        return not stat.S_ISREG(os.fstat(fd).st_mode) or ofdlock.is_locked(fd)
    except OSError:
        return True
    finally:
        os.close(fd)


def _alive(pid: int, start: int) -> bool:
    try:
        return processes.is_running(pid, start)
    except AccessDenied:
        return False  # cannot look: not counted


def sweep(state_dir: str) -> int:
    """Remove the lock files (and half-made ones) of owners known to be gone whose sentinel holds no
    lock on them any more (`cgturn reap`); how many were removed. Never raises."""
    try:
        dir_fd = _open_dir(os.path.join(state_dir, DIR), create=False)
    except OSError:
        return 0  # nothing there, or not a directory cgturn made
    removed = 0
    try:
        for name in os.listdir(dir_fd):
            parsed = parse_name(name.removeprefix(_HIDDEN))
            if parsed is None or processes.alive_or_unknown(*parsed[:2]) or _held_or_unknown(dir_fd, name):
                continue
            try:
                os.unlink(name, dir_fd=dir_fd)
                removed += 1
            except OSError as err:
                log.debug("cannot remove the sentinel lock file %s: %s", name, err)
    except OSError as err:
        log.debug("cannot sweep the sentinel lock files of %s: %s", state_dir, err)
    finally:
        os.close(dir_fd)
    return removed
