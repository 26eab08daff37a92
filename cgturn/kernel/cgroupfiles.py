"""Raw reads of cgroupfs files by path (or relative to an open directory), and the kernel's file names.

The hot paths of listing thousands of turns live here: one open + read per file, no buffered-file
overhead, no object per cgroup. `cgroupfs.Cgroup` builds on these for everything else.
"""
from __future__ import annotations

import errno
import os

from ..errors import translate
from . import libc, parsers, procfs

PROCS_FILE = "cgroup.procs"
EVENTS_FILE = "cgroup.events"
KILL_FILE = "cgroup.kill"          # 5.14+
FREEZE_FILE = "cgroup.freeze"      # 5.2+
THREADS_FILE = "cgroup.threads"
STAT_FILE = "cgroup.stat"
CONTROLLERS_FILE = "cgroup.controllers"
CPU_STAT_FILE = "cpu.stat"
MEMORY_CURRENT_FILE = "memory.current"
IO_STAT_FILE = "io.stat"
CGROUP2_SUPER_MAGIC = 0x63677270


# A first read(2) shorter than this is the whole file: the read that would only see EOF is spared
# (one of the four syscalls per file a listing reads). cgroupfs files are seq_files; seq_read_iter
# (fs/seq_file.c) fills the caller's buffer from its own (a page, or more for one long show) until
# the records run out or the next one does not fit, so a read that returns well under a page, to a
# 64 KiB buffer, stopped because there was nothing more: no cgroup file's line is near this long.
WHOLE_IF_SHORTER = 1024


def read_text(path: str, dir_fd: int | None = None) -> str:
    """Read a whole (small) kernel file with raw os.read calls: no buffered-file overhead.

    With `dir_fd`, `path` is relative to that open directory: the kernel then resolves one or two
    path components instead of the whole mount path (measurably cheaper over 1000s of cgroups).
    """
    fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
    try:
        chunk = os.read(fd, 65536)
        if len(chunk) < WHOLE_IF_SHORTER:
            return chunk.decode("ascii", "replace")
        chunks = [chunk]
        while chunk:
            chunk = os.read(fd, 65536)
            chunks.append(chunk)
        return b"".join(chunks).decode("ascii", "replace")
    finally:
        os.close(fd)


def read_procs(path: str, dir_fd: int | None = None) -> list[int]:
    """Pids directly in the cgroup at `path` (relative to `dir_fd` as in read_text); [] when the
    cgroup is gone, also when it goes between open and read (ENODEV).

    A threaded cgroup refuses to list cgroup.procs (EOPNOTSUPP): its members are read from
    cgroup.threads and mapped from thread ids to their processes.
    """
    try:
        return parsers.parse_cgroup_procs(read_text(f"{path}/{PROCS_FILE}", dir_fd=dir_fd))
    except FileNotFoundError:
        return []
    except OSError as err:
        if err.errno == errno.ENODEV:
            return []
        if err.errno != errno.EOPNOTSUPP:
            raise translate("read", f"{path}/{PROCS_FILE}", err) from err
    try:
        tids = parsers.parse_cgroup_procs(read_text(f"{path}/{THREADS_FILE}", dir_fd=dir_fd))
    except FileNotFoundError:
        return []
    except OSError as err:
        raise translate("read", f"{path}/{THREADS_FILE}", err) from err
    return sorted({pid for pid in map(procfs.tgid_of, tids) if pid is not None})


# A turn record is a few hundred bytes. CPython's os.getxattr asks for 128 bytes first and, on
# ERANGE, again with 64 KiB (which the kernel allocates for the copy): two syscalls per record.
# Asking once with room for any realistic record halves the cost of reading 1000 turns' records.
XATTR_READ_SIZE = 4096


def get_xattr(path: str, key: str) -> bytes | None:
    """getxattr(2) with one XATTR_READ_SIZE buffer (larger values take os.getxattr's slow path); None
    when `path` or the attribute is absent.

    Raises OSError for any other errno, as os.getxattr would.
    """
    try:
        return libc.getxattr(path, key, XATTR_READ_SIZE)
    except OSError as err:
        if err.errno == errno.ERANGE:
            return os.getxattr(path, key)
        raise


def xattr_or_none(where: str | int, key: str) -> bytes | None:
    """xattr `key` of a path (one XATTR_READ_SIZE read, as get_xattr) or of an open fd; None when it
    cannot be had (absent, refused, gone): for callers that then ask a reader that decides why."""
    try:
        return get_xattr(where, key) if isinstance(where, str) else os.getxattr(where, key)
    except OSError:
        return None


def child_entries(path: str | int) -> list[tuple[str, int]]:
    """(name, cgroup id) of the cgroups directly below `path` (a path or an open directory fd);
    [] when it is gone. The id is the kernfs inode number getdents reports, so no stat is needed."""
    try:
        with os.scandir(path) as entries:
            return [(e.name, e.inode()) for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def read_head(path: str, size: int = 4096, dir_fd: int | None = None) -> str:
    """The first read(2) of a kernel file: enough for a key that comes first (cpu.stat's
    usage_usec), without the second read that only confirms end of file. `dir_fd` as in read_text."""
    fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
    try:
        return os.read(fd, size).decode("ascii", "replace")
    finally:
        os.close(fd)


def walk_tree(path: str) -> list[tuple[str, int]]:
    """(path, cgroup id) of the cgroup at `path` and every cgroup below it, parents first.

    A cgroup's id is its kernfs inode number, which getdents reports as d_ino, so no stat is needed
    below the top. [] when the cgroup is gone.
    """
    try:
        out = [(path, os.stat(path).st_ino)]
    except FileNotFoundError:
        return []
    i = 0
    while i < len(out):
        try:
            with os.scandir(out[i][0]) as entries:
                out.extend((e.path, e.inode()) for e in entries if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            pass
        i += 1
    return out


def is_cgroup2(path: str) -> bool:
    """True if `path` lies on a cgroup2 filesystem (statfs(2) magic CGROUP2_SUPER_MAGIC)."""
    try:
        return libc.filesystem_magic(path) == CGROUP2_SUPER_MAGIC
    except OSError:
        return False


def read_io_bytes(path: str) -> int | None:
    """Bytes read and written by the cgroup at `path` (io.stat); None without the io controller."""
    try:
        return parsers.parse_io_stat_bytes(read_text(f"{path}/{IO_STAT_FILE}"))
    except OSError:
        return None
