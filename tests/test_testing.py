"""cgturn.testing: what tests and benches use instead of reaching into the backends (the forced spawn
path, the guard's state, v1 directories)."""
import logging

import pytest

from cgturn import testing
from cgturn.backends import spawn_paths


def taken_path(caplog, turn) -> str:
    """The spawn path cgroup2 logged for one spawn of `turn`."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="cgturn"):
        assert turn.spawn(["true"]).wait(30) == 0
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("spawn path")]
    return line.split(": ")[1].split(" ")[0]


def test_a_forced_spawn_path_is_taken_and_the_flags_come_back(cgroup2_manager, caplog):
    before = (spawn_paths.can_clone3, spawn_paths.can_posix_spawn)
    turn = cgroup2_manager.begin_turn("task", "turn")
    with testing.forced_spawn_path(testing.SHIM):
        assert taken_path(caplog, turn) == testing.SHIM
    assert (spawn_paths.can_clone3, spawn_paths.can_posix_spawn) == before
    native = testing.spawn_paths_available()[0]
    assert taken_path(caplog, turn) == native
    with pytest.raises(RuntimeError), testing.forced_spawn_path(testing.SHIM):
        raise RuntimeError("the block failed")  # the flags come back all the same
    assert (spawn_paths.can_clone3, spawn_paths.can_posix_spawn) == before
    turn.complete()


def test_forcing_a_path_this_host_lacks_or_none_at_all_is_refused():
    with pytest.raises(ValueError, match="no spawn path"):
        testing.spawn_path_unavailable("vfork")
    lacking = [p for p in (testing.CLONE3, testing.POSIX_SPAWN) if testing.spawn_path_unavailable(p)]
    for path in lacking:
        with pytest.raises(ValueError, match="cannot force"), testing.forced_spawn_path(path):
            pass
    assert testing.spawn_path_unavailable(testing.SHIM) is None
    assert testing.spawn_paths_available()[-1] == testing.SHIM


def test_guard_state_and_v1_dirs_without_a_guard_or_v1(manager):
    assert testing.guard_live(manager) is None and testing.guard_pressing(manager) is None
    turn = manager.begin_turn("task", "turn")
    dirs = testing.v1_dirs(manager, turn)
    assert all(path.endswith(f"/{turn.record.task_key}/{turn.record.turn_key}") for path in dirs.values())
    turn.complete()
