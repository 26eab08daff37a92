"""Prometheus exposition: scraped over loopback from a real `cgturn metrics`, parsed by prometheus_client."""
import json
import os
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cgturn.metrics import AuditTail
from conftest import cgturn_popen, cli, completed_turn


def samples(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(scraped, name, **labels):
    return scraped.get((name, frozenset(labels.items())))


@pytest.fixture
def exporter(cgroup2_root, state_dir):
    """A running `cgturn metrics --listen 127.0.0.1:0`; yields its URL."""
    proc = cgturn_popen(cgroup2_root, state_dir, "metrics", "--listen", "127.0.0.1:0")
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving metrics on http://127.0.0.1:"), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return samples(resp.read().decode())


def test_metrics_endpoint_over_loopback(cgroup2_root, state_dir, runs, exporter):
    runs("chat", "t-1")
    runs("chat", "t-2")
    completed_turn(cgroup2_root, state_dir, "ci", "job")
    first = scrape(exporter)
    assert value(first, "cgturn_turns", state="running") == 2
    assert value(first, "cgturn_turns", state="completed") == 1
    assert value(first, "cgturn_turns", state="abandoned") == 0
    assert value(first, "cgturn_turn_processes", task="ci", turn="job", state="completed") == 1
    assert value(first, "cgturn_turn_processes", task="chat", turn="t-1", state="running") >= 2
    assert value(first, "cgturn_turn_cpu_seconds_total", task="chat", turn="t-1") > 0  # its shell ran
    assert value(first, "cgturn_turn_memory_bytes", task="ci", turn="job") > 0
    assert value(first, "cgturn_abandon_duration_seconds_count") == 0
    # kills done by other processes (the CLI here) after the exporter started are counted
    assert cli(cgroup2_root, state_dir, "stop", "chat", "t-1", "--grace", "0").returncode == 0
    assert cli(cgroup2_root, state_dir, "end", "ci").returncode == 0
    second = scrape(exporter)
    assert value(second, "cgturn_turns", state="running") == 1
    assert value(second, "cgturn_kills_total", reason="stop") == 1
    assert value(second, "cgturn_kills_total", reason="end-task") == 1
    assert value(second, "cgturn_killed_processes_total", reason="end-task") == 1
    assert value(second, "cgturn_abandon_duration_seconds_count") == 2
    assert value(second, "cgturn_abandon_duration_seconds_bucket", le="+Inf") == 2
    assert value(second, "cgturn_abandon_duration_seconds_sum") > 0


def test_metrics_once_prints_one_exposition(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "metrics", "--once")
    assert out.returncode == 0, out.stderr
    assert value(samples(out.stdout), "cgturn_turns", state="running") == 0


def test_metrics_cannot_bind_exits_1(cgroup2_root, state_dir):
    out = cli(cgroup2_root, state_dir, "metrics", "--listen", "192.0.2.1:0")  # TEST-NET: not ours
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "cannot listen" in out.stderr


def _append(path, *records, tail=""):
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_audit_tail_reads_incrementally_and_survives_rotation(tmp_path):
    log = tmp_path / "audit.jsonl"
    tail = AuditTail(str(tmp_path), buckets=(0.01, 1.0))
    tail.update()  # no log yet
    assert tail.kills == {}
    _append(log, {"reason": "stop", "pids": [1, 2], "duration_ms": 5}, tail='{"reason": "time')
    tail.update()
    assert tail.kills == {"stop": 1} and tail.killed_processes == {"stop": 2}
    with open(log, "a") as f:
        f.write('out", "pids": [3], "duration_ms": 2000}\nnot json\n')
    tail.update()
    assert tail.kills == {"stop": 1, "timeout": 1}
    assert tail.histogram_buckets() == [("0.01", 1), ("1.0", 1), ("+Inf", 2)]
    os.rename(log, tmp_path / "audit.jsonl.1")  # logrotate: a new file starts
    _append(log, {"reason": "stop", "pids": [4], "duration_ms": 500})
    tail.update()
    assert tail.kills == {"stop": 2, "timeout": 1} and tail.histogram_buckets()[1] == ("1.0", 2)
    assert tail.latency_sum == pytest.approx(2.505)


@pytest.mark.parametrize("line", [
    '{"pids": 3}',                                            # no reason, pids not a list
    '{"reason": "stop", "pids": 3, "duration_ms": 1}',
    '{"reason": "stop", "pids": ["1"], "duration_ms": 1}',
    '{"reason": "stop", "pids": [true], "duration_ms": 1}',
    '{"reason": 7, "pids": [], "duration_ms": 1}',
    '{"reason": "stop", "pids": [], "duration_ms": NaN}',     # Python's json accepts NaN
    '{"reason": "stop", "pids": [], "duration_ms": Infinity}',
    '{"reason": "stop", "pids": [], "duration_ms": -5}',
    '{"reason": "stop", "pids": [], "duration_ms": "5"}',
    '{"reason": "stop", "action": 3}',
    '{"v": "1", "reason": "stop", "pids": [], "duration_ms": 1}',   # a version that is no whole number
    '{"v": -1, "reason": "stop", "pids": [], "duration_ms": 1}',
    '{"v": true, "reason": "stop", "pids": [], "duration_ms": 1}',
    '{"v": 1, "action": "limit", "reason": "oom", "count": -1}',
    "[" * 200_000,                                            # RecursionError in the parser
    '"just a string"',
    "\udcff",
], ids=lambda line: line[:40])
def test_a_malformed_audit_line_is_skipped_and_counted(tmp_path, line):
    tail = AuditTail(str(tmp_path), buckets=(1.0,))
    with open(tmp_path / "audit.jsonl", "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(line + "\n" + json.dumps({"reason": "stop", "pids": [1], "duration_ms": 5}) + "\n")
    tail.update()
    tail.update()
    assert tail.malformed == 1
    assert tail.kills == {"stop": 1} and tail.killed_processes == {"stop": 1}
    assert tail.latency_sum == pytest.approx(0.005)


def test_an_over_long_audit_line_is_skipped_without_being_held(tmp_path, monkeypatch):
    from cgturn import metrics

    monkeypatch.setattr(metrics, "MAX_LINE", 100)
    tail = AuditTail(str(tmp_path), buckets=(1.0,))
    log = tmp_path / "audit.jsonl"
    _append(log, tail="x" * 150)  # longer than MAX_LINE before its newline even arrives
    tail.update()
    assert tail.malformed == 1 and tail._partial == b""
    _append(log, tail="rest of the long line\n")
    _append(log, {"reason": "stop", "pids": [], "duration_ms": 1}, tail="y" * 120 + "\n")
    _append(log, {"reason": "stop", "pids": [], "duration_ms": 1})
    tail.update()
    assert tail.malformed == 2 and tail.kills == {"stop": 2}


# Lines exactly as cgturn wrote them before records carried a format version (no `v` field).
UNVERSIONED_KILL = ('{"time": 1764590000.25, "task": "chat", "turn": "t1", "reason": "deadline", "pids": [412, 415], '
                    '"signals": ["SIGTERM", "SIGKILL"], "duration_ms": 21.5, "backend": "cgroup2", "by_pid": 400, '
                    '"usage": {"oom_kills": 0}}')
UNVERSIONED_LIMIT = ('{"time": 1764590001.0, "action": "limit", "task": "chat", "turn": "t1", "reason": "oom", '
                     '"count": 2, "limit": 268435456, "backend": "cgroup2", "by_pid": 400}')
UNVERSIONED_FREEZE = ('{"time": 1764590002.0, "action": "freeze", "task": "chat", "turn": "t1", "reason": "guard", '
                      '"pids": [412], "backend": "cgroup2", "by_pid": 400}')


def test_an_unversioned_line_reads_as_todays_format(tmp_path):
    from cgturn import audit

    kill = audit.parse_line(UNVERSIONED_KILL)
    assert kill is not None and audit.action_of(kill) == "kill" and audit.pids_of(kill) == [412, 415]
    assert audit.duration_of(kill) == pytest.approx(0.0215)
    assert audit.count_of(audit.parse_line(UNVERSIONED_LIMIT)) == 2
    (tmp_path / "audit.jsonl").write_text("\n".join((UNVERSIONED_KILL, UNVERSIONED_LIMIT, UNVERSIONED_FREEZE)) + "\n")
    tail = AuditTail(str(tmp_path), buckets=(0.01, 1.0))
    tail.update()
    assert (tail.kills, tail.killed_processes, tail.malformed) == ({"deadline": 1}, {"deadline": 2}, 0)
    assert tail.limit_events["oom"] == 2 and tail.guard_actions["freeze"] == 1
    assert tail.histogram_buckets() == [("0.01", 0), ("1.0", 1), ("+Inf", 1)]
    assert [r["reason"] for r in audit.read_records(str(tmp_path))] == ["deadline", "oom", "guard"]


def test_records_are_written_with_their_format_version_and_read_back(tmp_path):
    from cgturn import audit

    state_dir = str(tmp_path)
    audit.record_kill(state_dir, task="t", turn="u", reason="stop", pids=[3, 1], signals=["SIGKILL"],
                      duration_ms=2.0, backend="registry")
    audit.record_limit(state_dir, task="t", turn="u", reason="pids-max", count=1, limit=10, backend="registry")
    audit.record_action(state_dir, action="thaw", task="t", turn="u", reason="user", pids=[1], backend="registry")
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert [json.loads(line)["v"] for line in lines] == [audit.FORMAT] * 3
    assert [audit.action_of(audit.parse_line(line)) for line in lines] == ["kill", "limit", "thaw"]
    tail = AuditTail(state_dir, buckets=(1.0,))
    tail.update()
    assert (tail.kills, tail.limit_events["pids-max"], tail.malformed) == ({"stop": 1}, 1, 0)


def test_records_of_other_actions_are_not_kills_nor_malformed(tmp_path):
    tail = AuditTail(str(tmp_path), buckets=(1.0,))
    _append(tmp_path / "audit.jsonl", {"action": "limit", "reason": "oom", "task": "t", "turn": "u"},
            {"action": "kill", "reason": "stop", "pids": [], "duration_ms": 1})
    tail.update()
    assert tail.kills == {"stop": 1} and tail.malformed == 0


def test_the_exporter_keeps_serving_after_a_bad_line(cgroup2_root, state_dir, exporter):
    url = exporter
    _append(os.path.join(state_dir, "audit.jsonl"), {"pids": 3}, tail="[" * 200_000 + "\n")
    _append(os.path.join(state_dir, "audit.jsonl"), {"reason": "stop", "pids": [1], "duration_ms": float("nan")})
    for _ in range(2):
        scraped = scrape(url)
        assert value(scraped, "cgturn_audit_malformed_lines_total") == 3
    assert value(scraped, "cgturn_abandon_duration_seconds_sum") == 0
