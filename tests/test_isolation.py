"""Spawns as another user (and, below, turns with a network or a seal of their own), on the real kernel."""
from __future__ import annotations

import grp
import json
import os
import pwd
import subprocess

import pytest

from conftest import PY, cli, turn_dir, wait_until
from cgturn.kernel.cgroupfs import Cgroup

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


# --- network="none" ----------------------------------------------------------------------------------

LISTEN = ("import socket, sys, time\n"
          "s = socket.socket(); s.bind(('127.0.0.1', 3000)); s.listen()\n"
          "print(open('/proc/self/net/dev').read().count(':'), flush=True); time.sleep(300)\n")
CONNECT = ("import socket, sys\n"
           "try:\n    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5); print('reached')\n"
           "except OSError as err:\n    print(type(err).__name__)\n")


def netns_of(pid) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_two_turns_without_network_each_listen_on_3000_and_ps_shows_both(cgroup2_manager, cgroup2_root, state_dir):
    mgr = cgroup2_manager
    turns = [mgr.begin_turn("net", f"t{i}", network="none") for i in (1, 2)]
    servers = [t.spawn([PY, "-c", LISTEN], stdout=subprocess.PIPE, text=True) for t in turns]
    assert [s.stdout.readline().strip() for s in servers] == ["1", "1"]   # bound; one interface: lo
    first, second = (netns_of(s.pid) for s in servers)
    assert len({first, second, netns_of("self")}) == 3
    client = turns[0].spawn([PY, "-c", CONNECT, "3000"], stdout=subprocess.PIPE, text=True)
    assert client.communicate(timeout=10)[0].strip() == "reached"   # its own turn's server: same namespace
    rows = {row["turn"]: row for row in json.loads(cli(cgroup2_root, str(state_dir), "ps", "--json").stdout)}
    for name in ("t1", "t2"):
        assert (rows[name]["network"], rows[name]["sealed"]) == ("none", False)
        assert {"proto": "tcp", "address": "127.0.0.1", "port": 3000} in rows[name]["ports"]
    for t, s in zip(turns, servers):
        t.abandon("test", grace=0)
        s.wait(timeout=10)
        s.stdout.close()
    assert mgr.backend.isolation._fds == {}
    assert not any(os.readlink(f"/proc/self/fd/{fd}") in (first, second) for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))
    mgr.end_task("net")


def test_a_turn_without_network_cannot_reach_the_host_loopback(cgroup2_manager):
    import socket

    mgr = cgroup2_manager
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = str(server.getsockname()[1])
        host = mgr.begin_turn("reach", "host")
        none = mgr.begin_turn("reach", "none", network="none")
        got = [t.spawn([PY, "-c", CONNECT, port], stdout=subprocess.PIPE, text=True).communicate(timeout=10)[0]
               for t in (host, none)]
    assert [g.strip() for g in got] == ["reached", "ConnectionRefusedError"]
    assert (host.record.network, none.record.network) == ("host", "none")
    for t in (host, none):
        t.complete()


def test_another_manager_spawning_into_the_turn_joins_the_same_namespace(cgroup2_manager, cgroup2_root, state_dir):
    from cgturn import TurnManager

    turn = cgroup2_manager.begin_turn("shared-net", network="none")
    first = turn.spawn(["sleep", "300"])
    assert wait_until(lambda: netns_of(first.pid) != netns_of("self"))  # past nsenter: in the namespace
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=str(state_dir)) as other:
        second = other.turn("shared-net", turn.record.turn_id).spawn(["sleep", "300"])
    # spawn returns before the target runs: wait until the shim has passed nsenter
    assert wait_until(lambda: netns_of(second.pid) == netns_of(first.pid) != netns_of("self"))
    turn.abandon("test", grace=0)
    for p in (first, second):
        p.wait(timeout=10)


def test_network_none_is_refused_by_the_registry_and_without_nsenter_before_anything(manager, monkeypatch):
    from cgturn import IsolationUnavailable
    from cgturn.backends import isolation

    if manager.backend_name == "cgroup2":  # a missing helper: the one branch this host cannot produce
        isolation.helper.cache_clear()
        monkeypatch.setattr("shutil.which", lambda *a, **k: None)  # isolation imports shutil where it looks
    with pytest.raises(IsolationUnavailable, match="nsenter|registry"):
        manager.begin_turn("refused", network="none")
    isolation.helper.cache_clear()
    assert manager.turns() == []
    with pytest.raises(ValueError, match="network must be"):
        manager.begin_turn("refused", network="bridge")


def test_cli_run_network_none_and_its_refusal_on_the_registry(cgroup2_root, state_dir):
    out = cli(cgroup2_root, str(state_dir), "run", "--network", "none", "--", "cat", "/proc/net/dev")
    assert out.returncode == 0, out.stderr
    assert [line.split(":")[0].strip() for line in out.stdout.splitlines()[2:]] == ["lo"]
    refused = cli(None, str(state_dir), "run", "--network", "none", "--", "true", backend="registry")
    assert refused.returncode == 125
    assert "cannot" in refused.stderr


# --- seal=True -------------------------------------------------------------------------------------

# Every route out of the turn a root process has, each reported as "ok" (it worked) or the errno name.
ESCAPE = r'''
import ctypes, errno, json, os, sys
mount_root, sibling, own, outsider, v1, probe = sys.argv[1:7]
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWCGROUP, MS_REMOUNT, MS_BIND = 0x20000, 0x02000000, 32, 4096
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as err:
        out[name] = errno.errorcode[err.errno]
def write_pid(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
def check(rc):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
def via_setns(kind, flag):
    fd = os.open(f"/proc/{outsider}/ns/{kind}", os.O_RDONLY)
    try:
        check(libc.setns(fd, flag))
    finally:
        os.close(fd)
attempt("mount root", lambda: write_pid(os.path.join(mount_root, "cgroup.procs")))
attempt("sibling", lambda: write_pid(os.path.join(sibling, "cgroup.procs")))
attempt("v1 root", lambda: write_pid(os.path.join(v1, "cgroup.procs")))
attempt("own sub-cgroup", lambda: os.mkdir(os.path.join(own, "sub")))
attempt("fresh cgroup2", lambda: check(libc.mount(b"none", probe.encode(), b"cgroup2", 0, None)))
attempt("remount", lambda: check(libc.mount(None, mount_root.encode(), None, MS_REMOUNT | MS_BIND, None)))
attempt("unshare", lambda: check(libc.unshare(CLONE_NEWNS)))
attempt("setns mnt", lambda: via_setns("mnt", CLONE_NEWNS))
attempt("setns cgroup", lambda: via_setns("cgroup", CLONE_NEWCGROUP))
attempt("outsider's root", lambda: write_pid(f"/proc/{outsider}/root{mount_root}/cgroup.procs"))
out["uid"] = os.getuid()
out["cgroup"] = open("/proc/self/cgroup").read().splitlines()[-1]
print(json.dumps(out), flush=True)
'''


def cgroup_mounts_here() -> list[str]:
    """This (the host's) mount namespace's mounts at and below /sys/fs/cgroup, as mountinfo lists them."""
    return [line for line in open("/proc/self/mountinfo") if " /sys/fs/cgroup" in line]


def test_a_root_process_in_a_sealed_turn_tries_every_way_out_and_stays(cgroup2_manager, bystanders, tmp_path):
    mgr = cgroup2_manager
    before = cgroup_mounts_here()
    (tmp_path / "probe").mkdir()
    turn = mgr.begin_turn("sealed", seal=True)
    sibling = os.path.join(mgr.backend.root.path, "sibling")   # ours: made in this test's managed root
    os.mkdir(sibling)
    outsider = bystanders()                                     # a root process outside the turn
    own = turn_dir(mgr, turn)
    v1 = "/sys/fs/cgroup/pids" if os.path.isdir("/sys/fs/cgroup/pids") else mgr.backend.mount
    proc = turn.spawn([PY, "-c", ESCAPE, mgr.backend.mount, sibling, own, str(outsider.pid), v1,
                       str(tmp_path / "probe")],
                      stdout=subprocess.PIPE, text=True, cwd=str(tmp_path))
    report = json.loads(proc.communicate(timeout=30)[0])
    assert report.pop("uid") == 0
    assert report.pop("cgroup") == "0::/"                       # a cgroup namespace rooted at its turn
    assert report == {"mount root": "EROFS", "sibling": "EROFS", "v1 root": "EROFS", "own sub-cgroup": "EROFS",
                      "fresh cgroup2": "EPERM", "remount": "EPERM", "unshare": "EPERM",
                      # the outsider is not in the sealed spawn's PID namespace: its /proc does not show it
                      "setns mnt": "ENOENT", "setns cgroup": "ENOENT", "outsider's root": "ENOENT"}
    assert Cgroup(sibling).procs() == []
    assert not os.path.exists(os.path.join(own, "sub"))
    assert cgroup_mounts_here() == before                         # the host's mounts never changed
    assert " ro," not in "".join(before) and os.listdir(tmp_path / "probe") == []
    stays = turn.spawn(["sleep", "300"])
    assert stays.pid in turn.pids()
    result = turn.abandon("test", grace=0)
    assert stays.pid in result.killed
    stays.wait(timeout=10)
    os.rmdir(sibling)


def test_seal_network_and_user_combine(cgroup2_manager):
    turn = cgroup2_manager.begin_turn("all", seal=True, network="none")
    out = turn.spawn(["sh", "-c", "id -u; cat /proc/net/dev | tail -n +3 | cut -d: -f1; "
                      "echo $$ > /sys/fs/cgroup/unified/cgroup.procs 2>/dev/null || echo refused"],
                     stdout=subprocess.PIPE, text=True, user="nobody").communicate(timeout=10)[0]
    assert out.split() == [str(NOBODY.pw_uid), "lo", "refused"]
    info = {i.turn: i for i in cgroup2_manager.turns()}[turn.record.turn_id]
    assert (info.to_json()["sealed"], info.to_json()["network"]) == (True, "none")
    turn.complete()


def test_seal_is_refused_by_the_registry_and_without_bubblewrap(manager, monkeypatch):
    from cgturn import IsolationUnavailable
    from cgturn.backends import isolation, seal

    if manager.backend_name == "cgroup2":
        isolation.helper.cache_clear()
        seal.check.cache_clear()
        monkeypatch.setattr("shutil.which", lambda *a, **k: None)  # isolation imports shutil where it looks
    with pytest.raises(IsolationUnavailable, match="bubblewrap|registry"):
        manager.begin_turn("refused", seal=True)
    isolation.helper.cache_clear()
    seal.check.cache_clear()
    assert manager.turns() == []


def test_cli_run_seal_and_its_refusal_on_the_registry(cgroup2_root, state_dir):
    from cgturn.kernel.discovery import find_cgroup2_mount

    mount = find_cgroup2_mount()[0]
    out = cli(cgroup2_root, str(state_dir), "run", "--seal", "--", "sh", "-c",
              f'cat /proc/self/cgroup | tail -n 1; echo $$ > {mount}/cgroup.procs')
    assert out.returncode == 2 and out.stdout.strip() == "0::/", (out.stdout, out.stderr)  # sh: cannot create
    assert "Read-only file system" in out.stderr
    refused = cli(None, str(state_dir), "run", "--seal", "--", "true", backend="registry")
    assert refused.returncode == 125 and "cannot seal" in refused.stderr
