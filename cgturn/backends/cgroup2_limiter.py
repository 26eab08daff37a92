"""The cgroup v2 backend's limiter (`backend.limiter`): limits, usage counters and pressure at the three
levels (turn, task, managed root).

Where the controllers are and which files a limit maps to is cgroup2_limits.Layout's; this is what the
backend does with it: new turns' limits and v1 directories (`limit_new_turn`), changing limits later
(moving a running turn's processes into v1 directories, frozen meanwhile), reading what a turn used, and
lifting a dying turn's CPU quota. The registry backend has no limiter (`limiter` is None there).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any, Callable, Iterable

from ..errors import CgturnError, KernelError, LimitsUnavailable, LockTimeout, NoSuchTurn
from ..logfields import turn_fields
from ..kernel.cgroupfs import Cgroup, child_entries
from ..limits import Limits, Usage, refuse_budget_under_one_page, stored_limits
from ..model import CORRUPT, TurnRecord
from . import cgroup2_views
from .cgroup2_limits import Layout

log = logging.getLogger("cgturn")
FREEZE_TIMEOUT = 1.0
# How long a new budget waits for the record of a turn directory made just before it was stored.
RECORD_WAIT = 1.0
RECORD_POLL = 0.002

# The backend's atomic record change: (task_key, turn_key, allowed_from, to_state, updates, when=None).
Transition = Callable[..., tuple[bool, "TurnRecord | None"]]


def limit_new_turn(layout: Layout, root: Cgroup, record: TurnRecord, cg: Cgroup, task: Cgroup, limits: Limits,
                   new_task: bool = False) -> None:
    """Give a new turn (cgroup `cg` in task directory `task`) its limits and, on v1, its v1 directories
    when any level has limits; sets `record.limits` and `record.v1_dirs` to match.

    Args:
        new_task: the caller made the task directory, which has no limits of its own yet.

    Raises:
        LimitsUnavailable, KernelError: a limit could not be written (the caller removes the turn).
    """
    if layout.v1_dirs():  # some controller lives in v1: does a limit apply to this turn?
        inherited = layout.stored_limits(root)
        if not new_task:
            inherited = layout.stored_limits(task).merged(inherited)
        if layout.uses_v1(limits) or layout.uses_v1(inherited):
            layout.make_v1_dirs(record.task_key, record.turn_key)
            record.v1_dirs = True
    effective = layout.default_limits().merged(limits)
    if not effective.is_empty():
        layout.apply(effective, cg.path, record.task_key, record.turn_key)
    record.limits = None if limits.is_empty() else json.dumps(limits.to_stored())


def budget_came_meanwhile(layout: Layout, root: Cgroup, record: TurnRecord, task: Cgroup) -> bool:
    """Whether a new turn, just recorded without v1 directories, needs them after all: a task or root
    budget in a v1 hierarchy was stored after `limit_new_turn` read the budgets. Its setter gives v1
    directories to the turns it finds recorded, and waits only RECORD_WAIT for a directory's record; a
    creator stalled longer than that between its mkdir and its record (stopped, swapped out) re-checks
    here, after its record is written, so one of the two always sees the other."""
    if record.v1_dirs or not layout.v1_dirs():
        return False
    return layout.uses_v1(layout.stored_limits(task)) or layout.uses_v1(layout.stored_limits(root))


class CgroupLimiter:
    """Limits and figures for the turns below one managed root.

    Args:
        root: the managed root (turns are `root/<task_key>/<turn_key>`).
        layout: returns where the controllers are for this root (made once, on first use).
        ensure_root: creates the managed root if needed (a root budget may come before any turn).
        records: the records of a task's turns (all turns with None), to give them v1 directories.
        transition: the backend's atomic record change, to store a turn's new limits under its lock.
    """

    def __init__(self, root: Cgroup, layout: Callable[[], Layout], ensure_root: Callable[[], bool],
                 records: Callable[[str | None], list[TurnRecord]], transition: Transition):
        self._root = root
        self._layout = layout
        self._ensure_root = ensure_root
        self._records = records
        self._transition = transition

    def _cg(self, record: TurnRecord) -> Cgroup:
        return self._root.child(record.task_key).child(record.turn_key)

    def set_turn_limits(self, record: TurnRecord, limits: Limits) -> TurnRecord:
        """Change the limits set on a turn (None fields unchanged).

        Returns:
            The turn's record after the change.

        Raises:
            LimitsUnavailable: a limit cannot be enforced here (nothing changed).
            NoSuchTurn: the turn is gone.
        """
        layout = self._layout()
        merged = stored_limits(record.limits).merged(limits)
        layout.check(merged)
        cg = self._cg(record)
        if layout.uses_v1(merged) and not record.v1_dirs:
            record = self._give_v1_dirs(record)
        layout.apply(merged, cg.path, record.task_key, record.turn_key)
        won, rec = self._transition(record.task_key, record.turn_key, {record.state}, record.state,
                                    {"limits": json.dumps(merged.to_stored()), "v1_dirs": record.v1_dirs})
        if rec is None:
            raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} no longer exists")
        return rec

    def set_task_limits(self, task_key: str, limits: Limits) -> None:
        """Change the budget of a task: all its turns together (None fields unchanged); makes the
        task directory if needed. Raises LimitsUnavailable when a limit cannot be enforced here,
        ValueError for a memory budget under one page (nothing made)."""
        refuse_budget_under_one_page(limits, f"task {task_key!r}")
        layout = self._layout()
        self._ensure_root()
        task = self._root.child(task_key)
        merged = layout.stored_limits(task).merged(limits)
        layout.check(merged)
        made = task.create()
        try:
            if made:
                layout.enable_v2(task)
            with _stored_first(layout, task, merged, layout.uses_v1(merged)) as needs_v1:
                if needs_v1:
                    layout.make_v1_dirs(task_key)
                    self._give_all_v1_dirs(task_key)
                layout.apply(merged, task.path, task_key)
        except BaseException:
            if made:  # a budget the kernel refused leaves no task behind (one a turn joined meanwhile stays)
                self._remove_if_empty(task, task_key)
            raise

    def _remove_if_empty(self, task: Cgroup, task_key: str) -> None:
        """Remove a task directory this call made, and its v1 directories, if no turn is in them;
        quietly: the caller is raising the error that made it fail."""
        with contextlib.suppress(OSError, CgturnError):
            if task.remove_if_empty():
                for path in self._layout().v1_dirs(task_key).values():
                    Cgroup(path).remove_if_empty()

    def set_root_limits(self, limits: Limits) -> None:
        """Change the budget of the managed root: all turns together (None fields unchanged).
        Raises LimitsUnavailable when a limit cannot be enforced here, ValueError for a memory budget
        under one page."""
        refuse_budget_under_one_page(limits, "the managed root")
        layout = self._layout()
        self._ensure_root()
        merged = layout.stored_limits(self._root).merged(limits)
        layout.check(merged)
        with _stored_first(layout, self._root, merged, layout.uses_v1(merged)) as needs_v1:
            if needs_v1:
                layout.make_v1_dirs()
                self._give_all_v1_dirs(None)
            layout.apply(merged, self._root.path)

    def task_limits(self, task_key: str) -> Limits:
        """The task's own limits as stored on its directory (empty when none)."""
        return self._layout().stored_limits(self._root.child(task_key))

    def root_limits(self) -> Limits:
        """The managed root's own limits (empty when none)."""
        return self._layout().stored_limits(self._root)

    def unthrottle(self, record: TurnRecord) -> None:
        """Lift the turn's own CPU limit once its processes are SIGKILLed: nothing useful runs any
        more, and exiting 500 processes within a 1-core quota takes twice as long as on 2 cores.
        Failures are logged at debug level, never raised (a kill path must finish)."""
        if stored_limits(record.limits).cpus is None:
            return
        try:
            self._layout().apply(Limits(cpus="max"), self._cg(record).path, record.task_key, record.turn_key)
        except (LimitsUnavailable, KernelError, FileNotFoundError) as err:
            log.debug("cannot lift the cpu limit of dying turn %r: %s", record.turn_id, err,
                      extra=turn_fields(record.task_id, record.turn_id, record.reason))

    # A turn has v1 directories only when its record says so (`v1_dirs`, set under its lock when they
    # are made): a turn without limits opens no v1 file.
    def limit_counters(self, record: TurnRecord) -> Usage:
        """The counters of limits the kernel enforced on the turn (`oom_kills`, `pids_max_hits`);
        other figures are left at their defaults."""
        return self._layout().usage(self._cg(record).path, record.task_key, record.turn_key, figures=False,
                                    v1=record.v1_dirs)

    def task_usage(self, task_key: str) -> Usage:
        """What the task's turns used together, from the task directory's hierarchical counters."""
        return self._layout().usage(self._root.child(task_key).path, task_key)

    def root_usage(self) -> Usage:
        """What all turns used together, from the managed root's counters."""
        return self._layout().usage(self._root.path)

    def report(self) -> dict:
        """`{layout, available, problems}`: which limits this root can have, through which layout, and
        why any cannot (`cgturn doctor`)."""
        return self._layout().report()

    def turn_pressure(self, record: TurnRecord) -> dict | None:
        """{resource: {some_avg10, full_avg10} or None} for cpu, memory, io (the turn's PSI files)."""
        return cgroup2_views.pressure(self._cg(record).path)

    def _give_all_v1_dirs(self, task_key: str | None) -> None:
        """Give v1 directories to every turn of the task (all turns with None) that has none.

        Called once the new limits are stored (`_stored_first`): a turn whose creator reads them from
        now on makes its own v1 directories (limit_new_turn). One whose creator read them before has
        its directory already, perhaps not yet its record: those are waited for (RECORD_WAIT), so
        that they get v1 directories here.
        """
        done: set[tuple[str, str]] = set()
        deadline = time.monotonic() + RECORD_WAIT
        while True:
            for rec in self._records(task_key):
                names = (rec.task_key, rec.turn_key)
                if names in done:
                    continue
                done.add(names)
                if not rec.v1_dirs and rec.state != CORRUPT:
                    try:
                        self._give_v1_dirs(rec)
                    except NoSuchTurn:
                        continue  # removed meanwhile: nothing of it to limit
            unrecorded = self._turn_dirs(task_key) - done
            if not unrecorded or time.monotonic() >= deadline:
                if unrecorded:  # their creators re-check once recorded (budget_came_meanwhile)
                    log.debug("no record appeared within %g s for turn directories %s: their creators give "
                              "them v1 directories", RECORD_WAIT, sorted("/".join(n) for n in unrecorded))
                return
            time.sleep(RECORD_POLL)  # a creator between its mkdir and its record write: microseconds

    def _turn_dirs(self, task_key: str | None) -> set[tuple[str, str]]:
        """(task_key, turn_key) of every turn directory of the task (of all tasks with None)."""
        tasks = [self._root.child(task_key)] if task_key is not None else self._root.children()
        return {(task.name, cg.name) for task in tasks for cg in task.children()}

    def _give_v1_dirs(self, record: TurnRecord) -> TurnRecord:
        """Make a running turn's v1 directories and move its processes in, frozen meanwhile so that
        none forks past the move (cgroup.freeze, 5.2+).

        The order closes the window a spawn could slip through: the record says `v1_dirs` (under the
        turn's lock) before the processes are listed. A spawn that read the record earlier holds the
        turn's shared lock until its child is in the turn's cgroup, so that child is listed and moved
        here; one that reads it later joins the v1 directories itself (spawn_paths, shim).

        Raises:
            NoSuchTurn: the turn is gone.
        """
        cg = self._cg(record)
        self._layout().make_v1_dirs(record.task_key, record.turn_key)
        record = self._mark_v1_dirs(record)
        was_frozen = cg.events().get("frozen", 0) == 1  # paused by a user or the guard: stays so
        cg.set_frozen(True)
        try:
            frozen = cg.wait_events(lambda ev: ev.get("frozen", 1) == 1, FREEZE_TIMEOUT)
            self._join_all(record, cg, settled=frozen)
        finally:
            if not was_frozen:
                self._thaw_unless_paused(record, cg)
        return record

    def _thaw_unless_paused(self, record: TurnRecord, cg: Cgroup) -> None:
        """End the move's freeze, unless a user or the guard paused the turn while it ran. Done under
        the turn's lock: a pause marks the record (`frozen_by`) under that lock before it writes
        cgroup.freeze (freezing.py), so either the mark is seen here or the pause's freeze comes
        after this thaw. With the lock held past its bound, the record read without it decides."""
        def thaw_if_unpaused(rec: TurnRecord) -> bool:
            if rec.frozen_by is None:
                cg.set_frozen(False)
            return False  # nothing to record
        try:
            self._transition(record.task_key, record.turn_key, {record.state}, record.state, {},
                             when=thaw_if_unpaused)
        except LockTimeout as busy:
            rec = next((r for r in self._records(record.task_key) if r.turn_key == record.turn_key), None)
            log.warning("thawing turn %r after moving it into its v1 directories without its lock: %s",
                        record.turn_id, busy, extra=turn_fields(record.task_id, record.turn_id))
            if rec is None or rec.frozen_by is None:
                cg.set_frozen(False)

    def _mark_v1_dirs(self, record: TurnRecord) -> TurnRecord:
        """Set `v1_dirs` in the turn's record, whatever state it moved to meanwhile."""
        for _ in range(5):
            won, rec = self._transition(record.task_key, record.turn_key, {record.state}, record.state,
                                        {"v1_dirs": True})
            if rec is None:
                raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} no longer exists")
            if won or rec.v1_dirs:
                return rec
            record = rec  # its state changed under us: mark it in the state it has now
        raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} keeps changing state")

    def _join_all(self, record: TurnRecord, cg: Cgroup, settled: bool) -> None:
        """Move every process of the turn's cgroup tree into its v1 directories. Frozen (`settled`),
        one pass sees them all; otherwise passes repeat until one finds no process it had not moved
        (children forked by a moved process are born in its v1 cgroups)."""
        moved: set[int] = set()
        while True:
            new = [pid for pid in cg.procs_recursive() if pid not in moved]
            for pid in new:
                try:
                    self._layout().join_v1(pid, record.task_key, record.turn_key)
                except (FileNotFoundError, KernelError):
                    pass  # exited meanwhile
                moved.add(pid)
            if settled or not new:
                return

    def sweep_v1_dirs(self) -> list[str]:
        """Remove v1 directories whose turn or task is gone from cgroup2 (an owner that crashed
        between the two removals); returns the paths removed."""
        removed = []
        for controller, root in self._layout().v1_dirs().items():
            for task_name, _ in child_entries(root):
                task_v2 = self._root.child(task_name)
                for turn_name, _ in child_entries(os.path.join(root, task_name)):
                    if not os.path.isdir(task_v2.child(turn_name).path):
                        path = os.path.join(root, task_name, turn_name)
                        if Cgroup(path).remove_tree(timeout=0.5):
                            removed.append(path)
                if not os.path.isdir(task_v2.path) and Cgroup(os.path.join(root, task_name)).remove_tree(timeout=0.5):
                    removed.append(os.path.join(root, task_name))
        return removed


@contextlib.contextmanager
def _stored_first(layout: Layout, cg: Cgroup, limits: Limits, needs_v1: bool):
    """Store a task's or the root's new `limits` before the body gives turns v1 directories and
    applies them, so a turn begun meanwhile reads them (limit_new_turn); the previous ones come back
    when the body fails. Yields `needs_v1`."""
    if not needs_v1:
        yield needs_v1
        layout.store_limits(cg, limits)
        return
    previous = layout.stored_limits(cg)
    layout.store_limits(cg, limits)
    try:
        yield needs_v1
    except BaseException:
        layout.store_limits(cg, previous)
        raise
