"""cgturn inside a systemd-delegated subtree (Delegate=yes), as root and as an unprivileged user.

What this proves that the development machine cannot: there, systemd is not PID 1 and nothing is
delegated; here systemd hands a unit its cgroup subtree (chowning it to User=), puts the service in
the `supervisor` leaf (DelegateSubgroup=, systemd >= 254), and cgroup2 is mounted with nsdelegate.

Every case's unit is started at once by the module's fixture (an interpreter start is most of a
unit's time under software emulation, and the cases run side by side on the guest's CPUs); each test
checks the output of its own.
"""
from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys

import pytest

from hostlib import (GUEST_STATE, MOUNT, TEST_USER, last_json, pid_alive, start_in_unit, stop_user_manager, systemctl,  # noqa: F401
                     systemd_host, unit_name, wait_value)

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host"), GUEST_STATE]
HERE = os.path.dirname(os.path.abspath(__file__))
DELEGATED = ("Delegate=yes", "DelegateSubgroup=supervisor")


class Case:
    """A unit started in the background; `result()` its output and status, `unit_dir` its cgroup."""

    def __init__(self, argv: list[str], props: tuple[str, ...], unit_dir: str, name: str, **kwargs):
        self.unit_dir = unit_dir
        self.run = start_in_unit(argv, props=props, name=name, timeout=600, **kwargs)
        self._result: subprocess.CompletedProcess | None = None

    def result(self) -> subprocess.CompletedProcess:
        if self._result is None:
            self._result = self.run.result()
        return self._result


def _doctor(user: str | None, props: tuple[str, ...], ask_root: bool = True) -> Case:
    name = unit_name()
    unit_dir = f"{MOUNT}/system.slice/{name}.service"
    props = props + ((f"User={user}",) if user else ())
    env = {"CGTURN_ROOT": f"{unit_dir}/turns"} if ask_root else {}
    return Case([sys.executable, "-m", "cgturn", "doctor", "--json"], props, unit_dir, name, env=env)


def _abandon(user: str | None) -> Case:
    name = unit_name()
    props = DELEGATED + (f"RuntimeDirectory={name}",) + ((f"User={user}",) if user else ())
    return Case([sys.executable, os.path.join(HERE, "turn_scenario.py"), f"/run/{name}"], props,
                f"/system.slice/{name}.service", name)


def _user_manager_up(uid: int) -> bool:
    active = systemctl("is-active", f"user@{uid}.service", check=False).stdout.strip() == "active"
    return active and os.path.exists(f"/run/user/{uid}/bus")


@pytest.fixture(scope="module")
def cases():
    """Every case's unit of the system manager, all started at once with the test user logged out;
    then, with the user lingering, the case of its own manager."""
    uid = pwd.getpwnam(TEST_USER).pw_uid
    # Logged out, not lingering: with the user's manager up, the no-delegation doctor would find it
    # and plan cgturn.scope (test_testhost_user.py) instead of falling back.
    stop_user_manager(TEST_USER)
    started: dict[str, Case] = {}
    try:
        started["doctor-root"] = _doctor(None, DELEGATED)
        started["doctor-user"] = _doctor(TEST_USER, DELEGATED)
        started["fallback"] = _doctor(TEST_USER, (), ask_root=False)
        started["refuse"] = _doctor(TEST_USER, ())
        started["abandon-root"] = _abandon(None)
        started["abandon-user"] = _abandon(TEST_USER)
        for case in started.values():
            case.result()
        subprocess.run(["loginctl", "enable-linger", TEST_USER], check=True, capture_output=True, timeout=60)
        assert wait_value(lambda: _user_manager_up(uid), 120), \
            systemctl("status", "--no-pager", f"user@{uid}.service", check=False).stdout
        name = unit_name()
        started["user-manager"] = Case(
            [sys.executable, os.path.join(HERE, "turn_scenario.py"), f"/run/user/{uid}/{name}"],
            DELEGATED + (f"RuntimeDirectory={name}",),
            f"/user.slice/user-{uid}.slice/user@{uid}.service/app.slice/{name}.service", name, user_manager=TEST_USER)
        for case in started.values():
            case.result()
        yield started
    finally:
        for case in started.values():
            try:
                case.result()
            except subprocess.TimeoutExpired:
                pass  # that case's test reports it
        stop_user_manager(TEST_USER)


@pytest.mark.parametrize("user", [None, TEST_USER], ids=["root", "user"])
def test_doctor_in_a_delegated_subtree(cases, user):
    case = cases["doctor-user" if user else "doctor-root"]
    res, unit_dir = case.result(), case.unit_dir
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


def test_doctor_without_delegation_as_a_user_falls_back_with_a_reason(cases):
    # No managed root asked for: the default (<own cgroup>/cgturn) is not writable, the registry is used.
    res, unit_dir = cases["fallback"].result(), cases["fallback"].unit_dir
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["backend"] == "registry"
    assert report["own_cgroup"] == unit_dir
    assert report["managed_root"] == f"{unit_dir}/cgturn"
    assert report["writable"] is False
    assert any("no write permission" in p for p in report["problems"]), report["problems"]


def test_doctor_without_delegation_refuses_an_asked_for_root(cases):
    res = cases["refuse"].result()
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["usable"] is False
    assert report["writable"] is False
    assert any("was asked for but cgroup v2 is not usable" in p for p in report["problems"]), report["problems"]


@pytest.mark.parametrize("user", [None, TEST_USER], ids=["root", "user"])
def test_abandon_in_a_delegated_subtree_kills_a_setsid_daemon(cases, user):
    case = cases["abandon-user" if user else "abandon-root"]
    res, unit_dir = case.result(), case.unit_dir
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    assert out["uid"] == (pwd.getpwnam(user).pw_uid if user else 0)
    assert out["own_cgroup"] == f"{unit_dir}/supervisor"
    assert out["daemon_cgroup"].startswith(f"{unit_dir}/turns/"), out
    assert out["daemon"] in out["killed"]
    assert out["daemon_gone"] is True
    assert out["daemon_cgroup_gone"] is True
    assert not pid_alive(out["daemon"])


def test_abandon_in_a_user_managers_delegated_service(cases):
    # The unprivileged path without root's help: the user's manager (systemd --user, itself
    # delegated by user@.service) delegates a subtree of its own to one of its services.
    case = cases["user-manager"]
    res, unit_dir = case.result(), case.unit_dir
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    assert out["uid"] == pwd.getpwnam(TEST_USER).pw_uid
    assert out["own_cgroup"] == f"{unit_dir}/supervisor"
    assert out["daemon_cgroup"].startswith(f"{unit_dir}/turns/"), out
    assert out["daemon"] in out["killed"]
    assert out["daemon_gone"] is True
    assert not pid_alive(out["daemon"])
