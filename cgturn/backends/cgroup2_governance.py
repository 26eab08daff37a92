"""The cgroup v2 backend's limits, usage figures and pressure, as a mixin of `Cgroup2Backend`.

Where the controllers are and which files a limit maps to is cgroup2_limits.Layout's; this is what the
backend does with it at the three levels (turn, task, managed root): new turns' limits and v1
directories, changing limits later (moving a running turn's processes into v1 directories, frozen
meanwhile), reading what a turn used, and lifting a dying turn's CPU quota.
"""
from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..errors import KernelError, LimitsUnavailable, NoSuchTurn
from ..logfields import turn_fields
from ..kernel.cgroupfs import Cgroup, child_entries
from ..limits import Limits, Usage, stored_limits
from ..model import CORRUPT, TurnRecord
from . import cgroup2_views

log = logging.getLogger("cgturn")
FREEZE_TIMEOUT = 1.0


class GovernanceMixin:
    """Limits and figures for Cgroup2Backend (uses its root, layout, _cg, records, transition)."""

    if TYPE_CHECKING:  # what Cgroup2Backend provides
        from .cgroup2_limits import Layout

        root: Cgroup

        @property
        def layout(self) -> Layout: ...
        def _cg(self, record: TurnRecord) -> Cgroup: ...
        def ensure_root(self) -> bool: ...
        def records(self, task_key: str | None = None) -> list[TurnRecord]: ...
        def transition(self, task_key: str, turn_key: str, allowed_from: Iterable[str], to_state: str,
                       updates: dict[str, Any], when: Callable[[TurnRecord], bool] | None = None,
                       ) -> tuple[bool, TurnRecord | None]: ...

    def _limit_new_turn(self, record: TurnRecord, cg: Cgroup, task: Cgroup, limits: Limits,
                        new_task: bool = False) -> None:
        """Give a new turn its limits and, on v1, its v1 directories when any level has limits.
        `new_task`: this call made the task directory, which has no limits of its own yet."""
        layout = self.layout
        if layout.v1_dirs():  # some controller lives in v1: does a limit apply to this turn?
            inherited = layout.stored_limits(self.root)
            if not new_task:
                inherited = layout.stored_limits(task).merged(inherited)
            if layout.uses_v1(limits) or layout.uses_v1(inherited):
                layout.make_v1_dirs(record.task_key, record.turn_key)
                record.v1_dirs = True
        effective = layout.default_limits().merged(limits)
        if not effective.is_empty():
            layout.apply(effective, cg.path, record.task_key, record.turn_key)
        record.limits = None if limits.is_empty() else json.dumps(limits.to_stored())

    def set_turn_limits(self, record: TurnRecord, limits: Limits) -> TurnRecord:
        layout = self.layout
        merged = stored_limits(record.limits).merged(limits)
        layout.check(merged)
        cg = self._cg(record)
        if layout.uses_v1(merged) and not record.v1_dirs:
            record = self._give_v1_dirs(record)
        layout.apply(merged, cg.path, record.task_key, record.turn_key)
        won, rec = self.transition(record.task_key, record.turn_key, {record.state}, record.state,
                                   {"limits": json.dumps(merged.to_stored()), "v1_dirs": record.v1_dirs})
        if rec is None:
            raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} no longer exists")
        return rec

    def set_task_limits(self, task_key: str, limits: Limits) -> None:
        layout = self.layout
        self.ensure_root()
        task = self.root.child(task_key)
        merged = layout.stored_limits(task).merged(limits)
        layout.check(merged)
        if task.create():
            layout.enable_v2(task)
        if layout.uses_v1(merged):
            layout.make_v1_dirs(task_key)
            for rec in self.records(task_key):
                if not rec.v1_dirs and rec.state != CORRUPT:
                    self._give_v1_dirs(rec)
        layout.apply(merged, task.path, task_key)
        layout.store_limits(task, merged)

    def set_root_limits(self, limits: Limits) -> None:
        layout = self.layout
        self.ensure_root()
        merged = layout.stored_limits(self.root).merged(limits)
        layout.check(merged)
        if layout.uses_v1(merged):
            layout.make_v1_dirs()
            for rec in self.records():
                if not rec.v1_dirs and rec.state != CORRUPT:
                    self._give_v1_dirs(rec)
        layout.apply(merged, self.root.path)
        layout.store_limits(self.root, merged)

    def task_limits(self, task_key: str) -> Limits:
        return self.layout.stored_limits(self.root.child(task_key))

    def root_limits(self) -> Limits:
        return self.layout.stored_limits(self.root)

    def unthrottle(self, record: TurnRecord) -> None:
        if stored_limits(record.limits).cpus is None:
            return
        try:
            self.layout.apply(Limits(cpus="max"), self._cg(record).path, record.task_key, record.turn_key)
        except (LimitsUnavailable, KernelError, FileNotFoundError) as err:
            log.debug("cannot lift the cpu limit of dying turn %r: %s", record.turn_id, err,
                      extra=turn_fields(record.task_id, record.turn_id, record.reason))

    # A turn has v1 directories only when its record says so (`v1_dirs`, set under its lock when they
    # are made): a turn without limits opens no v1 file.
    def turn_usage(self, record: TurnRecord) -> Usage:
        return self.layout.usage(self._cg(record).path, record.task_key, record.turn_key, v1=record.v1_dirs)

    def limit_counters(self, record: TurnRecord) -> Usage:
        return self.layout.usage(self._cg(record).path, record.task_key, record.turn_key, figures=False,
                                 v1=record.v1_dirs)

    def task_usage(self, task_key: str) -> Usage:
        return self.layout.usage(self.root.child(task_key).path, task_key)

    def root_usage(self) -> Usage:
        return self.layout.usage(self.root.path)

    def limits_report(self) -> dict:
        return self.layout.report()

    def turn_pressure(self, record: TurnRecord) -> dict | None:
        return cgroup2_views.pressure(self._cg(record).path)

    def turn_frozen(self, record: TurnRecord) -> bool:
        return self._cg(record).events().get("frozen", 0) == 1

    def _give_v1_dirs(self, record: TurnRecord) -> TurnRecord:
        """Make a running turn's v1 directories and move its processes in, frozen meanwhile so that
        none forks past the move (cgroup.freeze, 5.2+)."""
        cg = self._cg(record)
        self.layout.make_v1_dirs(record.task_key, record.turn_key)
        was_frozen = cg.events().get("frozen", 0) == 1  # paused by a user or the guard: stays so
        cg.set_frozen(True)
        try:
            cg.wait_events(lambda ev: ev.get("frozen", 1) == 1, FREEZE_TIMEOUT)
            for pid in cg.procs_recursive():
                try:
                    self.layout.join_v1(pid, record.task_key, record.turn_key)
                except (FileNotFoundError, KernelError):
                    continue  # exited meanwhile
        finally:
            if not was_frozen:
                cg.set_frozen(False)
        _, rec = self.transition(record.task_key, record.turn_key, {record.state}, record.state, {"v1_dirs": True})
        return rec or record

    def sweep_v1_dirs(self) -> list[str]:
        """Remove v1 directories whose turn or task is gone from cgroup2 (an owner that crashed
        between the two removals); returns the paths removed."""
        removed = []
        for controller, root in self.layout.v1_dirs().items():
            for task_name, _ in child_entries(root):
                task_v2 = self.root.child(task_name)
                for turn_name, _ in child_entries(os.path.join(root, task_name)):
                    if not os.path.isdir(task_v2.child(turn_name).path):
                        path = os.path.join(root, task_name, turn_name)
                        if Cgroup(path).remove_tree(timeout=0.5):
                            removed.append(path)
                if not os.path.isdir(task_v2.path) and Cgroup(os.path.join(root, task_name)).remove_tree(timeout=0.5):
                    removed.append(os.path.join(root, task_name))
        return removed
