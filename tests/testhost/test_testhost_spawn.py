"""The posix_spawn path (glibc 2.39+ posix_spawnattr_setcgroup_np) for real: the test host has glibc
2.41 (and the host's built C extension, which run.py copies in); the development machine has glibc
2.36. The path is forced with the capability flags (as trio does): the extension's path off, the C
library's on; then the Popen
behaviour tests of tests/test_native_spawn.py run on it: the target reads /proc/self/cgroup as its
first act, pipes both ways, cwd, env, exec failures and their filenames, sessions, signal state,
spawns racing abandons.

(`scripts/testhost/run.py -- tests/testhost tests/test_native_spawn.py` also runs that whole module
there, on every path the host has.)
"""
from __future__ import annotations

import pytest

from cgturn.backends import spawn_paths
from cgturn.host import doctor_report
from cgturn.kernel import posix_spawn
from conftest import force_spawn_path
from hostlib import systemd_host  # noqa: F401
from test_native_spawn import (  # noqa: F401 - collected here, on the forced path
    test_argv_items_as_popen_takes_them, test_cwd_env_umask, test_exec_failures_raise_as_popen, test_exit_codes_and_signals,
    test_first_act_is_in_the_turn_with_popen_attributes, test_inherited_environment_follows_os_environ,
    test_pipes_both_ways, test_posix_spawn_hands_over_what_it_cannot_honour, test_session_and_process_group,
    test_signal_state_is_reset_in_the_child, test_spawns_racing_abandons_never_outlive_the_mark,
    test_streams_given_every_way)

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host")]


@pytest.fixture
def path(monkeypatch):
    assert posix_spawn.available(), "glibc on the test host has posix_spawnattr_setcgroup_np (2.39+)"
    force_spawn_path(monkeypatch, spawn_paths.POSIX_SPAWN)
    return spawn_paths.POSIX_SPAWN


@pytest.fixture
def turn(cgroup2_manager, path):
    return cgroup2_manager.begin_turn("posix-spawn")


def test_doctor_lists_posix_spawn_where_the_extension_is_not_built():
    from cgturn.kernel import spawn as kspawn

    assert doctor_report()["spawn_paths"] == ["clone3"] * kspawn.clone3_built() + ["posix_spawn", "shim"]
