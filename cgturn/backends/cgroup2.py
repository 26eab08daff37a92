"""The cgroup v2 backend: every turn is a child cgroup `<root>/<task>/<turn>`; membership is ownership.

Spawn: straight into the turn's cgroup where a native path honours the request, else through a gated
shim (spawn_paths.py, shim.py, spawn_options.py: the process is in the turn before the target runs).

The backend composes small objects with one job each: the killer (cgroup2_killer.py: signalling,
cgroup.kill and its fallback, strays), the limiter (cgroup2_limiter.py, `backend.limiter`: limits and
figures), the placement of processes (cgroup2_placement.py: which turn a pid is in, enter/leave) and
the turns' isolation (cgroup2_isolation.py: sealing checks, network namespaces). The listing hot path
is cgroup2_views.py; where the controllers are is cgroup2_limits.py's. What stays here: creating a
turn, its records and state changes under the turn-directory lock, and what a spawn needs.
"""
# size: a little over the limit: the cgroup2 backend's core methods, each a few lines over its composed parts (killer, limiter, placement, isolation, spawn paths); splitting further would scatter one interface.
from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Callable, Iterable

from ..errors import AccessDenied, CgturnError, NoSuchTurn, TurnExists
from ..kernel import dirlock, procfs
from ..kernel.cgroupfs import Cgroup
from ..limits import NO_LIMITS, Limits, Usage
from ..model import COMPLETED, CORRUPT, RUNNING, TurnRecord, TurnView
from .base import Backend, Member, turn_environment
from . import cgroup2_views
from .cgroup2_isolation import TurnIsolation
from .cgroup2_killer import CgroupKiller
from .cgroup2_limiter import CgroupLimiter, budget_came_meanwhile, limit_new_turn
from .cgroup2_limits import Layout
from .cgroup2_placement import Placement
from .metadata import MetadataStore

if TYPE_CHECKING:
    import subprocess
    import types

    from .gates import SpawnGates
    from .shim import ShimHooks
    from .spawn_options import SpawnTarget

log = logging.getLogger("cgturn")
SPAWN_TARGETS_MAX = 1024  # turns whose SpawnTarget a backend keeps
# Empty task directories a backend keeps for its process's next turn of that task (`turn_removed`):
# the least recently emptied beyond this many is removed, and close() removes the rest.
KEPT_TASKS_MAX = 64


def _spawn_paths():
    """backends/spawn_paths.py, imported on the first begin or spawn (a listing does not need it);
    kept in a global, as `from . import` runs importlib's Python-level fromlist handling on every call."""
    global _SPAWN_PATHS
    if _SPAWN_PATHS is None:
        from . import spawn_paths

        _SPAWN_PATHS = spawn_paths
    return _SPAWN_PATHS


_SPAWN_PATHS: "types.ModuleType | None" = None


class Cgroup2Backend(Backend):
    name = "cgroup2"

    def __init__(self, root: str, mount: str, state_dir: str, fsroot: str = "/", use_xattrs: bool = True,
                 cgroup_kill: bool | None = None, before_root: Callable[[], None] | None = None):
        self.root = Cgroup(os.path.normpath(root))
        # called before anything is created: the caller joins cgturn's systemd scope (host.ScopeJoin)
        self._before_root = before_root
        self.mount = mount
        self.placement = Placement(self.root, mount, fsroot)
        self.state_dir = state_dir
        self.meta = MetadataStore(state_dir, use_xattrs)
        # cgroup_kill: decided once (discovery looked without writing; None = not known yet, so try
        # it), and switched off on the first refusal (trio-style capability flag,
        # `killer.cgroup_kill_works`); tests set it to force the freeze fallback.
        self.killer = CgroupKiller(self.root, self.placement.path_on_mount, cgroup_kill)
        self.limiter = CgroupLimiter(self.root, lambda: self.layout, self.ensure_root, self.records, self.transition)
        self._gates: SpawnGates | None = None
        self._gates_lock = threading.Lock()
        self._layout: Layout | None = None
        self._layout_recorded = False
        self.isolation = TurnIsolation(self.load, self.killer.under)  # sealing, network namespaces
        # (task_key, turn_key, v1_dirs) -> the turn's SpawnTarget and shim hooks (fixed for its life)
        self._spawn_targets: dict[tuple[str, str, bool], tuple[SpawnTarget, ShimHooks]] = {}
        # Task directories this process made or made private and kept when its last turn went, least
        # recently emptied first (turn_removed); a begin in one of them makes no mkdir of it.
        self._kept_tasks: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._kept_lock = threading.Lock()
        # Tasks where a v1 budget was found after a turn's record: their turns read budgets up front.
        self._budgeted_tasks: set[str] = set()
        # Turn directories whose last record write left its task's generation stamp for later.
        self._unstamped: set[str] = set()

    @property
    def gates(self) -> "SpawnGates":
        """The spawn gates, made on the first spawn."""
        if self._gates is None:
            with self._gates_lock:  # threads spawning at once must share one set of gates
                if self._gates is None:
                    from .gates import SpawnGates  # what spawns needs, a listing does not

                    self._gates = SpawnGates()
        return self._gates

    @property
    def scope(self) -> str:
        return self.root.path

    @property
    def location(self) -> str:
        return self.root.path

    def turn_cgroup(self, task_key: str, turn_key: str) -> Cgroup:
        return self.root.child(task_key).child(turn_key)

    def _cg(self, record: TurnRecord) -> Cgroup:
        return self.turn_cgroup(record.task_key, record.turn_key)

    def env_for(self, record: TurnRecord) -> dict[str, str]:
        return turn_environment(record, self.scope)

    # --- records and state ------------------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        """Where memory, pids and cpu are for this managed root (see cgroup2_limits)."""
        if self._layout is None:
            self._layout = Layout(self.root, self.placement.path_on_mount(procfs.cgroup_of("self") or ""))
        return self._layout

    def ensure_root(self) -> bool:
        if self._before_root is not None:
            self._before_root()
        created = self.root.create()
        if created or not self._layout_recorded:
            if not created and not self.root.make_private():
                log.warning("cannot make the managed root %s private (chmod go-rw refused): other users can "
                            "take its lock and stall a guard's claim for %g s at a time", self.root.path,
                            dirlock.LOCK_WAIT)
            self.layout.record()
            self._layout_recorded = True
        return created

    def remove_root(self) -> bool:
        for task in self.root.children():
            if not self.remove_task(task.name, force=True):
                return False
        gone = self.root.remove_if_empty()
        if gone:
            self.layout.remove_v1_dirs()
        return gone

    def create_turn(self, record: TurnRecord, limits: Limits | None = None) -> None:
        limits = limits or NO_LIMITS
        if self._before_root is not None:
            self._before_root()  # the layout below depends on where the managed root's parent is
        self.layout.check(limits)  # LimitsUnavailable before anything is made
        netns = self.isolation.prepare(record)  # IsolationUnavailable, before anything is made
        try:
            self._create_turn(record, limits)
        except BaseException:
            if netns is not None:
                os.close(netns)
            raise
        if netns is not None:
            self.isolation.keep(record, netns)
        # A turn is begun to be spawned into: the spawn paths are imported now, while `cgturn run`'s
        # sentinel starts beside it, not after that, when its command starts.
        _spawn_paths()

    def _create_turn(self, record: TurnRecord, limits: Limits) -> None:
        task = self.root.child(record.task_key)
        cg = task.child(record.turn_key)
        for _ in range(20):  # a concurrent remove_task may rmdir the task between our two mkdirs
            kept = record.task_key in self._kept_tasks  # made private by this process: no mkdir, no stat
            new_task = False if kept else self._create_task(task)
            if new_task:
                self.layout.enable_v2(task)
            elif not kept:
                task.make_private()  # made before task directories were private: its lock is ours alone now
            try:
                cg.make()
            except FileNotFoundError:
                self._unkeep(record.task_key)  # removed meanwhile (reap, end_task elsewhere): made again
                continue
            except FileExistsError:
                if not self._replace_finished(cg):
                    raise TurnExists(f"turn {record.turn_id!r} already exists in task {record.task_id!r}") from None
                continue
            try:
                self._limit_new_turn(record, cg, task, limits, new_task)
                self.meta.save(cg, record, new=not new_task)  # a new task gets its first stamp
                if budget_came_meanwhile(self.layout, self.root, record, task):
                    if len(self._budgeted_tasks) >= SPAWN_TARGETS_MAX:
                        self._budgeted_tasks.clear()  # a hint, not a record: bounded in a long-lived process
                    self._budgeted_tasks.add(record.task_key)
                    self.layout.make_v1_dirs(record.task_key, record.turn_key)
                    won, _ = self.transition(record.task_key, record.turn_key, {RUNNING}, RUNNING, {"v1_dirs": True})
                    record.v1_dirs = won   # not won: ended meanwhile, nothing will be spawned into it
            except BaseException:
                cg.remove_tree(timeout=1.0)  # nothing is left behind by a turn that could not be made
                self.layout.remove_v1_dirs(record.task_key, record.turn_key)
                if new_task:  # nor by its task, made for it (rmdir of a non-empty one fails: another turn's)
                    self._remove_if_empty(task, record.task_key)
                raise
            return
        raise TurnExists(f"could not create turn {record.turn_id!r}: its task directory keeps vanishing")

    def _limit_new_turn(self, record: TurnRecord, cg: Cgroup, task: Cgroup, limits: Limits, new_task: bool) -> None:
        """limit_new_turn, but for a turn with no limits of its own or by default in a task where no
        v1 budget was seen: it reads no budget before its record. Whether a task or root budget gives
        it v1 directories is then answered by the one read after the record (budget_came_meanwhile),
        the read that must be made anyway to see a budget stored meanwhile."""
        if limits.is_empty() and record.task_key not in self._budgeted_tasks and self.layout.default_limits().is_empty():
            record.limits = None
            return
        limit_new_turn(self.layout, self.root, record, cg, task, limits, new_task)

    def _create_task(self, task: Cgroup) -> bool:
        """mkdir the task directory (True) unless it exists (False). The managed root is made first
        only until this backend has seen it: after that a begin costs no mkdir of the root, and a
        root removed meanwhile (remove_root, `cgturn reap` elsewhere) shows as ENOENT and is made again."""
        if not self._layout_recorded:
            self.ensure_root()
        try:
            task.make()
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            self.ensure_root()
            return task.create()

    def _remove_if_empty(self, task: Cgroup, task_key: str) -> None:
        """Remove a task directory and its v1 directories that hold no turn (a failed first turn's),
        quietly: the caller is raising the error that made the turn fail."""
        with contextlib.suppress(OSError, CgturnError):
            if task.remove_if_empty():
                for path in self.layout.v1_dirs(task_key).values():
                    Cgroup(path).remove_if_empty()

    def _replace_finished(self, cg: Cgroup) -> bool:
        """Remove an existing turn cgroup that holds nothing and will hold nothing: a completed turn,
        or a directory whose creator died before writing its record."""
        rec = self.meta.load(cg)
        if rec is None or rec.state not in (COMPLETED, CORRUPT) or cg.populated():
            return False
        removed = cg.remove_tree(timeout=0.5)
        if removed:
            self.meta.forget(cg)
            self.layout.remove_v1_dirs(os.path.basename(os.path.dirname(cg.path)), cg.name)
        return removed

    def load(self, task_key: str, turn_key: str) -> TurnRecord | None:
        return self.meta.load(self.turn_cgroup(task_key, turn_key))

    def records(self, task_key: str | None = None) -> list[TurnRecord]:
        tasks = [self.root.child(task_key)] if task_key is not None else self.root.children()
        out = []
        for task in tasks:
            for cg in task.children():
                rec = self.meta.load(cg)
                if rec is not None:
                    out.append(rec)
        return out

    def transition(self, task_key, turn_key, allowed_from: Iterable[str], to_state, updates, when=None,
                   stamp_later: bool = False):
        cg = self.turn_cgroup(task_key, turn_key)
        # Bounded (LockTimeout, nothing changed): a spawner stopped while it holds the turn's shared
        # lock (spawn_paths) must not stop an abandon, least of all the sentinel's, which exists for
        # stopped owners; the abandon then kills without the mark (control.abandon_turn).
        with cg.lock(f"change turn {turn_key!r} of task {task_key!r} to {to_state}") as present:
            if not present:
                return False, None
            rec = self.meta.load(cg)
            if rec is None or (when is not None and not when(rec)) or not rec.advance(allowed_from, to_state, updates):
                return False, rec
            # `stamp_later`: the task's generation stamp (metadata.py) is owed to the next signal or
            # kill, or to `remove`, which pays it only if the turn stays (a listing finds a removed
            # turn's directory gone); a listing in between sees the turn as it was just before.
            self.meta.save(cg, rec, stamp=not stamp_later)
            if stamp_later:
                self._unstamped.add(cg.path)
        if to_state != RUNNING and self.isolation.holds(task_key, turn_key):
            self.isolation.release_ended()
        return True, rec

    @contextlib.contextmanager
    def task_lock(self, task_key):
        """flock(2) on the task's cgroup directory (each call opens its own fd, so threads exclude
        each other too); the task exists while one of its turns does. Raises LockTimeout when
        another process keeps it past dirlock.LOCK_WAIT."""
        with self.root.child(task_key).lock(f"lock task {task_key!r}") as present:
            if not present:
                raise NoSuchTurn(f"task directory {task_key!r} no longer exists")
            yield

    # --- membership -------------------------------------------------------------------------------

    def spawn(self, record, argv, popen_kwargs) -> "subprocess.Popen":
        spawn_paths = _spawn_paths()
        target, hooks = self._spawn_target(record, spawn_paths)
        return spawn_paths.spawn(record, target, self.meta, hooks, argv, popen_kwargs)

    def _spawn_target(self, record: TurnRecord, spawn_paths) -> "tuple[SpawnTarget, ShimHooks]":
        """The turn's SpawnTarget and the shim's hooks into this backend, made once per turn."""
        key = (record.task_key, record.turn_key, record.v1_dirs)
        found = self._spawn_targets.get(key)
        if found is None:
            task, turn, cg = record.task_key, record.turn_key, self._cg(record)
            v1 = [f"{d}/cgroup.procs" for d in self.layout.v1_dirs(task, turn).values()] if record.v1_dirs else []
            hooks = spawn_paths.ShimHooks(gates=lambda: self.gates,
                                          join_v1=lambda pid: self.layout.join_v1(pid, task, turn),
                                          network_fd=lambda: self.isolation.network_fd(record, cg))
            found = (spawn_paths.target(cg.path, v1, self.env_for(record)), hooks)
            if len(self._spawn_targets) >= SPAWN_TARGETS_MAX:
                self._spawn_targets.clear()
            self._spawn_targets[key] = found
        return found

    def close(self) -> None:
        with self._kept_lock:
            kept, self._kept_tasks = list(self._kept_tasks), collections.OrderedDict()
        for task_key in kept:
            self._remove_kept(task_key)
        if self._gates is not None:  # never made by a read-only user: nothing to close
            self._gates.close()
        self.isolation.close()

    def adopt(self, record, pid) -> None:
        try:
            self._cg(record).move_in(pid)
            if record.v1_dirs:
                self.layout.join_v1(pid, record.task_key, record.turn_key)
        except FileNotFoundError:
            raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} no longer exists") from None

    def members(self, record) -> list[Member]:
        out = []
        for pid in self._cg(record).procs_recursive():
            try:
                started = procfs.start_time(pid)
            except AccessDenied:
                started = -1  # in the turn (the kernel says so) though we may not read its start
            if started is not None:
                out.append((pid, started))
        return out

    def turn_of(self, pid: int) -> tuple[str, str] | None:
        return self.placement.turn_of(pid)

    def enter(self, record) -> None:
        try:
            self.placement.enter(self._cg(record), self.layout.own_v1_dirs, joins_v1=bool(record.v1_dirs))
            if record.v1_dirs:
                self.layout.join_v1(os.getpid(), record.task_key, record.turn_key)
        except FileNotFoundError:
            raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} no longer exists") from None

    def leave(self) -> None:
        self.placement.leave()

    def contains_caller(self, record) -> bool:
        """True when the turn holds the caller, one of its ancestors or PID 1: what the killer refuses
        to kill, asked before an abandon marks the turn, so a refused abandon changes nothing."""
        return self.checked_members_at(record.task_key, record.turn_key) is None

    def checked_members_at(self, task_key: str, turn_key: str) -> list[int] | None:
        """The cgroup's member list answers (`contains_caller`); a turn that is gone holds nobody."""
        return self.killer.unprotected_members(self.turn_cgroup(task_key, turn_key))

    def wait_empty(self, record, timeout, signalled_at=None) -> bool:
        return self._cg(record).wait_unpopulated(timeout, spin_from=signalled_at)

    def remove(self, record) -> bool:
        cg = self._cg(record)
        try:
            # One rmdir, the atomic check, removes an emptied leaf (the common case). On EBUSY a turn
            # with processes stays at once; one without has sub-cgroups, or the kernel has not yet
            # finished with the processes that just left it (populated is updated asynchronously):
            # remove_tree walks it and retries with a bounded backoff.
            removed = cg.remove_if_empty() or (not cg.populated() and cg.remove_tree(timeout=2.0))
        except BaseException:
            self._pay_stamp(cg)
            raise
        if not removed:
            self._pay_stamp(cg)
            return False
        self._unstamped.discard(cg.path)
        self.meta.forget(cg)
        if record.v1_dirs:
            self.layout.remove_v1_dirs(record.task_key, record.turn_key)
        self._keep_task(record)
        return True

    def _pay_stamp(self, cg: Cgroup) -> None:
        """Stamp the task of a turn whose `transition(stamp_later=True)` left it (see there)."""
        if cg.path in self._unstamped:
            self._unstamped.discard(cg.path)
            self.meta.stamp(cg)

    def task_keys(self) -> list[str]:
        return [cg.name for cg in self.root.children()]

    def cgroup_dir(self, record) -> str:
        return self._cg(record).path

    def remove_task(self, task_key, force: bool = False) -> bool:
        """Remove a task directory with no turns left; one with limits of its own stays until
        `force` (end_task): its budget holds between turns. So does, until `force`, close() or
        KEPT_TASKS_MAX others, one this process keeps for its next turn there (`_keep_task`)."""
        if not force and task_key in self._kept_tasks:
            return False
        self._unkeep(task_key)
        return self._remove_task_now(task_key, force)

    def _remove_task_now(self, task_key: str, force: bool) -> bool:
        task = self.root.child(task_key)
        if not force and not self.layout.stored_limits(task).is_empty():
            return False
        if not task.remove_if_empty():
            return False
        if self.layout.v1_dirs():
            self.layout.remove_v1_dirs(task_key)
        return True

    def _keep_task(self, record: TurnRecord) -> None:
        """This process removed the turn `record`. Its owner keeps the task directory for its next
        turn of that task, so a begin then makes one mkdir and a complete one rmdir, as a bare cgroup
        does; the directory of a turn someone else ended (the sentinel's, reap's) goes at once."""
        if record.owner_pid != os.getpid():
            return
        with self._kept_lock:
            self._kept_tasks[record.task_key] = None
            self._kept_tasks.move_to_end(record.task_key)
            evicted = self._kept_tasks.popitem(last=False)[0] if len(self._kept_tasks) > KEPT_TASKS_MAX else None
        if evicted is not None:
            self._remove_kept(evicted)

    def _unkeep(self, task_key: str) -> None:
        with self._kept_lock:
            self._kept_tasks.pop(task_key, None)

    def _remove_kept(self, task_key: str) -> None:
        """remove_task for a kept directory, quietly: a close or an eviction must not fail its caller
        (a directory left behind is an empty task, which reap removes)."""
        try:
            self._remove_task_now(task_key, force=False)
        except (OSError, CgturnError) as err:
            log.warning("cannot remove the empty task directory %r: %s", task_key, err)

    def views(self, task_key=None, detail=False) -> list[TurnView]:
        """One pass over the tree (see cgroup2_views), with every turn's usage, pressure and frozen
        state when `detail`. A turn without v2 memory.current but with a v1 memory directory (a hybrid
        host, a turn with limits) gets its v1 memory.usage_in_bytes: what the kernel charges it, page
        cache included, as memory.current would be (ps, the memory guard)."""
        out = cgroup2_views.views(self.root, self.meta, task_key, self._listed_usage if detail else None)
        for view in out:
            if view.memory_bytes is None and view.record.v1_dirs:
                view.memory_bytes = self.layout.v1_memory_bytes(view.record.task_key, view.record.turn_key)
        return out

    def _listed_usage(self, record: TurnRecord, name: str, task_fd: int, cpu_stat: str) -> Usage:
        """turn_usage in a listing's pass: the turn `name` of the open task directory `task_fd`, whose
        cpu.stat the listing read (cgroup2_views)."""
        return self.layout.usage(name, record.task_key, record.turn_key, v1=record.v1_dirs, dir_fd=task_fd,
                                 cpu_stat=cpu_stat)

    # A turn has v1 directories only when its record says so (`v1_dirs`, set under its lock when they
    # are made): a turn without limits opens no v1 file.
    def turn_usage(self, record) -> Usage:
        return self.layout.usage(self._cg(record).path, record.task_key, record.turn_key, v1=record.v1_dirs)

    def turn_frozen(self, record) -> bool:
        return self._cg(record).events().get("frozen", 0) == 1

    # --- killing: the killer's, on the turn's cgroup ---------------------------------------------------

    def signal_members(self, record, sig) -> list[int]:
        cg = self._cg(record)
        try:
            return self.killer.signal(cg, sig, spare_inits=record.sealed)
        finally:
            self._pay_stamp(cg)  # an abandon's mark (stamp_later): listings learn of it now

    def kill_members(self, record, checked=None) -> list[int]:
        cg = self._cg(record)
        try:
            return self.killer.kill(cg, checked)
        finally:
            self._pay_stamp(cg)

    def freeze_members(self, record, frozen: bool) -> list[int]:
        try:
            return self.killer.freeze(self._cg(record), frozen)
        except FileNotFoundError:
            raise NoSuchTurn(f"turn {record.turn_id!r} of task {record.task_id!r} no longer exists") from None

    def kill_where(self, record, doomed) -> list[int]:
        return self.killer.kill_where(self._cg(record), doomed)

    def strays(self) -> list[tuple[str, int]]:
        return self.killer.strays()

    def kill_stray(self, where: str, pid: int) -> bool:
        return self.killer.kill_stray(where, pid)
