"""Issue 10 ("trust nothing on disk"): forged, corrupt and missing records, ancestors of the caller,
huge ids and a refused record write, a mistyped --root — on the real kernel, with forgeries written
by os.setxattr on cgroups the test created and kills aimed at processes the test started.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import textwrap

import pytest

from cgturn import errors
from cgturn.backends import metadata
from cgturn.model import TurnRecord
from conftest import PY, alive, turn_dir, wait_until

XATTR = "user.cgturn"


def cgturn(root, state, *args) -> subprocess.CompletedProcess:
    """`python -m cgturn` as a real subprocess on this test's root and state dir."""
    return subprocess.run([PY, "-m", "cgturn", "--root", root, "--backend", "cgroup2", "--state-dir", state,
                           *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=60)


def sleeping_turn(mgr, task, turn="t"):
    """A running turn of `mgr` holding one `sleep 300`; returns (turn, popen)."""
    t = mgr.begin_turn(task, turn)
    return t, t.spawn(["sleep", "300"])


def ps_rows(root, state) -> dict[tuple[str, str], dict]:
    proc = cgturn(root, state, "ps", "--json")
    assert proc.returncode == 0, proc.stderr
    return {(row["task"], row["turn"]): row for row in json.loads(proc.stdout)}


# --- item 1: a record is never trusted over the directory it came from -------------------------------

def test_stop_kills_the_directory_it_resolved_not_the_turn_a_copied_record_names(cgroup2_manager, state_dir):
    root = cgroup2_manager.root
    x, px = sleeping_turn(cgroup2_manager, "X")
    y, py = sleeping_turn(cgroup2_manager, "Y")
    os.setxattr(turn_dir(cgroup2_manager, x), XATTR, os.getxattr(turn_dir(cgroup2_manager, y), XATTR))
    proc = cgturn(root, state_dir, "stop", "X", "t", "--grace", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["killed"] == [px.pid]
    assert px.wait(10) == -9
    assert alive(py.pid) and y.state == "running"


def test_reap_never_follows_a_copied_record_with_a_dead_owner(cgroup2_manager, state_dir):
    root = cgroup2_manager.root
    x, px = sleeping_turn(cgroup2_manager, "X")
    y, py = sleeping_turn(cgroup2_manager, "Y")
    forged = json.loads(os.getxattr(turn_dir(cgroup2_manager, y), XATTR))
    dead = subprocess.Popen(["true"])
    dead.wait()
    forged["owner_pid"] = dead.pid
    os.setxattr(turn_dir(cgroup2_manager, x), XATTR, json.dumps(forged).encode())
    proc = cgturn(root, state_dir, "reap", "--json")
    assert proc.returncode == 0, proc.stderr
    actions = [(a["action"], a["task"], a["turn"]) for a in json.loads(proc.stdout)]
    assert actions == [("killed-corrupt", "X", "t")]
    assert px.wait(10) == -9
    assert alive(py.pid) and y.state == "running"


@pytest.mark.parametrize("field, value", [("owner_pid", "1"), ("state", 5), ("task_id", ["X"]),
                                          ("started_at", "yesterday"), ("owner_start", 1.5)])
def test_a_record_with_wrong_field_types_is_corrupt_and_killable(cgroup2_manager, state_dir, field, value):
    x, px = sleeping_turn(cgroup2_manager, "X")
    y, py = sleeping_turn(cgroup2_manager, "Y")
    rec = json.loads(os.getxattr(turn_dir(cgroup2_manager, x), XATTR))
    rec[field] = value
    os.setxattr(turn_dir(cgroup2_manager, x), XATTR, json.dumps(rec).encode())
    rows = ps_rows(cgroup2_manager.root, state_dir)
    assert rows[("X", "t")]["state"] == "corrupt" and rows[("X", "t")]["pids"] == [px.pid]
    assert rows[("Y", "t")]["state"] == "running"
    proc = cgturn(cgroup2_manager.root, state_dir, "stop", "X", "t", "--grace", "0")
    assert proc.returncode == 0, proc.stderr
    assert px.wait(10) == -9
    assert alive(py.pid)


def test_a_record_shaped_like_a_trusted_one_still_has_its_values_checked():
    """Records whose values have the types of one that passed every check skip the type checks
    (metadata._typed): the checks of values still apply to them, and other types are checked again."""
    path = "/nowhere/task-a/t1"
    good = {"format": 1, **TurnRecord(task_id="task-a", turn_id="t1", task_key="task-a", turn_key="t1", owner_pid=7,
                                      started_at=1.5).to_json()}
    first = metadata.record_from_xattr(json.dumps(good).encode(), path)
    assert first is not None and metadata.record_from_xattr(json.dumps(good).encode(), path) == first
    for field, value in [("state", "finished"), ("network", "bridge"), ("frozen_by", "someone"),  # same types
                         ("owner_pid", 7.0), ("owner_pid", True), ("sealed", 0), ("started_at", "1.5"),
                         ("task_id", "task-b"), ("turn_key", "t2")]:
        assert metadata.record_from_xattr(json.dumps({**good, field: value}).encode(), path) is None, (field, value)


# --- item 3: ancestors of the caller -----------------------------------------------------------------

ABANDON_PARENTS_TURN = textwrap.dedent("""
    import sys
    from cgturn import TurnManager
    sys.stdin.readline()                      # the test has moved our parent into the turn
    mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2], sentinel=False)
    try:
        mgr.turn("task", "turn").abandon("test", grace=0)
        print("abandoned", flush=True)
    except Exception as err:
        print(type(err).__name__, flush=True)
""")


def test_abandon_of_a_turn_holding_the_callers_parent_is_refused(cgroup2_manager, state_dir):
    turn = cgroup2_manager.begin_turn("task", "turn")
    # The shell forks the python child before it is moved, so only the shell is in the turn.
    wrapper = subprocess.Popen(["sh", "-c", '"$@"; exec sleep 300', "sh", PY, "-c", ABANDON_PARENTS_TURN,
                                cgroup2_manager.root, state_dir], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: any(True for _ in os.scandir(f"/proc/{wrapper.pid}/task")), 5)
        assert wait_until(lambda: len(_children(wrapper.pid)) == 1, 10)
        turn.adopt(wrapper.pid)
        assert turn.pids() == [wrapper.pid]
        wrapper.stdin.write("go\n")
        wrapper.stdin.flush()
        assert wrapper.stdout.readline().split() == ["UnsafeOperation"]
        assert wait_until(lambda: open(f"/proc/{wrapper.pid}/cmdline", "rb").read().startswith(b"sleep"), 10)
        assert wrapper.poll() is None
        assert turn.state == "running"   # the refusal touched nothing
    finally:
        wrapper.kill()
        wrapper.wait()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


# --- item 4: a corrupt or missing record never makes a turn unkillable --------------------------------

def _garbage(raw: bytes) -> bytes:
    return b"\xff\x00garbage{"


def _truncated(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]


def _kill_by(how, mgr, turn, state_dir):
    if how == "abandon":
        result = turn.abandon("test", grace=0)
        assert result.skipped is False
        return
    args = {"stop": ("stop", "X", "t", "--grace", "0"), "end": ("end", "X", "--grace", "0"), "reap": ("reap", "--json")}[how]
    proc = cgturn(mgr.root, state_dir, *args)
    assert proc.returncode == 0, proc.stderr
    if how == "reap":
        assert [(a["action"], a["task"], a["turn"]) for a in json.loads(proc.stdout)] == \
            [("killed-corrupt", "X", "t")]


@pytest.mark.parametrize("how", ["stop", "end", "reap", "abandon"])
@pytest.mark.parametrize("damage", [_garbage, _truncated], ids=["garbage", "truncated"])
def test_a_turn_with_an_unreadable_record_is_listed_corrupt_and_killed(cgroup2_manager, state_dir, damage, how):
    x, px = sleeping_turn(cgroup2_manager, "X")
    y, py = sleeping_turn(cgroup2_manager, "Y")
    path = turn_dir(cgroup2_manager, x)
    os.setxattr(path, XATTR, damage(os.getxattr(path, XATTR)))
    row = ps_rows(cgroup2_manager.root, state_dir)[("X", "t")]
    assert (row["state"], row["pids"]) == ("corrupt", [px.pid])
    _kill_by(how, cgroup2_manager, x, state_dir)
    assert px.wait(10) == -9
    assert not os.path.exists(path)
    assert alive(py.pid) and y.state == "running"


def test_a_turn_directory_without_a_record_is_corrupt_killed_by_reap_and_replaceable(
        cgroup2_manager, bystanders, monkeypatch):
    """An owner killed between mkdir and the record write leaves a directory with no record."""
    monkeypatch.setattr(metadata, "CREATING_GRACE", 0.0)
    cgroup2_manager.create_root()
    path = os.path.join(cgroup2_manager.root, "X", "t")
    os.makedirs(path)
    victim = bystanders("sleep", "300")
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(victim.pid))
    infos = {(i.task, i.turn): i for i in cgroup2_manager.turns()}
    assert (infos[("X", "t")].state, infos[("X", "t")].pids) == ("corrupt", [victim.pid])
    actions = [(a.action, a.task, a.turn) for a in cgroup2_manager.recover()]
    assert actions == [("killed-corrupt", "X", "t")]
    assert victim.wait(10) == -9
    # Left empty without a record: the turn id is free again, not TurnExists for ever.
    os.makedirs(path)
    turn = cgroup2_manager.begin_turn("X", "t")
    assert turn.state == "running" and turn.spawn(["true"]).wait(10) == 0


# --- item 5: huge ids, and one refused record write ---------------------------------------------------

def test_a_70kb_turn_id_is_a_value_error_and_creates_nothing(cgroup2_manager):
    try:
        cgroup2_manager.begin_turn("task", "x" * 70_000)
    except ValueError:
        pass
    else:
        raise AssertionError("a 70 KB turn id was accepted")
    assert not os.path.exists(os.path.join(cgroup2_manager.root, "task"))


def test_one_refused_record_write_does_not_switch_the_manager_to_files(cgroup2_manager, monkeypatch):
    """The kernel refuses an xattr value over 64 KiB (E2BIG, xattr(7)): one record made that big goes
    to a file; the manager keeps xattrs for the others, and its earlier turns stay visible."""
    from cgturn.model import TurnRecord

    a, pa = sleeping_turn(cgroup2_manager, "task", "a")
    plain = TurnRecord.to_json
    monkeypatch.setattr(TurnRecord, "to_json",
                        lambda rec: {**plain(rec), "pad": "x" * 70_000} if rec.turn_id == "big" else plain(rec))
    big, pbig = sleeping_turn(cgroup2_manager, "task", "big")
    with pytest.raises(OSError) as missing:
        os.getxattr(turn_dir(cgroup2_manager, big), XATTR)   # the kernel refused it: it is in a file
    assert missing.value.errno == errno.ENODATA
    c, pc = sleeping_turn(cgroup2_manager, "task", "c")
    assert json.loads(os.getxattr(turn_dir(cgroup2_manager, c), XATTR))["turn_id"] == "c"
    states = {(i.turn, i.state) for i in cgroup2_manager.turns("task")}
    assert states == {("a", "running"), ("big", "running"), ("c", "running")}
    result = a.abandon("test", grace=0)
    assert (result.skipped, result.killed) == (False, [pa.pid])
    assert pa.wait(10) == -9
    assert sorted(cgroup2_manager.end_task("task").killed) == sorted([pbig.pid, pc.pid])


# --- item 13 (first half): a mistyped --root -----------------------------------------------------------

def test_a_relative_root_under_auto_exits_2_and_creates_no_registry(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    proc = subprocess.run([PY, "-m", "cgturn", "--root", "relative/path", "--state-dir", str(state), "ps"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "relative/path" in proc.stderr
    assert proc.stdout == ""
    assert os.listdir(state) == []


def test_file_records_hold_turn_names_as_long_as_a_directory_name(cgroup2_manager):
    """Where records go to files, a turn whose name takes all of NAME_MAX still gets one: the file
    name is shortened, not `<name>.json.<pid>.tmp` over 255 bytes (ENAMETOOLONG)."""
    cgroup2_manager.backend.meta.use_xattrs = False   # the capability flag, as on a host without xattrs
    long_id, shortened_id = "y" * 255, "z" * 400
    turns = {tid: sleeping_turn(cgroup2_manager, "task", tid) for tid in (long_id, shortened_id)}
    assert {(i.turn, i.state) for i in cgroup2_manager.turns("task")} == \
        {(long_id, "running"), (shortened_id, "running")}
    for turn, proc in turns.values():
        assert turn.abandon("test", grace=0).killed == [proc.pid]
        assert proc.wait(10) == -9
