"""Spawns as another user (and, below, turns with a network or a seal of their own), on the real kernel."""
from __future__ import annotations

import grp
import os
import pwd
import subprocess

import pytest

from conftest import cli, turn_dir

NOBODY = pwd.getpwnam("nobody")
NOGROUP = grp.getgrgid(NOBODY.pw_gid)
EXTRA = grp.getgrnam("users").gr_gid

# Prints `<path> ok` or `<path> denied` for each write the shell tries (sh, not Python: the test's
# interpreter may not be readable by nobody).
WRITE_PROBE = 'for p in "$@"; do if (echo $$ > "$p") 2>/dev/null; then echo "$p ok"; else echo "$p denied"; fi; done'


def status_ids(text: str) -> dict[str, list[int]]:
    """Uid, Gid and Groups lines of /proc/PID/status, as lists of ints."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            out[key] = [int(v) for v in value.split()]
    return out


def test_a_spawn_as_another_user_is_in_its_turn_with_exactly_the_ids_asked(manager):
    turn = manager.begin_turn("as-user")
    proc = turn.spawn(["sh", "-c", "cat /proc/self/status; exec sleep 300"], stdout=subprocess.PIPE, text=True,
                      user="nobody", group=NOGROUP.gr_name, extra_groups=["users"])
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Groups:"):
            break
    ids = status_ids("".join(lines))
    assert ids["Uid"] == [NOBODY.pw_uid] * 4          # real, effective, saved, filesystem
    assert ids["Gid"] == [NOBODY.pw_gid] * 4
    assert ids["Groups"] == [EXTRA]
    assert proc.pid in turn.pids()                      # the same process: setpriv exec'd the target
    assert pwd.getpwuid(os.stat(f"/proc/{proc.pid}").st_uid).pw_name == "nobody"
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)
    proc.stdout.close()


def test_user_alone_gives_the_primary_group_and_the_group_database_s_groups(manager):
    turn = manager.begin_turn("as-user-init")
    out = turn.spawn(["cat", "/proc/self/status"], stdout=subprocess.PIPE, text=True,
                     user=NOBODY.pw_uid).communicate(timeout=10)[0]
    ids = status_ids(out)
    expected = sorted({g.gr_gid for g in grp.getgrall() if "nobody" in g.gr_mem} | {NOBODY.pw_gid})
    assert (ids["Uid"][0], ids["Gid"][0], sorted(ids["Groups"])) == (NOBODY.pw_uid, NOBODY.pw_gid, expected)
    turn.complete()


@pytest.mark.parametrize("kwargs, message", [({"user": "no-such-user-cgturn"}, "unknown user"),
                                             ({"user": "nobody", "group": "no-such-group"}, "unknown group"),
                                             ({"extra_groups": ["no-such-group"]}, "unknown group"),
                                             ({"user": 4_000_000}, "no passwd entry")])
def test_an_unknown_user_or_group_is_a_value_error_and_nothing_runs(manager, tmp_path, kwargs, message):
    turn = manager.begin_turn("unknown-user")
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match=message):
        turn.spawn(["touch", str(marker)], **kwargs)
    assert turn.pids() == []
    assert not marker.exists()
    turn.complete()


def test_an_unprivileged_turn_process_cannot_touch_its_turn_the_root_or_the_state(cgroup2_manager, state_dir):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("unprivileged")
    here = turn_dir(mgr, turn)
    mount_root = mgr.backend.mount
    targets = [os.path.join(here, "cgroup.procs"), os.path.join(here, "cgroup.kill"),
               os.path.join(here, "cgroup.freeze"), os.path.join(mgr.backend.root.path, "cgroup.procs"),
               os.path.join(mount_root, "cgroup.procs"), os.path.join(str(state_dir), "probe"),
               f"/proc/{os.getpid()}/fd/probe"]   # the spawner's fds: its spawn gates
    out = turn.spawn(["sh", "-c", WRITE_PROBE + '; mkdir "$0/sub" 2>/dev/null && echo mkdir ok || echo mkdir denied',
                      here, *targets], stdout=subprocess.PIPE, text=True, user="nobody").communicate(timeout=10)[0]
    assert out.split("\n")[:-1] == [f"{t} denied" for t in targets] + ["mkdir denied"]
    assert os.listdir(str(state_dir)).count("probe") == 0
    assert not os.path.exists(os.path.join(here, "sub"))
    assert turn.pids() == []
    turn.complete()


def test_cli_run_as_another_user_and_an_unknown_one_exits_2_before_anything(cgroup2_root, state_dir, tmp_path):
    out = cli(cgroup2_root, str(state_dir), "run", "--user", "nobody", "--extra-groups", "users", "--",
              "sh", "-c", "id -u; id -G")
    assert (out.returncode, out.stdout.split()) == (0, [str(NOBODY.pw_uid), str(NOBODY.pw_gid), str(EXTRA)])
    marker = tmp_path / "ran"
    bad = cli(cgroup2_root, str(state_dir), "run", "--task", "never", "--user", "no-such-user-cgturn", "--",
              "touch", str(marker))
    assert bad.returncode == 2, bad.stderr
    assert "unknown user" in bad.stderr
    assert not marker.exists()
    assert not os.path.exists(os.path.join(cgroup2_root, "never"))
