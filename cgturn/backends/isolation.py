"""What a spawn runs between joining its turn and its target: helpers that drop privileges, enter the
turn's network namespace and (seal.py) seal it, chained by exec.

The shim (shim.SPAWN_SHIM) execs `"$@"` once the parent has moved it into its turn; the backend
puts these helpers in front of the target there, so every step runs inside the turn, as the caller,
before the target's first instruction: the process joins its turn with the caller's privileges (only
those may write cgroup.procs), then `nsenter(1)`, bubblewrap and `setpriv(1)` exec in that order. Popen's own
`user=`/`group=` would drop them before the join.

Everything a step needs is resolved in the parent before any process or cgroup exists: an unknown user
or group is a ValueError, a missing helper an IsolationUnavailable.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..errors import IsolationUnavailable
from ..kernel import procfd

if TYPE_CHECKING:
    from ..identity import Identity

SETPRIV = "setpriv"
NSENTER = "nsenter"


@functools.lru_cache(maxsize=None)
def helper(name: str, package: str = "util-linux") -> str:
    """The absolute path of a helper program; IsolationUnavailable when it is not installed."""
    import shutil  # here, not at every `cgturn` start: it imports the compressors (bz2, lzma, zlib)

    found = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if found is None:
        raise IsolationUnavailable(f"{name} ({package}) is not installed: cannot isolate the spawn")
    return found


def drop_privileges(identity: Identity | None) -> list[str]:
    """The helper command (without the target) that becomes `identity`; [] for None. Raises
    IsolationUnavailable without setpriv."""
    return [helper(SETPRIV), *identity.setpriv_args(), "--"] if identity is not None else []


def enter_network(fd: int) -> list[str]:
    """The helper command that enters the network namespace `fd` (inherited by the shim) and execs
    the rest. Raises IsolationUnavailable when nsenter is not installed."""
    return [helper(NSENTER), f"--net={procfd.inherited_fd_path(fd)}", "--"]
