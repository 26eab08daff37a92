"""Resource controllers: where memory, pids and cpu live on this host, which files a `Limits` maps to,
and which files report what a cgroup used.

Two layouts:
- **v2**: the controllers are enabled in the cgroup2 tree (`cgroup.subtree_control`), and limits are
  the v2 files (`memory.max`, `pids.max`, `cpu.max`, ...) of the turn's own cgroup.
- **v1 hybrid** (this kind of host: cgroup2 without memory/pids/cpu, those mounted as v1
  hierarchies): a turn also gets a cgroup in each v1 hierarchy it needs, at the same place relative
  to the caller's own cgroup of that hierarchy, and the limits are the v1 files there.

The mapping functions are pure (Limits in, (controller, file, value) out); the readers take a
directory and read the usage files, tolerating the ones this kernel does not have.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import LimitsUnavailable
from ..limits import UNLIMITED, Limits, Usage
from . import parsers
from .cgroupfiles import read_text

CONTROLLERS = ("memory", "pids", "cpu")
V2 = "v2"
V1 = "v1"
CPU_PERIOD_US = 100_000
# Which controller each Limits field needs.
FIELD_CONTROLLER = {"memory_max": "memory", "memory_high": "memory", "swap_max": "memory",
                    "oom_group": "memory", "pids_max": "pids", "cpus": "cpu", "cpu_weight": "cpu"}


@dataclass(frozen=True, slots=True)
class Place:
    """Where one controller of a managed root is: `version` v2 (the turn's own cgroup2 directory) or
    v1 (`path`: the managed root's directory in that v1 hierarchy)."""

    version: str
    path: str | None = None
    base: str | None = None  # v1: the creating process's own cgroup there, below which `path` lies

    def to_json(self) -> dict:
        return {"version": self.version, "path": self.path, "base": self.base}

    @classmethod
    def from_json(cls, data: dict) -> "Place":
        version, path, base = data.get("version"), data.get("path"), data.get("base")
        if version not in (V1, V2) or (version == V1 and not isinstance(path, str)) \
                or not (base is None or isinstance(base, str)):
            raise ValueError(f"not a controller place: {data!r}")
        return cls(version, path, base)


def needed_controllers(limits: Limits) -> set[str]:
    """The controllers the set fields of `limits` need."""
    return {FIELD_CONTROLLER[name] for name, value in limits.to_stored().items() if value is not None}


# --- where the controllers are --------------------------------------------------------------------

def v1_mounts(mountinfo_text: str) -> dict[str, str]:
    """controller -> mount point of its cgroup v1 hierarchy (a co-mounted `cpu,cpuacct` maps both)."""
    out: dict[str, str] = {}
    for point, controllers in parsers.parse_mountinfo_cgroup1(mountinfo_text):
        for controller in controllers:
            out.setdefault(controller, point)
    return out


def decide_places(v2_available: list[str], v1_mount_points: dict[str, str], own_v1: dict[str, str],
                  relative_root: str) -> tuple[dict[str, Place], list[str]]:
    """Where each of memory, pids, cpu goes for a managed root, and why any cannot be had.

    Args:
        v2_available: controllers the managed root's parent delegates (its `cgroup.subtree_control`).
        v1_mount_points: controller -> v1 mount (from `v1_mounts`).
        own_v1: controller -> the caller's cgroup in that v1 hierarchy (/proc/self/cgroup).
        relative_root: the managed root relative to the caller's own cgroup2 cgroup: its v1
            directories go at the same place below the caller's own v1 cgroups.
    """
    places: dict[str, Place] = {}
    problems: list[str] = []
    for controller in CONTROLLERS:
        if controller in v2_available:
            places[controller] = Place(V2)
        elif controller in v1_mount_points and controller in own_v1:
            own = os.path.normpath(os.path.join(v1_mount_points[controller], own_v1[controller].lstrip("/")))
            places[controller] = Place(V1, os.path.normpath(os.path.join(own, relative_root)), own)
        elif controller in v1_mount_points:
            problems.append(f"{controller}: the caller's cgroup in the v1 {controller} hierarchy is not visible")
        else:
            # systemd's DelegateSubgroup= alone puts the caller in a leaf but enables nothing for the
            # unit's children (systemd 257): enter-leaf does that, from the leaf.
            problems.append(f"{controller}: not delegated to the managed root's parent in cgroup v2 (enable "
                            f"it in the parent's cgroup.subtree_control from a leaf, e.g. systemd Delegate=yes "
                            f"with DelegateSubgroup= and contrib/enter-leaf), and no v1 hierarchy has it")
    return places, problems


def layout_name(places: dict[str, Place]) -> str | None:
    """"v2", "v1-hybrid" (any controller in a v1 hierarchy) or None (no controller at all)."""
    if not places:
        return None
    return "v1-hybrid" if any(p.version == V1 for p in places.values()) else "v2"


# --- limits -> files --------------------------------------------------------------------------------

def limit_files(limits: Limits, places: dict[str, Place]) -> list[tuple[str, str, str]]:
    """(controller, file, value) to write, in order, for the set fields of `limits`.

    Raises:
        LimitsUnavailable: a field's controller has no place here, or the layout has no equivalent
            (memory_high and oom_group=True on v1; swap_max on v1 without memory_max).
    """
    missing = sorted(c for c in needed_controllers(limits) if c not in places)
    if missing:
        raise LimitsUnavailable(f"no {', '.join(missing)} controller for the managed root (see `cgturn doctor`)")
    out: list[tuple[str, str, str]] = []
    for controller in CONTROLLERS:
        if controller not in places:
            continue
        if places[controller].version == V2:
            out.extend((controller, f, v) for f, v in _v2_files(controller, limits))
        else:
            out.extend((controller, f, v) for f, v in _v1_files(controller, limits))
    return out


def _size(value) -> str:
    return "max" if value == UNLIMITED else str(value)


def _v2_files(controller: str, limits: Limits) -> list[tuple[str, str]]:
    out = []
    if controller == "memory":
        if limits.memory_max is not None:
            out.append(("memory.max", _size(limits.memory_max)))
        if limits.memory_high is not None:
            out.append(("memory.high", _size(limits.memory_high)))
        if limits.swap_max is not None:
            out.append(("memory.swap.max", _size(limits.swap_max)))
        if limits.oom_group is not None:
            out.append(("memory.oom.group", "1" if limits.oom_group else "0"))
    elif controller == "pids" and limits.pids_max is not None:
        out.append(("pids.max", _size(limits.pids_max)))
    elif controller == "cpu":
        if limits.cpus is not None:
            quota = "max" if limits.cpus == UNLIMITED else str(max(1000, int(limits.cpus * CPU_PERIOD_US)))
            out.append(("cpu.max", f"{quota} {CPU_PERIOD_US}"))
        if limits.cpu_weight is not None:
            out.append(("cpu.weight", str(limits.cpu_weight)))
    return out


def _v1_files(controller: str, limits: Limits) -> list[tuple[str, str]]:
    out = []
    if controller == "memory":
        if limits.memory_high is not None:
            raise LimitsUnavailable("memory_high has no cgroup v1 equivalent (v1 memory has no throttling threshold)")
        if limits.oom_group:
            raise LimitsUnavailable("oom_group=True needs cgroup v2 (v1 memory has no group OOM kill)")
        if limits.swap_max is not None and not isinstance(limits.memory_max, int):
            raise LimitsUnavailable("swap_max on cgroup v1 needs memory_max (memory.memsw.limit_in_bytes is "
                                    "memory plus swap)")
        if limits.memory_max is not None:
            # memsw must never be below the memory limit: lift it first, then set both.
            v1_max = "-1" if limits.memory_max == UNLIMITED else str(limits.memory_max)
            if limits.swap_max is not None:
                out.append(("memory.memsw.limit_in_bytes", "-1"))
            out.append(("memory.limit_in_bytes", v1_max))
            if limits.swap_max is not None:
                # both are ints here: memory_max was checked above, and swap_max is not "max"
                swap = "-1" if limits.swap_max == UNLIMITED else str(int(limits.memory_max) + int(limits.swap_max))
                out.append(("memory.memsw.limit_in_bytes", swap))
    elif controller == "pids" and limits.pids_max is not None:
        out.append(("pids.max", _size(limits.pids_max)))
    elif controller == "cpu":
        if limits.cpus is not None:
            out.append(("cpu.cfs_period_us", str(CPU_PERIOD_US)))
            quota = "-1" if limits.cpus == UNLIMITED else str(max(1000, int(limits.cpus * CPU_PERIOD_US)))
            out.append(("cpu.cfs_quota_us", quota))
        if limits.cpu_weight is not None:
            out.append(("cpu.shares", str(max(2, round(limits.cpu_weight * 1024 / 100)))))
    return out


# --- usage ------------------------------------------------------------------------------------------

def read_usage(v2_dir: str, places: dict[str, Place], v1_dirs: dict[str, str], figures: bool = True,
               dir_fd: int | None = None, cpu_stat: str | None = None) -> Usage:
    """What the cgroup at `v2_dir` (and its v1 directories `v1_dirs`, controller -> path) used.

    Files this kernel or layout lacks leave their figure at its default (0, or None for peaks).
    `figures=False` reads only the counters of limits the kernel enforced (`oom_kills`,
    `pids_max_hits`): what a limit audit needs, without cpu.stat and the peaks. With `dir_fd`,
    `v2_dir` is relative to that open directory (a listing's task directory: cgroupfiles.read_text);
    `cpu_stat`: the cgroup's cpu.stat as the caller read it already (it is not read again).
    """
    usage = Usage()
    if not figures:
        cpu = {}
    elif cpu_stat is not None:
        cpu = parsers.parse_flat_keyed(cpu_stat)
    else:
        cpu = _flat(f"{v2_dir}/cpu.stat", dir_fd)
    usage.cpu_seconds = cpu.get("usage_usec", 0) / 1e6
    memory = places.get("memory")
    if memory is not None and memory.version == V2:
        usage.oom_kills = _flat(f"{v2_dir}/memory.events", dir_fd).get("oom_kill", 0)
        usage.memory_peak_bytes = read_int(f"{v2_dir}/memory.peak", dir_fd) if figures else None
    elif memory is not None and "memory" in v1_dirs:
        usage.oom_kills = _flat(f"{v1_dirs['memory']}/memory.oom_control").get("oom_kill", 0)
        usage.memory_peak_bytes = read_int(f"{v1_dirs['memory']}/memory.max_usage_in_bytes") if figures else None
    pids = places.get("pids")
    on_v2 = pids is not None and pids.version == V2
    pids_dir = v2_dir if on_v2 else v1_dirs.get("pids")
    if pids is not None and pids_dir is not None:
        usage.pids_max_hits = _flat(f"{pids_dir}/pids.events", dir_fd if on_v2 else None).get("max", 0)
    if not figures:
        return usage
    cpu_place = places.get("cpu")
    if cpu_place is not None and cpu_place.version == V2:
        usage.cpu_throttled_seconds = cpu.get("throttled_usec", 0) / 1e6
    elif cpu_place is not None and "cpu" in v1_dirs:
        usage.cpu_throttled_seconds = _flat(f"{v1_dirs['cpu']}/cpu.stat").get("throttled_time", 0) / 1e9
    return usage


def _flat(path: str, dir_fd: int | None = None) -> dict[str, int]:
    try:
        return parsers.parse_flat_keyed(read_text(path, dir_fd=dir_fd))
    except OSError:
        return {}


def read_int(path: str, dir_fd: int | None = None) -> int | None:
    """The integer a one-number cgroup file holds (`path` relative to `dir_fd` when given); None when
    absent or unreadable."""
    try:
        return int(read_text(path, dir_fd=dir_fd).strip())
    except (OSError, ValueError):
        return None
