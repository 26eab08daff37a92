"""What a spawn runs between joining its turn and its target: util-linux helpers that drop privileges
(and, for a turn that asks, enter its network namespace and seal it), chained by exec.

The shim (shim.SPAWN_SHIM) execs `"$@"` once the parent has moved it into its turn; the backend
puts these helpers in front of the target there, so every step runs inside the turn, as the caller,
before the target's first instruction: the process joins its turn with the caller's privileges (only
those may write cgroup.procs), then `setpriv(1)` drops them and execs the target. Popen's own
`user=`/`group=` would drop them before the join.

Everything a step needs is resolved in the parent before any process or cgroup exists: an unknown user
or group is a ValueError, a missing helper an IsolationUnavailable.
"""
from __future__ import annotations

import functools
import shutil

from ..errors import IsolationUnavailable
from ..identity import Identity
from ..kernel import procfd

SETPRIV = "setpriv"
NSENTER = "nsenter"
UNSHARE = "unshare"
MOUNT = "mount"


@functools.lru_cache(maxsize=None)
def helper(name: str) -> str:
    """The absolute path of a util-linux helper; IsolationUnavailable when it is not installed."""
    found = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if found is None:
        raise IsolationUnavailable(f"{name} (util-linux) is not installed: cannot isolate the spawn")
    return found


# Capabilities a sealed turn's processes lose from their bounding (and inheritable) set before the
# target runs (capabilities(7)): CAP_SYS_ADMIN for mount(2), setns(2) and unshare(2); CAP_SYS_PTRACE
# for /proc/PID/root of processes outside (ptrace_may_access: without it, only processes whose
# capabilities are a subset of the caller's), whose paths reach the host's read-write cgroup mounts;
# CAP_SYS_MODULE, as a kernel module can do anything.
SEAL_DROPPED = ("sys_admin", "sys_ptrace", "sys_module")
# Run by unshare(1) in the turn's new mount and cgroup namespaces: $0 is mount(8), $1 the number of
# cgroup mount points that follow, then the rest of the chain.
SEAL_SCRIPT = ('n=$1; shift; while [ "$n" -gt 0 ]; do "$0" -o remount,bind,ro "$1" || exit 125; shift; '
               'n=$((n-1)); done; exec "$@"')


def drop_privileges(identity: Identity | None, sealed: bool = False) -> list[str]:
    """The helper command (without the target) that becomes `identity` and, for a sealed turn, drops
    SEAL_DROPPED; [] when there is nothing to drop. Raises IsolationUnavailable without setpriv."""
    args = list(identity.setpriv_args()) if identity is not None else []
    if sealed:
        caps = ",".join(f"-{cap}" for cap in SEAL_DROPPED)
        args += [f"--bounding-set={caps}", f"--inh-caps={caps}"]
    return [helper(SETPRIV), *args, "--"] if args else []


def seal(cgroup_mounts: list[str]) -> list[str]:
    """The helper command that seals the process in the cgroups it is in: new mount and cgroup
    namespaces (the cgroup namespace rooted at its turn), `/` made private first so that nothing
    propagates back to the host, then every cgroup mount re-bound read-only. Raises
    IsolationUnavailable without unshare or mount."""
    return [helper(UNSHARE), "--mount", "--cgroup", "--propagation", "private", "--",
            "/bin/sh", "-c", SEAL_SCRIPT, helper(MOUNT), str(len(cgroup_mounts)), *cgroup_mounts]


@functools.lru_cache(maxsize=1)
def check_seal() -> None:
    """Raise IsolationUnavailable unless the helpers exist and the kernel gives this process new mount
    and cgroup namespaces (tried once per process: an unshare(1) that exits at once)."""
    import subprocess

    for name in (UNSHARE, MOUNT, SETPRIV):
        helper(name)
    probe = subprocess.run([helper(UNSHARE), "--mount", "--cgroup", "--propagation", "private", "true"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if probe.returncode != 0:
        raise IsolationUnavailable(f"the kernel refused mount and cgroup namespaces: {probe.stderr.strip()}")


def enter_network(fd: int) -> list[str]:
    """The helper command that enters the network namespace `fd` (inherited by the shim) and execs
    the rest. Raises IsolationUnavailable when nsenter is not installed."""
    return [helper(NSENTER), f"--net={procfd.inherited_fd_path(fd)}", "--"]
