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
