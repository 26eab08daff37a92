"""The faces of resource governance: `cgturn run --memory ...`, `cgturn limits`, what `ps`, `doctor` and
the metrics show of limits, through the real CLI on the real kernel; the parsers and formatting in process.

On this hybrid host limits land in the v1 memory/pids/cpu hierarchies below the test's own cgroups (the
library places them); every allocation and fork loop here is bounded in size, count and time.
"""
import json
import os
import re

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cgturn import Limits, Usage
from cgturn.cli import main
from cgturn.cli.common import format_size
from cgturn.cli.doctor import format_limits
from cgturn.cli.limits import format_report
from cgturn.cli.ps import format_table
from cgturn.cli.run import limit_messages
from cgturn.metrics import AuditTail
from conftest import PY, alive, audit_records, cli, wait_until

MiB = 1024 ** 2
# Allocates 200 MiB at once: with a 50 MiB limit the kernel OOM-kills it (bounded by the limit itself).
ALLOCATE = f"{PY} -c 'bytearray(200 * 2**20)'"
# Forks up to 40 sleepers (each sleeps at most 30 s), stops at the first refused fork, kills and reaps
# them, prints how many it made, and exits 0.
FORK_LOOP = """
import os, time
kids = []
for _ in range(40):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(len(kids))
"""


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
        ["cpus", "0.5"], ["cpu_weight", "default", "(100)"], ["oom_group", "default", "(on:", "an", "OOM", "kill",
                                                                       "takes", "the", "whole", "turn)"]]
    assert lines[8] == "usage:"
    assert [line.split() for line in lines[9:]] == [
        ["oom_kills", "1"], ["pids_max_hits", "0"], ["memory_peak_bytes", "50", "MiB"], ["cpu_seconds", "1.25s"],
        ["cpu_throttled_seconds", "-"]]
    assert format_report({**data, "level": "root", "task": None, "turn": None}).startswith(
        "limits of the managed root (all turns together):")


def test_doctor_limits_section_in_words():
    assert format_limits({"layout": "v1-hybrid", "available": ["cpu", "memory", "pids"],
                          "problems": ["io: not delegated"]}).splitlines() == [
        "limits:         cpu memory pids (layout v1-hybrid: the v1 hierarchies of a hybrid host)",
        "limits problem: io: not delegated"]
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
        {"action": "freeze", "reason": "guard"}, {"action": "thaw", "reason": "guard"},
        {"action": "freeze", "reason": "user"}, {"action": "thaw", "reason": "user"},  # a user's pause: not the guard
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


# --- on the real kernel --------------------------------------------------------------------------------

def _layout(root, state_dir) -> str | None:
    out = cli(root, state_dir, "doctor", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["limits"]["layout"]


def _oom_turn_with_survivor(root, state_dir, task, turn) -> int:
    """`cgturn run --memory 50M` a shell that leaves a daemon and runs an allocation the kernel
    OOM-kills; returns the daemon's pid (the turn completes and keeps it)."""
    out = cli(root, state_dir, "run", "--task", task, "--turn", turn, "--memory", "50M", "--pids", "30",
              "--cpus", "0.5", "--", "sh", "-c", f"setsid sleep 300 >/dev/null 2>&1 & echo $!; {ALLOCATE}")
    assert out.returncode == 137, out.stderr  # the shell's status: its child died of SIGKILL
    ours = [line for line in out.stderr.splitlines() if line.startswith("cgturn:")]  # the shell says "Killed"
    assert ours == ["cgturn: the turn hit its memory limit (50 MiB): 1 process OOM-killed"]
    # The turn completed with a survivor, so its cgroup (and counters) stay: audited once all the same.
    assert [(r["reason"], r["count"]) for r in audit_records(state_dir, turn) if r.get("action") == "limit"] == \
        [("oom", 1)]
    return int(out.stdout.split()[-1])


def test_run_over_its_memory_limit_exits_137_and_says_so(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "run", "--task", "mem", "--turn", "big", "--memory", "50M", "--",
              "sh", "-c", f"exec {ALLOCATE}")
    assert out.returncode == 137
    assert out.stderr == "cgturn: the turn hit its memory limit (50 MiB): 1 process OOM-killed\n"
    limit_records = [r for r in audit_records(state_dir, "big") if r.get("action") == "limit"]
    assert [(r["reason"], r["task"], r["count"], r["limit"]) for r in limit_records] == [("oom", "mem", 1, 50 * MiB)]


def test_run_at_its_pids_limit_says_so_and_keeps_the_status(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "run", "--task", "forks", "--turn", "loop", "--pids", "20", "--",
              PY, "-c", FORK_LOOP)
    assert out.returncode == 0, out.stderr
    assert 0 < int(out.stdout) < 20  # the limit stopped the loop
    assert re.fullmatch(r"cgturn: the turn hit its pids limit \(20\): \d+ forks? refused\n", out.stderr), out.stderr
    assert [r["reason"] for r in audit_records(state_dir, "loop") if r.get("action") == "limit"] == ["pids-max"]


def test_ps_shows_the_limits_and_figures_of_real_turns(cgroup2_root, state_dir):
    survivor = _oom_turn_with_survivor(cgroup2_root, state_dir, "mem", "oom")
    assert cli(cgroup2_root, state_dir, "run", "--task", "mem", "--turn", "plain", "--", "true").returncode == 0
    out = cli(cgroup2_root, state_dir, "ps", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["turn"]: row for row in json.loads(out.stdout)}
    assert set(rows) == {"oom"}  # the plain turn completed empty and was removed
    row = rows["oom"]
    assert row["state"] == "completed" and row["pids"] == [survivor]
    assert row["limits"] == {"memory_max": 50 * MiB, "memory_high": None, "swap_max": None, "pids_max": 30,
                             "cpus": 0.5, "cpu_weight": None}
    assert row["oom_kills"] == 1 and row["pids_max_hits"] == 0
    assert 40 * MiB <= row["memory_peak_bytes"] <= 50 * MiB  # the allocation grew to the limit
    assert isinstance(row["cpu_throttled_seconds"], float) and row["cpu_throttled_seconds"] >= 0
    assert set(row["pressure"]) == {"cpu", "memory", "io"}
    for figures in row["pressure"].values():
        assert figures is None or set(figures) == {"some_avg10", "full_avg10", "some_total_usec", "full_total_usec"}
    assert (row["frozen"], row["expires_at"], row["sealed"], row["network"], row["keys"]) == \
        (False, None, False, "host", {})
    table = cli(cgroup2_root, state_dir, "ps").stdout.splitlines()
    # EVENTS lists what holds, comma-separated; a loaded host adds the turn's pressure (psi:cpu=…).
    events = [e for e in table[1].split()[-1].split(",") if not e.startswith("psi:")]
    assert table[0].split()[-1] == "EVENTS" and events == ["oom:1"]
    assert "/50.0M" in table[1].split()[6]
    assert cli(cgroup2_root, state_dir, "end", "mem").returncode == 0
    assert wait_until(lambda: not alive(survivor))


def test_metrics_count_a_real_oom_kill(cgroup2_root, state_dir):
    survivor = _oom_turn_with_survivor(cgroup2_root, state_dir, "mem", "oom")
    out = cli(cgroup2_root, state_dir, "metrics", "--once")
    assert out.returncode == 0, out.stderr
    scraped = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(out.stdout) for s in family.samples}
    turn = {("task", "mem"), ("turn", "oom")}
    assert scraped[("cgturn_turn_oom_kills_total", frozenset(turn))] == 1
    assert 40 * MiB <= scraped[("cgturn_turn_memory_peak_bytes", frozenset(turn))] <= 50 * MiB
    assert scraped[("cgturn_limit_events_total", frozenset({("reason", "oom")}))] == 1
    assert scraped[("cgturn_limit_events_total", frozenset({("reason", "pids-max")}))] == 0
    for action in ("freeze", "thaw", "abandon"):
        assert scraped[("cgturn_guard_actions_total", frozenset({("action", action)}))] == 0
    assert ("cgturn_kills_total", frozenset({("reason", "oom")})) not in scraped  # a limit event is no kill
    assert cli(cgroup2_root, state_dir, "end", "mem").returncode == 0
    assert wait_until(lambda: not alive(survivor))


def test_limits_show_and_change_at_every_level(cgroup2_root, state_dir, runs):
    def limits(*args):
        out = cli(cgroup2_root, state_dir, "limits", *args, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    empty = limits()  # reading creates nothing
    assert empty["level"] == "root" and set(empty["limits"].values()) == {None} and not os.path.exists(cgroup2_root)
    root = limits("--memory", "1G", "--pids", "500")
    assert (root["level"], root["task"], root["turn"]) == ("root", None, None)
    assert (root["limits"]["memory_max"], root["limits"]["pids_max"]) == (1024 * MiB, 500)
    assert limits()["limits"] == root["limits"]          # read back by another process
    assert limits("--memory", "max")["limits"]["memory_max"] is None
    assert limits()["limits"]["pids_max"] == 500         # what was not given stays

    task = limits("chat", "--cpus", "0.5", "--memory", "256M")
    assert (task["level"], task["task"], task["turn"]) == ("task", "chat", None)
    assert limits("chat")["limits"] == task["limits"] and task["limits"]["cpus"] == 0.5

    runs("chat", "t-1")
    turn = limits("chat", "t-1", "--memory", "64M")
    assert (turn["level"], turn["task"], turn["turn"]) == ("turn", "chat", "t-1")
    assert turn["limits"]["memory_max"] == 64 * MiB and turn["usage"]["oom_kills"] == 0
    rows = json.loads(cli(cgroup2_root, state_dir, "ps", "--json").stdout)
    assert [row["limits"]["memory_max"] for row in rows] == [64 * MiB]
    text = cli(cgroup2_root, state_dir, "limits", "chat", "t-1")
    assert text.returncode == 0 and "memory_max" in text.stdout and "64 MiB" in text.stdout


@pytest.mark.parametrize("args", [["limits", "chat", "nosuch"], ["limits", "nosuch"]])
def test_limits_of_what_does_not_exist_exit_1(cgroup2_root, state_dir, runs, args):
    runs("chat", "t-1")
    out = cli(cgroup2_root, state_dir, *args)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and out.stdout == "", out.stderr


def test_registry_backend_refuses_limits_with_125_and_runs_nothing(state_dir, tmp_path):
    marker = tmp_path / "ran"
    out = cli(None, state_dir, "run", "--memory", "50M", "--", "touch", str(marker), backend="registry",
              env={**os.environ, "CGTURN_SENTINEL": "0"})
    assert out.returncode == 125
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("cgturn: cannot start touch: ")
    assert not marker.exists()
    refused = cli(None, state_dir, "limits", "t", "--pids", "5", backend="registry")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "cannot enforce limits" in refused.stderr


def test_a_limit_the_layout_cannot_enforce_exits_125_and_runs_nothing(cgroup2_root, state_dir, tmp_path):
    if _layout(cgroup2_root, state_dir) != "v1-hybrid":
        pytest.skip("memory.high exists on cgroup v2: refused only by the v1 layout")
    marker = tmp_path / "ran"
    out = cli(cgroup2_root, state_dir, "run", "--task", "t", "--memory-high", "10M", "--", "touch", str(marker))
    assert out.returncode == 125
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("cgturn: cannot start touch: ")
    assert not marker.exists()
    assert json.loads(cli(cgroup2_root, state_dir, "ps", "--json").stdout) == []


def test_doctor_shows_the_limits_section(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "doctor", "--json")
    section = json.loads(out.stdout)["limits"]
    assert set(section) >= {"layout", "available", "problems"}
    assert section["layout"] in ("v2", "v1-hybrid", None)
    text = cli(cgroup2_root, state_dir, "doctor").stdout.splitlines()
    shown = [line for line in text if line.startswith("limits:")]
    assert len(shown) == 1
    for name in section["available"]:
        assert name in shown[0]
    assert [line.split(":", 1)[1].strip() for line in text if line.startswith("limits problem:")] == section["problems"]
    assert not os.path.exists(cgroup2_root)  # doctor stays read-only
