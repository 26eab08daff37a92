"""Limits for the cgroup v2 backend: where each controller is for a managed root, the v1 directories of
a hybrid host, and limits and usage at the three levels (turn, task, managed root).

The places are decided once, when the managed root is made, from what the host offers *without
writing anything outside cgturn's own cgroups*: a controller is v2 when the managed root's parent
delegates it (its `cgroup.subtree_control`; cgturn never writes that file of a cgroup it did not
create), else v1 when a v1 hierarchy has it (a hybrid host), at the same place relative to the
creating process's own cgroup there. They are recorded on the managed root (`user.cgturn.layout`) and
every process (reap, the CLI) uses the record, not its own view of the host.

On v1, a turn gets directories in the v1 hierarchies only when a limit applies to it (its own, its
task's or the root's): a turn without limits pays nothing. Its processes join them before the target
runs, as they join the turn's cgroup2 directory (spawn's gate), and they are removed with the turn.
"""
from __future__ import annotations

import errno
import json
import logging
import os

from ..errors import KernelError, LimitsUnavailable
from ..kernel import controllers, parsers, procfs
from ..kernel.cgroupfs import CONTROLLERS_FILE, Cgroup, read_text
from ..kernel.controllers import V1, V2, Place
from ..limits import NO_LIMITS, Limits, Usage

log = logging.getLogger("cgturn")

LAYOUT_KEY = "user.cgturn.layout"   # on the managed root: where each controller is
LIMITS_KEY = "user.cgturn.limits"   # on the managed root and on task directories: their own limits
SUBTREE_CONTROL = "cgroup.subtree_control"


class Layout:
    """The controllers of one managed root. `root` is its cgroup2 directory; `own_v2` the creating
    process's own cgroup2 directory (the v1 places mirror the root's position below it)."""

    def __init__(self, root: Cgroup, own_v2: str | None):
        self.root = root
        self.own_v2 = own_v2
        self._places: dict[str, Place] | None = None
        self._problems: list[str] = []

    # --- where the controllers are ------------------------------------------------------------------

    def places(self) -> dict[str, Place]:
        """The recorded places; before the root exists, what they would be (nothing is written)."""
        if self._places is None:
            recorded = self._recorded()
            if recorded is not None:
                self._places = recorded
            else:
                return self._decide()[0]
        return self._places

    def problems(self) -> list[str]:
        """Why any of memory, pids, cpu cannot be had for this managed root."""
        have = self.places()
        return [p for p in self._decide()[1] if p.split(":", 1)[0] not in have]

    def report(self) -> dict:
        """`{layout, available, problems, unsupported}` (what `cgturn doctor` shows); `unsupported`
        maps each limit field this layout cannot set to why (`cgturn limits` shows it)."""
        places = self.places()
        return {"layout": controllers.layout_name(places), "available": sorted(places),
                "problems": self.problems(), "unsupported": unsupported_fields(places)}

    def record(self) -> None:
        """Record the places on the managed root (just made, or made by an older cgturn) and enable
        the v2 controllers in its subtree (a cgroup cgturn created). The first writer wins."""
        if self._recorded() is not None:
            self._places = self._recorded()
            return
        places, _ = self._decide()
        try:
            self.root.set_xattr(LAYOUT_KEY, _layout_json(places), create=True)
        except FileExistsError:
            places = self._recorded() or places
        except OSError as err:
            log.warning("cannot record the controller layout on %s (%s); limits unavailable", self.root.path,
                        os.strerror(err.errno or 0))
            places = {}
        enabled = self._enable_v2(self.root, places)
        if enabled != places:  # the parent took a controller back meanwhile: record what the root has
            try:
                self.root.set_xattr(LAYOUT_KEY, _layout_json(enabled))
            except OSError as err:
                log.warning("cannot record the controller layout on %s (%s)", self.root.path,
                            os.strerror(err.errno or 0))
        self._places = enabled

    def _recorded(self) -> dict[str, Place] | None:
        raw = self.root.get_xattr(LAYOUT_KEY) if os.path.isdir(self.root.path) else None
        if raw is None:
            return None
        try:
            return {name: Place.from_json(value) for name, value in json.loads(raw).items()
                    if name in controllers.CONTROLLERS}
        except (ValueError, AttributeError, TypeError):
            log.warning("unreadable controller layout on %s: limits unavailable", self.root.path)
            return {}

    def _decide(self) -> tuple[dict[str, Place], list[str]]:
        parent = os.path.dirname(self.root.path)
        try:
            delegated = parsers.parse_controllers(read_text(f"{parent}/{SUBTREE_CONTROL}"))
        except OSError:
            delegated = []
        try:
            mounts = controllers.v1_mounts(procfs.DEFAULT.read("self", "mountinfo").decode("utf-8", "replace"))
            own_v1 = parsers.parse_proc_cgroup_v1(procfs.DEFAULT.read("self", "cgroup").decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 - no v1 view at all is an answer: no v1 places
            mounts, own_v1 = {}, {}
        if self.own_v2 is not None and (self.root.path + "/").startswith(self.own_v2.rstrip("/") + "/"):
            relative = os.path.relpath(self.root.path, self.own_v2)
        else:
            relative = os.path.basename(self.root.path)
        return controllers.decide_places(delegated, mounts, own_v1, relative)

    def enable_v2(self, cg: Cgroup) -> None:
        """Enable the v2 controllers in the subtree of `cg` (the managed root or a task directory,
        both made by cgturn). EBUSY means processes sit in `cg` (the no-internal-processes rule)."""
        self._enable_v2(cg, self.places())

    def _enable_v2(self, cg: Cgroup, places: dict[str, Place]) -> dict[str, Place]:
        """enable_v2 with `places`; returns them less the v2 controllers `cg`'s parent no longer offers.

        A controller the layout counted on may have left the parent since it was read (ENOENT: the
        kernel refuses the whole write). systemd takes a controller off a cgroup's subtree_control
        when no unit of its own needs it any more, and a managed root outside a delegated unit sees
        it go (the test host's `+memory +pids +cpu` failed so while a user logged out). The root then
        enables and records what is left, and the log names the rest, whose limits are refused. Once
        enabled on the root, a controller stays: the kernel refuses to take it off the parent.
        """
        wanted = [name for name, place in places.items() if place.version == V2]
        if not wanted:
            return places
        try:
            cg.write(SUBTREE_CONTROL, " ".join(f"+{name}" for name in wanted))
            return places
        except FileNotFoundError:
            return places
        except KernelError as err:
            if err.errno != errno.ENOENT:
                raise
        try:
            offered = parsers.parse_controllers(cg.read(CONTROLLERS_FILE))
        except FileNotFoundError:
            return places
        left = [name for name in wanted if name in offered]
        if left:
            cg.write(SUBTREE_CONTROL, " ".join(f"+{name}" for name in left))
        log.warning("controllers %s are no longer delegated to %s (its parent's cgroup.subtree_control changed): "
                    "limits on them are unavailable", ", ".join(name for name in wanted if name not in left), cg.path)
        return {name: place for name, place in places.items() if place.version != V2 or name in left}

    # --- v1 directories -------------------------------------------------------------------------------

    def v1_dirs(self, *names: str) -> dict[str, str]:
        """controller -> the v1 directory of the managed root (no names), a task, or a turn."""
        suffix = "".join("/" + name for name in names)  # on every turn's path: no os.path.join
        return {name: f"{place.path}{suffix}" for name, place in self.places().items() if place.version == V1}

    def make_v1_dirs(self, *names: str) -> None:
        """Make the v1 directories of the root, and of the task and turn named, as needed."""
        for path in self.v1_dirs(*names).values():
            # Every component below the caller's own v1 cgroup is cgturn's: the root's mirror, the
            # task's, the turn's. The caller's own cgroup itself exists. Usually only the last one is
            # missing: try it first, walk up only when its parent is missing too.
            missing = []
            while True:
                try:
                    Cgroup(path).make()
                    break
                except FileExistsError:
                    break
                except FileNotFoundError:
                    missing.append(path)
                    path = os.path.dirname(path)
            for directory in reversed(missing):
                Cgroup(directory).create()

    def remove_v1_dirs(self, *names: str) -> bool:
        """Remove the v1 directories of a turn, task or (no names) the root; True when all are gone.

        For the root, the directories `make_v1_dirs` made between it and the caller's own v1 cgroup
        go too, once empty (another managed root below them keeps them)."""
        ok = True
        for controller, path in self.v1_dirs(*names).items():
            cg = Cgroup(path)
            # A v1 directory has children only if a turn process made some: one rmdir first.
            ok = (cg.remove_if_empty() or cg.remove_tree(timeout=2.0)) and ok
            base = self.places()[controller].base
            if names or not ok or base is None:
                continue
            parent = os.path.dirname(path)
            while parent.startswith(base.rstrip("/") + "/") and Cgroup(parent).remove_if_empty():
                parent = os.path.dirname(parent)
        return ok

    def own_v1_dirs(self) -> dict[str, str]:
        """controller -> the caller's current v1 cgroup directory, for the v1 places."""
        mine = parsers.parse_proc_cgroup_v1(procfs.DEFAULT.read("self", "cgroup").decode("utf-8", "replace"))
        mounts = controllers.v1_mounts(procfs.DEFAULT.read("self", "mountinfo").decode("utf-8", "replace"))
        return {name: os.path.normpath(os.path.join(mounts[name], mine[name].lstrip("/")))
                for name, place in self.places().items() if place.version == V1 and name in mine and name in mounts}

    def join_v1(self, pid: int, *names: str) -> None:
        """Move `pid` into the v1 directories of the turn named (FileNotFoundError if one is gone)."""
        for path in self.v1_dirs(*names).values():
            Cgroup(path).move_in(pid)

    # --- limits --------------------------------------------------------------------------------------

    def check(self, limits: Limits) -> list[tuple[str, str, str]]:
        """The files `limits` needs here; raises LimitsUnavailable before anything is touched."""
        if limits.is_empty():  # most turns: nothing to look up
            return []
        return controllers.limit_files(limits, self.places())

    def apply(self, limits: Limits, v2_dir: str, *names: str) -> None:
        """Write `limits` to the v2 directory `v2_dir` and/or the v1 directories named."""
        v1 = self.v1_dirs(*names)
        for controller, name, value in self.check(limits):
            place = self.places()[controller]
            directory = v2_dir if place.version == V2 else v1[controller]
            try:
                Cgroup(directory).write(name, value)
            except FileNotFoundError as err:
                raise LimitsUnavailable(f"{directory}/{name} does not exist: this kernel cannot set it") from err

    def default_limits(self) -> Limits:
        """What every turn gets on this layout without asking: on v2, a memory OOM kills the whole
        turn (memory.oom.group), not one arbitrary process."""
        memory = self.places().get("memory")
        return Limits(oom_group=True) if memory is not None and memory.version == V2 else NO_LIMITS

    def uses_v1(self, limits: Limits) -> bool:
        """True if setting `limits` needs v1 directories."""
        if limits is NO_LIMITS:  # what an absent budget reads as: twice per begin_turn
            return False
        places = self.places()
        return any(places[c].version == V1 for c in controllers.needed_controllers(limits) if c in places)

    @staticmethod
    def stored_limits(cg: Cgroup) -> Limits:
        """The limits recorded on the managed root or a task directory (empty when none)."""
        raw = cg.get_xattr(LIMITS_KEY)  # None when the directory or the record is absent
        if raw is None:
            return NO_LIMITS
        try:
            return Limits.from_json(json.loads(raw))
        except (ValueError, TypeError, AttributeError):
            log.warning("unreadable limits record on %s: ignored", cg.path)
            return NO_LIMITS

    @staticmethod
    def store_limits(cg: Cgroup, limits: Limits) -> None:
        cg.set_xattr(LIMITS_KEY, json.dumps(limits.to_stored()).encode())

    def v1_memory_bytes(self, *names: str) -> int | None:
        """memory.usage_in_bytes of the v1 memory directory of the turn named (None: memory is not in
        v1 here, or the directory is gone). Page cache counts, as it does in v2's memory.current."""
        path = self.v1_dirs(*names).get("memory")
        return None if path is None else controllers.read_int(f"{path}/memory.usage_in_bytes")

    def usage(self, v2_dir: str, *names: str, figures: bool = True, v1: bool = True, dir_fd: int | None = None,
              cpu_stat: str | None = None) -> Usage:
        """What the cgroup at `v2_dir` (with the v1 directories named, where it has them; none with
        `v1=False`) used (`figures=False`: only the limit counters; `dir_fd`, `cpu_stat`: a listing's
        open task directory and the cpu.stat it read; see controllers.read_usage)."""
        return controllers.read_usage(v2_dir, self.places(), self.v1_dirs(*names) if v1 else {}, figures,
                                      dir_fd=dir_fd, cpu_stat=cpu_stat)


# One value per limit field, to ask the layout's own rules (controllers.limit_files) whether the field can
# be set at all: swap_max is asked with memory_max, which it needs on v1.
_PROBES = {"memory_max": Limits(memory_max=2 ** 30), "memory_high": Limits(memory_high=2 ** 30),
           "swap_max": Limits(memory_max=2 ** 30, swap_max=0), "pids_max": Limits(pids_max=100),
           "cpus": Limits(cpus=1.0), "cpu_weight": Limits(cpu_weight=100), "oom_group": Limits(oom_group=True)}


def _layout_json(places: dict[str, Place]) -> bytes:
    """The managed root's recorded layout (LAYOUT_KEY): controller -> its place."""
    return json.dumps({name: place.to_json() for name, place in places.items()}).encode()


def unsupported_fields(places: dict[str, Place]) -> dict[str, str]:
    """{limit field: why it cannot be set} for the fields the controllers at `places` cannot take."""
    out = {}
    for name, probe in _PROBES.items():
        try:
            controllers.limit_files(probe, places)
        except LimitsUnavailable as err:
            out[name] = str(err)
    return out
