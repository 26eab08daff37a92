"""PID namespaces as /proc shows them: which process is the init (PID 1) of a namespace below ours.

A sealed turn's spawn has a PID namespace of its own, whose init (cgturn-init, or bubblewrap's) is a
member of the turn beside its target. cgturn-init forwards every signal it is sent to the target, so
whoever signals every member by host pid (abandon's SIGTERM) skips the inits: the target, signalled
directly, must get one SIGTERM, not two. A process cannot make a PID namespace in a sealed turn
(CAP_SYS_ADMIN is dropped, new user namespaces are refused), so the only inits there are the
sandboxes' own.
"""
from __future__ import annotations

import os

PROC = "/proc"
_NSPID = b"\nNSpid:"


def is_namespace_init(pid: int, proc: str = PROC) -> bool:
    """Whether `pid` is PID 1 of a PID namespace below the reader's.

    /proc/PID/status `NSpid:` (Linux 4.1, proc(5)) lists the process's pid in each namespace it is
    in, the reader's first: an init of a nested namespace has more than one, the last being 1.

    Args:
        pid: a host pid (as the reader's /proc numbers it).
        proc: the procfs mount to read.

    Returns:
        True for such an init; False otherwise, and when the process is gone or cannot be read
        (whoever acts on False signals it, as for any member).
    """
    try:
        fd = os.open(f"{proc}/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        data = os.read(fd, 8192)
    except OSError:
        return False
    finally:
        os.close(fd)
    at = data.find(_NSPID)
    if at < 0:
        return False
    end = data.find(b"\n", at + 1)
    pids = data[at + len(_NSPID):end if end > 0 else len(data)].split()
    return len(pids) > 1 and pids[-1] == b"1"
