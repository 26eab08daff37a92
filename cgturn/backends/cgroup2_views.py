"""The cgroup v2 backend's listing: every turn of the managed root with its pids and usage, in one pass.

This is the hot path of `ps` over thousands of turns; kernfs syscalls are most of its cost, so it asks
for nothing twice: per turn two small reads relative to the open task directory, its record (reused
while the task's generation token holds, see metadata.py), and a sub-cgroup walk only where a task's
cgroup.stat counts more cgroups than it has turns.
"""
from __future__ import annotations

import os
from typing import Callable

from ..kernel import parsers
from ..kernel.cgroupfs import (CPU_STAT_FILE, EVENTS_FILE, MEMORY_CURRENT_FILE, STAT_FILE, Cgroup, child_entries,
                               read_head, read_procs, read_text, walk_tree)
from ..limits import Usage
from ..model import TurnRecord, TurnView
from .metadata import MetadataStore


def views(root: Cgroup, meta: MetadataStore, task_key: str | None = None,
          usage: "UsageOf | None" = None) -> list[TurnView]:
    """One pass over the tree: per turn two small reads relative to the open task directory,
    and its record (read and parsed again only after the task's generation changed, see
    metadata.py); a sub-cgroup walk only where a task's cgroup.stat counts more cgroups than it
    has turns. With `usage` (the backend's usage of a turn: a listing with detail), also each
    turn's usage, pressure and frozen state, read relative to the same open directory, cpu.stat
    once for its seconds and its usage.

    This is the hot path of `ps` over 1000s of turns; kernfs syscalls are most of its cost, so
    it asks for nothing twice. (Reading tasks from two threads was tried and was slower: the
    Python half holds the GIL.)
    """
    tasks = [root.child(task_key).path] if task_key is not None else [c.path for c in root.children()]
    if task_key is None:
        meta.forget_tasks_except(tasks)
    reader = UsageReader()
    out: list[TurnView] = []
    for task_path in tasks:
        task_fd = Cgroup(task_path).open_dir()
        if task_fd is None:
            continue
        try:
            out.extend(_task_views(meta, task_path, task_fd, reader, usage))
        finally:
            os.close(task_fd)
    return out


# A backend's usage of the turn `name` of the open task directory, given its record and cpu.stat.
UsageOf = Callable[[TurnRecord, str, int, str], Usage]


def _task_views(meta: MetadataStore, task_path: str, task_fd: int, reader: "UsageReader",
                usage: UsageOf | None) -> list[TurnView]:
    entries = child_entries(task_fd)
    # Turns rarely have sub-cgroups: when the task's cgroup.stat counts no more descendants
    # than it has turns, none has, and no turn needs a walk of its own.
    nested = _descendant_count(Cgroup(task_path)) != len(entries)
    records = meta.load_task(task_path, entries)
    out = []
    for name, cgroup_id in entries:
        path = f"{task_path}/{name}"
        rec = records.get(name)
        if rec is None:
            continue
        if nested:
            tree = walk_tree(path)
            pids = sorted(pid for sub, _ in tree for pid in Cgroup(sub).procs())
            cgroup_ids = frozenset(i for _, i in tree)
        else:
            pids, cgroup_ids = sorted(read_procs(name, dir_fd=task_fd)), frozenset((cgroup_id,))
        if usage is None:
            cpu, mem = reader.read(task_fd, name)
            out.append(TurnView(rec, pids, cpu, mem, cgroup_ids, path))
            continue
        used = usage(rec, name, task_fd, reader.cpu_stat(task_fd, name))  # its CPU seconds are the view's
        out.append(TurnView(rec, pids, used.cpu_seconds, reader.memory_current(task_fd, name), cgroup_ids, path,
                            usage=used, pressure=pressure(name, task_fd), frozen=_frozen(name, task_fd)))
    return out


class UsageReader:
    """cpu seconds and memory.current of turn cgroups. memory.current exists only where the memory
    controller is enabled; once it is found missing, a listing stops asking for it."""

    def __init__(self):
        self.memory = True

    def read(self, dir_fd: int | None, path: str) -> tuple[float, int | None]:
        """(cpu seconds from cpu.stat, memory.current or None) of the turn at `path` (relative to
        `dir_fd` when given)."""
        try:
            cpu = (parsers.parse_cpu_usage_usec(read_head(f"{path}/{CPU_STAT_FILE}", dir_fd=dir_fd)) or 0) / 1e6
        except OSError:
            cpu = 0.0
        return cpu, self.memory_current(dir_fd, path)

    @staticmethod
    def cpu_stat(dir_fd: int | None, path: str) -> str:
        """The whole cpu.stat of the turn at `path` ('' when it cannot be read)."""
        try:
            return read_text(f"{path}/{CPU_STAT_FILE}", dir_fd=dir_fd)
        except OSError:
            return ""

    def memory_current(self, dir_fd: int | None, path: str) -> int | None:
        """memory.current of the turn at `path`, or None (from the first turn without one on)."""
        if not self.memory:
            return None
        try:
            return int(read_text(f"{path}/{MEMORY_CURRENT_FILE}", dir_fd=dir_fd))
        except (OSError, ValueError):
            self.memory = False
            return None


def _frozen(path: str, dir_fd: int | None) -> bool:
    """cgroup.events `frozen` of the turn at `path` (False when it is gone)."""
    try:
        return parsers.parse_cgroup_events(read_text(f"{path}/{EVENTS_FILE}", dir_fd=dir_fd)).get("frozen", 0) == 1
    except OSError:
        return False


def _descendant_count(cg: Cgroup) -> int:
    """Live cgroups below `cg` (cgroup.stat `nr_descendants`, 4.14+); -1 when it cannot be read."""
    try:
        return parsers.parse_flat_keyed(read_text(cg.file(STAT_FILE))).get("nr_descendants", -1)
    except OSError:
        return -1


PRESSURE_RESOURCES = ("cpu", "memory", "io")


def pressure(path: str, dir_fd: int | None = None) -> dict:
    """{resource: {some_avg10, full_avg10} or None} of the cgroup at `path` (relative to `dir_fd` when
    given; PSI files, 4.20+; every v2 cgroup has them, controllers or not). A file the kernel lacks,
    or a missing `full` line (cpu before 5.13), reads as None."""
    out: dict = {}
    for resource in PRESSURE_RESOURCES:
        try:
            out[resource] = parsers.parse_pressure_figures(read_text(f"{path}/{resource}.pressure", dir_fd=dir_fd))
        except OSError:
            out[resource] = None
    return out
