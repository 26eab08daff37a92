"""cgturn inside a systemd-delegated subtree (Delegate=yes), as root and as an unprivileged user.

What this proves that the development machine cannot: there, systemd is not PID 1 and nothing is
delegated; here systemd hands a unit its cgroup subtree (chowning it to User=), puts the service in
the `supervisor` leaf (DelegateSubgroup=, systemd >= 254), and cgroup2 is mounted with nsdelegate.
"""
from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys

import pytest

from hostlib import (MOUNT, TEST_USER, last_json, pid_alive, run_in_unit, systemctl, systemd_host,  # noqa: F401
                     unit_name, wait_value)

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host")]
HERE = os.path.dirname(os.path.abspath(__file__))
DELEGATED = ("Delegate=yes", "DelegateSubgroup=supervisor")


def _doctor(user: str | None, props: tuple[str, ...], ask_root: bool = True):
    name = unit_name()
    unit_dir = f"{MOUNT}/system.slice/{name}.service"
    props = props + ((f"User={user}",) if user else ())
    env = {"CGTURN_ROOT": f"{unit_dir}/turns"} if ask_root else {}
    res = run_in_unit([sys.executable, "-m", "cgturn", "doctor", "--json"], props=props, name=name, env=env)
    return unit_dir, res


@pytest.mark.parametrize("user", [None, TEST_USER], ids=["root", "user"])
def test_doctor_in_a_delegated_subtree(user):
    unit_dir, res = _doctor(user, DELEGATED)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["backend"] == "cgroup2"
    assert report["own_cgroup"] == f"{unit_dir}/supervisor"
    assert report["managed_root"] == f"{unit_dir}/turns"
    assert report["writable"] is True
    assert report["cgroup_kill"] is True
    # systemd enables memory and pids down to a delegated unit (pure v2: the v1 hierarchies are gone).
    assert {"memory", "pids"} <= set(report["controllers"])
    assert report["problems"] == []


def test_doctor_without_delegation_as_a_user_falls_back_with_a_reason():
    # No managed root asked for: the default (<own cgroup>/cgturn) is not writable, the registry is used.
    unit_dir, res = _doctor(TEST_USER, (), ask_root=False)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["backend"] == "registry"
    assert report["own_cgroup"] == unit_dir
    assert report["managed_root"] == f"{unit_dir}/cgturn"
    assert report["writable"] is False
    assert any("no write permission" in p for p in report["problems"]), report["problems"]


def test_doctor_without_delegation_refuses_an_asked_for_root():
    unit_dir, res = _doctor(TEST_USER, ())
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["usable"] is False
    assert report["writable"] is False
    assert any("was asked for but cgroup v2 is not usable" in p for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("user", [None, TEST_USER], ids=["root", "user"])
def test_abandon_in_a_delegated_subtree_kills_a_setsid_daemon(user):
    name = unit_name()
    unit_dir = f"/system.slice/{name}.service"
    props = DELEGATED + (f"RuntimeDirectory={name}",) + ((f"User={user}",) if user else ())
    res = run_in_unit([sys.executable, os.path.join(HERE, "turn_scenario.py"), f"/run/{name}"],
                      props=props, name=name)
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    assert out["uid"] == (pwd.getpwnam(user).pw_uid if user else 0)
    assert out["own_cgroup"] == f"{unit_dir}/supervisor"
    assert out["daemon_cgroup"].startswith(f"{unit_dir}/turns/"), out
    assert out["daemon"] in out["killed"]
    assert out["daemon_gone"] is True
    assert out["daemon_cgroup_gone"] is True
    assert not pid_alive(out["daemon"])


@pytest.fixture
def user_manager():
    """The test user's own systemd manager (user@UID.service), started by lingering; stopped after."""
    uid = pwd.getpwnam(TEST_USER).pw_uid
    subprocess.run(["loginctl", "enable-linger", TEST_USER], check=True, capture_output=True, timeout=60)

    def up() -> bool:
        active = systemctl("is-active", f"user@{uid}.service", check=False).stdout.strip() == "active"
        return active and os.path.exists(f"/run/user/{uid}/bus")

    assert wait_value(up, 120), systemctl("status", "--no-pager", f"user@{uid}.service", check=False).stdout
    yield uid
    subprocess.run(["loginctl", "disable-linger", TEST_USER], capture_output=True, timeout=60)
    systemctl("stop", f"user@{uid}.service", check=False)


def test_abandon_in_a_user_managers_delegated_service(user_manager):
    # The unprivileged path without root's help: the user's manager (systemd --user, itself
    # delegated by user@.service) delegates a subtree of its own to one of its services.
    uid = user_manager
    name = unit_name()
    unit_dir = f"/user.slice/user-{uid}.slice/user@{uid}.service/app.slice/{name}.service"
    res = run_in_unit([sys.executable, os.path.join(HERE, "turn_scenario.py"), f"/run/user/{uid}/{name}"],
                      props=DELEGATED + (f"RuntimeDirectory={name}",), name=name, user_manager=TEST_USER)
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    assert out["uid"] == uid
    assert out["own_cgroup"] == f"{unit_dir}/supervisor"
    assert out["daemon_cgroup"].startswith(f"{unit_dir}/turns/"), out
    assert out["daemon"] in out["killed"]
    assert out["daemon_gone"] is True
    assert not pid_alive(out["daemon"])
