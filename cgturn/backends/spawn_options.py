"""The one table of spawn options: which Popen keyword arguments each cgroup v2 spawn path honours,
and the value object that says where a spawn goes.

Paths, preferred first (spawn_paths.py chooses, per request, the first that honours every option):
- "clone3": the C extension clones straight into the turn's cgroup (kernel/spawn.py);
- "posix_spawn": glibc 2.39+'s posix_spawnattr_setcgroup_np (kernel/posix_spawn.py);
- "shim": the gated /bin/sh shim (shim.py), which honours every option cgturn accepts.

An option given at its Popen default is not a request (`umask=-1` does not need the shim). A keyword
Python adds to Popen later is in no row of the table until someone classifies it: tests/test_native_spawn.py
compares the table with `subprocess.Popen.__init__`'s signature, so a new keyword fails that test
rather than silently sending every spawn that uses it down the slower shim. posix_spawn may still
hand a request back at run time for what only shows once Popen has arranged it (a standard stream
given as another standard fd, a program looked up along another PATH; kernel/posix_spawn.py).
"""
from __future__ import annotations

import dataclasses

CLONE3, POSIX_SPAWN, SHIM = "clone3", "posix_spawn", "shim"
PATHS = (CLONE3, POSIX_SPAWN, SHIM)

_EVERY_PATH = frozenset(PATHS)
_NOT_POSIX_SPAWN = frozenset({CLONE3, SHIM})
_SHIM_ONLY = frozenset({SHIM})
_REFUSED: frozenset[str] = frozenset()  # no path: Turn.spawn raises ValueError (see REFUSED_OPTIONS)

# Popen keyword -> (the paths that honour it, its Popen default). `args` is the argv, not an option.
SPAWN_OPTIONS: dict[str, tuple[frozenset[str], object]] = {
    "bufsize": (_EVERY_PATH, -1),
    "stdin": (_EVERY_PATH, None),
    "stdout": (_EVERY_PATH, None),
    "stderr": (_EVERY_PATH, None),
    "close_fds": (_EVERY_PATH, True),
    "shell": (_EVERY_PATH, False),  # normalised to /bin/sh -c before any path sees it
    "cwd": (_EVERY_PATH, None),
    "env": (_EVERY_PATH, None),
    "universal_newlines": (_EVERY_PATH, None),
    "text": (_EVERY_PATH, None),
    "encoding": (_EVERY_PATH, None),
    "errors": (_EVERY_PATH, None),
    "restore_signals": (_EVERY_PATH, True),
    "start_new_session": (_EVERY_PATH, False),
    "process_group": (_EVERY_PATH, None),
    # posix_spawn has no file-creation mask attribute, and closes what it is not told to keep.
    "umask": (_NOT_POSIX_SPAWN, -1),
    "pass_fds": (_NOT_POSIX_SPAWN, ()),
    # Python code between fork and exec forces fork instead of vfork and is unsafe with threads.
    "preexec_fn": (_SHIM_ONLY, None),
    # Privileges are dropped after the join (only a privileged process may write cgroup.procs
    # there): by setpriv(1) in the shim's chain (isolation.py).
    "user": (_SHIM_ONLY, None),
    "group": (_SHIM_ONLY, None),
    "extra_groups": (_SHIM_ONLY, None),
    # F_SETPIPE_SZ on the pipes Popen makes: only Popen itself does it.
    "pipesize": (_SHIM_ONLY, -1),
    # Windows only: Popen itself refuses other values on POSIX, so the shim passes them to it.
    "startupinfo": (_SHIM_ONLY, None),
    "creationflags": (_SHIM_ONLY, 0),
    "executable": (_REFUSED, None),
}

# Options no path honours without weakening ownership, and what to do instead.
REFUSED_OPTIONS = {
    "executable": "put the program in argv[0]",
}


def options_refused_by(path: str, popen_kwargs: dict) -> list[str]:
    """The options of a request (given, and not at their Popen default) that `path` cannot honour,
    sorted; an option the table does not know counts as one only the shim honours."""
    out = []
    for name, value in popen_kwargs.items():
        honoured, default = SPAWN_OPTIONS.get(name, (_SHIM_ONLY, None))
        if path in honoured or value is None or value is default:
            continue
        if value == default or (default == () and not value):  # pass_fds=[] asks for no fd either
            continue
        out.append(name)
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class SpawnTarget:
    """Where a spawn into one turn goes, fixed for the turn's life (kept per turn by the backend).

    Attributes:
        cgroup_dir: the turn's cgroup v2 directory.
        v1_procs: the cgroup.procs files of its v1 directories (empty without v1 limits).
        environment: the CGTURN_* entries of the turn's processes.
        environment_entries: the same as KEY=VALUE bytes, as the native paths add them.
    """

    cgroup_dir: str
    v1_procs: list[str]
    environment: dict[str, str]
    environment_entries: tuple[bytes, ...]
