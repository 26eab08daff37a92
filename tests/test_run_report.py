"""What `cgturn run` tells at the end: `--report FILE|-` (cgturn.RunReport), `--cpu-time S` and
`--oom-kills-turn`, on the real kernel, plus the pure pieces (how an outcome maps to `ended`, the
sentinel's `watch` message, the CPU-time values refused).

Every burn, allocation and restart loop is bounded in size and time on its own, so a limit that is
not enforced shows as a wrong status or report, never as a hung test.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import textwrap

import pytest

from cgturn import Limits, Outcome, RunReport, SentinelUnavailable, Supervisor, TurnManager, Usage, reasons
from cgturn import sentinel_protocol as protocol
from cgturn.limits import MAX_CPU_TIME, parse_cpu_time
from cgturn.outcome import usage_from_note
from cgturn.sentinel_watch import CPUS, MIN_CPU_LOOK, OOM_LOOK, Watch
from conftest import PY, alive, cgturn_env, cgturn_popen, cli, wait_until

MiB = 2 ** 20
REPORT_KEYS = {"exit_status", "ended", "reason", "killed_by", "signal", "wall_seconds", "cpu_seconds",
               "memory_peak_bytes", "oom_kills", "pids_max_hits", "cpu_throttled_seconds", "error"}
# Burns CPU until killed, or gives up by itself after 30 s of wall time (exit 3: not killed).
BURN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\nraise SystemExit(3)"
# Allocates and touches N MiB, holds it a moment, exits 0.
ALLOC = "import sys\ndata = b'\\1' * (int(sys.argv[1]) * 2 ** 20)\nprint(len(data) // 2 ** 20, flush=True)"
# A worker that restarts its OOM-killed child, 5 times at most, then says `done`.
RESTARTER = textwrap.dedent(f"""
    import subprocess, sys
    for i in range(5):
        code = subprocess.call([sys.executable, "-c", {ALLOC!r}, "200"])
        print("worker", i, "exited", code, flush=True)
    print("done", flush=True)
""")


def _report(path) -> dict:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.count("\n") == 1, text  # one object, one line
    data = json.loads(text)
    assert set(data) == REPORT_KEYS
    return data


def _memory_here(root, state_dir) -> None:
    """Skip unless a turn can get a memory controller here (v2 memory, or the v1 hierarchy)."""
    mgr = TurnManager(root=root, backend="cgroup2", state_dir=state_dir)
    try:
        report = mgr.limits_report()
    finally:
        mgr.close()
    if "memory" not in report["available"]:
        pytest.skip(f"needs a memory controller for a turn here: {report}")


# --- pure: how an outcome maps to a report ------------------------------------------------------

USED = Usage(cpu_seconds=1.5, memory_peak_bytes=10 * MiB)


@pytest.mark.parametrize("outcome, returncode, status, ended, died_of", [
    (Outcome(completed=True, result=0, usage=USED), 0, None, "exited", None),
    (Outcome(completed=True, result=3, usage=USED), 3, None, "exited", None),
    (Outcome(completed=True, result=-9, usage=USED), -9, None, "signal", "SIGKILL"),
    (Outcome(completed=True, result=-9, usage=Usage(oom_kills=1)), -9, None, "oom", "SIGKILL"),
    (Outcome(completed=True, result=0, usage=Usage(oom_kills=2)), 0, None, "oom", None),  # a worker, not CMD
    (Outcome(completed=True, result=1, usage=Usage(pids_max_hits=4)), 1, None, "pids-max", None),
    (Outcome(completed=False, reason=reasons.TIMEOUT, usage=USED), -15, 124, "timeout", "SIGTERM"),
    (Outcome(completed=False, reason=reasons.DEADLINE), -9, 124, "timeout", "SIGKILL"),
    (Outcome(completed=False, reason=reasons.CPU_TIME, killed_by=77), -9, 124, "cpu-time", "SIGKILL"),
    (Outcome(completed=False, reason=reasons.OOM, usage=Usage(oom_kills=1)), -9, None, "oom", "SIGKILL"),
    (Outcome(completed=False, reason=reasons.STOP, external=True, killed_by=5), -15, None, "abandoned", "SIGTERM"),
    (Outcome(completed=False, reason="signal:SIGINT"), -2, 130, "abandoned", "SIGINT"),
    # --reap-on-exit: CMD ended by itself; the abandon only took what it left
    (Outcome(completed=False, reason=reasons.REAP_ON_EXIT, usage=USED), 0, None, "exited", None),
])
def test_an_outcome_becomes_a_report(outcome, returncode, status, ended, died_of):
    report = RunReport.from_outcome(outcome, 2.5, returncode=returncode, exit_status=status)
    assert report.ended == ended and report.signal == died_of
    assert report.exit_status == (status if status is not None else returncode if returncode >= 0 else 128 - returncode)
    assert report.reason == outcome.reason and report.killed_by == outcome.killed_by
    assert report.wall_seconds == 2.5
    usage = outcome.usage or Usage()
    assert (report.cpu_seconds, report.memory_peak_bytes, report.oom_kills, report.pids_max_hits) == (
        usage.cpu_seconds, usage.memory_peak_bytes, usage.oom_kills, usage.pids_max_hits)
    assert json.loads(report.dumps()) == report.to_json() and set(report.to_json()) == REPORT_KEYS


def test_a_command_that_never_ran_is_reported_as_not_started():
    report = RunReport.not_started(127, "command not found", 0.01)
    assert (report.ended, report.exit_status, report.error, report.cpu_seconds) == (
        "not-started", 127, "command not found", 0.0)


@pytest.mark.parametrize("data", [None, "x", {}, {"oom_kills": True, "pids_max_hits": 0, "cpu_seconds": 1.0},
                                  {"oom_kills": 0, "pids_max_hits": 0, "cpu_seconds": "1"},
                                  {"oom_kills": 0, "pids_max_hits": 0, "cpu_seconds": 1.0, "memory_peak_bytes": 1.5}])
def test_usage_in_a_note_of_the_wrong_shape_is_not_trusted(data):
    assert usage_from_note(data) is None


def test_usage_in_a_note_is_read_back():
    usage = Usage(oom_kills=1, pids_max_hits=2, memory_peak_bytes=3, cpu_seconds=4.5, cpu_throttled_seconds=0.5)
    assert usage_from_note(json.loads(json.dumps(usage.to_json()))) == usage


@pytest.mark.parametrize("text", ["0", "-1", "-0.5", "nan", "inf", "-inf", str(MAX_CPU_TIME * 10), "1e300", "", "x"])
def test_cpu_time_edge_values_are_refused(text):
    with pytest.raises(ValueError):
        parse_cpu_time(text)


def test_cpu_time_values_accepted():
    assert parse_cpu_time("0.001") == 0.001 and parse_cpu_time(str(MAX_CPU_TIME)) == MAX_CPU_TIME


def test_the_watch_message_is_checked_field_by_field():
    msg = protocol.watch("t", "u", 2.5, True, 1.0)
    assert protocol.parse_message(protocol.encode(msg)) == {
        "op": "watch", "key": tuple(protocol.key("t", "u")), "task": "t", "turn": "u", "cpu_time": 2.5,
        "oom": True, "grace": 1.0}
    for bad in ({"oom": 1}, {"oom": None}, {"cpu_time": -1}, {"cpu_time": math.inf}, {"turn": "other"}):
        with pytest.raises(ValueError):
            protocol.parse_message(protocol.encode({**msg, **bad}))


def test_a_watch_looks_again_when_the_allowance_could_be_used_up_at_the_earliest():
    watch = Watch("t", "u", cpu_time=10.0, oom=False, grace=0.0, next_look=0.0)
    assert watch.after(4.0, 100.0) == pytest.approx(100.0 + 6.0 / CPUS)
    assert watch.after(9.9999, 100.0) == 100.0 + MIN_CPU_LOOK
    assert Watch("t", "u", cpu_time=10.0, oom=True, grace=0.0, next_look=0.0).after(0.0, 100.0) == 100.0 + OOM_LOOK
    assert watch.verdict(Usage(cpu_seconds=9.99)) is None and watch.verdict(Usage(cpu_seconds=10.0)) == "cpu-time"
    assert watch.verdict(Usage(oom_kills=1)) is None  # not watched for OOM
    assert Watch("t", "u", None, True, 0.0, 0.0).verdict(Usage(oom_kills=1)) == "oom"


# --- the real kernel, through the CLI -----------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e300", "2e9", "soon"])
def test_edge_values_of_cpu_time_exit_2_with_one_line_and_touch_nothing(cgroup2_root, state_dir, value):
    out = cli(cgroup2_root, state_dir, "run", "--cpu-time", value, "--", "true")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--cpu-time" in out.stderr and "Traceback" not in out.stderr
    assert not os.path.exists(cgroup2_root)


def test_a_report_file_that_cannot_be_written_exits_2_before_anything_starts(cgroup2_root, state_dir, tmp_path):
    marker = tmp_path / "ran"
    out = cli(cgroup2_root, state_dir, "run", "--report", str(tmp_path / "no" / "such" / "dir.json"), "--",
              "touch", str(marker))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not marker.exists() and not os.path.exists(cgroup2_root)


def test_the_report_of_a_known_allocation_shows_its_peak_memory(cgroup2_root, state_dir, tmp_path):
    _memory_here(cgroup2_root, state_dir)
    path = tmp_path / "report.json"
    out = cli(cgroup2_root, state_dir, "run", "--memory", "400M", "--report", str(path), "--", PY, "-c", ALLOC, "150")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "150\n"
    report = _report(path)
    assert (report["exit_status"], report["ended"], report["reason"], report["oom_kills"]) == (0, "exited", None, 0)
    # The allocation itself, the interpreter on top (tens of MiB), never more than the limit.
    assert 150 * MiB <= report["memory_peak_bytes"] <= 400 * MiB, report
    assert report["cpu_seconds"] > 0 and report["wall_seconds"] > 0


def test_report_dash_is_the_last_line_of_stdout(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "run", "--report", "-", "--", "sh", "-c", "echo one; echo two; exit 7")
    assert out.returncode == 7, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["one", "two"] and len(lines) == 3
    report = json.loads(lines[-1])
    assert (report["exit_status"], report["ended"], report["signal"]) == (7, "exited", None)


def test_a_cpu_burn_is_abandoned_by_cpu_time_with_the_reason_and_report(cgroup2_root, state_dir, tmp_path):
    path = tmp_path / "report.json"
    out = cli(cgroup2_root, state_dir, "run", "--cpu-time", "0.5", "--grace", "0", "--report", str(path), "--",
              PY, "-c", BURN)
    assert out.returncode == 124, (out.returncode, out.stderr)
    assert "CPU time" in out.stderr and "abandoned by" not in out.stderr
    report = _report(path)
    assert (report["exit_status"], report["ended"], report["reason"], report["signal"]) == (
        124, "cpu-time", "cpu-time", "SIGKILL")
    assert report["killed_by"] is not None  # run's sentinel
    assert report["cpu_seconds"] >= 0.5, report
    assert report["cpu_seconds"] < 30, report  # killed, not run to its own end


def test_cpu_time_holds_while_cgturn_run_itself_is_stopped(cgroup2_root, state_dir, tmp_path):
    """The sentinel watches the CPU use: a SIGSTOPped `cgturn run` still loses its burning turn."""
    pidfile = tmp_path / "pid"
    burn = f"import os\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\n" + BURN
    run = cgturn_popen(cgroup2_root, state_dir, "run", "--cpu-time", "0.5", "--grace", "0", "--report", "-",
                       "--", PY, "-c", burn)
    try:
        assert wait_until(lambda: pidfile.exists() and pidfile.read_text(), timeout=30)
        burner = int(pidfile.read_text())
        os.kill(run.pid, signal.SIGSTOP)
        assert wait_until(lambda: not alive(burner), timeout=20)
    finally:
        os.kill(run.pid, signal.SIGCONT)
    stdout, _ = run.communicate(timeout=60)
    assert run.returncode == 124
    report = json.loads(stdout.splitlines()[-1])
    assert (report["ended"], report["reason"]) == ("cpu-time", "cpu-time")


def test_cpu_time_without_a_sentinel_is_refused_and_reported(cgroup2_root, state_dir, tmp_path):
    path, marker = tmp_path / "report.json", tmp_path / "ran"
    out = cli(cgroup2_root, state_dir, "run", "--cpu-time", "5", "--report", str(path), "--", "touch", str(marker),
              env={**os.environ, "CGTURN_SENTINEL": "0"})
    assert out.returncode == 125 and "sentinel" in out.stderr, out.stderr
    assert not marker.exists()
    report = _report(path)
    assert (report["exit_status"], report["ended"]) == (125, "not-started") and "sentinel" in report["error"]


@pytest.mark.parametrize("mode, status, why", [
    (None, 127, "command not found"),
    (0o600, 126, "permission denied"),   # not executable
    (0o700, 125, "Exec format error"),   # executable, but no format the kernel runs
])
def test_the_report_is_written_when_the_command_cannot_start(cgroup2_root, state_dir, tmp_path, mode, status, why):
    path, program = tmp_path / "report.json", tmp_path / "program"
    if mode is not None:
        program.write_bytes(b"\0\1\2 not a program")
        program.chmod(mode)
    out = cli(cgroup2_root, state_dir, "run", "--report", str(path), "--", str(program))
    assert out.returncode == status, out.stderr
    report = _report(path)
    assert (report["exit_status"], report["ended"], report["error"]) == (status, "not-started", why)


def test_the_report_is_written_when_run_cannot_start_the_command_exit_125(cgroup2_root, state_dir, tmp_path):
    path, marker = tmp_path / "report.json", tmp_path / "ran"
    out = cli(cgroup2_root, state_dir, "run", "--memory", "100", "--report", str(path), "--", "touch", str(marker))
    assert out.returncode == 125, out.stderr
    assert not marker.exists()
    report = _report(path)
    assert (report["exit_status"], report["ended"]) == (125, "not-started")
    assert "less than one page" in report["error"]


def test_an_outside_stop_is_reported_with_its_reason_killer_and_figures(cgroup2_root, state_dir, tmp_path):
    """`cgturn stop` kills and removes the turn: its figures reach the report through the killer's note."""
    path = tmp_path / "report.json"
    work = "import time\nwhile time.process_time() < 0.3: pass\nprint('burnt', flush=True)\ntime.sleep(300)"
    run = cgturn_popen(cgroup2_root, state_dir, "run", "--task", "st", "--turn", "u", "--report", str(path), "--",
                       PY, "-c", work)
    try:
        assert run.stdout.readline() == "burnt\n"
        stop = cli(cgroup2_root, state_dir, "stop", "st", "u", "--grace", "0")
        assert stop.returncode == 0, stop.stderr
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 137
    report = _report(path)
    assert (report["ended"], report["reason"], report["signal"], report["exit_status"]) == (
        "abandoned", "stop", "SIGKILL", 137)
    assert report["killed_by"] not in (None, run.pid)
    assert report["cpu_seconds"] >= 0.3, report  # read by the killer before the cgroup went


def _restarting_worker(root, state_dir, tmp_path, *flags):
    path = tmp_path / "report.json"
    out = subprocess.run([PY, "-m", "cgturn", "--root", root, "--state-dir", state_dir, "run", "--memory", "50M",
                          *flags, "--report", str(path), "--", PY, "-c", RESTARTER],
                         capture_output=True, text=True, timeout=120, env=cgturn_env())
    return out, _report(path)


def test_oom_kills_turn_ends_a_worker_that_restarts_its_oom_killed_children(cgroup2_root, state_dir, tmp_path):
    _memory_here(cgroup2_root, state_dir)
    # Without it, on a layout with no group OOM kill (v1) the worker runs on past every OOM kill;
    # with the default group kill (v2) the kernel ends the whole turn at the first one.
    out, report = _restarting_worker(cgroup2_root, state_dir, tmp_path)
    group_kill = report["oom_kills"] == 1 and "done" not in out.stdout
    if not group_kill:
        assert out.returncode == 0 and "done" in out.stdout, out.stdout
        assert report["ended"] == "oom" and report["oom_kills"] == 5 and report["exit_status"] == 0
    out, report = _restarting_worker(cgroup2_root, state_dir, tmp_path, "--oom-kills-turn")
    # Ended at (or, under load, soon after) the first OOM kill: never its 5 restarts.
    assert "done" not in out.stdout and out.stdout.count("exited") < 5, out.stdout
    assert out.returncode == 137, (out.returncode, out.stderr)
    assert (report["ended"], report["exit_status"], report["signal"]) == ("oom", 137, "SIGKILL")
    assert 1 <= report["oom_kills"] < 5
    if not group_kill:
        assert report["reason"] == "oom" and report["killed_by"] is not None
        assert "abandoned by" not in out.stderr and "OOM-killed" in out.stderr


# --- the library -----------------------------------------------------------------------------------

def test_a_supervisor_with_cpu_time_abandons_and_reports(cgroup2_manager):
    turn = cgroup2_manager.begin_turn("lib", "burn")
    sup = Supervisor(turn, cpu_time=0.3, grace=0)
    sup.start()
    proc = turn.spawn([PY, "-c", BURN])
    outcome = sup.run_blocking(proc.wait)
    proc.wait(timeout=30)
    report = RunReport.from_outcome(outcome, 0.0, returncode=proc.returncode)
    assert (outcome.reason, report.ended, report.signal) == ("cpu-time", "cpu-time", "SIGKILL")
    assert report.cpu_seconds >= 0.3


def test_a_supervisor_with_cpu_time_needs_the_sentinel(cgroup2_root, state_dir):
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        turn = mgr.begin_turn("lib", "nosentinel")
        with pytest.raises(SentinelUnavailable):
            Supervisor(turn, cpu_time=1.0).start()
        with pytest.raises(ValueError):
            Supervisor(turn, cpu_time=math.nan)
        turn.abandon("test", grace=0)
    finally:
        mgr.close()


def test_limits_oom_group_on_v1_still_raises(cgroup2_manager):
    from cgturn import LimitsUnavailable

    if cgroup2_manager.limits_report()["layout"] != "v1-hybrid":
        pytest.skip("needs a v1-hybrid layout")
    with pytest.raises(LimitsUnavailable):
        cgroup2_manager.begin_turn("lib", "g", limits=Limits(memory_max=50 * MiB, oom_group=True))
