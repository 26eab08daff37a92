"""Helpers for the tests that need the test host: Debian 13, systemd 257 as PID 1, pure cgroup v2.

Those tests carry the `testhost` marker: tests/conftest.py skips them elsewhere with a reason naming
the stage that runs them (`python3 scripts/testhost/run.py`, part of .ci/run). Inside the guest
(scripts/testhost/guest.sh sets CGTURN_TESTHOST=1) they run, and the `systemd_host` fixture fails them
(never skips) when the guest is not what they were written for. (A module, not a conftest.py: a
second conftest module would shadow tests/conftest.py for `from conftest import ...`.)

Helpers here start transient systemd units; every unit name contains `cgturn-test` and every unit is
stopped and collected at teardown.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

SHARE = os.environ.get("PYTHONPATH", "").split(":")[0] or os.getcwd()
MOUNT = "/sys/fs/cgroup"
TEST_USER = "cgtest"
HERE = os.path.dirname(os.path.abspath(__file__))
# The guest runs these tests in two pytest-xdist workers, one per vCPU (`-n 2 --dist loadgroup`,
# scripts/testhost/run.py): under software emulation most of a test's time is interpreter starts and
# waits, and one worker left the second vCPU idle much of the time. Tests that share guest-wide state
# carry one `xdist_group` and run one after another on one worker; the rest are spread over both.
#
# GUEST_STATE: the test user's login state and the guest's swap.
# - cgtest's systemd manager and linger: test_testhost_delegation.py needs the user logged out and not
#   lingering (its no-delegation doctor would otherwise find the user manager and plan a scope), the
#   user file logs the user in and out and lingers it, the rootless container lingers it, and each
#   stops the user manager at its end.
# - swap: test_testhost_limits.py's swap test turns on a swap file for the whole guest. Beside it the
#   OOM kills that the limits, seal and container tests wait for would page out instead (50 MiB + swap
#   holds a 200 MiB allocation), and the containers' 512 MiB allocations would fill the swap that test
#   needs.
GUEST_STATE = pytest.mark.xdist_group("guest-state")
# UNIT: test_testhost_unit.py installs the shipped unit under fixed names and reloads systemd in a
# module fixture, which must run once, on one worker.
UNIT = pytest.mark.xdist_group("unit")

@pytest.fixture
def systemd_host():
    """Fail (not skip) unless this really is the host the tests were written for."""
    check_systemd_host()


def check_systemd_host() -> None:
    """Raise AssertionError unless PID 1 is systemd and cgroup2 is mounted with nsdelegate."""
    with open("/proc/1/comm") as f:
        assert f.read().strip() == "systemd", "PID 1 is not systemd"
    with open("/proc/self/mounts") as f:
        cg = [line.split() for line in f if line.split()[1:3] == [MOUNT, "cgroup2"]]
    assert cg, f"no cgroup2 mounted at {MOUNT}"
    assert "nsdelegate" in cg[0][3].split(","), f"cgroup2 mounted without nsdelegate: {cg[0][3]}"


def unit_name(prefix: str = "cgturn-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def systemctl(*args: str, check: bool = True, user: str | None = None) -> subprocess.CompletedProcess:
    argv = ["systemctl", *args]
    if user:
        argv = user_argv(user, argv)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {res.returncode}: {res.stderr.strip()}")
    return res


def user_argv(user: str, argv: list[str]) -> list[str]:
    """Run `argv` as `user` talking to that user's systemd manager (XDG_RUNTIME_DIR points at its bus)."""
    import pwd
    uid = pwd.getpwnam(user).pw_uid
    return ["runuser", "-u", user, "--", "env", f"XDG_RUNTIME_DIR=/run/user/{uid}",
            f"DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/{uid}/bus", *argv]


class UnitRun:
    """A transient service started by `start_in_unit`, running while the caller does something else."""

    def __init__(self, argv: list[str], name: str, user_manager: str | None, timeout: float):
        self.name, self.user_manager, self.timeout = name, user_manager, timeout
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def result(self) -> subprocess.CompletedProcess:
        """Wait for the unit to finish (its `timeout` from now; then TimeoutExpired), stop it, and
        return its output and status."""
        try:
            try:
                out, err = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # systemd-run, started by this object; the unit is stopped below
                self.proc.communicate()
                raise
            return subprocess.CompletedProcess(self.argv, self.proc.returncode, out, err)
        finally:
            stop = ["systemctl", "stop", f"{self.name}.service"]
            subprocess.run(user_argv(self.user_manager, [stop[0], "--user", *stop[1:]]) if self.user_manager
                           else stop, capture_output=True, timeout=60)


def start_in_unit(argv: list[str], *, props: tuple[str, ...] = (), env: dict[str, str] | None = None,
                  user_manager: str | None = None, name: str | None = None, timeout: float = 180) -> UnitRun:
    """Start `argv` as a transient service (systemd-run --wait --pipe) without waiting for it.

    Several started at once run side by side: under software emulation the guest's interpreter
    starts are most of a unit's time, and one unit after another leaves the second CPU idle.
    `user_manager`: start it under that user's own systemd manager instead of the system's.
    """
    name = name or unit_name()
    argv_run = ["systemd-run", "--wait", "--pipe", "--quiet", "--collect", f"--unit={name}",
                f"--setenv=PYTHONPATH={SHARE}"]
    argv_run += [f"--setenv={k}={v}" for k, v in (env or {}).items()]
    argv_run += [f"--property={p}" for p in props]
    if user_manager:
        argv_run = user_argv(user_manager, [argv_run[0], "--user", *argv_run[1:]])
    return UnitRun([*argv_run, "--", *argv], name, user_manager, timeout)


def run_in_unit(argv: list[str], *, props: tuple[str, ...] = (), env: dict[str, str] | None = None,
                user_manager: str | None = None, name: str | None = None,
                timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `argv` as a transient service (systemd-run --wait --pipe) and return its output and status.

    `user_manager`: start it under that user's own systemd manager instead of the system's.
    """
    return start_in_unit(argv, props=props, env=env, user_manager=user_manager, name=name,
                         timeout=timeout).result()


def last_json(stdout: str):
    """The last JSON document printed on its own line (scenario scripts print one at the end)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith(("{", "[")):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output: {stdout!r}")


def unit_cgroup(unit: str, user: str | None = None) -> str:
    """The absolute cgroup directory of a unit, from systemd itself."""
    out = systemctl("show", "--property=ControlGroup", "--value", unit, user=user).stdout.strip()
    assert out, f"{unit} has no control group"
    return MOUNT + out


def user_manager_running(user: str) -> bool:
    """Whether `user`'s systemd manager (user@UID.service) is active."""
    import pwd
    uid = pwd.getpwnam(user).pw_uid
    return systemctl("is-active", f"user@{uid}.service", check=False).stdout.strip() == "active"


def stop_user_manager(user: str) -> None:
    """`user` not lingering and logged out everywhere, its manager and its bus gone (bounded wait)."""
    import pwd
    uid = pwd.getpwnam(user).pw_uid
    subprocess.run(["loginctl", "disable-linger", user], capture_output=True, timeout=60)
    subprocess.run(["loginctl", "terminate-user", user], capture_output=True, timeout=60)
    systemctl("stop", f"user@{uid}.service", check=False)
    assert wait_value(lambda: not os.path.exists(f"/run/user/{uid}/bus") and not user_manager_running(user), 120), \
        f"the user manager of {user} did not stop"


def wait_value(fn, timeout: float):
    """Call `fn` until it returns something truthy (returned) or the deadline passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read
        return False
    return state not in ("Z", "X")
