"""The systemd scope path (kernel/systemd.py, kernel/userscope.py) where this machine can test it.

systemd is not the init here, so the scope itself is proven in the test host
(tests/testhost/test_testhost_user.py). Here: the parsers, the choice of the manager's bus, the
delegation mark on real cgroups, the D-Bus error branches against a real (private) dbus-daemon with no
systemd on it, the fallback with a reason when no manager is reachable, and that commands which need
no manager never import the D-Bus client.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

from conftest import need_cgroup2
from cgturn.errors import CgroupUnavailable
from cgturn.kernel import discovery, systemd, userscope
from cgturn.kernel.cgroupfs import Cgroup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("value, expected", [
    (None, None), (b"1", True), (b"1\0", True), (b"0", False), (b"", False), (b"yes", True), (b"2", False),
])
def test_parse_delegate_mark(value, expected):
    assert systemd.parse_delegate_mark(value) is expected


@pytest.fixture
def booted(tmp_path, monkeypatch):
    """Pretend systemd is the init (its runtime directory exists) for the bus-choice tests."""
    run = tmp_path / "systemd-system"
    run.mkdir()
    monkeypatch.setattr(systemd, "SYSTEMD_RUNTIME", str(run))


def _listening_socket(path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.listen(1)
    return sock


def test_no_manager_where_systemd_is_not_the_init(tmp_path, monkeypatch):
    monkeypatch.setattr(systemd, "SYSTEMD_RUNTIME", str(tmp_path / "absent"))
    address, why = systemd.manager_address(1000, {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert address is None and "systemd is not the init" in why


def test_a_user_talks_to_the_bus_in_its_runtime_dir(booted, tmp_path):
    uid = os.geteuid() or 1000
    sock = _listening_socket(tmp_path / "bus")
    try:
        if os.geteuid() == 0:  # the socket must be the user's own
            os.chown(tmp_path / "bus", uid, -1)
        address, why = systemd.manager_address(uid, {"XDG_RUNTIME_DIR": str(tmp_path)})
    finally:
        sock.close()
    assert address == systemd.ManagerAddress("user", str(tmp_path / "bus")), why
    assert address.slice == "app.slice"


def test_another_users_bus_socket_is_never_used(booted, tmp_path):
    sock = _listening_socket(tmp_path / "bus")
    try:
        if os.geteuid() == 0:
            os.chown(tmp_path / "bus", 4242, -1)  # another user's
        address, why = systemd.manager_address(os.geteuid() or 1000, {"XDG_RUNTIME_DIR": str(tmp_path)})
    finally:
        sock.close()
    assert address is None
    assert "no systemd user manager is reachable" in why and "linger" in why


def test_a_job_without_a_runtime_dir_names_the_places_it_looked(booted):
    # cron: no XDG_RUNTIME_DIR; /run/user/UID/bus exists only while the user is logged in or lingers
    address, why = systemd.manager_address(4242, {})
    assert address is None
    assert "/run/user/4242/bus" in why and "linger" in why


def test_root_asks_the_system_manager(booted, tmp_path, monkeypatch):
    monkeypatch.setattr(systemd, "SYSTEM_BUS", str(tmp_path / "system_bus_socket"))
    address, why = systemd.manager_address(0, {})
    assert address is None and "system bus" in why
    sock = _listening_socket(tmp_path / "system_bus_socket")
    try:
        if os.geteuid() != 0:
            pytest.skip("the system bus socket must be root's: only root can make one here")
        address, why = systemd.manager_address(0, {"XDG_RUNTIME_DIR": str(tmp_path)})
    finally:
        sock.close()
    assert address == systemd.ManagerAddress("system", str(tmp_path / "system_bus_socket"))
    assert address.slice == "system.slice"


def test_a_missing_dbus_client_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jeepney", None)  # import jeepney raises ImportError
    with pytest.raises(CgroupUnavailable, match="jeepney is not installed"):
        systemd.Manager(systemd.ManagerAddress("user", str(tmp_path / "bus")))


def test_a_bus_nobody_listens_on_is_a_reason_with_its_path(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "bus"))  # bound, never listening: connect() is refused
    try:
        with pytest.raises(CgroupUnavailable, match=f"cannot connect .* {tmp_path}/bus"):
            systemd.Manager(systemd.ManagerAddress("user", str(tmp_path / "bus")))
    finally:
        sock.close()


@pytest.fixture
def private_bus(tmp_path):
    """A real dbus-daemon on a private socket, with no systemd on it; stopped at teardown."""
    if shutil.which("dbus-daemon") is None:
        pytest.skip("dbus-daemon is not installed")
    path = tmp_path / "bus"
    config = tmp_path / "bus.conf"  # no service directories: nothing is activated on demand
    config.write_text('<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"\n'
                      ' "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">\n'
                      f'<busconfig><type>session</type><listen>unix:path={path}</listen><auth>EXTERNAL</auth>'
                      '<policy context="default"><allow send_destination="*"/><allow receive_sender="*"/>'
                      '<allow own="*"/></policy>'
                      '</busconfig>\n')
    proc = subprocess.Popen(["dbus-daemon", f"--config-file={config}", "--nofork", "--nopidfile",
                             "--print-address"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith("unix:path="), "dbus-daemon did not start"
        yield str(path)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_bus_without_systemd_answers_with_an_error_that_names_it(private_bus):
    with systemd.Manager(systemd.ManagerAddress("user", private_bus)) as manager:
        with pytest.raises(systemd.ManagerError) as err:
            manager.unit_control_group(systemd.SCOPE_UNIT)
    assert err.value.name == "org.freedesktop.DBus.Error.ServiceUnknown"
    assert "GetUnit" in str(err.value)


def test_plan_gives_the_reason_when_the_manager_does_not_answer(private_bus, booted, tmp_path, monkeypatch):
    if os.geteuid() == 0:
        monkeypatch.setattr(systemd, "SYSTEM_BUS", private_bus)
    scope, why = userscope.plan(lambda path: "/sys/fs/cgroup" + path, None, {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert scope is None
    assert "ServiceUnknown" in why


def test_doctor_without_a_manager_falls_back_with_the_reason():
    """As nobody, whose cgroup (this host's root) is not writable: today's registry, with why no scope."""
    need_cgroup2()
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as nobody")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": REPO}
    res = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3",
                          "-m", "cgturn", "doctor", "--json"], capture_output=True, text=True, env=env,
                         cwd="/", timeout=60)
    report = json.loads(res.stdout)
    assert report["backend"] == "registry", report
    assert report["systemd_scope"] is None
    assert any("no write permission" in p and "no delegated systemd scope either: systemd is not the init" in p
               for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("command", [["doctor", "--json"], ["ps", "--json"]])
def test_commands_that_need_no_manager_never_import_the_dbus_client(command):
    need_cgroup2()
    code = ("import sys, io, contextlib\n"
            "from cgturn.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main({command!r})\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jeepney'))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


@pytest.fixture
def unit_like_cgroup():
    """A cgroup named like a systemd unit (`cgturn-test-….service`) below the mount; removed after."""
    mount = need_cgroup2()
    cg = Cgroup(os.path.join(mount, f"cgturn-test-{uuid.uuid4().hex[:10]}.service"))
    cg.create()
    try:
        yield cg
    finally:
        cg.remove_tree()


def test_the_delegation_mark_is_read_from_the_nearest_unit(unit_like_cgroup, booted):
    cg = unit_like_cgroup
    leaf = cg.child("supervisor")
    leaf.create()
    mount = os.path.dirname(cg.path)
    assert discovery.unit_delegation(leaf.path, mount) is False  # a unit's cgroup without the mark
    os.setxattr(cg.path, "user.delegate", b"1")
    assert systemd.delegation_mark(cg.path) is True
    assert discovery.unit_delegation(leaf.path, mount) is True   # from the leaf up to the unit
    os.setxattr(cg.path, "user.delegate", b"0")
    assert discovery.unit_delegation(leaf.path, mount) is False


def test_no_mark_is_looked_for_where_systemd_is_not_the_init(unit_like_cgroup, tmp_path, monkeypatch):
    monkeypatch.setattr(systemd, "SYSTEMD_RUNTIME", str(tmp_path / "absent"))
    os.setxattr(unit_like_cgroup.path, "user.delegate", b"1")
    assert discovery.unit_delegation(unit_like_cgroup.path, os.path.dirname(unit_like_cgroup.path)) is None


def test_a_scope_plan_reports_what_doctor_shows():
    plan = userscope.ScopePlan("user", "/run/user/1000/bus", "cgturn.scope",
                               "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/app.slice/cgturn.scope",
                               exists=False, caller_inside=False)
    assert plan.managed_root == plan.cgroup + "/cgturn"
    assert plan.to_json() == {"manager": "user", "unit": "cgturn.scope", "cgroup": plan.cgroup, "exists": False,
                              "caller_inside": False, "moves_caller": True, "owners": plan.cgroup + "/owners"}


def test_a_process_that_joined_the_scope_finds_its_managed_root_by_its_own_cgroup(cgroup2_root):
    """A second TurnManager in a process already in cgturn.scope/owners uses the scope's managed root
    (not `owners/cgturn`, a root of its own below the leaf), with no manager asked."""
    scope = Cgroup(os.path.join(cgroup2_root, "cgturn.scope"))
    Cgroup(cgroup2_root).create()
    scope.create()
    owners = scope.child("owners")
    owners.create()
    code = "import json; from cgturn import doctor_report; print(json.dumps(doctor_report()))"
    res = subprocess.run(["sh", "-c", f'echo $$ > {owners.path}/cgroup.procs && exec "$0" -c "$1"',
                          sys.executable, code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["own_cgroup"] == owners.path
    assert report["managed_root"] == scope.path + "/cgturn"
    assert report["backend"] == "cgroup2"
    assert report["systemd_scope"]["caller_inside"] is True and report["systemd_scope"]["exists"] is True


def test_only_the_owners_leaf_of_cgturns_scope_is_taken_for_it():
    to_mount = lambda path: path  # noqa: E731
    assert userscope.joined_plan("/a/app.slice/cgturn.scope/owners", to_mount).cgroup == "/a/app.slice/cgturn.scope"
    assert userscope.joined_plan("/a/app.slice/other.scope/owners", to_mount) is None
    assert userscope.joined_plan("/a/app.slice/cgturn.scope/cgturn", to_mount) is None


def test_an_asked_for_root_in_a_scope_not_made_yet_is_pending_not_an_error(booted, tmp_path, monkeypatch):
    """The sentinel of `cgturn run` gets `--root …/cgturn.scope/cgturn` before the first turn makes
    the scope: that root is cgturn's scope-to-be (with a manager reachable), not a missing parent."""
    sock = _listening_socket(tmp_path / "bus")  # the caller's own socket: root's is the system bus
    monkeypatch.setattr(systemd, "SYSTEM_BUS", str(tmp_path / "bus"))
    try:
        scope_dir = str(tmp_path / "app.slice" / "cgturn.scope")
        env = {"XDG_RUNTIME_DIR": str(tmp_path)}
        to_mount = lambda path: path  # noqa: E731
        plan = userscope.pending_plan(scope_dir + "/cgturn", None, to_mount, env)
        assert plan is not None and plan.cgroup == scope_dir and plan.exists is False
        assert plan.socket == str(tmp_path / "bus")
        assert userscope.pending_plan(scope_dir + "/turns", None, to_mount, env) is None
        os.makedirs(scope_dir)  # made: an ordinary explicit root from now on
        assert userscope.pending_plan(scope_dir + "/cgturn", None, to_mount, env) is None
    finally:
        sock.close()


def test_a_pending_root_without_a_manager_stays_an_error(booted, tmp_path, monkeypatch):
    monkeypatch.setattr(systemd, "SYSTEM_BUS", str(tmp_path / "no-system-bus"))
    scope_dir = str(tmp_path / "app.slice" / "cgturn.scope")
    assert userscope.pending_plan(scope_dir + "/cgturn", None, lambda path: path, {"XDG_RUNTIME_DIR": str(tmp_path)}) is None
