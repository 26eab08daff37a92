"""Upgrades keep live turns: records carry a format version (cgturn/backends/record_format.py).

The literals below are what cgturn 53c0d75 (before records carried a version) wrote, captured from that
code: the `user.cgturn` xattr of a turn, its metadata-file fallback, and the registry's turns table and
row. The code of today must read each as the same running turn (not `corrupt`, which any stop or reap
kills), list it, complete it and abandon it; a record of a newer format reads as corrupt and says why.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3

import pytest

from cgturn import NoSuchTurn, TurnManager
from cgturn.backends.record_format import RECORD_FORMAT
from cgturn.kernel.cgroupfs import Cgroup
from conftest import destroy_registry, turn_dir

XATTR_53C0D75 = (
    b'{"task_id": "chat:1", "turn_id": "turn 1", "task_key": "chat:1", "turn_key": "turn%201", "state": "running", '
    b'"owner_pid": 8976, "owner_start": 184222, "reason": null, "started_at": 1796140746.0788279, "ended_at": null, '
    b'"killer_pid": null, "killer_start": null, "limits": null, "v1_dirs": false, "audited_oom_kills": 0, '
    b'"audited_pids_max_hits": 0, "frozen_by": null, "frozen_at": null, "frozen_seconds": 0.0, "expires_at": null, '
    b'"keys": null, "sealed": false, "network": "host"}')
FILE_53C0D75 = (
    b'{"task_id": "chat:1", "turn_id": "turn 2", "task_key": "chat:1", "turn_key": "turn%202", "state": "running", '
    b'"owner_pid": 8976, "owner_start": 184222, "reason": null, "started_at": 1796140746.0845537, "ended_at": null, '
    b'"killer_pid": null, "killer_start": null, "limits": null, "v1_dirs": false, "audited_oom_kills": 0, '
    b'"audited_pids_max_hits": 0, "frozen_by": null, "frozen_at": null, "frozen_seconds": 0.0, "expires_at": null, '
    b'"keys": null, "sealed": false, "network": "host", "_inode": 445803}')
SCHEMA_53C0D75 = (
    "CREATE TABLE turns (task_id TEXT, turn_id TEXT, task_key TEXT, turn_key TEXT, state TEXT, owner_pid INTEGER, "
    "owner_start INTEGER, reason TEXT, started_at REAL, ended_at REAL, killer_pid INTEGER, killer_start INTEGER, "
    "limits TEXT, v1_dirs INTEGER, audited_oom_kills INTEGER, audited_pids_max_hits INTEGER, frozen_by TEXT, "
    "frozen_at REAL, frozen_seconds REAL, expires_at REAL, keys TEXT, sealed INTEGER, network TEXT, "
    "PRIMARY KEY (task_key, turn_key))")
ROW_53C0D75 = ('chat:1', 'turn 1', 'chat:1', 'turn%201', 'running', 8976, 184222, None, 1796140746.1440256, None,
               None, None, None, 0, 0, 0, None, None, 0.0, None, None, 0, 'host')


def _as_turn(literal: bytes, turn_id: str) -> bytes:
    """The same record of another turn of the task (turn ids and keys replaced, nothing else)."""
    return literal.replace(b'"turn 1"', f'"{turn_id}"'.encode()).replace(
        b'"turn%201"', f'"{turn_id.replace(" ", "%20")}"'.encode())


def _listed(mgr) -> dict[str, str]:
    return {info.turn: info.state for info in mgr.turns("chat:1")}


def _lists_completes_and_abandons(mgr, done, doomed) -> None:
    """`done` and `doomed` (Turns whose records were just replaced by old-format ones) are running
    turns: listed as such, one completes, the other is abandoned with its process killed."""
    assert _listed(mgr) == {done.turn_id: "running", doomed.turn_id: "running"}
    assert mgr.turn("chat:1", doomed.turn_id).record.owner_pid == 8976  # the old record, read as it was
    proc, survivor = doomed.spawn(["sleep", "300"]), done.spawn(["sleep", "300"])
    done.complete()
    result = doomed.abandon("upgrade-test", grace=0)
    assert not result.skipped and result.killed == [proc.pid]
    assert proc.wait(timeout=10) == -signal.SIGKILL
    # The completed turn stays while its survivor lives; the abandoned one is gone with its cgroup/rows.
    assert _listed(mgr) == {done.turn_id: "completed"}
    mgr.end_task("chat:1")
    assert survivor.wait(timeout=10) == -signal.SIGTERM  # end_task: SIGTERM first


def test_a_cgroup2_record_written_before_versions_is_the_same_turn(cgroup2_root, state_dir):
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        done, doomed = mgr.begin_turn("chat:1", "turn 1"), mgr.begin_turn("chat:1", "turn 3")
        os.setxattr(turn_dir(mgr, done), "user.cgturn", XATTR_53C0D75)
        os.setxattr(turn_dir(mgr, doomed), "user.cgturn", _as_turn(XATTR_53C0D75, "turn 3"))
        path = turn_dir(mgr, done)
        _lists_completes_and_abandons(mgr, done, doomed)
        again = mgr.begin_turn("chat:1", "turn 1")  # what today's code writes carries its format
        assert json.loads(os.getxattr(path, "user.cgturn"))["format"] == RECORD_FORMAT
        again.complete()
    finally:
        mgr.end_task("chat:1")
        mgr.close()


def test_a_metadata_file_written_before_versions_is_the_same_turn(cgroup2_root, state_dir):
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    mgr.backend.meta.use_xattrs = False  # the capability flag, as on a host without xattrs
    try:
        done, doomed = mgr.begin_turn("chat:1", "turn 2"), mgr.begin_turn("chat:1", "turn 4")
        for turn, literal in ((done, FILE_53C0D75), (doomed, _as_turn(FILE_53C0D75.replace(b"turn 2", b"turn 1")
                                                                      .replace(b"turn%202", b"turn%201"), "turn 4"))):
            cg = Cgroup(turn_dir(mgr, turn))
            with open(mgr.backend.meta._file(cg), "wb") as f:  # the inode is the directory's own
                f.write(literal.replace(b'"_inode": 445803', f'"_inode": {cg.inode()}'.encode()))
        _lists_completes_and_abandons(mgr, done, doomed)
    finally:
        mgr.end_task("chat:1")
        mgr.close()


def test_a_registry_row_written_before_versions_is_the_same_turn(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    with sqlite3.connect(state / "registry.sqlite3") as conn:  # the database as 53c0d75 left it
        conn.execute(SCHEMA_53C0D75)
        conn.execute(f"INSERT INTO turns VALUES ({', '.join('?' * len(ROW_53C0D75))})", ROW_53C0D75)
        conn.execute(f"INSERT INTO turns VALUES ({', '.join('?' * len(ROW_53C0D75))})",
                     ROW_53C0D75[:1] + ("turn 3",) + ROW_53C0D75[2:3] + ("turn%203",) + ROW_53C0D75[4:])
    conn.close()
    mgr = TurnManager(backend="registry", state_dir=str(state), sentinel=False)
    try:
        _lists_completes_and_abandons(mgr, mgr.turn("chat:1", "turn 1"), mgr.turn("chat:1", "turn 3"))
        mgr.begin_turn("chat:1", "turn 1")  # what today's code writes carries its format
        assert mgr.backend.db.read("SELECT format FROM turns WHERE turn_key='turn%201'") == [(RECORD_FORMAT,)]
    finally:
        destroy_registry(mgr)


def _problem(mgr, turn_id: str) -> str | None:
    [info] = [info for info in mgr.turns("chat:1") if info.turn == turn_id]
    assert info.state == "corrupt"
    return mgr.backend.load("chat:1", turn_id.replace(" ", "%20")).problem


def test_a_cgroup2_record_of_a_newer_format_reads_as_corrupt_and_says_why(cgroup2_root, state_dir):
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        turn = mgr.begin_turn("chat:1", "turn 1")
        newer = b'{"format": %d, ' % (RECORD_FORMAT + 1) + XATTR_53C0D75[1:]
        os.setxattr(turn_dir(mgr, turn), "user.cgturn", newer)
        assert "newer than this cgturn reads" in _problem(mgr, "turn 1")
        with pytest.raises(NoSuchTurn):
            turn.spawn(["true"])  # nothing starts in a turn whose record this code cannot read
    finally:
        mgr.end_task("chat:1")
        mgr.close()


def test_a_registry_row_of_a_newer_format_reads_as_corrupt_and_says_why(tmp_path):
    mgr = TurnManager(backend="registry", state_dir=str(tmp_path / "state"), sentinel=False)
    try:
        mgr.begin_turn("chat:1", "turn 1")
        with mgr.backend.db.write() as conn:
            conn.execute("UPDATE turns SET format=? WHERE turn_key='turn%201'", (RECORD_FORMAT + 1,))
        assert "newer than this cgturn reads" in _problem(mgr, "turn 1")
    finally:
        destroy_registry(mgr)
