# The C extension (cgturn/_spawn.c): clone3(CLONE_INTO_CGROUP) and exec, as Popen's _fork_exec.
import os
from typing import Sequence

def spawn(args: Sequence[str | bytes | os.PathLike[str] | os.PathLike[bytes]], executable_list: tuple[bytes, ...], close_fds: bool, keep: tuple[int, ...],
          cwd: bytes | None, env: list[bytes] | None, extra_env: Sequence[bytes], p2cread: int, p2cwrite: int,
          c2pread: int, c2pwrite: int, errread: int, errwrite: int, restore_signals: bool,
          start_new_session: bool, process_group: int, umask: int, cgroup: int | tuple[str, bytes, bytes],
          join_fds: Sequence[int], seal: tuple[object, ...] | None = None, /) -> int | tuple[int, bytes] | None: ...
