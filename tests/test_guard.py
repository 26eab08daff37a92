"""The pressure guard: PSI trigger rules (table), arming on the real kernel, and the guard acting on real
CPU pressure made on purpose — a turn running more busy loops than the machine has cores beside a
stand-in gateway in a cgroup the test created and watches (never a cgroup the test did not create).

Every busy loop ends by itself after BUSY_SECONDS; every cgroup is removed at teardown.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from conftest import (PY, audit_records, cgturn_argv, cgturn_env, cli, destroy_cgroup_tree, need_cgroup2, turn_dir,
                      wait_until)
from cgturn import GuardUnavailable, Limits, Overloaded, PressureGuard, TurnManager
from cgturn.backends import guard_state
from cgturn.guard_policy import Hold, Step, eligible, frozen_too_long, heaviest, poll_timeout_ms, still_pressing, watched_cgroup
from cgturn.kernel.cgroupfs import Cgroup
from cgturn.model import TurnRecord
from cgturn.kernel import parsers, procfs, psi
from cgturn.metrics import AuditTail

BUSY_SECONDS = 60
BUSY = f"import time\nend = time.monotonic() + {BUSY_SECONDS}\nwhile time.monotonic() < end: pass"
HOGS = (os.cpu_count() or 2) + 1
# Windows must be multiples of 2 s without CAP_SYS_RESOURCE (6.5+); 5 % of the window as threshold.
TRIGGER = "some 100000 2000000"
DEADLINE = 60  # generous: other test runs share these 2 cores


# --- pure parts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("some 150000 1000000", psi.Trigger("some", 150000, 1000000)),
    ("full 1 500000", psi.Trigger("full", 1, 500000)),
    ("  some   10000000 10000000 ", psi.Trigger("some", 10000000, 10000000)),
])
def test_parse_trigger(text, expected):
    assert psi.parse_trigger(text) == expected


@pytest.mark.parametrize("text, rule", [
    ("some 150000", "expected 'some|full <stall us> <window us>'"),
    ("some 1 2 3", "expected 'some|full"),
    ("most 1 1000000", "the kind must be 'some' or 'full'"),
    ("some 1.5 1000000", "whole microseconds"),
    ("some -1 1000000", "whole microseconds"),
    ("some ١ 1000000", "whole microseconds"),
    ("some 1 499999", "windows of 500000-10000000 us"),
    ("some 1 10000001", "windows of 500000-10000000 us"),
    ("some 0 1000000", "must be > 0 and at most the window"),
    ("some 1000001 1000000", "must be > 0 and at most the window"),
])
def test_parse_trigger_names_the_kernel_rule(text, rule):
    with pytest.raises(ValueError, match=rule.replace("|", r"\|").replace("(", r"\(")):
        psi.parse_trigger(text)


@pytest.mark.parametrize("window, privileged, kernel, rule", [
    (1000000, True, (6, 18), None),
    (2000000, False, (6, 5), None),
    (4000000, False, (6, 18), None),
    (1000000, False, (6, 18), "multiples of 2 s"),
    (2000000, False, (6, 4), "needs CAP_SYS_RESOURCE before Linux 6.5"),
])
def test_privilege_rule(window, privileged, kernel, rule):
    trig = psi.Trigger("some", 1000, window)
    if rule is None:
        psi.check_privilege(trig, privileged, kernel)
    else:
        with pytest.raises(ValueError, match=rule):
            psi.check_privilege(trig, privileged, kernel)


@pytest.mark.parametrize("release, expected", [("6.18.44-fc-v857", (6, 18)), ("5.4.0", (5, 4)),
                                               ("6.5-rc1", (6, 5)), ("garbage", (0, 0))])
def test_parse_kernel_release(release, expected):
    assert psi.parse_kernel_release(release) == expected


def test_parse_cap_eff_and_stall_total():
    assert psi.parse_cap_eff("Name:\tx\nCapEff:\t000001fffeffffff\n") >> psi.CAP_SYS_RESOURCE & 1 == 0
    assert psi.parse_cap_eff("CapEff:\t000001ffffffffff\n") >> psi.CAP_SYS_RESOURCE & 1 == 1
    text = "some avg10=1.50 avg60=0.00 avg300=0.00 total=12345\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=7\n"
    assert (psi.stall_total(text, "some"), psi.stall_total(text, "full")) == (12345, 7)
    assert psi.stall_total("some avg10=0.00\n", "full") is None
    assert parsers.parse_io_stat_bytes("8:0 rbytes=10 wbytes=5 rios=1\n259:0 rbytes=1 wbytes=0\n") == 16


@pytest.mark.parametrize("now, before, cumulative, expected", [
    ({}, {}, True, None),
    ({"a": 10.0, "b": 3.0}, {"a": 9.5, "b": 0.0}, True, "b"),     # CPU in the window, not in a lifetime
    ({"a": 10.0, "b": 3.0}, {"a": 9.5}, True, "b"),               # new turn: all it used
    ({"a": 100, "b": 300}, {"a": 0, "b": 299}, False, "b"),        # memory: the level
])
def test_heaviest(now, before, cumulative, expected):
    assert heaviest(now, before, cumulative) == expected


@pytest.mark.parametrize("watch, owner, root, expected", [
    ("host", "/m/x", "/m/r", None),                  # None: the host, /proc/pressure
    ("root", "/m/x", "/m/r", "/m/r"),
    ("owner", "/m/gw", "/m/r", "/m/gw"),
    ("owner", None, "/m/r", None),                   # the owner sits in the root cgroup: the host
    ("/m/other", None, None, "/m/other"),
])
def test_watched_cgroup(watch, owner, root, expected):
    assert watched_cgroup(watch, owner, root) == expected


def test_watched_cgroup_root_needs_cgroup2():
    with pytest.raises(GuardUnavailable, match="needs the cgroup2 backend"):
        watched_cgroup("root", None, None)


def _rec(state="running", frozen_by=None):
    return TurnRecord("t", "u", "t", "u", state=state, frozen_by=frozen_by)


@pytest.mark.parametrize("rec, pids, expected", [
    (_rec(), [1], True),
    (_rec(), [], False),                              # nothing to freeze
    (_rec(frozen_by="user"), [1], False),             # a user's pause is never the guard's
    (_rec(frozen_by="guard"), [1], False),            # frozen already
    (_rec(state="completed"), [1], False),            # survivors of a completed turn are not work in flight
])
def test_eligible(rec, pids, expected):
    assert eligible(rec, pids) is expected


@pytest.mark.parametrize("total, prev, elapsed, expected", [
    (100_000, 0, 2.0, True),      # 100 ms of stall in 2 s, scaled to the 2 s window: at the threshold
    (99_999, 0, 2.0, False),
    (50_000, 0, 1.0, True),       # 50 ms in 1 s is 100 ms per 2 s window
    (10, 0, 0.0, False),          # no time passed: nothing measured
])
def test_still_pressing(total, prev, elapsed, expected):
    assert still_pressing(total, prev, elapsed, window=2.0, threshold=100_000) is expected


# (crossed, still, now) at each wake-up, and the Step expected; thaw_after 5, last over at -5 (a start).
@pytest.mark.parametrize("wakeups, steps", [
    ([(False, False, 1.0)], [Step(refresh=True, thaw=True)]),                    # quiet: baselines only
    ([(True, True, 1.0)], [Step(began=True, act=True)]),                          # a crossing: on, act
    ([(True, True, 1.0), (True, True, 2.0)], [Step(began=True, act=True), Step(act=True)]),  # on already
    ([(True, True, 1.0), (False, True, 4.0), (False, False, 8.0), (False, False, 9.0)],
     [Step(began=True, act=True), Step(), Step(), Step(ended=True, thaw=True)]),  # still on at 4: ends at 9
    ([(True, True, 1.0), (False, False, 6.0)], [Step(began=True, act=True), Step(ended=True, thaw=True)]),
])
def test_hold_steps(wakeups, steps):
    hold = Hold(thaw_after=5.0, last_over=-5.0)
    assert [hold.step(c, s, now, cumulative=True) for c, s, now in wakeups] == steps


def test_hold_on_memory_refreshes_nothing():
    assert Hold(thaw_after=5.0, last_over=-5.0).step(False, False, 1.0, cumulative=False) == Step(thaw=True)


@pytest.mark.parametrize("frozen_at, now, expected", [(None, 100.0, False), (40.0, 100.0, True),
                                                      (40.1, 100.0, False)])
def test_frozen_too_long(frozen_at, now, expected):
    assert frozen_too_long(frozen_at, now, abandon_after=60.0) is expected


@pytest.mark.parametrize("holding, cumulative, expected", [(True, True, 1000), (True, False, 1000),
                                                           (False, True, 2000), (False, False, None)])
def test_poll_timeout(holding, cumulative, expected):
    assert poll_timeout_ms(holding, 2.0, cumulative) == expected
    assert poll_timeout_ms(True, 0.01, cumulative) == 50  # never a busy loop


@pytest.mark.parametrize("kwargs, rule", [
    ({"resource": "disk"}, "unknown resource"),
    ({"action": "kill"}, "unknown action"),
    ({"watch": "gateway"}, "watch must be one of"),
    ({"thaw_after": -1}, "thaw_after must be"),
    ({"abandon_after": float("nan")}, "abandon_after must be"),
    ({"trigger": "some 1 100"}, "windows of 500000-10000000 us"),
])
def test_guard_rejects_bad_settings(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        PressureGuard(**kwargs)


@pytest.mark.parametrize("args, rule", [
    (["--trigger", "some 150000"], "expected 'some|full"),
    (["--trigger", "some 2000001 2000000"], "at most the window"),
    (["--resource", "disk"], "unknown resource"),
    (["--action", "kill"], "unknown action"),
])
def test_cli_guard_bad_input_exits_2(tmp_path, args, rule):
    proc = subprocess.run(cgturn_argv(None, str(tmp_path), "guard", *args), env=cgturn_env(),
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert rule in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_metrics_count_guard_actions(tmp_path):
    lines = [{"action": "freeze", "reason": "guard", "task": "t", "turn": "u", "pids": [1]},
             {"action": "freeze", "reason": "user", "task": "t", "turn": "u", "pids": [1]},
             {"action": "thaw", "reason": "guard", "task": "t", "turn": "u", "pids": [1]},
             {"task": "t", "turn": "u", "reason": "pressure", "pids": [5], "duration_ms": 3.0}]
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    tail = AuditTail(str(tmp_path))
    tail.update()
    assert tail.guard_actions == {"freeze": 1, "thaw": 1, "abandon": 1}


# --- the kernel ------------------------------------------------------------------------------------

@pytest.fixture
def test_cgroup():
    """A cgroup this test created (`<mount>/cgturn-test-<random>-w`), removed at teardown."""
    path = os.path.join(need_cgroup2(), f"cgturn-test-{uuid.uuid4().hex[:10]}-w")
    os.mkdir(path)
    yield path
    destroy_cgroup_tree(path)


def test_arm_read_and_poll_err_when_the_cgroup_goes(test_cgroup):
    trig = psi.ArmedTrigger(psi.pressure_file("cpu", test_cgroup), psi.validate_trigger(TRIGGER))
    try:
        assert trig.total_us() == 0  # nothing ever ran in it
        with pytest.raises(OSError) as err:  # one trigger per open file
            os.write(trig.fd, b"some 100000 2000000\0")
        assert err.value.errno == 16  # EBUSY
        assert trig.wait(0) == 0
        os.rmdir(test_cgroup)
        assert trig.wait(5) & 0x8  # POLLERR: the watched cgroup is gone
    finally:
        trig.close()


@pytest.mark.skipif(psi.privileged(), reason="this process has CAP_SYS_RESOURCE: the kernel takes 1 s windows")
def test_kernel_refuses_what_validation_refuses(test_cgroup):
    with pytest.raises(OSError) as err:
        psi.ArmedTrigger(psi.pressure_file("cpu", test_cgroup), psi.Trigger("some", 150000, 1000000))
    assert err.value.errno == 22  # EINVAL: the rule psi.check_privilege states
    with pytest.raises(ValueError, match="multiples of 2 s"):
        psi.validate_trigger("some 150000 1000000")


def test_guard_that_cannot_arm_says_so_and_doctor_shows_it(cgroup2_root, state_dir):
    missing = cgroup2_root + "-absent"
    with pytest.raises(GuardUnavailable, match="no PSI file"):
        TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir,
                    guard=PressureGuard(resource="cpu", trigger=TRIGGER, watch=missing))


# --- admission (the state any process reads) ---------------------------------------------------------

def _claim_over(mgr) -> dict:
    me = os.getpid()
    state = {"owner_pid": me, "owner_start": procfs.start_time(me), "armed": True, "over": True,
             "since": time.time(), "resource": "cpu", "file": "/test"}
    assert guard_state.claim(mgr.backend, state) is None
    return state


def test_admission_waits_while_over_then_admits(cgroup2_manager):
    state = _claim_over(cgroup2_manager)
    clearing = threading.Event()

    def clear():
        # Set before the save that lets admission through, so a begin_turn that returns saw it set.
        clearing.set()
        state["over"] = False
        guard_state.save(cgroup2_manager.backend, state)

    # A delay, not a wait: admission must be waiting (over) when the pressure clears.
    timer = threading.Timer(0.3, clear)
    timer.start()
    try:
        turn = cgroup2_manager.begin_turn("t", "u", admit_timeout=30)
        assert clearing.is_set() and turn.state == "running"
        turn.complete()
    finally:
        timer.cancel()
        timer.join()


def test_admission_raises_overloaded_and_without_timeout_is_immediate(cgroup2_manager):
    _claim_over(cgroup2_manager)
    start = time.monotonic()
    with pytest.raises(Overloaded, match="pressure guard"):
        cgroup2_manager.begin_turn("t", "late", admit_timeout=0.3)
    assert time.monotonic() - start >= 0.3
    assert cgroup2_manager.turns("t") == []
    with pytest.raises(Overloaded):
        asyncio.run(cgroup2_manager.abegin_turn("t", "late", admit_timeout=0.2))
    cgroup2_manager.begin_turn("t", "now").complete()  # no admit_timeout: unchanged behaviour


def test_admission_ignores_a_dead_guard(cgroup2_manager):
    state = _claim_over(cgroup2_manager)
    with pytest.raises(Overloaded):  # while the guard lives, its pressure holds admission back
        cgroup2_manager.begin_turn("t", "held", admit_timeout=0)
    state["owner_start"] += 1  # a pid whose start time does not match: not this guard
    guard_state.save(cgroup2_manager.backend, state)
    assert guard_state.live(cgroup2_manager.backend) is None
    turn = cgroup2_manager.begin_turn("t", "u", admit_timeout=0)
    assert turn.state == "running" and [i.turn for i in cgroup2_manager.turns("t")] == ["u"]
    turn.complete()


def test_cli_run_admit_timeout_exits_125(cgroup2_manager, cgroup2_root, state_dir):
    _claim_over(cgroup2_manager)
    proc = subprocess.run(cgturn_argv(cgroup2_root, state_dir, "run", "--admit-timeout", "0.2", "--", "true"),
                          env=cgturn_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 125
    assert "not admitted" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# --- the guard under real CPU pressure ---------------------------------------------------------------

@pytest.fixture
def gateway(test_cgroup):
    """A stand-in gateway: one busy loop in a cgroup the test created (the watched cgroup). In a session
    of its own, so in a scheduling autogroup of its own (sched(7)): a test can raise its priority alone."""
    proc = subprocess.Popen([PY, "-c", BUSY], start_new_session=True)
    with open(os.path.join(test_cgroup, "cgroup.procs"), "w") as f:
        f.write(str(proc.pid))
    yield test_cgroup
    proc.kill()
    proc.wait()


def _hog(mgr, turn_id="hog"):
    turn = mgr.begin_turn("t", turn_id)
    for _ in range(HOGS):
        turn.spawn([PY, "-c", BUSY])
    return turn


def _guarded(root, state_dir, gateway, **kw):
    return TurnManager(root=root, backend="cgroup2", state_dir=state_dir,
                       guard=PressureGuard(resource="cpu", trigger=TRIGGER, watch=gateway, **kw))


def test_guard_freezes_the_hog_then_thaws_it(cgroup2_root, state_dir, gateway):
    with _guarded(cgroup2_root, state_dir, gateway, thaw_after=5.0, abandon_after=600) as mgr:
        quiet = mgr.begin_turn("t", "quiet")
        quiet.spawn(["sleep", str(BUSY_SECONDS)])
        hog = _hog(mgr)
        assert wait_until(lambda: hog.record.frozen_by == "guard", timeout=DEADLINE)
        assert quiet.record.frozen_by is None
        state = guard_state.live(mgr.backend)
        assert state["over"] is True and state["file"] == os.path.join(gateway, "cpu.pressure")
        assert [r["task"] for r in _ps(cgroup2_root, state_dir) if r["frozen"]] == ["t"]
        # Stop the stand-in gateway (the fixture's process): its cgroup then stalls no more, however
        # loaded the host is, so the pressure surely falls (on a busy host the gateway kept stalling).
        for pid in open(os.path.join(gateway, "cgroup.procs")).read().split():
            os.kill(int(pid), signal.SIGKILL)
        assert wait_until(lambda: any(r.get("action") == "thaw" and r["reason"] == "guard"
                                      for r in audit_records(state_dir, "hog")), timeout=DEADLINE)
        assert hog.record.state == "running"
        doctor = json.loads(subprocess.run(cgturn_argv(cgroup2_root, state_dir, "doctor", "--json"),
                                           env=cgturn_env(), capture_output=True, text=True, timeout=60).stdout)
        assert doctor["guard"]["active"] is True and doctor["guard"]["resource"] == "cpu"
        hog.abandon("test-done", grace=0)
        quiet.abandon("test-done", grace=0)


def test_guard_abandons_a_turn_frozen_too_long(cgroup2_root, state_dir, gateway):
    with _guarded(cgroup2_root, state_dir, gateway, thaw_after=600, abandon_after=1.0) as mgr:
        hog = _hog(mgr)
        assert wait_until(lambda: hog.record.frozen_by == "guard", timeout=DEADLINE)
        # Admission sees the pressure the guard reports (it stays "over" for thaw_after).
        with pytest.raises(Overloaded):
            mgr.begin_turn("t", "late", admit_timeout=0.1)
        assert wait_until(lambda: _kills(state_dir, "hog"), timeout=DEADLINE)  # written once the kill is done
        assert [r["reason"] for r in _kills(state_dir, "hog")] == ["pressure"]
        assert hog.state == "abandoned"


def test_guard_never_thaws_or_abandons_a_user_paused_turn(cgroup2_root, state_dir, gateway):
    with _guarded(cgroup2_root, state_dir, gateway, thaw_after=600, abandon_after=0.5) as mgr:
        paused = mgr.begin_turn("t", "paused")
        paused.spawn([PY, "-c", BUSY])
        mgr._control.freeze_turn(*paused.names, by="user")
        hog = _hog(mgr)
        assert wait_until(lambda: _kills(state_dir, "hog"), timeout=DEADLINE)
        rec = paused.record
        assert (rec.state, rec.frozen_by) == ("running", "user")
        assert [r["action"] for r in audit_records(state_dir, "paused")] == ["freeze"]
        mgr._control.thaw_turn(*paused.names)
        paused.abandon("test-done", grace=0)


OWNER = """
import os, sys, time
from cgturn import TurnManager, PressureGuard
mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2],
                  guard=PressureGuard(resource="cpu", trigger=sys.argv[3], watch=sys.argv[4], thaw_after=600))
turn = mgr.begin_turn("t", "hog")
for _ in range(int(sys.argv[5])):
    turn.spawn([sys.executable, "-c", sys.argv[6]])
print("ready", flush=True)
time.sleep(120)
"""


def test_guard_works_while_the_owner_is_stopped(cgroup2_root, state_dir, gateway):
    owner = subprocess.Popen([PY, "-c", OWNER, cgroup2_root, state_dir, TRIGGER, gateway, str(HOGS), BUSY],
                             stdout=subprocess.PIPE, text=True, env=cgturn_env())
    try:
        assert owner.stdout.readline().strip() == "ready"
        os.kill(owner.pid, signal.SIGSTOP)
        assert wait_until(lambda: any(r.get("action") == "freeze" and r["reason"] == "guard"
                                      for r in audit_records(state_dir, "hog")), timeout=DEADLINE)
        assert procfs.stat(owner.pid).state == "T"  # it was stopped the whole time
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        os.kill(owner.pid, signal.SIGCONT)
        owner.wait()


def _kills(state_dir, turn):
    return [r for r in audit_records(state_dir, turn) if r.get("action", "kill") == "kill"]


def _ps(root, state_dir):
    out = subprocess.run(cgturn_argv(root, state_dir, "ps", "--json"), env=cgturn_env(), capture_output=True,
                         text=True, timeout=60)
    return json.loads(out.stdout)


def _ps_row(root, state_dir, turn):
    return next(r for r in _ps(root, state_dir) if r["turn"] == turn)


def _stall_rate(gateway: str, seconds: float) -> float:
    """Microseconds of `some` CPU stall per second of the watched cgroup, over `seconds` (a
    measurement window, not a wait for an event)."""
    path = os.path.join(gateway, "cpu.pressure")
    read = lambda: parsers.parse_pressure(open(path).read())["some"]["total"]  # noqa: E731
    before, started = read(), time.monotonic()
    time.sleep(seconds)
    return (read() - before) / (time.monotonic() - started)


# Ahead of the rest of the host: nice -15, for the task and for its session's autogroup (sched(7): with
# autogroups on, nice weighs only inside a session, and sessions share a CPU equally).
AHEAD = -15


def _ahead(pid: int, cpu: int) -> None:
    """Put process `pid`, a session leader, on CPU `cpu` only and AHEAD of the rest of the host."""
    os.sched_setaffinity(pid, {cpu})
    os.setpriority(os.PRIO_PROCESS, pid, AHEAD)
    if os.path.exists(f"/proc/{pid}/autogroup"):  # CONFIG_SCHED_AUTOGROUP
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(AHEAD))


def _busy_ahead(cpu: int) -> str:
    """BUSY in a session of its own, as `_ahead` puts it, saying `ready` once there."""
    return (f"import os\nif os.getsid(0) != os.getpid():\n    os.setsid()\n"
            f"os.sched_setaffinity(0, {{{cpu}}})\nos.setpriority(os.PRIO_PROCESS, 0, {AHEAD})\n"
            f"if os.path.exists('/proc/self/autogroup'):\n"
            f"    with open('/proc/self/autogroup', 'w') as f:\n        f.write('{AHEAD}')\n"
            f"print('ready', flush=True)\n{BUSY}")


def test_freezing_the_hog_relieves_the_gateway(cgroup2_root, state_dir, gateway):
    """What the guard is for: the gateway's stall time falls once the hog is frozen.

    The gateway and the hog's busy loops share one CPU, AHEAD of the rest of the host: there they compete
    with each other, not with whatever else the host runs (other suites on 2 cores stalled the gateway as
    much without the hog as with it), and the other CPU stays to the rest of the host."""
    cpu = max(os.sched_getaffinity(0))
    for pid in open(os.path.join(gateway, "cgroup.procs")).read().split():
        _ahead(int(pid), cpu)
    plain = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        hog = plain.begin_turn("t", "hog")
        loops = [hog.spawn([PY, "-c", _busy_ahead(cpu)], stdout=subprocess.PIPE, text=True) for _ in range(HOGS)]
        assert [p.stdout.readline() for p in loops] == ["ready\n"] * HOGS  # all of them in their loops
        loaded = _stall_rate(gateway, 1.0)
        assert loaded > 50_000, loaded  # 3 busy loops beside the gateway on its CPU: it waits for it
        with _guarded(cgroup2_root, state_dir, gateway, thaw_after=600, abandon_after=600):
            # The record is marked before cgroup.freeze is written: the kernel's `frozen 1` says the
            # loops have stopped.
            assert wait_until(lambda: hog.record.frozen_by == "guard"
                              and Cgroup(turn_dir(plain, hog)).events().get("frozen") == 1, timeout=DEADLINE)
            relieved = _stall_rate(gateway, 1.0)
        assert relieved < loaded * 0.75, (loaded, relieved)
        hog.abandon("test-done", grace=0)
    finally:
        plain.close()


def test_cgturn_guard_in_the_foreground_freezes_and_thaws_on_sigterm(cgroup2_root, state_dir, gateway):
    """`cgturn guard` as an operator runs it (a unit of its own): it freezes the hog under pressure,
    and SIGTERM thaws what it froze and exits 0."""
    plain = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    guard = subprocess.Popen(cgturn_argv(cgroup2_root, state_dir, "guard", "--resource", "cpu", "--trigger",
                                         TRIGGER, "--watch", gateway, "--thaw-after", "600"),
                             env=cgturn_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        hog = _hog(plain)
        assert wait_until(lambda: hog.record.frozen_by == "guard", timeout=DEADLINE)
        guard.send_signal(signal.SIGTERM)
        assert guard.wait(timeout=30) == 0, guard.stderr.read()
        assert hog.record.frozen_by is None and hog.record.state == "running"
        hog.abandon("test-done", grace=0)
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.wait()
        plain.close()


# --- a crashed guard leaves no turn frozen --------------------------------------------------------------

def _quiet(gateway: str) -> None:
    """Stop the stand-in gateway's busy loop: its cgroup stalls no more, however loaded the host."""
    with open(os.path.join(gateway, "cgroup.procs")) as f:
        for pid in f.read().split():
            os.kill(int(pid), signal.SIGKILL)


def _guard_cli(root, state_dir, gateway, *extra) -> subprocess.Popen:
    return subprocess.Popen(cgturn_argv(root, state_dir, "guard", "--resource", "cpu", "--trigger", TRIGGER,
                                        "--watch", gateway, *extra),
                            env=cgturn_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def frozen_by_guard(cgroup2_root, state_dir, gateway):
    """A hog turn that a `cgturn guard` (thaw and abandon after 600 s) froze under CPU pressure:
    yields (manager, hog turn, guard process); the turn is abandoned and the guard stopped at teardown."""
    plain = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    guard = _guard_cli(cgroup2_root, state_dir, gateway, "--thaw-after", "600", "--abandon-after", "600")
    hog = plain.begin_turn("t", "hog")
    try:
        for _ in range(HOGS):
            hog.spawn([PY, "-c", BUSY])
        assert wait_until(lambda: hog.record.frozen_by == "guard", timeout=DEADLINE), guard.stderr
        yield plain, hog, guard
    finally:
        _stopped(guard)
        if hog.state != "abandoned":
            hog.abandon("test over", grace=0)
        plain.close()


@pytest.fixture
def crashed_guard(frozen_by_guard):
    """`frozen_by_guard` with its guard SIGKILLed by its recorded pid: yields (manager, hog turn)."""
    plain, hog, first = frozen_by_guard
    recorded = guard_state.live(plain.backend)
    assert recorded is not None and recorded["owner_pid"] == first.pid
    os.kill(recorded["owner_pid"], signal.SIGKILL)
    first.wait(30)
    assert guard_state.live(plain.backend) is None and hog.record.frozen_by == "guard"  # left frozen
    return plain, hog


def _stopped(guard: subprocess.Popen) -> None:
    if guard.poll() is None:
        guard.send_signal(signal.SIGTERM)
        try:
            guard.wait(30)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait()


def test_a_successor_guard_thaws_a_turn_a_killed_guard_left_frozen(crashed_guard, cgroup2_root, state_dir,
                                                                    gateway):
    """docs/guard.md: the guard thaws what it froze once the pressure stayed away `thaw_after`; a
    successor does so for the turns a SIGKILLed guard left frozen."""
    plain, hog = crashed_guard
    _quiet(gateway)
    successor = _guard_cli(cgroup2_root, state_dir, gateway, "--thaw-after", "1", "--abandon-after", "600")
    try:
        assert wait_until(lambda: hog.record.frozen_by is None, timeout=DEADLINE)
        assert hog.record.state == "running"
        assert Cgroup(turn_dir(plain, hog)).events().get("frozen") == 0
        thaws = [r for r in audit_records(state_dir, "hog") if r.get("action") == "thaw"]
        assert [r["reason"] for r in thaws] == ["guard"]
    finally:
        _stopped(successor)


def test_a_successor_guard_abandons_a_turn_left_frozen_too_long(crashed_guard, cgroup2_root, state_dir, gateway):
    """A turn a killed guard left frozen is abandoned `abandon_after` after its freeze by a successor
    that does not thaw it first (pressure reason)."""
    plain, hog = crashed_guard
    successor = _guard_cli(cgroup2_root, state_dir, gateway, "--thaw-after", "600", "--abandon-after", "1")
    try:
        assert wait_until(lambda: hog.state == "abandoned", timeout=DEADLINE)
        kills = [r for r in audit_records(state_dir, "hog") if r.get("action", "kill") == "kill"]
        assert wait_until(lambda: [r["reason"] for r in audit_records(state_dir, "hog")
                                   if r.get("action", "kill") == "kill"] == ["pressure"], timeout=DEADLINE), kills
    finally:
        _stopped(successor)


def test_reap_thaws_a_turn_a_killed_guard_left_frozen(crashed_guard, cgroup2_root, state_dir):
    """With no guard alive on the managed root, `cgturn reap` thaws what a guard froze (its clocks
    run again, so its timeouts can fire) and says so."""
    plain, hog = crashed_guard
    out = cli(cgroup2_root, state_dir, "reap", "--json")
    assert out.returncode == 0, out.stderr
    assert {"action": "thawed", "task": "t", "turn": "hog", "reason": "guard"} in json.loads(out.stdout)
    assert hog.record.frozen_by is None and hog.record.state == "running"
    assert Cgroup(turn_dir(plain, hog)).events().get("frozen") == 0
    again = cli(cgroup2_root, state_dir, "reap")
    assert "thawed" not in again.stdout  # once


def test_reap_leaves_a_live_guards_frozen_turn_alone(frozen_by_guard, cgroup2_root, state_dir):
    """While the guard that froze a turn lives, `reap` does not thaw it: it is the guard's."""
    _plain, hog, _guard = frozen_by_guard
    out = cli(cgroup2_root, state_dir, "reap", "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stdout
    assert hog.record.frozen_by == "guard"


# --- the guard under real memory pressure ------------------------------------------------------------

MiB = 1 << 20
THRASH_FILE = 512 * MiB
THRASH_LIMIT = 128 * MiB   # a quarter of the file: every pass re-reads it from disk through reclaim
QUIET_HELD = 48 * MiB
# Page-cache thrash measured here stalled one reader ~90 ms per second (`some`, in memory.pressure of the
# turn and of the managed root, avg10 ~6 %): act at 2.5 % of a 2 s window, with 2 readers for margin.
MEMORY_TRIGGER = "some 50000 2000000"
# Re-read the file, uncached (O_DIRECT would bypass the page cache, and with it the limit's reclaim).
THRASH = f"""
import os, sys, time
end = time.monotonic() + {BUSY_SECONDS}
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
while time.monotonic() < end:
    while os.read(fd, 1 << 20):
        pass
    os.lseek(fd, 0, os.SEEK_SET)
"""
HOLD = f"import time\nheld = b'x' * {QUIET_HELD}\ntime.sleep({BUSY_SECONDS})"


@pytest.fixture
def thrash_file(tmp_path):
    """A 512 MiB file on disk, written and dropped from the page cache (so that reading it charges the
    reader's memory cgroup), removed at teardown."""
    path = tmp_path / "thrash.bin"
    block = b"\xa5" * MiB
    with open(path, "wb") as f:
        for _ in range(THRASH_FILE // MiB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    yield str(path)
    path.unlink()


def test_memory_guard_freezes_the_thrashing_turn_then_thaws_it(cgroup2_root, state_dir, thrash_file):
    """Memory pressure made on purpose, bounded: a turn with a 128 MiB memory limit re-reads a 512 MiB
    file (page-cache thrash: reclaim stalls, no OOM; there is no swap to fill). Beside it a quiet turn
    with the same limit holds 48 MiB of its own and sleeps — more resident memory than the readers, far
    less charged to its cgroup. The guard watches the managed root (its memory.pressure aggregates the
    turns'), freezes the turn using the most memory, shows in ps, and thaws it after the hold."""
    # thaw_after outlasts the `cgturn ps` below, which must see the hog frozen.
    guard = PressureGuard(resource="memory", trigger=MEMORY_TRIGGER, watch="root", thaw_after=5.0,
                          abandon_after=600)
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, guard=guard) as mgr:
        if "memory" not in mgr.limits_report()["available"]:
            pytest.skip(f"no memory limit here: {mgr.limits_report()}")
        limit = Limits(memory_max=THRASH_LIMIT)
        quiet = mgr.begin_turn("t", "quiet", limits=limit)
        holder = quiet.spawn([PY, "-c", HOLD])
        assert wait_until(lambda: (procfs.rss_bytes(holder.pid) or 0) > QUIET_HELD, timeout=DEADLINE)
        hog = mgr.begin_turn("t", "hog", limits=limit)
        for _ in range(2):
            hog.spawn([PY, "-c", THRASH, thrash_file])
        assert wait_until(lambda: hog.record.frozen_by == "guard", timeout=DEADLINE)
        assert quiet.record.frozen_by is None
        state = guard_state.live(mgr.backend)
        assert (state["over"], state["resource"]) == (True, "memory")
        assert state["file"] == os.path.join(cgroup2_root, "memory.pressure")
        rows = {r["turn"]: r for r in _ps(cgroup2_root, state_dir)}
        assert (rows["hog"]["frozen"], rows["quiet"]["frozen"]) == (True, False)
        assert rows["hog"]["pressure"]["memory"]["some_total_usec"] > 0, rows["hog"]
        # The kernel recomputes the averages at most every 2 s (PSI_FREQ), counted from the cgroup's
        # creation (kernel/sched/psi.c group_init, psi_show): a freeze inside the hog's first 2 s shows
        # avg10 0.00 beside a total that already counts the stall. The next recompute folds it in.
        assert wait_until(lambda: _ps_row(cgroup2_root, state_dir, "hog")["pressure"]["memory"]["some_avg10"] > 0,
                          timeout=DEADLINE)
        assert rows["quiet"]["pressure"]["memory"]["some_total_usec"] == 0
        assert rows["hog"]["oom_kills"] == 0  # reclaim stalled it; nothing was OOM-killed
        assert wait_until(lambda: any(r.get("action") == "thaw" and r["reason"] == "guard"
                                      for r in audit_records(state_dir, "hog")), timeout=DEADLINE)
        assert hog.record.state == "running" and quiet.record.frozen_by is None
        hog.abandon("test-done", grace=0)
        quiet.abandon("test-done", grace=0)
