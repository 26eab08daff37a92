"""The faces of resource governance: `cgturn run --memory ...`, `cgturn limits`, what `ps`, `doctor` and
the metrics show of limits, through the real CLI on the real kernel; the parsers and formatting in process.

On this hybrid host limits land in the v1 memory/pids/cpu hierarchies below the test's own cgroups (the
library places them); every allocation and fork loop here is bounded in size, count and time.
"""
import json
import os

import psutil
import pytest

from cgturn import Limits, Usage
from cgturn.cli import main
from cgturn.cli.common import format_size
from cgturn.cli.doctor import format_limits
from cgturn.cli.limits import format_report
from cgturn.cli.ps import format_table
from cgturn.cli.run import limit_messages
from cgturn.metrics import AuditTail

MiB = 1024 ** 2


# --- bad input: exit 2, one line, nothing created, no sentinel started ---------------------------------

@pytest.mark.parametrize("args", [
    ["run", "--memory", "12Q", "--", "true"],
    ["run", "--memory", "-1", "--", "true"],
    ["run", "--memory", "1.5.3G", "--", "true"],
    ["run", "--memory", "", "--", "true"],
    ["run", "--memory-high", "1X", "--", "true"],
    ["run", "--swap", "G", "--", "true"],
    ["run", "--pids", "0", "--", "true"],
    ["run", "--pids", "1.5", "--", "true"],
    ["run", "--cpus", "0", "--", "true"],
    ["run", "--cpus", "-0.5", "--", "true"],
    ["run", "--cpus", "nan", "--", "true"],
    ["run", "--cpu-weight", "0", "--", "true"],
    ["run", "--cpu-weight", "10001", "--", "true"],
    ["run", "--memory", "1G", "--memory-high", "2G", "--", "true"],  # high above max: Limits refuses it
    ["limits", "--memory", "12Q"],
    ["limits", "t", "--pids", "0"],
    ["limits", "t", "u", "--cpus", "0"],
    ["limits", "t", "u", "extra"],
    ["limits", "", "u"],
    ["limits", "--memory", "1M", "--memory-high", "2M"],
])
def test_bad_limits_exit_2_with_one_line_and_create_nothing(cgroup2_root, state_dir, args, capsys):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main(["--root", cgroup2_root, "--state-dir", state_dir, *args])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and captured.err.startswith("cgturn: ") and "Traceback" not in captured.err
    assert captured.out == ""
    assert not os.path.exists(cgroup2_root) and os.listdir(state_dir) == []
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()  # no sentinel


# --- formatting, in process ----------------------------------------------------------------------------

@pytest.mark.parametrize("value, text", [
    (512 * MiB, "512 MiB"), (50 * MiB, "50 MiB"), (3 * 1024 ** 3 // 2, "1.5 GiB"), (1023, "1023 B"),
    (0, "0 B"), (2048, "2 KiB"), (5 * 1024 ** 4, "5 TiB"), ("max", "max"), (None, "-"),
])
def test_format_size(value, text):
    assert format_size(value) == text


@pytest.mark.parametrize("usage, limits, lines", [
    (None, None, []),
    (Usage(), Limits(memory_max=50 * MiB), []),
    (Usage(oom_kills=1), Limits(memory_max=512 * MiB),
     ["the turn hit its memory limit (512 MiB): 1 process OOM-killed"]),
    (Usage(oom_kills=3), None, ["the turn hit a memory limit (its task's or the managed root's): 3 processes OOM-killed"]),
    (Usage(oom_kills=1), Limits(pids_max=5), ["the turn hit a memory limit (its task's or the managed root's): "
                                              "1 process OOM-killed"]),
    (Usage(pids_max_hits=4), Limits(pids_max=20), ["the turn hit its pids limit (20): 4 forks refused"]),
    (Usage(pids_max_hits=1), Limits(pids_max="max"), ["the turn hit a pids limit: 1 fork refused"]),
    (Usage(oom_kills=2, pids_max_hits=1), Limits(memory_max=MiB, pids_max=9),
     ["the turn hit its memory limit (1 MiB): 2 processes OOM-killed", "the turn hit its pids limit (9): 1 fork refused"]),
])
def test_limit_messages(usage, limits, lines):
    assert limit_messages(usage, limits) == lines


def _row(**changes):
    row = {"task": "chat", "turn": "t-1", "state": "running", "pids": [10, 11], "age_seconds": 3.0,
           "cpu_seconds": 0.5, "memory_bytes": 40 * MiB, "ports": [], "owner_pid": 9,
           "limits": Limits().to_json(), "oom_kills": 0, "pids_max_hits": 0, "frozen": False}
    return {**row, **changes}


def test_ps_table_shows_memory_against_its_limit_and_events_only_when_there_are_any():
    plain = format_table([_row(), _row(turn="t-2", limits=Limits(memory_max=512 * MiB).to_json())]).splitlines()
    assert plain[0].split() == ["TASK", "TURN", "STATE", "PIDS", "AGE", "CPU", "MEM", "PORTS", "OWNER"]
    assert plain[1].split()[6] == "40.0M" and plain[2].split()[6] == "40.0M/512.0M"
    hit = format_table([_row(), _row(turn="t-2", oom_kills=1, pids_max_hits=3, frozen=True)]).splitlines()
    assert hit[0].split()[-1] == "EVENTS"
    assert hit[1].split()[-1] == "-" and hit[2].split()[-1] == "oom:1,pids-max:3,frozen"


def test_limits_report_in_words():
    data = {"level": "turn", "task": "chat", "turn": "t-1",
            "limits": Limits(memory_max=50 * MiB, pids_max=20, cpus=0.5).to_json(),
            "usage": Usage(oom_kills=1, memory_peak_bytes=50 * MiB, cpu_seconds=1.25).to_json()}
    lines = format_report(data).splitlines()
    assert lines[0] == "limits of turn 't-1' of task 'chat':"
    assert [line.split() for line in lines[1:8]] == [
        ["memory_max", "50", "MiB"], ["memory_high", "max"], ["swap_max", "max"], ["pids_max", "20"],
        ["cpus", "0.5"], ["cpu_weight", "max"], ["oom_group", "default"]]
    assert lines[8] == "usage:"
    assert [line.split() for line in lines[9:]] == [
        ["oom_kills", "1"], ["pids_max_hits", "0"], ["memory_peak_bytes", "50", "MiB"], ["cpu_seconds", "1.25s"],
        ["cpu_throttled_seconds", "-"]]
    assert format_report({**data, "level": "root", "task": None, "turn": None}).startswith(
        "limits of the managed root (all turns together):")


def test_doctor_limits_section_in_words():
    assert format_limits({"layout": "v1-hybrid", "available": ["memory_max", "pids_max"],
                          "problems": ["memory_high: cgroup v1 has no equivalent"]}).splitlines() == [
        "limits:         memory_max pids_max (through cgroup v1 hierarchies (hybrid host))",
        "limits problem: memory_high: cgroup v1 has no equivalent"]
    assert format_limits({"layout": None, "available": [], "problems": ["no controllers"]}).splitlines() == [
        "limits:         unavailable", "limits problem: no controllers"]


def test_audit_tail_counts_limit_events_and_guard_actions(tmp_path):
    tail = AuditTail(str(tmp_path), buckets=(1.0,))
    tail.update()
    assert tail.limit_events == {"oom": 0, "pids-max": 0}
    assert tail.guard_actions == {"freeze": 0, "thaw": 0, "abandon": 0}
    records = [
        {"action": "limit", "reason": "oom", "count": 2, "task": "t", "turn": "u"},
        {"action": "limit", "reason": "pids-max", "count": 5},
        {"action": "limit", "reason": "oom"},                                   # no count: one event
        {"action": "freeze", "reason": "pressure"}, {"action": "thaw", "reason": "pressure"},
        {"action": "freeze", "reason": "pause"},                                # a user's pause: not the guard
        {"action": "kill", "reason": "pressure", "pids": [7], "duration_ms": 3},
        {"reason": "stop", "pids": [8], "duration_ms": 3},
    ]
    malformed = [{"action": "limit", "reason": "oom", "count": -1}, {"action": "limit", "reason": "oom", "count": True},
                 {"action": "limit", "count": 1}, {"action": "limit", "reason": 3}, {"action": "freeze", "reason": 1}]
    with open(tmp_path / "audit.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records + malformed)
    tail.update()
    assert tail.limit_events == {"oom": 3, "pids-max": 5}
    assert tail.guard_actions == {"freeze": 1, "thaw": 1, "abandon": 1}
    assert tail.kills == {"pressure": 1, "stop": 1}  # only kill records count as kills
    assert tail.malformed == len(malformed)
