"""cgturn as an unprivileged user on a systemd host, with no configuration (docs/where.md).

A user logged in the way an SSH session is (pam_systemd puts them in a root-owned
`session-N.scope`, and starts their own manager, user@UID.service) gets cgroup2 turns: cgturn asks
that manager for `cgturn.scope` with Delegate=yes and moves itself into it. Also here: a user service
without Delegate=yes (its own, writable, undelegated cgroup), a cron-style job (a system service with
User=, no PAM session) with and without linger, and what logging out does to the scope.

Every session and unit here is the test's own; the user manager is stopped at the end of each test.
"""
from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import subprocess
import sys

import pytest

from hostlib import (GUEST_STATE, MOUNT, SHARE, TEST_USER, last_json, pid_alive, run_in_unit, start_in_unit, stop_user_manager,  # noqa: F401
                     systemctl, systemd_host, unit_name, user_manager_running, wait_value)

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host"), GUEST_STATE]
HERE = os.path.dirname(os.path.abspath(__file__))


def _test_uid() -> int:
    try:
        return pwd.getpwnam(TEST_USER).pw_uid
    except KeyError:  # not the test host: every test here is skipped (tests/conftest.py)
        return -1


UID = _test_uid()
SCOPE = f"/user.slice/user-{UID}.slice/user@{UID}.service/app.slice/cgturn.scope"
# logind names sessions without an audit session id c1, c2, ... (session-c1.scope)
SESSION = re.compile(rf"^/user\.slice/user-{UID}\.slice/session-[^/]+\.scope$")
# Sessions run with the sentinel on, the default: `cgturn run` forks it before its turn (before the
# scope exists, when it is the first), TurnManager's is attached after; both must guard turns in the
# scope. Units that test only where the managed root is run without it (CGTURN_SENTINEL=0).
NO_SENTINEL = "0"
# A daemon's stdio off the test's pipes: a survivor holding the captured stdout would make the
# session's subprocess.run wait for it to exit, and a check after that would see it gone either way.
QUIET = "</dev/null >/dev/null 2>&1"
# Inside a session: wait (bounded) for the user's bus, which pam_systemd's user manager brings up.
WAIT_BUS = ('i=0; while [ ! -S "$XDG_RUNTIME_DIR/bus" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; ')


def _login_argv(method: str, command: str) -> list[str]:
    """A login session for TEST_USER through PAM (pam_systemd), running `command` in sh."""
    script = f"{WAIT_BUS}cd / && export PYTHONPATH={SHARE} && {command}"
    if method == "su":
        return ["su", "-l", TEST_USER, "-c", script]
    return ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", f"--uid={TEST_USER}", "-p", "PAMName=login",
            f"--unit={unit_name()}", "--", "/bin/sh", "-c", script]


def _pam_stack_has_systemd(service: str, pam_dir: str = "/etc/pam.d", depth: int = 0) -> bool:
    """Whether PAM's `service` runs pam_systemd in its session phase (its own lines or an @include)."""
    try:
        with open(os.path.join(pam_dir, service)) as f:
            lines = [line.split() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError:
        return False
    for words in lines:
        if words[0] == "@include" and len(words) > 1 and depth < 4:
            if _pam_stack_has_systemd(words[1], pam_dir, depth + 1):
                return True
        elif words[0].lstrip("-") == "session" and any("pam_systemd.so" in w for w in words):
            return True
    return False


@pytest.fixture(scope="module")
def login_method():
    """How this guest makes an SSH-like session: `su -l` when su's PAM stack runs pam_systemd (Debian's
    does, through common-session), else a PAMName=login unit. Read from the PAM files rather than
    tried with a login of its own, which costs a user manager's start and stop; the tests check that
    their session is a root-owned session scope."""
    return "su" if _pam_stack_has_systemd("su") else "pam-unit"


def in_session(method: str, command: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(_login_argv(method, command), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _user_manager_running() -> bool:
    return user_manager_running(TEST_USER)


def _stop_user_manager() -> None:
    stop_user_manager(TEST_USER)


@pytest.fixture
def no_user_manager():
    """TEST_USER logged out, not lingering: no user manager runs. Left so afterwards too."""
    _stop_user_manager()
    yield
    _stop_user_manager()


def _marker() -> str:
    return f"300.{secrets.randbelow(10**8):08d}"


def _marked(marker: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read() and pid_alive(int(name)):
                        out.append(int(name))
            except OSError:
                continue
    return out


def _kill_record(state_dir: str, task: str, turn: str | None) -> dict | None:
    """The first kill record of `task` (and `turn`, unless None) in the audit log of `state_dir`."""
    try:
        with open(os.path.join(state_dir, "audit.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return None
    return next((r for r in records if r.get("action", "kill") == "kill" and r["task"] == task
                 and turn in (None, r["turn"])), None)


def _json_lines(stdout: str) -> list:
    """The JSON documents in `stdout`, in order. The CLI prints them indented: a document starts on a
    line that begins with `{` or `[` and ends where it parses (other output may sit between). Read
    here rather than compacted by a `python3 -c` after each command: under emulation every
    interpreter start in a session costs seconds."""
    decoder, docs, offset, done_to = json.JSONDecoder(), [], 0, 0
    for line in stdout.splitlines(keepends=True):
        start, offset = offset, offset + len(line)
        if start < done_to or not line.startswith(("{", "[")):
            continue
        try:
            doc, done_to = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            continue
        docs.append(doc)
    return docs


def test_an_ssh_style_user_gets_cgroup2_turns_in_a_delegated_scope(login_method, no_user_manager):
    # A session that stays open for the whole test: the user is logged in throughout.
    holder = subprocess.Popen(_login_argv(login_method, "exec sleep 900"), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_value(lambda: os.path.exists(f"/run/user/{UID}/bus"), 120), "no user bus after login"
        res = in_session(login_method, f"{sys.executable} {HERE}/user_scenario.py")
        assert res.returncode == 0, res.stdout + res.stderr
        out = last_json(res.stdout)
        assert out["uid"] == UID
        assert SESSION.match(out["own_before"]), out["own_before"]  # root-owned: not writable
        before = out["doctor_before"]
        assert before["backend"] == "cgroup2", before
        assert before["systemd_scope"]["exists"] is False and before["systemd_scope"]["moves_caller"] is True
        assert before["managed_root"] == MOUNT + SCOPE + "/cgturn"
        assert out["backend"] == "cgroup2" and out["root"] == MOUNT + SCOPE + "/cgturn"
        assert out["own_after"] == SCOPE + "/owners"  # the caller moved itself into the scope
        # Every escaper was in the turn's cgroup and died with it, the environment-clearing one too.
        launched = out["escapers"]
        assert {"double_fork_setsid", "setsid_f", "nohup_disown", "env_cleared"} <= set(launched), launched
        for name, seen in launched.items():
            assert seen["pids"], name
            assert seen["cgroups"] == [SCOPE + "/cgturn/chat/t1"], (name, seen)
            assert seen["left"] == [], (name, seen)
            assert set(seen["pids"]) <= set(out["killed"]), (name, seen)
        # v2 limits for what the user manager delegates: the scope's subtree_control was cgturn's to write.
        assert out["limits"]["layout"] == "v2", out["limits"]
        assert {"memory", "pids"} <= set(out["limits"]["available"]), out["limits"]
        assert out["pids_max"] == "7"
        # The completed turn's server outlives the gateway that started it.
        assert out["server_cgroup"] == SCOPE + "/cgturn/chat/t2"
        assert pid_alive(out["server"])

        # Another session finds the managed root without creating or moving anything.
        res = in_session(login_method, "python3 -m cgturn ps --json; python3 -m cgturn doctor --json")
        assert res.returncode == 0, res.stdout + res.stderr
        listing, doctor = _json_lines(res.stdout)[-2:]
        t2 = [t for t in listing if t["turn"] == "t2"]
        assert t2 and t2[0]["state"] == "completed" and out["server"] in t2[0]["pids"], listing
        assert doctor["systemd_scope"]["exists"] is True and doctor["systemd_scope"]["caller_inside"] is False
        assert SESSION.match(doctor["own_cgroup"][len(MOUNT):]), doctor["own_cgroup"]

        # `cgturn run` from a session: the command runs in the scope, its env-clearing daemon dies.
        marker = _marker()
        res = in_session(login_method, "cgturn run --task cli --reap-on-exit -- sh -c "
                                       f"'cat /proc/self/cgroup; setsid -f env -i sleep {marker} {QUIET}'")
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"0::{SCOPE}/cgturn/cli/" in res.stdout, res.stdout
        assert wait_value(lambda: not _marked(marker), 30), _marked(marker)

        # A gateway SIGKILLed with a turn running: only its sentinel, forked into the scope's owners
        # leaf, is left to abandon the turn, whose environment-clearing daemon dies with it.
        res = in_session(login_method, f"{sys.executable} {HERE}/user_scenario.py --die")
        died = last_json(res.stdout)  # the session's status is the SIGKILL's (137): not checked
        assert died["own"] == died["sentinel_cgroup"] == SCOPE + "/owners", died
        assert died["escaper_cgroups"] == [SCOPE + "/cgturn/killed/t1"] and died["escaper_pids"], died
        assert wait_value(lambda: not _marked(died["marker"]), 60), _marked(died["marker"])
        record = wait_value(lambda: _kill_record(died["state_dir"], "killed", "t1"), 30)
        assert record and record["reason"] == "owner-died" and record["by_pid"] == died["sentinel"], record
        assert set(died["escaper_pids"]) <= set(record["pids"]), record
        assert wait_value(lambda: not os.path.isdir(MOUNT + SCOPE + "/cgturn/killed/t1"), 30)

        # `cgturn run` SIGKILLed while its command runs: run's sentinel abandons the turn.
        marker = _marker()
        res = in_session(login_method, "cgturn run --task cli-killed -- sh -c "
                                       f"'setsid -f env -i sleep {marker} {QUIET}; kill -KILL $PPID; "
                                       f"exec sleep {marker} {QUIET}'")
        record = wait_value(lambda: _kill_record(died["state_dir"], "cli-killed", None), 60)
        assert record and record["reason"] == "owner-died", (record, res.stdout + res.stderr)
        assert len(record["pids"]) >= 2, record  # the command and its env-clearing daemon
        assert wait_value(lambda: not _marked(marker), 30), _marked(marker)

        # `stop` from another session kills the survivor through cgroup.kill.
        res = in_session(login_method, "cgturn stop chat t2 --force --grace 0 --json")
        assert res.returncode == 0, res.stdout + res.stderr
        assert wait_value(lambda: not pid_alive(out["server"]), 30)
    finally:
        holder.terminate()
        holder.wait(timeout=60)


def test_logging_out_without_linger_takes_the_scope_and_its_survivors(login_method, no_user_manager):
    # Documented (docs/where.md): without linger the user manager stops after the last session,
    # and cgturn.scope, with a completed turn's survivors in it, goes with it. A second session is
    # the "last session" here, so that the survivor is seen alive before the logout.
    holder = subprocess.Popen(_login_argv(login_method, "exec sleep 900"), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_value(lambda: os.path.exists(f"/run/user/{UID}/bus"), 120), "no user bus after login"
        marker = _marker()
        res = in_session(login_method, "cgturn run --task bg -- sh -c "
                                       f"'setsid -f sleep {marker} {QUIET}; cat /proc/self/cgroup'")
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"0::{SCOPE}/cgturn/bg/" in res.stdout, res.stdout
        survivors = _marked(marker)
        assert survivors, "the completed turn's daemon did not survive cgturn run"
    finally:
        holder.terminate()  # the user's last session ends
        holder.wait(timeout=60)
    # logind stops user@UID.service after UserStopDelaySec (10 s by default), and the scope with it.
    assert wait_value(lambda: not _marked(marker), 120), "the survivor outlived the user's logout"
    assert wait_value(lambda: not os.path.isdir(MOUNT + SCOPE), 60), "cgturn.scope outlived the user manager"


def _cgturn(*args: str) -> list[str]:
    return [sys.executable, "-m", "cgturn", *args]


@pytest.fixture(scope="module")
def jobs():
    """The cron-style and user-service cases, their units run side by side where they can: first the
    cron-style job with the user logged out and not lingering, then, with the user lingering, the
    user service and the lingering user's cron-style job at once. Returns their results by name."""
    out = {}
    _stop_user_manager()
    try:
        # A system service with User= and no PAM session, as Debian's cron runs a job (its PAM stack
        # has no pam_systemd): a root-owned cgroup, no XDG_RUNTIME_DIR, and no user manager.
        out["cron"] = run_in_unit(_cgturn("doctor", "--json"), props=(f"User={TEST_USER}",))
        subprocess.run(["loginctl", "enable-linger", TEST_USER], check=True, capture_output=True, timeout=60)
        assert wait_value(lambda: _user_manager_running() and os.path.exists(f"/run/user/{UID}/bus"), 120), \
            systemctl("status", "--no-pager", f"user@{UID}.service", check=False).stdout
        name = unit_name()
        out["service_cgroup"] = f"/user.slice/user-{UID}.slice/user@{UID}.service/app.slice/{name}.service"
        service = start_in_unit(["/bin/sh", "-c", f"{' '.join(_cgturn('doctor', '--json'))}; "
                                 f"{' '.join(_cgturn('run', '--task', 'svc', '--reap-on-exit', '--', 'cat', '/proc/self/cgroup'))}"],
                                name=name, user_manager=TEST_USER, env={"CGTURN_SENTINEL": NO_SENTINEL},
                                timeout=600)
        out["marker"] = marker = _marker()
        cron = start_in_unit(["/bin/sh", "-c", f"{' '.join(_cgturn('doctor', '--json'))}; "
                              + " ".join(_cgturn("run", "--task", "cron", "--reap-on-exit", "--", "sh", "-c",
                                                 f"'cat /proc/self/cgroup; setsid -f env -i sleep {marker} {QUIET}'"))],
                             props=(f"User={TEST_USER}",), env={"CGTURN_SENTINEL": NO_SENTINEL}, timeout=600)
        out["service"], out["cron_lingering"] = service.result(), cron.result()
        yield out
    finally:
        _stop_user_manager()


def test_a_user_service_without_delegation_uses_its_own_cgroup_and_says_so(jobs):
    res, unit = jobs["service"], jobs["service_cgroup"]
    assert res.returncode == 0, res.stdout + res.stderr
    report = _json_lines(res.stdout)[0]
    assert report["backend"] == "cgroup2" and report["own_cgroup"] == MOUNT + unit
    assert report["delegated"] is False and report["systemd_scope"] is None
    assert any("systemd did not delegate it" in p for p in report["problems"]), report["problems"]
    assert report["limits"]["available"] == [], report["limits"]
    assert f"0::{unit}/cgturn/svc/" in res.stdout, res.stdout  # turns below the unit's own cgroup


def test_a_cron_style_job_without_linger_falls_back_with_a_reason(jobs):
    res = jobs["cron"]
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["backend"] == "registry" and report["systemd_scope"] is None
    assert any("no systemd user manager is reachable" in p and "linger" in p for p in report["problems"]), \
        report["problems"]


def test_a_cron_style_job_of_a_lingering_user_gets_the_scope(jobs):
    res, marker = jobs["cron_lingering"], jobs["marker"]
    assert res.returncode == 0, res.stdout + res.stderr
    report = _json_lines(res.stdout)[0]
    assert report["backend"] == "cgroup2", report
    assert report["systemd_scope"]["manager"] == "user" and report["systemd_scope"]["moves_caller"] is True
    assert f"0::{SCOPE}/cgturn/cron/" in res.stdout, res.stdout
    assert wait_value(lambda: not _marked(marker), 30), _marked(marker)
