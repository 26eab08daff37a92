"""The audit log's rotation (cgturn.audit renames it past CGTURN_AUDIT_MAX_BYTES) and the metrics
exporter following it: no record lost, none counted twice, by writers that are real processes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cgturn import audit
from cgturn.metrics import AuditTail

WRITER = """
import sys
from cgturn import audit
state_dir, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    audit.record_kill(state_dir, task=tag, turn=f"{tag}-{i}", reason="stop", pids=[i + 1],
                      signals=["SIGKILL"], duration_ms=1.0, backend="cgroup2")
"""


def _kill(state_dir: str, turn: str, reason: str = "stop") -> None:
    audit.record_kill(state_dir, task="t", turn=turn, reason=reason, pids=[1, 2], signals=["SIGKILL"],
                      duration_ms=3.0, backend="cgroup2")


def _generations(state_dir: str) -> list[str]:
    path = audit.audit_path(state_dir)
    return [g for g in (audit.rotated_path(path, n) for n in range(1, audit.KEEP + 2)) if os.path.exists(g)]


def test_the_log_is_renamed_past_max_bytes_and_keeps_keep_generations(tmp_path, monkeypatch):
    state_dir = str(tmp_path)
    monkeypatch.setenv(audit.MAX_BYTES_ENV, "2000")
    for i in range(200):
        _kill(state_dir, f"u{i}")
    path = audit.audit_path(state_dir)
    # The current file was started again (or is not there yet: the last record's write rotated it, as
    # it does whenever a record ends exactly past max_bytes — the lines' lengths vary with pids).
    assert (os.path.getsize(path) if os.path.exists(path) else 0) < 2000 + 1000
    assert _generations(state_dir) == [audit.rotated_path(path, n) for n in range(1, audit.KEEP + 1)]
    for name in [p for p in [path] if os.path.exists(p)] + _generations(state_dir):
        with open(name) as f:
            assert all(audit.parse_line(line) for line in f)   # whole lines only, in every generation
    kept = [r["turn"] for r in audit.read_records(state_dir)]
    assert kept == [f"u{i}" for i in range(200 - len(kept), 200)]  # the newest, oldest first, no gap


def test_max_bytes_zero_never_rotates(tmp_path, monkeypatch):
    monkeypatch.setenv(audit.MAX_BYTES_ENV, "0")
    for i in range(50):
        _kill(str(tmp_path), f"u{i}")
    assert _generations(str(tmp_path)) == [] and len(audit.read_records(str(tmp_path))) == 50


def test_the_exporter_follows_rotation_without_losing_or_double_counting(tmp_path, monkeypatch):
    state_dir = str(tmp_path)
    monkeypatch.setenv(audit.MAX_BYTES_ENV, "3000")
    tail = AuditTail(state_dir)
    written = 0
    # Batches of 25 records (~230 bytes each): one or two rotations between scrapes, and scrapes that
    # stop inside a file that is rotated before the next one.
    for batch in range(12):
        for _ in range(25):
            _kill(state_dir, f"u{written}", reason="stop" if written % 3 else "timeout")
            written += 1
        tail.update()
        assert sum(tail.kills.values()) == written, f"after batch {batch}"
    assert tail.kills == {"stop": sum(1 for i in range(written) if i % 3),
                          "timeout": sum(1 for i in range(written) if not i % 3)}
    assert tail.malformed == 0 and tail.killed_processes["stop"] == 2 * tail.kills["stop"]
    assert _generations(state_dir), "the test must have rotated the log"


def test_the_exporter_reads_the_rest_of_a_line_finished_in_the_rotated_file(tmp_path):
    state_dir = str(tmp_path)
    path = audit.audit_path(state_dir)
    tail = AuditTail(state_dir)
    with open(path, "w") as f:
        f.write('{"reason": "stop", "pids": [1], "duration_ms": 1}\n{"reason": "time')
    tail.update()
    with open(path, "a") as f:
        f.write('out", "pids": [2], "duration_ms": 1}\n')
    os.rename(path, audit.rotated_path(path, 1))
    _kill(state_dir, "after")
    tail.update()
    assert tail.kills == {"stop": 2, "timeout": 1} and tail.malformed == 0


def test_concurrent_writers_rotate_once_each_time_and_lose_no_record(tmp_path):
    state_dir = str(tmp_path)
    # 4 writers x 150 records of ~190 bytes: ~115 KB, 3 rotations at 40 KB, so every record is still
    # kept (the current file and KEEP generations). Two writers rotating the same file would rename
    # the fresh log over generation 1 and lose what it held.
    env = dict(os.environ, **{audit.MAX_BYTES_ENV: str(40_000)})
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, state_dir, f"w{k}", "150"], env=env)
               for k in range(4)]
    assert [w.wait(timeout=120) for w in writers] == [0] * 4
    records = audit.read_records(state_dir)
    assert len(_generations(state_dir)) <= audit.KEEP
    turns = [r["turn"] for r in records]
    assert sorted(turns) == sorted(f"w{k}-{i}" for k in range(4) for i in range(150))
    for k in range(4):  # each writer's records in its own order
        mine = [t for t in turns if t.startswith(f"w{k}-")]
        assert mine == [f"w{k}-{i}" for i in range(150)]


def test_a_real_kill_that_takes_the_log_past_the_limit_is_counted_once(cgroup2_manager, state_dir, monkeypatch):
    monkeypatch.setenv(audit.MAX_BYTES_ENV, "1")   # every record rotates the log
    tail = AuditTail(state_dir)
    for n in range(1, 4):
        turn = cgroup2_manager.begin_turn("rot", f"r{n}")
        turn.spawn(["sleep", "300"])
        assert turn.abandon("stop", grace=0).killed
        tail.update()
        assert tail.kills == {"stop": n}
    assert len(_generations(state_dir)) == 3 and not os.path.exists(audit.audit_path(state_dir))


@pytest.mark.parametrize("raw", ["lots", "-5"])
def test_a_bad_max_bytes_falls_back_to_the_default(monkeypatch, raw):
    monkeypatch.setenv(audit.MAX_BYTES_ENV, raw)
    assert audit.max_bytes() == audit.DEFAULT_MAX_BYTES
