"""/proc reads and pidfd signalling: process identity that survives PID reuse.

A process is identified by (pid, start time), start time being /proc/PID/stat field 22 (clock ticks
since boot): a recycled pid gets a new start time, so a stale record never matches a new process.
Signals go through pidfds (5.3+) where possible: once opened, a pidfd can only ever reach the process
it was opened for.

"Gone" and "not allowed to look" are different answers (psutil's NoSuchProcess / AccessDenied):
`ProcFS` translates every OSError in one place, `_translate`, so a caller that acts on "gone" (reap,
the sentinel) never acts on a process it merely could not read (`hidepid=1` gives EPERM). A zombie
has exited: it reads as not alive, while its pid is still taken.

`ProcFS` owns its root (default /proc). The module-level questions read the host's /proc (`HOST`)
unless a caller hands them another `ProcFS` as `proc=`: a test injects a directory of its own
instead of patching anything (psutil's lesson: patch no global, inject a root).
"""
# size: a little over the limit: every /proc question, and the one reading of the protected processes a kill path shares, in the one module that translates /proc's errors.
from __future__ import annotations

import contextlib
import errno
import os
import signal
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from ..errors import AccessDenied, KernelError, NoSuchProcess
from . import ancestry, parsers

PROC = "/proc"
_GONE = frozenset({errno.ENOENT, errno.ESRCH})
_DENIED = frozenset({errno.EACCES, errno.EPERM})
DEAD_STATES = ("Z", "X")


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    start_time: int

    @property
    def exited(self) -> bool:
        """A zombie (or a dead task being reaped): it runs no more, though its pid is still taken."""
        return self.state in DEAD_STATES


def _translate(pid: int | str, what: str, err: OSError) -> Exception:
    if err.errno in _GONE:
        return NoSuchProcess(pid if isinstance(pid, int) else -1)
    if err.errno in _DENIED:
        return AccessDenied(pid if isinstance(pid, int) else -1,
                            f"not allowed to read /proc/{pid}/{what}: {err.strerror}")
    return KernelError("read", f"/proc/{pid}/{what}", err)


class ProcFS:
    """One procfs mount, or a directory laid out like one (`<root>/<pid>/stat`, ...).

    Reads raise NoSuchProcess, AccessDenied or KernelError (with the path).

    Args:
        root: the mount point or directory; /proc by default.
    """

    __slots__ = ("root",)

    def __init__(self, root: str = PROC):
        self.root = root

    def read(self, pid: int | str, what: str, whole: bool = False) -> bytes:
        """The raw content of /proc/PID/what. `whole`: the file is one seq_file record (stat, statm,
        cgroup: single_open in fs/proc/base.c), which one read(2) with room for it returns entirely,
        so a read shorter than the buffer is the whole file and the read that would see EOF is spared."""
        try:
            fd = os.open(f"{self.root}/{pid}/{what}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise _translate(pid, what, err) from err
        try:
            chunks: list[bytes] = []
            while True:
                chunk = os.read(fd, 65536)
                if not chunk or (whole and not chunks and len(chunk) < 65536):
                    return chunk if not chunks else b"".join(chunks)
                chunks.append(chunk)
        except OSError as err:
            raise _translate(pid, what, err) from err
        finally:
            os.close(fd)

    def stat(self, pid: int) -> ProcStat:
        """/proc/PID/stat parsed."""
        state, ppid, start = parsers.parse_proc_stat(self.read(pid, "stat", whole=True).decode("utf-8", "replace"))
        return ProcStat(pid, state, ppid, start)

    def environ(self, pid: int) -> dict[str, str]:
        """The initial environment of `pid` (empty for a zombie or a kernel thread)."""
        return parsers.parse_environ(self.read(pid, "environ"))

    def cmdline(self, pid: int) -> str:
        """The command line joined with spaces ('' for a kernel thread or a zombie)."""
        return self.read(pid, "cmdline").rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")

    def cgroup(self, pid: int | str) -> str | None:
        """The cgroup v2 path as /proc/PID/cgroup shows it; None when it has no v2 line."""
        return parsers.parse_proc_cgroup(self.read(pid, "cgroup", whole=True).decode("utf-8", "replace"))

    def rss_pages(self, pid: int) -> int:
        """Resident pages (/proc/PID/statm, second field)."""
        return int(self.read(pid, "statm", whole=True).split()[1])

    def tgid(self, tid: int) -> int:
        """The process (thread group) thread `tid` belongs to (/proc/TID/status `Tgid:`)."""
        for line in self.read(tid, "status").splitlines():
            if line.startswith(b"Tgid:"):
                return int(line.split()[1])
        raise NoSuchProcess(tid)

    def children(self, pid: int) -> list[int]:
        """Children of `pid` from /proc/PID/task/*/children (CONFIG_PROC_CHILDREN, 3.5+)."""
        try:
            tids = os.listdir(f"{self.root}/{pid}/task")
        except OSError as err:
            raise _translate(pid, "task", err) from err
        out: list[int] = []
        for tid in tids:
            try:
                out.extend(int(child) for child in self.read(pid, f"task/{tid}/children").split())
            except NoSuchProcess:
                continue  # that thread exited meanwhile
        return out

    def pids(self) -> list[int]:
        """Every pid visible in this procfs."""
        return [int(name) for name in os.listdir(self.root) if name.isdigit()]


HOST = ProcFS()
DEFAULT = HOST  # the name the kernel layer's other readers use; never reassigned


# --- the questions callers ask, of the host's procfs unless handed another (`proc=`) ---------------

def stat(pid: int, proc: ProcFS = HOST) -> ProcStat | None:
    """/proc/PID/stat parsed; None when the process is gone. Raises AccessDenied when unreadable."""
    try:
        return proc.stat(pid)
    except NoSuchProcess:
        return None
    except (ValueError, IndexError):
        return None  # a truncated read of a task being torn down


def start_time(pid: int, proc: ProcFS = HOST) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when it does not exist.

    Raises AccessDenied when it cannot be read.
    """
    st = stat(pid, proc)
    return st.start_time if st else None


_OWN_START: tuple[int, int] | None = None


def own_start_time() -> int | None:
    """`start_time` of the calling process, read from /proc once per process (a forked child has
    another pid, and reads its own; a process's start time never changes)."""
    global _OWN_START
    pid = os.getpid()
    if _OWN_START is not None and _OWN_START[0] == pid:
        return _OWN_START[1]
    started = start_time(pid)
    if started is not None:
        _OWN_START = (pid, started)
    return started


def is_alive(pid: int, started: int, proc: ProcFS = HOST) -> bool:
    """True if `pid` runs and is the process that started at `started` (a zombie has exited).

    Raises AccessDenied when that cannot be told: never read "cannot look" as "dead".
    """
    if pid <= 0:
        return False
    st = stat(pid, proc)
    return st is not None and st.start_time == started and not st.exited


def alive_or_unknown(pid: int | None, started: int | None, proc: ProcFS = HOST) -> bool:
    """True unless `pid` is known to be gone: it runs as the process that started at `started`, or it
    cannot be looked at (another user's process under hidepid). The one place that reads "cannot look"
    as "not known to be dead", for every caller that must never act on a guess (keys, leases of notes,
    the guard's owner, a killer's or a turn owner's liveness). A pid or start time of None is gone.
    """
    if pid is None or started is None:
        return False
    try:
        return is_alive(pid, started, proc)
    except AccessDenied:
        return True


def environ(pid: int, proc: ProcFS = HOST) -> dict[str, str] | None:
    """The initial environment of `pid`; None when gone or not readable (another user's process:
    such a process is never taken for a turn member by its environment)."""
    try:
        return proc.environ(pid)
    except (NoSuchProcess, AccessDenied):
        return None


def cmdline(pid: int, proc: ProcFS = HOST) -> str:
    """The command line of `pid` joined with spaces; '' when gone, unreadable or a kernel thread."""
    try:
        return proc.cmdline(pid)
    except (NoSuchProcess, AccessDenied):
        return ""


def cgroup_of(pid: int | str, proc: ProcFS = HOST) -> str | None:
    """The cgroup v2 path of a process as /proc/PID/cgroup shows it; None when gone or unreadable."""
    try:
        return proc.cgroup(pid)
    except (NoSuchProcess, AccessDenied):
        return None


def own_thread_count(proc: ProcFS = HOST) -> int | None:
    """How many threads the calling process runs (/proc/self/task: a C library's threads, which
    Python's threading module does not know of, count too); None when it cannot be read."""
    try:
        return len(os.listdir(f"{proc.root}/self/task"))
    except OSError:
        return None


def set_own_name(name: str, proc: ProcFS = HOST) -> bool:
    """Set the calling thread's name (/proc/self/comm, what `ps -e`, `top` and `pgrep` show: 15
    bytes kept, proc(5)); False when refused."""
    try:
        with open(f"{proc.root}/thread-self/comm", "w") as f:
            f.write(name[:15])
        return True
    except OSError:
        return False


def tgid_of(tid: int, proc: ProcFS = HOST) -> int | None:
    """The process a thread id belongs to; None when it is gone or unreadable."""
    try:
        return proc.tgid(tid)
    except (NoSuchProcess, AccessDenied, ValueError):
        return None


def rss_bytes(pid: int, proc: ProcFS = HOST) -> int | None:
    """Resident bytes of `pid`; None when gone or unreadable."""
    try:
        return proc.rss_pages(pid) * PAGE_SIZE
    except (NoSuchProcess, AccessDenied, ValueError, IndexError):
        return None


def children_of(pid: int, proc: ProcFS = HOST) -> list[int]:
    """Children of `pid`; a /proc scan by ppid where /proc/PID/task/*/children is missing."""
    try:
        return proc.children(pid)
    except NoSuchProcess:
        return []
    except (AccessDenied, KernelError):
        return [p for p in all_pids(proc) if (st := _stat_or_none(p, proc)) is not None and st.ppid == pid]


def _stat_or_none(pid: int, proc: ProcFS = HOST) -> ProcStat | None:
    try:
        return stat(pid, proc)
    except AccessDenied:
        return None


def all_pids(proc: ProcFS = HOST) -> list[int]:
    """Every pid visible in `proc`."""
    return proc.pids()


def is_kernel_thread(st: ProcStat) -> bool:
    """Kernel threads are kthreadd (pid 2) and its children (see kernel/kthread.c)."""
    return st.pid == 2 or st.ppid == 2


def ancestors(pid: int, proc: ProcFS = HOST) -> set[int]:
    """`pid`'s ancestors up to PID 1 (inclusive), following ppid links.

    The walk reads no /proc file it can do without: the caller's own parent is getppid(2), and PID 1
    ends the walk unread (its ppid is 0 in every pid namespace: it has no parent there). The
    caller's own chain is walked once and kept, pinned by pidfds, until one of its processes exits
    (kernel/ancestry.py): an abandon's reading of it is then getppid(2) and one poll(2).
    """
    if proc is HOST and pid == os.getpid():
        return set(ancestry.own_ancestors(_host_parent))
    out: set[int] = set()
    ppid = _ppid_or_zero(pid, proc)
    while ppid > 0 and ppid not in out:
        out.add(ppid)
        if ppid == 1:
            break
        ppid = _ppid_or_zero(ppid, proc)
    return out


def _host_parent(pid: int) -> int:
    return _ppid_or_zero(pid, HOST)


def _ppid_or_zero(pid: int, proc: ProcFS) -> int:
    """The parent of `pid`; 0 when it is gone or cannot be read (the walk ends there)."""
    st = _stat_or_none(pid, proc)
    return 0 if st is None else st.ppid


class Protected:
    """The processes cgturn never signals, adopts, freezes or kills the cgroup of — PID 1, the
    caller and the caller's ancestors — as read at one moment."""

    __slots__ = ("pids", "me")

    def __init__(self) -> None:
        self.me = os.getpid()
        self.pids = frozenset({1, self.me} | ancestors(self.me))


# The reading of one kill (`protected_once`), in this thread's context only.
_ONE_KILL: ContextVar[Protected | None] = ContextVar("cgturn_protected", default=None)


def protected() -> Protected:
    """The protected processes: the reading of the kill under way in this thread (`protected_once`),
    or a fresh one."""
    current = _ONE_KILL.get()
    return current if current is not None and current.me == os.getpid() else Protected()


@contextlib.contextmanager
def protected_once() -> Iterator[None]:
    """Within it, `protected()` and `protected_pids()` answer from one reading (an abandon checks
    the caller, its ancestors and PID 1 before it marks the turn and again at every signal and
    kill; a dozen /proc reads each time were most of a small turn's abandon). `reread_protected`
    takes a new reading, for a kill path that waited (a grace period) before it kills again."""
    current = _ONE_KILL.get()
    if current is not None and current.me == os.getpid():
        yield  # the abandon that called this kill path took the reading
        return
    token = _ONE_KILL.set(Protected())
    try:
        yield
    finally:
        _ONE_KILL.reset(token)


def reread_protected() -> None:
    """Take a new reading for the `protected_once` under way (no-op outside one)."""
    if _ONE_KILL.get() is not None:
        _ONE_KILL.set(Protected())


def protected_pids() -> set[int]:
    """Pids cgturn never signals, adopts or freezes: PID 1, the caller and the caller's ancestors."""
    return set(protected().pids)


def open_pidfd(pid: int, started: int | None = None) -> int | None:
    """Open a pidfd for `pid`, checking its start time when given; None if gone or not that process.

    The start-time check happens after pidfd_open, so a pid recycled in between is caught: the pidfd
    then belongs to the new process, whose start time differs.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError as err:
        if err.errno == errno.ESRCH:
            return None
        raise
    if started is not None:
        try:
            same = start_time(pid) == started
        except AccessDenied:
            same = False
        if not same:
            os.close(fd)
            return None
    return fd


def pidfd_signal(fd: int, sig: int) -> bool:
    """Send `sig` through a pidfd; False when the process has already exited."""
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False


def signal_pid(pid: int, sig: int, started: int | None = None) -> bool:
    """Signal `pid` (if its start time still matches) via a pidfd; False when it is gone."""
    fd = open_pidfd(pid, started)
    if fd is None:
        return False
    try:
        return pidfd_signal(fd, sig)
    finally:
        os.close(fd)


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
