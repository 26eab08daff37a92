"""The kernel's interface paths a sandbox keeps read-only or out of reach, and the capability numbers it
reads: facts about procfs, sysfs and devtmpfs, no policy (the seal, backends/seal.py, and writable.py
use them)."""
from __future__ import annotations

import functools

# Where procfs is mounted (a sandbox mounts its own there for its PID namespace).
PROC = "/proc"
# What of a fresh procfs still writes host state (sysctls, SysRq, IRQ affinity, PCI config): bubblewrap
# 0.8 makes these read-only only where access(2) says they are writable, and as root found /proc/sys
# not to be (seen on Linux 6.18), so the seal binds them read-only itself. The same files are seen
# through any procfs instance: sysctls are read through the reader's own namespaces.
PROC_HOST_STATE = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")


@functools.lru_cache(maxsize=1)
def last_capability() -> int:
    """The highest capability number this kernel knows (/proc/sys/kernel/cap_last_cap): a sandbox
    drops every one up to it that it does not keep from the bounding set.

    Raises:
        OSError: /proc is not mounted.
    """
    with open("/proc/sys/kernel/cap_last_cap", "rb") as f:
        return int(f.read())
