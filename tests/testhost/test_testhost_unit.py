"""contrib/cgturn.service for real: a gateway run by systemd as PID 1 with Delegate=yes.

The shipped unit is installed unchanged (/etc/systemd/system/cgturn.service) with the programs it
names: /usr/local/bin/cgturn (the CLI from the checkout, installed by scripts/testhost/guest.sh),
/usr/local/lib/cgturn/enter-leaf (contrib/enter-leaf) and /usr/local/bin/my-gateway (gateway.py
here). A drop-in adds only what a test varies: PYTHONPATH, where the gateway reports, and KillMode= or
User= where a test says so.
"""
from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import subprocess

import pytest

from hostlib import MOUNT, SHARE, TEST_USER, pid_alive, systemctl, systemd_host, wait_value  # noqa: F401

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host")]
HERE = os.path.dirname(os.path.abspath(__file__))
CONTRIB = os.path.join(SHARE, "contrib")
UNIT = "cgturn.service"
UNIT_CGROUP = f"/system.slice/{UNIT}"
STATE_DIR = "/run/cgturn"
DROPIN_DIR = f"/etc/systemd/system/{UNIT}.d"
INSTALLED = ["/etc/systemd/system/cgturn.service", "/usr/local/lib/cgturn/enter-leaf", "/usr/local/bin/my-gateway"]


@pytest.fixture
def gateway_unit():
    """Install the contrib unit; yield a function applying a drop-in; stop and remove it all at teardown."""
    os.makedirs("/usr/local/lib/cgturn", exist_ok=True)
    shutil.copy(os.path.join(CONTRIB, "cgturn.service"), INSTALLED[0])
    shutil.copy(os.path.join(CONTRIB, "enter-leaf"), INSTALLED[1])
    shutil.copy(os.path.join(HERE, "gateway.py"), INSTALLED[2])
    os.chmod(INSTALLED[1], 0o755)
    os.chmod(INSTALLED[2], 0o755)
    os.makedirs(DROPIN_DIR, exist_ok=True)

    def configure(*service_lines: str) -> None:
        with open(os.path.join(DROPIN_DIR, "testhost.conf"), "w") as f:
            f.write("[Service]\n")
            f.write(f"Environment=PYTHONPATH={SHARE} GATEWAY_STATUS_DIR={STATE_DIR}\n")
            f.write("".join(line + "\n" for line in service_lines))
        systemctl("daemon-reload")

    yield configure
    # Under KillMode=process `stop` leaves the turns running: kill every process of the unit's
    # cgroup first (the restart this triggers is cancelled by the stop), so no test inherits them.
    systemctl("kill", "--signal=SIGKILL", "--kill-whom=all", UNIT, check=False)
    systemctl("stop", UNIT, check=False)
    assert wait_value(lambda: not os.path.isdir(MOUNT + UNIT_CGROUP), 60), "the unit's cgroup outlived it"
    systemctl("reset-failed", UNIT, check=False)
    shutil.rmtree(DROPIN_DIR, ignore_errors=True)
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    for path in INSTALLED:
        os.unlink(path)
    systemctl("daemon-reload")


def gateway_reports(exclude=()) -> dict | None:
    """The newest status file of a gateway not in `exclude` (pids), or None."""
    for path in sorted(glob.glob(f"{STATE_DIR}/gateway-*.json"), key=os.path.getmtime, reverse=True):
        with open(path) as f:
            status = json.load(f)
        if status["pid"] not in exclude:
            return status
    return None


def wait_gateway(exclude=(), timeout: float = 120.0) -> dict:
    status = wait_value(lambda: gateway_reports(exclude), timeout)
    assert status is not None, (f"no gateway reported within {timeout} s:\n"
                                + systemctl("status", "--no-pager", "-l", UNIT, check=False).stdout)
    return status


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    return bool(wait_value(lambda: not pid_alive(pid), timeout))


def audit_records() -> list[dict]:
    try:
        with open(os.path.join(STATE_DIR, "audit.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def cli_ps() -> list[dict]:
    env = dict(os.environ, CGTURN_ROOT=f"{MOUNT}{UNIT_CGROUP}/turns", CGTURN_STATE_DIR=STATE_DIR)
    res = subprocess.run(["/usr/local/bin/cgturn", "ps", "--json"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_gateway_runs_in_its_leaf_and_its_turns_under_the_unit(gateway_unit):
    gateway_unit()
    systemctl("start", UNIT)
    gw = wait_gateway()
    assert gw["cgroup"] == f"{UNIT_CGROUP}/supervisor"  # DelegateSubgroup=supervisor (systemd 257)
    for key in ("daemon_cgroup", "worker_cgroup"):
        assert gw[key].startswith(f"{UNIT_CGROUP}/turns/"), gw
    rows = [r for r in cli_ps() if r["turn"] == gw["turn"]]
    assert len(rows) == 1 and rows[0]["state"] == "running", rows
    assert rows[0]["owner_pid"] == gw["pid"]
    assert {gw["daemon"], gw["worker"]} <= set(rows[0]["pids"])
    # Stopping the unit kills its whole subtree, the turn's setsid daemon included (KillMode=control-group).
    systemctl("stop", UNIT)
    assert wait_gone(gw["daemon"]) and wait_gone(gw["worker"])


@pytest.mark.parametrize("kill_mode", ["control-group", "mixed"])
def test_after_a_gateway_crash_systemd_itself_kills_the_turns(gateway_unit, kill_mode):
    # control-group is the shipped setting. mixed only changes who gets the first SIGTERM: its
    # final SIGKILL still goes to every process left in the unit's cgroup (systemd.kill(5)), so the
    # turns do not outlive the crashed gateway either, and reap finds nothing of theirs to kill.
    gateway_unit(f"KillMode={kill_mode}")
    systemctl("start", UNIT)
    old = wait_gateway()
    os.kill(old["pid"], signal.SIGKILL)
    new = wait_gateway(exclude={old["pid"]})  # Restart=on-failure
    assert wait_gone(old["daemon"]) and wait_gone(old["worker"])
    assert not [r for r in audit_records() if old["daemon"] in r.get("pids", [])], audit_records()
    assert old["turn"] not in [r["turn"] for r in cli_ps()]
    assert new["cgroup"] == f"{UNIT_CGROUP}/supervisor"


@pytest.mark.parametrize("user", [None, TEST_USER], ids=["root", "user"])
def test_reap_in_exec_start_pre_kills_the_crashed_gateways_turns(gateway_unit, user):
    # KillMode=process: systemd leaves the turns alone when the gateway dies, so only
    # ExecStartPre=cgturn reap can kill them on restart (and its audit record says it did).
    gateway_unit("KillMode=process", *([f"User={user}"] if user else []))
    systemctl("start", UNIT)
    old = wait_gateway()
    assert old["uid"] == (pwd.getpwnam(user).pw_uid if user else 0)
    assert old["daemon_cgroup"].startswith(f"{UNIT_CGROUP}/turns/")
    os.kill(old["pid"], signal.SIGKILL)
    wait_gateway(exclude={old["pid"]})
    assert wait_gone(old["daemon"]) and wait_gone(old["worker"])
    reaped = [r for r in audit_records() if r.get("turn") == old["turn"]]
    assert len(reaped) == 1, audit_records()
    assert reaped[0]["reason"] == "owner-died"
    assert {old["daemon"], old["worker"]} <= set(reaped[0]["pids"])
