"""The paths a sealed spawn may write (`Turn.spawn(..., writable=)`, `cgturn run --writable`), checked
before any process or cgroup exists, so that a bad path is bad input (docs/security.md)."""
from __future__ import annotations

import os
from typing import Any

# Top-level directories that are the kernel's own interfaces (procfs, sysfs, devtmpfs), never a sealed
# spawn's writable path: a sysctl or sysfs file is a host setting, and a block device opened for
# writing is the whole disk, read-only mount or not.
KERNEL_TOP_DIRS = ("proc", "sys", "dev")


def writable_paths(writable: Any, cwd: Any) -> list[str]:
    """The paths a sealed spawn may write besides its private /tmp: `writable` as given, else its
    working directory (`cwd`, or this process's) unless that is `/`.

    Raises:
        ValueError: `/`, a path below /proc, /sys or /dev, or one that does not exist.
    """
    base = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
    if writable is None:
        return [] if base == "/" else [base]
    if isinstance(writable, (str, bytes, os.PathLike)):
        writable = [writable]
    out = []
    for path in writable:
        full = os.path.normpath(os.path.join(base, os.fsdecode(path)))
        if full == "/" or full.split("/")[1] in KERNEL_TOP_DIRS:
            raise ValueError(f"writable= cannot name {full!r} in a sealed turn")
        if not os.path.exists(full):
            raise ValueError(f"writable= names {full!r}, which does not exist")
        out.append(full)
    return out
