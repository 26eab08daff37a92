"""The interface every backend implements, and the spawn preparation they share.

A backend knows how to own processes (create a turn, put processes in it, enumerate and kill them,
store the turn's record). It knows nothing of timeouts, supervision or the CLI; the ownership layer
(`cgturn.manager`) composes these primitives into begin/spawn/complete/abandon.
"""
from __future__ import annotations

import abc
import errno
import os
from typing import TYPE_CHECKING, Callable, Iterable

from ..model import Argv, TurnRecord, TurnView
from .spawn_options import REFUSED_OPTIONS

if TYPE_CHECKING:
    import subprocess

    from ..identity import Identity
    from ..limits import Limits, Usage
    from .capabilities import Limiter

ENV_TASK = "CGTURN_TASK"
ENV_TURN = "CGTURN_TURN"
# Which manager (managed root or registry database) a process belongs to, so that two managers on one
# host with the same task and turn names never take each other's processes. Its value is opaque.
ENV_SCOPE = "CGTURN_SCOPE"

# Popen would drop privileges before the process joins its turn (only a privileged process may write
# cgroup.procs there): the backends drop them after the join instead (isolation.py).
IDENTITY_KWARGS = ("user", "group", "extra_groups")

Member = tuple[int, int]  # (pid, start time in clock ticks since boot)


class Backend(abc.ABC):
    """One way of owning processes: what every backend does. Methods take turn records; they never
    decide policy. Optional capabilities are objects (`capabilities.py`), None where absent."""

    name: str = "?"
    # Limits and figures (cgroups only); None on a backend that cannot enforce limits.
    limiter: "Limiter | None"

    @property
    @abc.abstractmethod
    def scope(self) -> str:
        """An opaque string naming this manager's territory (root path or database path)."""

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """What to show users as where turns live (managed root, or the registry database)."""

    @abc.abstractmethod
    def env_for(self, record: TurnRecord) -> dict[str, str]:
        """The environment that ties a process (and what it leaves behind) to its turn."""

    @abc.abstractmethod
    def ensure_root(self) -> bool:
        """Create where turns live, if that is a thing to create; True if this call created it."""

    @abc.abstractmethod
    def remove_root(self) -> bool:
        """Remove where turns live once no turn is left; True when it is gone (or nothing to remove)."""

    # --- records and state ------------------------------------------------------------------------

    @abc.abstractmethod
    def create_turn(self, record: TurnRecord, limits: "Limits | None" = None) -> None:
        """Create the turn with `limits` and store `record`. Raises TurnExists if the turn id is
        taken, LimitsUnavailable (nothing created) if a limit cannot be enforced.

        A completed turn with no processes left is not 'taken': it is removed and replaced.
        """

    @abc.abstractmethod
    def load(self, task_key: str, turn_key: str) -> TurnRecord | None:
        """The stored record of a turn, or None when the turn does not exist."""

    @abc.abstractmethod
    def records(self, task_key: str | None = None) -> list[TurnRecord]:
        """Records of every existing turn (of one task when given)."""

    @abc.abstractmethod
    def transition(self, task_key: str, turn_key: str, allowed_from: Iterable[str], to_state: str,
                   updates: dict, when=None, stamp_later: bool = False) -> tuple[bool, TurnRecord | None]:
        """Atomically move a turn from one of `allowed_from` to `to_state`, across processes.

        `updates` are further TurnRecord fields set in the same step (ended_at, reason, killer_*);
        `when(record)`, if given, must also hold under the lock (a compare-and-set). `stamp_later`:
        the caller's next call on the turn follows at once and is `remove` (a completion) or
        `signal_members`/`kill_members` (an abandon), so whatever tells other processes' listings of
        the change may wait for it: until the first signal is sent, or, at a removal, only if the
        turn stays.

        Returns (won, record after the call). `won` is False when the turn was in another state
        (the first transition wins) or does not exist (record None).
        """

    @abc.abstractmethod
    def task_lock(self, task_key: str):
        """A context manager holding the task's lock, exclusive across processes and threads (what
        makes a keyed spawn's check and spawn one step, cgturn.keys)."""

    # --- membership -------------------------------------------------------------------------------

    @abc.abstractmethod
    def spawn(self, record: TurnRecord, argv: Argv, popen_kwargs: dict) -> subprocess.Popen:
        """Start a process that is inside the turn before it runs the target program."""

    @abc.abstractmethod
    def adopt(self, record: TurnRecord, pid: int) -> None:
        """Make an existing process (and what it starts from now on) part of the turn."""

    @abc.abstractmethod
    def members(self, record: TurnRecord) -> list[Member]:
        """Live processes the turn owns."""

    @abc.abstractmethod
    def contains_caller(self, record: TurnRecord) -> bool:
        """True if the calling process is one of the turn's processes (killing it is refused)."""

    @abc.abstractmethod
    def checked_members_at(self, task_key: str, turn_key: str) -> list[int] | None:
        """The members of the turn at these encoded names, read to answer `contains_caller` without
        its record: their pids when none is the caller, one of its ancestors or PID 1 ([] for a turn
        that is gone); None when this backend needs the record to answer, or a protected process is
        among them (the record then names the turn in the refusal). An abandon that gets a list marks
        the turn without reading its record first (the mark reads it under the lock anyway), and its
        first kill, which follows at once, takes the list as its check (`kill_members`' `checked`)."""

    @abc.abstractmethod
    def turn_of(self, pid: int) -> tuple[str, str] | None:
        """(scope, task_key) of the cgturn turn process `pid` belongs to, as far as this backend can
        tell (its own turns, and another manager's by its marks); None when it is in none."""

    @abc.abstractmethod
    def enter(self, record: TurnRecord) -> None:
        """Make the calling process part of the turn (what it starts from now on belongs to it)."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Undo `enter`: the calling process goes back to where it was before its first enter."""

    # --- killing ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def signal_members(self, record: TurnRecord, sig: int) -> list[int]:
        """Send `sig` to every member; returns the pids reached. In a sealed turn each PID
        namespace's init is reached through its target (it forwards what it gets), not signalled."""

    @abc.abstractmethod
    def kill_members(self, record: TurnRecord, checked: list[int] | None = None) -> list[int]:
        """SIGKILL every member, as race-free against forks as the backend can; pids hit. `checked`:
        the members as `checked_members_at` read them just before (an abandon's first kill, its mark
        in between), taken as the refusal's check and the pids hit instead of reading them again;
        a backend that signals member by member reads them all the same."""

    @abc.abstractmethod
    def freeze_members(self, record: TurnRecord, frozen: bool) -> list[int]:
        """Freeze (or thaw) every member: cgroup.freeze on cgroup v2, SIGSTOP/SIGCONT on the
        registry (never a protected process). Returns the pids it reached."""

    @abc.abstractmethod
    def kill_where(self, record: TurnRecord, doomed: Callable[[int, int], bool]) -> list[int]:
        """Hold the turn still (freeze/SIGSTOP), SIGKILL members with doomed(pid, start), resume."""

    @abc.abstractmethod
    def wait_empty(self, record: TurnRecord, timeout: float, signalled_at: float | None = None) -> bool:
        """Wait, event-driven, until the turn has no live process; True if it got there in time.
        `signalled_at`: the monotonic time its processes were sent the signal the wait is for (a
        cgroup waits busily only at first after it: cgroupfs.Cgroup.wait_events' `spin_from`)."""

    @abc.abstractmethod
    def remove(self, record: TurnRecord) -> bool:
        """Forget an empty turn (rmdir its cgroup / drop its rows). False, at once, while it still has
        processes (what a completion with survivors finds: no wait for them)."""

    @abc.abstractmethod
    def remove_task(self, task_key: str, force: bool = False) -> bool:
        """Forget a task that has no turns left. False if it still has some, or has limits of its
        own and not `force` (a task budget holds between turns until end_task)."""

    @abc.abstractmethod
    def task_keys(self) -> list[str]:
        """Keys of every task known here, with or without turns (reap removes the empty ones)."""

    @abc.abstractmethod
    def strays(self) -> list[tuple[str, int]]:
        """(where, pid) of processes inside the managed territory but in no turn."""

    @abc.abstractmethod
    def kill_stray(self, where: str, pid: int) -> bool:
        """SIGKILL a stray found by `strays` if it is still there; True if it was signalled."""

    # --- observation --------------------------------------------------------------------------------

    @abc.abstractmethod
    def turn_usage(self, record: TurnRecord) -> "Usage":
        """What the turn used, and which limits the kernel enforced on it."""

    @abc.abstractmethod
    def turn_frozen(self, record: TurnRecord) -> bool:
        """True while the kernel holds the turn frozen (cgroup.freeze); the record's `frozen_by`
        says who asked for a freeze."""

    @abc.abstractmethod
    def cgroup_dir(self, record: TurnRecord) -> str | None:
        """The turn's cgroup directory, where the backend has one (observability: ports, cpu)."""

    @abc.abstractmethod
    def views(self, task_key: str | None = None, detail: bool = False) -> list[TurnView]:
        """Every existing turn (of one task) with its live pids and usage: what `ps` lists. `detail`:
        the backend may read each turn's usage, pressure and frozen state in the same pass (a view
        leaves what it did not read None)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources (threads, database connections, fds)."""


def turn_environment(record: TurnRecord, scope: str) -> dict[str, str]:
    """The CGTURN_* entries that tie a process of `record`'s turn to it and to the manager `scope`."""
    return {ENV_TASK: record.task_key, ENV_TURN: record.turn_key, ENV_SCOPE: scope}


def scope_tag(env: dict[str, str] | None) -> tuple[str, str] | None:
    """(scope, task_key) a process environment names, whatever its scope; None without one."""
    if not env or not env.get(ENV_SCOPE) or not env.get(ENV_TASK):
        return None
    return env[ENV_SCOPE], env[ENV_TASK]


def turn_tag(env: dict[str, str] | None, scope: str) -> tuple[str, str] | None:
    """(task_key, turn_key) from a process environment carrying this scope, else None."""
    if not env or env.get(ENV_SCOPE) != scope:
        return None
    task, turn = env.get(ENV_TASK), env.get(ENV_TURN)
    return (task, turn) if task and turn else None


# --- spawn preparation shared by both backends ----------------------------------------------------

def prepare_spawn(argv, popen_kwargs: dict) -> tuple[list[str], str, dict, "Identity | None"]:
    """Normalise a spawn request and resolve its program; the environment is left to the backend.

    Resolving in the parent keeps Popen's behaviour for a missing or non-executable program
    (FileNotFoundError / PermissionError raised by spawn) even though a shim may run first.

    Returns (argv as a list of str, the program's resolved path, Popen kwargs, the identity
    `user=`/`group=`/`extra_groups=` ask for or None). Raises ValueError for an unknown user or group.
    """
    kwargs = dict(popen_kwargs)
    asked = [kwargs.pop(name, None) for name in IDENTITY_KWARGS]
    identity = None
    if asked != [None] * len(IDENTITY_KWARGS):  # the user database, only for a spawn that names someone
        from ..identity import resolve_identity

        identity = resolve_identity(*asked)
    argv, kwargs = normalize_spawn(argv, kwargs)
    env = kwargs.get("env")
    path = os.environ.get("PATH", os.defpath) if env is None else env.get("PATH", env.get(b"PATH", os.defpath))
    program = resolve_program(argv[0], os.fsdecode(path), kwargs.get("cwd"))
    return argv, program, kwargs, identity


def normalize_spawn(argv, popen_kwargs: dict) -> tuple[list[str], dict]:
    """A spawn request as (argv as a list of str, Popen kwargs): refused options raise ValueError,
    shell=True becomes /bin/sh -c. The program is not resolved (a native spawn resolves it in the
    child, along PATH, as Popen does)."""
    if not popen_kwargs and type(argv) is list and argv and all(type(a) is str for a in argv):
        return list(argv), {}  # the usual request: nothing to refuse or convert
    kwargs = dict(popen_kwargs)
    for name, instead in REFUSED_OPTIONS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"Turn.spawn does not support {name}=; {instead}")
        kwargs.pop(name, None)
    if kwargs.pop("shell", False):  # as Popen does on POSIX: the rest become the shell's $0, $1, ...
        argv = ["/bin/sh", "-c", os.fsdecode(argv)] if isinstance(argv, (str, bytes)) else \
            ["/bin/sh", "-c", *map(os.fsdecode, argv)]
    elif isinstance(argv, (str, bytes, os.PathLike)):
        argv = [os.fsdecode(argv)]
    else:
        argv = [os.fsdecode(a) for a in argv]
    if not argv:
        raise ValueError("Turn.spawn needs a non-empty argv")
    return argv, kwargs


def with_environment(kwargs: dict, additions: dict[str, str]) -> dict:
    """Popen kwargs whose `env` is the given (or inherited) environment plus `additions`."""
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    env.update(additions)
    return {**kwargs, "env": env}


def resolve_program(program: str, path: str, cwd=None) -> str:
    """The executable `program` names, as execvp would find it; raise as Popen would when it cannot."""
    if "/" in program:
        candidate = program if os.path.isabs(program) or cwd is None else os.path.join(os.fsdecode(cwd), program)
        if not os.path.exists(candidate):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        if os.path.isdir(candidate) or not os.access(candidate, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
        return candidate
    # shutil.which's own test, without importing shutil (and the compressors it imports) at every
    # `cgturn run`: the first entry of `path` holding an executable file of that name.
    for directory in dict.fromkeys(path.split(os.pathsep)):
        candidate = os.path.join(directory, program)
        if os.path.exists(candidate) and os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
