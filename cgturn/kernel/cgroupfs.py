"""The thin file layer over one cgroup v2 directory. Every cgroupfs access in cgturn goes through here.

A `Cgroup` is a path and nothing else: no cached state, so two objects for one directory always agree.
Errors carry the path and the data written. Each operation decides its errnos explicitly.
"""
from __future__ import annotations

import contextlib
import errno
import os
import select
import time

from ..errors import translate
from . import dirlock, parsers
from .cgroupfiles import (  # noqa: F401 - re-exported: the file layer's one import point
    CGROUP2_SUPER_MAGIC, CONTROLLERS_FILE, CPU_STAT_FILE, EVENTS_FILE, FREEZE_FILE, KILL_FILE, MEMORY_CURRENT_FILE,
    PROCS_FILE, STAT_FILE, THREADS_FILE, XATTR_READ_SIZE, child_entries, get_xattr, is_cgroup2,
    read_head, read_procs, read_text, walk_tree)

# errnos with which the kernel says "cgroup.kill cannot be used here": the file is missing (< 5.14),
# or the write is refused (EINVAL seen under some managers, EOPNOTSUPP for threaded cgroups).
KILL_UNSUPPORTED_ERRNOS = frozenset({errno.ENOENT, errno.EINVAL, errno.EOPNOTSUPP})


# The mode of every directory cgturn makes (mkdir(2), so never more than the umask allows). flock(2)
# needs only a read-only fd, so a directory others may read is a lock others may take, and hold for
# ever (issue 22): without read permission no other user can open, list or lock the directory, nor
# read its xattrs (the turn records); the search bit still lets them reach the kernel's interface
# files inside by path (cgroup.events, memory.current: 0644). cgroupfs (kernfs) honours the mode
# given to mkdir and chmod like any filesystem.
PRIVATE_MODE = 0o711
_OPEN_TO_OTHERS = 0o066  # group or other read/write: what PRIVATE_MODE takes away

# How long a wait re-reads cgroup.events back to back before it sleeps (Cgroup.wait_events).
SPIN_FOR = 0.005


class KillUnsupported(Exception):
    """cgroup.kill is missing or refused for this cgroup; the caller falls back to freeze + kill."""

    def __init__(self, path: str, err: OSError):
        super().__init__(f"{path}/{KILL_FILE}: {err.strerror}")
        self.errno = err.errno


class Cgroup:
    """One cgroup v2 directory. Construct with the absolute path of the directory."""

    __slots__ = ("path",)

    def __init__(self, path: str):
        self.path = path

    def __repr__(self) -> str:
        return f"Cgroup({self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cgroup) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def child(self, name: str) -> "Cgroup":
        """The cgroup `name` directly below this one. Refuses names that would lead elsewhere."""
        if not name or name in (".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"not a cgroup name: {name!r}")
        # Not os.path.join: a turn's path is made several times per state change.
        return Cgroup(f"{self.path}{name}" if self.path.endswith("/") else f"{self.path}/{name}")

    def file(self, name: str) -> str:
        return f"{self.path}/{name}"  # not os.path.join: this is on every hot path, and 4x cheaper

    # --- plain reads and writes -------------------------------------------------------------------

    def read(self, name: str) -> str:
        """Read an interface file. Raises FileNotFoundError when the cgroup (or file) is gone."""
        path = self.file(name)
        try:
            return read_text(path)
        except FileNotFoundError:
            raise
        except OSError as err:
            raise translate("read", path, err) from err

    def write(self, name: str, data: str) -> None:
        """Write `data` to an interface file in one write(2), as the kernel expects.

        Raises FileNotFoundError when the cgroup is gone (callers decide what that means), also when
        it is removed between the open and the write (ENODEV), else the translated cgturn error with
        path and data.
        """
        path = self.file(name)
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            raise
        except OSError as err:
            raise translate("open", path, err, data) from err
        try:
            os.write(fd, data.encode())
        except OSError as err:
            if err.errno == errno.ENODEV:
                raise FileNotFoundError(errno.ENODEV, "cgroup removed", path) from err
            raise translate("write", path, err, data) from err
        finally:
            os.close(fd)

    def exists(self) -> bool:
        return os.path.isfile(self.file(PROCS_FILE))

    def inode(self) -> int:
        """The directory's inode number: the kernel's cgroup id (sock_diag INET_DIAG_CGROUP_ID)."""
        return os.stat(self.path).st_ino

    # --- membership -------------------------------------------------------------------------------

    def procs(self) -> list[int]:
        """Pids directly in this cgroup; [] when the cgroup is gone (see read_procs)."""
        return read_procs(self.path)

    def descendants(self) -> list["Cgroup"]:
        """Every cgroup below this one, parents before children (walk order)."""
        return [Cgroup(path) for path, _ in walk_tree(self.path)[1:]]

    def children(self) -> list["Cgroup"]:
        """The cgroups directly below this one; [] when it is gone."""
        return [self.child(name) for name, _ in child_entries(self.path)]

    def procs_recursive(self) -> list[int]:
        """Pids in this cgroup and every descendant (a payload may create sub-cgroups). A leaf is
        told by one stat after the read: kernfs counts 2 + subdirectories as a directory's links
        (kernfs_refresh_inode(), fs/kernfs/inode.c); any other count walks."""
        pids = self.procs()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_nlink == 2:
                return pids
        for cg in self.descendants():
            pids.extend(cg.procs())
        return pids

    def move_in(self, pid: int) -> None:
        """Move a process (all its threads) into this cgroup: write its pid to cgroup.procs."""
        self.write(PROCS_FILE, str(pid))

    def events(self) -> dict[str, int]:
        """cgroup.events as a dict; {} when the cgroup is gone."""
        try:
            return parsers.parse_cgroup_events(self.read(EVENTS_FILE))
        except FileNotFoundError:
            return {}

    def populated(self) -> bool:
        """True while any process is in this cgroup or below (cgroup.events `populated`)."""
        return self.events().get("populated", 0) == 1

    # --- killing ----------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the whole subtree atomically, forks during the kill included (cgroup.kill, 5.14+).

        Raises KillUnsupported when the kernel lacks or refuses cgroup.kill for this cgroup.
        """
        path = self.file(KILL_FILE)
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
        except OSError as err:
            if err.errno in KILL_UNSUPPORTED_ERRNOS:
                raise KillUnsupported(self.path, err) from err
            raise translate("write", path, err, "1") from err

    def set_frozen(self, frozen: bool) -> None:
        """Freeze or thaw the subtree (cgroup.freeze, 5.2+). Completion shows as `frozen 1` in events."""
        self.write(FREEZE_FILE, "1" if frozen else "0")

    def wait_events(self, done, timeout: float, settled: bytes | None = None,
                    spin_from: float | None = None) -> bool:
        """Wait until `done(events)` is true or `timeout` seconds pass; True if it became true.

        cgroup.events notifications are rate-limited (cgroup_file_notify(), kernel/cgroup/cgroup.c:
        one per 10 ms; seen 13-14 ms after a kill right after a spawn) while the file is current, so
        the wait re-reads it: back to back for SPIN_FOR seconds from `spin_from` (default: now),
        with sched_yield(2) between reads (a SIGKILLed small turn is empty after ~0.1 ms), then at
        every POLLPRI wake-up and at least every 1 ms up to 50 ms, then every 20 ms. A wait after a
        kill spins from the kill's start: a cgroup.kill write that took milliseconds was preempted
        by the processes it woke, which queue on this CPU, and a spin takes from them the CPU they
        need to exit (100 processes here: 5.2 ms of spin after the write against 1.8 ms asleep,
        medians). A vanished cgroup reads as {} and `done` decides. `settled`: bytes whose presence
        in the file is what `done` asks, so nothing is parsed while the spin competes for the CPU.
        """
        started = time.monotonic()
        spin_until = (started if spin_from is None else spin_from) + SPIN_FOR
        deadline = started + timeout
        path = self.file(EVENTS_FILE)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return bool(done({}))
        except OSError as err:
            raise translate("open", path, err) from err
        try:
            poller = None
            while True:
                try:
                    raw = os.pread(fd, 4096, 0)
                except OSError as err:
                    if err.errno == errno.ENODEV:  # cgroup removed under us
                        return bool(done({}))
                    raise translate("read", path, err) from err
                if settled is not None:
                    if settled in raw:
                        return True
                elif done(parsers.parse_cgroup_events(raw.decode("ascii", "replace"))):
                    return True
                now = time.monotonic()
                if now >= deadline:
                    return False
                if now < spin_until:
                    os.sched_yield()
                    continue
                waited = now - started
                if poller is None:
                    poller = select.poll()
                    poller.register(fd, select.POLLPRI | select.POLLERR)
                interval_ms = 1 if waited < 0.05 else 20
                poller.poll(min(interval_ms, max(1, int((deadline - now) * 1000))))
        finally:
            os.close(fd)

    def wait_unpopulated(self, timeout: float, spin_from: float | None = None) -> bool:
        """Wait for `populated 0` (or the cgroup gone), as wait_events; True if it came within `timeout`."""
        return self.wait_events(lambda ev: ev.get("populated", 0) == 0, timeout, settled=b"populated 0\n",
                                spin_from=spin_from)

    # --- creation and removal ---------------------------------------------------------------------

    def create(self) -> bool:
        """mkdir this cgroup. True if created, False if it already existed."""
        try:
            self.make()
            return True
        except FileExistsError:
            return False
        except FileNotFoundError as err:
            raise translate("mkdir", self.path, err) from err

    def make(self) -> None:
        """mkdir this cgroup (PRIVATE_MODE), which must not exist yet.

        Raises:
            FileExistsError: it exists. FileNotFoundError: its parent does not (removed meanwhile).
            CgturnError: anything else, translated with the path.
        """
        try:
            os.mkdir(self.path, PRIVATE_MODE)
        except (FileExistsError, FileNotFoundError):
            raise
        except OSError as err:
            raise translate("mkdir", self.path, err) from err

    def make_private(self) -> bool:
        """Take group and other read/write away from this directory, made before cgturn made its
        directories PRIVATE_MODE (or by someone else). True when it is private (now or already);
        False when the caller may not chmod it or it is gone."""
        try:
            mode = os.stat(self.path).st_mode
            if mode & _OPEN_TO_OTHERS:
                os.chmod(self.path, mode & 0o7777 & ~_OPEN_TO_OTHERS)
            return True
        except OSError:
            return False

    def remove_if_empty(self) -> bool:
        """One rmdir: True when the cgroup is gone, False while it has children or processes."""
        try:
            os.rmdir(self.path)
            return True
        except FileNotFoundError:
            return True
        except OSError as err:
            if err.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            raise translate("rmdir", self.path, err) from err

    def remove(self, timeout: float = 2.0) -> bool:
        """rmdir this cgroup: True when it is gone (ENOENT too), False if it still holds processes or
        children after `timeout` (EBUSY right after the last exit is normal: populated is updated
        asynchronously, so it is retried with a short backoff)."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while not self.remove_if_empty():  # EINTR is retried by Python itself (PEP 475)
            if time.monotonic() >= deadline:
                return False
            # Wait for the kernel's asynchronous update instead of a blind sleep when we can.
            if self.populated():
                self.wait_unpopulated(min(delay * 4, max(0.0, deadline - time.monotonic())))
            else:
                time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True

    def remove_tree(self, timeout: float = 2.0) -> bool:
        """rmdir this cgroup and every descendant, children first. True when all are gone."""
        if self.remove_if_empty():  # the common case, a leaf with nothing in it: one rmdir, no walk
            return True
        ok = True
        for cg in reversed(self.descendants()):
            ok = cg.remove(timeout) and ok
        return self.remove(timeout) and ok

    # --- xattrs (metadata on the cgroup itself) ----------------------------------------------------

    def get_xattr(self, key: str) -> bytes | None:
        """The value of xattr `key`, or None when the cgroup or the attribute is absent."""
        return get_xattr(self.path, key)

    def set_xattr(self, key: str, value: bytes, create: bool = False) -> None:
        """Set xattr `key`; with `create`, only if it does not exist yet (FileExistsError otherwise:
        the first writer wins). Raises OSError: callers decide per errno (ENOTSUP, EACCES, E2BIG...)."""
        os.setxattr(self.path, key, value, os.XATTR_CREATE if create else 0)

    def remove_xattr(self, key: str) -> None:
        """Remove xattr `key`; absent already is fine."""
        try:
            os.removexattr(self.path, key)
        except OSError as err:
            if err.errno not in (errno.ENODATA, errno.ENOENT):
                raise

    def lock(self, what: str, timeout: float = dirlock.LOCK_WAIT):
        """Hold an exclusive flock(2) on the cgroup directory (works on cgroupfs) for `what` (the
        operation, named in the error); see dirlock.exclusive: yields False, holding nothing, when
        the directory is gone; raises LockTimeout when another holder kept it for `timeout` s."""
        return dirlock.exclusive(self.path, what, timeout)

    def open_dir(self) -> int | None:
        """An O_DIRECTORY fd of this cgroup for reads relative to it; None when it is gone."""
        try:
            return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None

