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

# Under software emulation (TCG: every CI run on the development machine) the guest's whole budget is
# `.ci/run`'s --timeout. Tests that cost minutes there beyond one case of their kind carry `slow`: they
# run where the guest has KVM, or when the checkout carries this flag file (`touch
# .testhost-containers-all` before scripts/testhost/run.py).
ALL_FLAG = "/share/.testhost-containers-all"


def everything() -> bool:
    """Whether this guest runs the `slow` tests too (KVM, or the flag file)."""
    virt = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True).stdout.strip()
    return virt == "kvm" or os.path.exists(ALL_FLAG)


slow = pytest.mark.skipif("not everything()", reason="under software emulation (TCG) this costs minutes the "
                          f"stage's budget does not have: runs under KVM or with {ALL_FLAG} (docs/testhost.md)")


@pytest.fixture
def systemd_host():
    """Fail (not skip) unless this really is the host the tests were written for."""
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


def run_in_unit(argv: list[str], *, props: tuple[str, ...] = (), env: dict[str, str] | None = None,
                user_manager: str | None = None, name: str | None = None,
                timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `argv` as a transient service (systemd-run --wait --pipe) and return its output and status.

    `user_manager`: start it under that user's own systemd manager instead of the system's.
    """
    name = name or unit_name()
    argv_run = ["systemd-run", "--wait", "--pipe", "--quiet", "--collect", f"--unit={name}",
                f"--setenv=PYTHONPATH={SHARE}"]
    argv_run += [f"--setenv={k}={v}" for k, v in (env or {}).items()]
    argv_run += [f"--property={p}" for p in props]
    if user_manager:
        argv_run = user_argv(user_manager, [argv_run[0], "--user", *argv_run[1:]])
    try:
        return subprocess.run([*argv_run, "--", *argv], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    finally:
        stop = ["systemctl", "stop", f"{name}.service"]
        subprocess.run(user_argv(user_manager, [stop[0], "--user", *stop[1:]]) if user_manager else stop,
                       capture_output=True, timeout=60)


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
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")
