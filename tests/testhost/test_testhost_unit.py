"""contrib/cgturn.service for real: a gateway run by systemd as PID 1 with Delegate=yes.

The shipped unit is installed unchanged with the programs it names: /usr/local/bin/cgturn (the CLI
from the checkout, installed by scripts/testhost/guest.sh), /usr/local/lib/cgturn/enter-leaf
(contrib/enter-leaf) and /usr/local/bin/my-gateway (gateway.py here). It is installed once per case,
under a name of the case's own (the unit names its cgroup and managed root by %n), with a drop-in
that adds only what the case varies: PYTHONPATH, a state directory of its own (so two cases never
share the audit log), where the gateway reports, and KillMode= or User=.

Every case runs at once (one `systemctl start`, one crash of every gateway): under software
emulation each gateway start is two interpreter starts (ExecStartPre's reap, the gateway), and the
cases run side by side on the guest's CPUs instead of one after the other. The module's fixture does
the starts and the crash; each test checks what its case promises.
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

from hostlib import MOUNT, SHARE, TEST_USER, UNIT, pid_alive, systemctl, systemd_host, wait_value  # noqa: F401

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host"), UNIT]
HERE = os.path.dirname(os.path.abspath(__file__))
CONTRIB = os.path.join(SHARE, "contrib")
HELPERS = ["/usr/local/lib/cgturn/enter-leaf", "/usr/local/bin/my-gateway"]
# case -> what its drop-in adds. control-group is the shipped KillMode.
CASES = {
    "control-group": (),
    "mixed": ("KillMode=mixed",),
    "reap-root": ("KillMode=process",),
    "reap-user": ("KillMode=process", f"User={TEST_USER}"),
}


class Case:
    """One installed copy of the shipped unit and where its gateway reports."""

    def __init__(self, case: str):
        self.case = case
        self.name = f"cgturn-test-{case}"
        self.unit = f"{self.name}.service"
        self.cgroup = f"/system.slice/{self.unit}"
        self.state_dir = f"/run/{self.name}"
        self.status_dir = f"/run/{self.name}-status"
        self.path = f"/etc/systemd/system/{self.unit}"
        self.dropin_dir = f"{self.path}.d"
        self.old: dict = {}
        self.new: dict = {}
        self.ps_after_crash: list[dict] = []

    def install(self, lines: tuple[str, ...]) -> None:
        shutil.copy(os.path.join(CONTRIB, "cgturn.service"), self.path)
        os.makedirs(self.dropin_dir, exist_ok=True)
        os.makedirs(self.status_dir, exist_ok=True)
        os.chmod(self.status_dir, 0o777)  # the User= gateway reports here too
        with open(os.path.join(self.dropin_dir, "testhost.conf"), "w") as f:
            # `RuntimeDirectory=` empty first: the shipped /run/cgturn would be one directory for every
            # case, chowned to each case's User= at its start.
            f.write("[Service]\nRuntimeDirectory=\n"
                    f"RuntimeDirectory={self.name}\n"
                    f"Environment=PYTHONPATH={SHARE} CGTURN_STATE_DIR={self.state_dir} "
                    f"GATEWAY_STATUS_DIR={self.status_dir}\n")
            f.write("".join(line + "\n" for line in lines))

    def reports(self, exclude=()) -> dict | None:
        """The newest status file of a gateway not in `exclude` (pids), or None."""
        for path in sorted(glob.glob(f"{self.status_dir}/gateway-*.json"), key=os.path.getmtime, reverse=True):
            with open(path) as f:
                status = json.load(f)
            if status["pid"] not in exclude:
                return status
        return None

    def wait_gateway(self, exclude=(), timeout: float = 240.0) -> dict:
        status = wait_value(lambda: self.reports(exclude), timeout)
        assert status is not None, (f"no gateway of {self.unit} reported within {timeout} s:\n"
                                    + systemctl("status", "--no-pager", "-l", self.unit, check=False).stdout)
        return status

    def audit_records(self) -> list[dict]:
        try:
            with open(os.path.join(self.state_dir, "audit.jsonl")) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def cli_ps(self) -> list[dict]:
        env = dict(os.environ, CGTURN_ROOT=f"{MOUNT}{self.cgroup}/turns", CGTURN_STATE_DIR=self.state_dir)
        res = subprocess.run(["/usr/local/bin/cgturn", "ps", "--json"], env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    def remove(self) -> None:
        # Under KillMode=process `stop` leaves the turns running: kill every process of the unit's
        # cgroup first (the restart this triggers is cancelled by the stop), so nothing outlives it.
        systemctl("kill", "--signal=SIGKILL", "--kill-whom=all", self.unit, check=False)
        systemctl("stop", self.unit, check=False)
        gone = wait_value(lambda: not os.path.isdir(MOUNT + self.cgroup), 60)
        systemctl("reset-failed", self.unit, check=False)
        shutil.rmtree(self.dropin_dir, ignore_errors=True)
        for path in (self.state_dir, self.status_dir):
            shutil.rmtree(path, ignore_errors=True)
        os.unlink(self.path)
        assert gone, f"the cgroup of {self.unit} outlived it"


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    return bool(wait_value(lambda: not pid_alive(pid), timeout))


@pytest.fixture(scope="module")
def gateways():
    """Every case's unit started, its gateway SIGKILLed and restarted (Restart=on-failure); removed after."""
    os.makedirs("/usr/local/lib/cgturn", exist_ok=True)
    shutil.copy(os.path.join(CONTRIB, "enter-leaf"), HELPERS[0])
    shutil.copy(os.path.join(HERE, "gateway.py"), HELPERS[1])
    for path in HELPERS:
        os.chmod(path, 0o755)
    cases = {case: Case(case) for case in CASES}
    try:
        for case, lines in CASES.items():
            cases[case].install(lines)
        systemctl("daemon-reload")
        systemctl("start", "--no-block", *(c.unit for c in cases.values()))
        for c in cases.values():
            c.old = c.wait_gateway()
        for c in cases.values():
            os.kill(c.old["pid"], signal.SIGKILL)
        for c in cases.values():
            c.new = c.wait_gateway(exclude={c.old["pid"]})
        for case in ("control-group", "mixed"):
            cases[case].ps_after_crash = cases[case].cli_ps()
        yield cases
    finally:
        problems = []
        for c in cases.values():
            try:
                c.remove()
            except (AssertionError, OSError) as err:
                problems.append(str(err))
        for path in HELPERS:
            os.unlink(path)
        systemctl("daemon-reload")
        assert not problems, problems


def test_gateway_runs_in_its_leaf_and_its_turns_under_the_unit(gateways):
    c = gateways["control-group"]
    gw = c.new
    assert gw["cgroup"] == f"{c.cgroup}/supervisor"  # DelegateSubgroup=supervisor (systemd 257)
    for key in ("daemon_cgroup", "worker_cgroup"):
        assert gw[key].startswith(f"{c.cgroup}/turns/"), gw
    rows = [r for r in c.ps_after_crash if r["turn"] == gw["turn"]]
    assert len(rows) == 1 and rows[0]["state"] == "running", rows
    assert rows[0]["owner_pid"] == gw["pid"]
    assert {gw["daemon"], gw["worker"]} <= set(rows[0]["pids"])
    # Stopping the unit kills its whole subtree, the turn's setsid daemon included (KillMode=control-group).
    systemctl("stop", c.unit)
    assert wait_gone(gw["daemon"]) and wait_gone(gw["worker"])


@pytest.mark.parametrize("kill_mode", ["control-group", "mixed"])
def test_after_a_gateway_crash_systemd_itself_kills_the_turns(gateways, kill_mode):
    # control-group is the shipped setting. mixed only changes who gets the first SIGTERM: its
    # final SIGKILL still goes to every process left in the unit's cgroup (systemd.kill(5)), so the
    # turns do not outlive the crashed gateway either, and reap finds nothing of theirs to kill.
    c = gateways[kill_mode]
    old = c.old
    assert old["daemon_cgroup"].startswith(f"{c.cgroup}/turns/"), old
    assert wait_gone(old["daemon"]) and wait_gone(old["worker"])
    assert not [r for r in c.audit_records() if old["daemon"] in r.get("pids", [])], c.audit_records()
    assert old["turn"] not in [r["turn"] for r in c.ps_after_crash]
    assert c.new["cgroup"] == f"{c.cgroup}/supervisor"


@pytest.mark.parametrize("user", [None, TEST_USER], ids=["root", "user"])
def test_reap_in_exec_start_pre_kills_the_crashed_gateways_turns(gateways, user):
    # KillMode=process: systemd leaves the turns alone when the gateway dies, so only
    # ExecStartPre=cgturn reap can kill them on restart (and its audit record says it did).
    c = gateways["reap-user" if user else "reap-root"]
    old = c.old
    assert old["uid"] == (pwd.getpwnam(user).pw_uid if user else 0)
    assert old["daemon_cgroup"].startswith(f"{c.cgroup}/turns/")
    assert wait_gone(old["daemon"]) and wait_gone(old["worker"])
    reaped = [r for r in c.audit_records() if r.get("turn") == old["turn"]]
    assert len(reaped) == 1, c.audit_records()
    assert reaped[0]["reason"] == "owner-died"
    assert {old["daemon"], old["worker"]} <= set(reaped[0]["pids"])
