"""Limits on the real kernel: memory, pids and cpu limits of a turn, a task and the managed root are
enforced, counted, audited once, shown by ps, and their cgroups go with the turn.

On a hybrid host (cgroup2 without memory/pids/cpu, those in v1 hierarchies) the limited turn's v1
directories sit below this process's own v1 cgroups (tests/conftest.py `v1_mirrors`); teardown removes
what a failed test left there. A host without those controllers skips the kernel tests with the reason.

Every allocation, fork loop and busy loop is bounded in size and time.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time

import pytest

from cgturn import Limits, LimitsUnavailable, NoSuchTurn, TurnManager, Usage
from cgturn.kernel import controllers, parsers
from cgturn.kernel.cgroupfs import Cgroup
from cgturn.kernel.controllers import V1, V2, Place
from cgturn.limits import parse_cpus, parse_pids, parse_size, parse_weight
from conftest import PY, alive, audit_records, cli, cgturn_env, turn_dir, v1_mirrors, wait_until

MiB = 2 ** 20
PAGE = os.sysconf("SC_PAGE_SIZE")
SLEEP = ["sleep", "300"]

# Allocates (and touches) N MiB, after a line on stdin when asked to wait; then says so and holds it
# until stdin closes (bounded: 60 s).
ALLOC = textwrap.dedent("""
    import select, sys
    size, wait = int(sys.argv[1]) * 2 ** 20, sys.argv[2:] == ["wait"]
    if wait:
        sys.stdin.readline()
    data = b"\\1" * size
    print("held", flush=True)
    select.select([sys.stdin], [], [], 60)
""")

# Forks children that block on a pipe until fork fails or 200 exist, prints "<forked> <failed>", then
# lets them go and reaps them.
FORK_LOOP = textwrap.dedent("""
    import os
    r, w = os.pipe()
    kids, failed = [], False
    while len(kids) < 200:
        try:
            pid = os.fork()
        except OSError:
            failed = True
            break
        if pid == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        kids.append(pid)
    print(len(kids), int(failed), flush=True)
    os.close(w)
    for pid in kids:
        os.waitpid(pid, 0)
""")

# Two busy loops (this process and a child) for `seconds` of wall time each.
BUSY = textwrap.dedent("""
    import os, sys, time
    end = time.monotonic() + float(sys.argv[1])
    child = os.fork()
    while time.monotonic() < end:
        pass
    if child:
        os.waitpid(child, 0)
    else:
        os._exit(0)
""")


def _v1_hybrid(mgr) -> None:
    report = mgr.limits_report()
    if report["layout"] != "v1-hybrid" or set(report["available"]) != {"memory", "pids", "cpu"}:
        pytest.skip(f"needs memory, pids and cpu in v1 hierarchies (a hybrid host); here: {report}")


@pytest.fixture
def mgr(cgroup2_manager):
    """A manager whose managed root has all three controllers in the v1 hierarchies."""
    _v1_hybrid(cgroup2_manager)
    return cgroup2_manager


def v1_dirs(mgr, *keys) -> dict[str, str]:
    """The v1 directories of the managed root, a task or a turn, computed here (not by the library)."""
    return {c: os.path.join(path, *keys) for c, path in v1_mirrors(mgr.backend.root.path).items()}


def v1_lines(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/cgroup") as f:
        return parsers.parse_proc_cgroup_v1(f.read())


def v1_mounts() -> dict[str, str]:
    with open("/proc/self/mountinfo") as f:
        return controllers.v1_mounts(f.read())


def in_v1_dirs(pid: int, dirs: dict[str, str]) -> bool:
    """True when `pid` sits in exactly the v1 directories `dirs` (controller -> path)."""
    mine, mounts = v1_lines(pid), v1_mounts()
    return all(os.path.normpath(os.path.join(mounts[c], mine[c].lstrip("/"))) == path for c, path in dirs.items())


def read_v1(path: str, name: str) -> str:
    with open(os.path.join(path, name)) as f:
        return f.read().strip()


def start_alloc(turn, mib: int, wait: bool = False) -> subprocess.Popen:
    return turn.spawn([PY, "-c", ALLOC, str(mib), *(["wait"] if wait else [])],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def limit_records(state_dir: str, turn: str | None = None) -> list[dict]:
    return [r for r in audit_records(state_dir, turn) if r["action"] == "limit"]


# --- 1. memory -----------------------------------------------------------------------------------------

def test_memory_limit_oom_kills_only_the_turn_and_is_audited_once(mgr, state_dir):
    neighbour = mgr.begin_turn("neighbour", "n1", limits=Limits(memory_max=50 * MiB))
    calm = neighbour.spawn(SLEEP)
    turn = mgr.begin_turn("hog", "h1", limits=Limits(memory_max=50 * MiB))
    dirs = v1_dirs(mgr, *turn.names)
    assert read_v1(dirs["memory"], "memory.limit_in_bytes") == str(50 * MiB)
    # The target's first look at itself already finds it inside the limits (spawn joins before exec).
    first_look = turn.spawn(["cat", "/proc/self/cgroup"], stdout=subprocess.PIPE, text=True).communicate(timeout=10)[0]
    assert {c: parsers.parse_proc_cgroup_v1(first_look)[c] for c in dirs} == \
        {c: path[len(v1_mounts()[c]):] for c, path in dirs.items()}
    hog = start_alloc(turn, 200)
    out, _ = hog.communicate(timeout=60)
    assert hog.returncode == -signal.SIGKILL and out == ""
    usage = turn.usage()
    assert usage.oom_kills >= 1
    assert 50 * MiB - 16 * PAGE <= usage.memory_peak_bytes <= 50 * MiB
    assert calm.poll() is None and alive(calm.pid) and neighbour.usage().oom_kills == 0

    first = turn.check_limits()
    assert [(r["reason"], r["turn"], r["limit"]) for r in first] == [("oom", "h1", 50 * MiB)]
    assert first[0]["count"] == usage.oom_kills
    assert turn.check_limits() == []
    with TurnManager(root=mgr.root, backend="cgroup2", state_dir=state_dir) as second:
        assert second._control.check_limits(*turn.names) == []
    reaped = cli(mgr.root, state_dir, "reap", "--json")  # another process: the owner (we) lives
    assert reaped.returncode == 0, reaped.stderr
    result = turn.abandon("test", grace=0)
    assert result.usage is not None and result.usage.oom_kills == usage.oom_kills
    assert result.usage.memory_peak_bytes == usage.memory_peak_bytes
    assert [(r["reason"], r["count"]) for r in limit_records(state_dir)] == [("oom", usage.oom_kills)]
    assert not any(os.path.exists(d) for d in dirs.values())
    neighbour.abandon("test", grace=0)
    assert calm.wait(timeout=10) == -signal.SIGKILL


# --- 2. pids -------------------------------------------------------------------------------------------

def test_pids_limit_contains_a_fork_loop(mgr, state_dir):
    turn = mgr.begin_turn("forks", "f1", limits=Limits(pids_max=50))
    assert read_v1(v1_dirs(mgr, *turn.names)["pids"], "pids.max") == "50"
    loop = turn.spawn([PY, "-c", FORK_LOOP], stdout=subprocess.PIPE, text=True)
    out, _ = loop.communicate(timeout=60)
    forked, failed = map(int, out.split())
    assert loop.returncode == 0 and failed == 1 and forked < 50
    usage = turn.usage()
    assert usage.pids_max_hits > 0
    assert turn.complete() is True
    records = limit_records(state_dir, "f1")
    assert [(r["reason"], r["limit"]) for r in records] == [("pids-max", 50)]
    assert records[0]["count"] == usage.pids_max_hits


# --- 3. cpu --------------------------------------------------------------------------------------------

def test_half_a_cpu_throttles_two_busy_loops(mgr):
    turn = mgr.begin_turn("cpu", "c1", limits=Limits(cpus=0.5))
    cpu_dir = v1_dirs(mgr, *turn.names)["cpu"]
    assert (read_v1(cpu_dir, "cpu.cfs_quota_us"), read_v1(cpu_dir, "cpu.cfs_period_us")) == ("50000", "100000")
    t0 = time.monotonic()
    busy = turn.spawn([PY, "-c", BUSY, "2"])
    assert busy.wait(timeout=60) == 0
    wall = time.monotonic() - t0
    usage = turn.usage()
    assert usage.cpu_throttled_seconds > 0
    # Two loops could use 2 x wall; the quota allows 0.5 x wall (plus one period of slack).
    assert 0 < usage.cpu_seconds < 0.8 * wall
    turn.complete()


# --- 4. budgets of a task and of the managed root ---------------------------------------------------------

def _two_holders(first, second) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Each turn allocates 64 MiB (under its own 80 MiB); the first holds it, then the second tries."""
    a = start_alloc(first, 64)
    assert a.stdout.readline() == "held\n"
    b = start_alloc(second, 64)
    b_out = b.stdout.readline()
    for p in (a, b):
        if p.poll() is None:
            p.stdin.close()
        p.wait(timeout=60)
    return a, b, b_out


def _one_oom_killed(a, b, b_out) -> None:
    """Both together were over the budget: the kernel OOM-killed one of them (the larger at that moment),
    and the other then fitted."""
    codes = sorted([a.returncode, b.returncode])
    assert codes == [-signal.SIGKILL, 0], (a.returncode, b.returncode)
    assert (b_out == "held\n") == (b.returncode == 0)


def test_task_budget_holds_when_each_turn_is_under_its_own(mgr, state_dir):
    mgr.set_task_limits("budget", Limits(memory_max=100 * MiB))
    assert mgr.task_limits("budget") == Limits(memory_max=100 * MiB)
    task_dirs = v1_dirs(mgr, "budget")
    assert read_v1(task_dirs["memory"], "memory.limit_in_bytes") == str(100 * MiB)
    one = mgr.begin_turn("budget", "one", limits=Limits(memory_max=80 * MiB))
    two = mgr.begin_turn("budget", "two", limits=Limits(memory_max=80 * MiB))
    a, b, b_out = _two_holders(one, two)
    _one_oom_killed(a, b, b_out)
    # v1 counts the kill on the victim's own cgroup (memory.oom_control is not hierarchical there); the
    # task's cgroup is where the limit was hit.
    victim, other = (one, two) if a.returncode else (two, one)
    assert victim.usage().oom_kills == 1 and other.usage().oom_kills == 0
    assert int(read_v1(task_dirs["memory"], "memory.failcnt")) > 0
    # The budget was reached: the task's peak is its limit. (Its own oom_kills stay 0 on v1, see above.)
    assert 100 * MiB - 16 * PAGE <= mgr.task_usage("budget").memory_peak_bytes <= 100 * MiB
    one.complete()
    two.complete()
    assert [r["turn"] for r in limit_records(state_dir)] == [victim.turn_id]
    assert os.path.isdir(task_dirs["memory"])  # a task with a budget keeps its cgroups between turns
    mgr.end_task("budget")
    assert not any(os.path.exists(d) for d in task_dirs.values())


def test_root_budget_holds_when_each_turn_is_under_its_own(mgr, state_dir):
    mgr.set_limits(Limits(memory_max=100 * MiB))
    assert mgr.limits() == Limits(memory_max=100 * MiB)
    root_dirs = v1_dirs(mgr)
    assert read_v1(root_dirs["memory"], "memory.limit_in_bytes") == str(100 * MiB)
    one = mgr.begin_turn("left", "one", limits=Limits(memory_max=80 * MiB))
    two = mgr.begin_turn("right", "two", limits=Limits(memory_max=80 * MiB))
    a, b, b_out = _two_holders(one, two)
    _one_oom_killed(a, b, b_out)
    assert one.usage().oom_kills + two.usage().oom_kills == 1
    assert int(read_v1(root_dirs["memory"], "memory.failcnt")) > 0
    assert 100 * MiB - 16 * PAGE <= mgr.usage().memory_peak_bytes <= 100 * MiB
    one.complete()
    two.complete()
    assert len(limit_records(state_dir)) == 1
    assert mgr.remove_root() is True
    assert not any(os.path.exists(d) for d in root_dirs.values())


def test_root_budget_alone_gives_every_turn_v1_dirs(mgr):
    mgr.set_limits(Limits(memory_max=60 * MiB))
    turn = mgr.begin_turn("plain", "p1")  # no limits of its own: the root's still apply
    assert turn.limits() == Limits()
    dirs = v1_dirs(mgr, *turn.names)
    calm = turn.spawn(SLEEP)
    assert in_v1_dirs(calm.pid, dirs)
    hog = start_alloc(turn, 200)
    hog.communicate(timeout=60)
    assert hog.returncode == -signal.SIGKILL
    assert turn.usage().oom_kills == 1
    turn.abandon("test", grace=0)
    assert not any(os.path.exists(d) for d in dirs.values())


# --- 5. a completed turn's survivors -----------------------------------------------------------------------

def test_limits_hold_for_survivors_of_a_completed_turn(mgr, state_dir):
    turn = mgr.begin_turn("keep", "k1", limits=Limits(memory_max=50 * MiB))
    survivor = start_alloc(turn, 200, wait=True)
    assert wait_until(lambda: turn.pids() == [survivor.pid])
    assert turn.complete() is True
    assert survivor.poll() is None and turn.state == "completed"
    survivor.stdin.write("go\n")
    survivor.stdin.flush()
    survivor.communicate(timeout=60)
    assert survivor.returncode == -signal.SIGKILL
    assert turn.usage().oom_kills == 1
    assert [r["reason"] for r in (turn.check_limits())] == ["oom"]
    mgr.end_task("keep")
    assert not any(os.path.exists(d) for d in v1_dirs(mgr, "keep").values())


# --- 6. limits set on a running turn -----------------------------------------------------------------------

SPAWNER = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    print(child.pid, flush=True)
    sys.stdin.readline()
    data = b"\\1" * (200 * 2 ** 20)
    print("held", flush=True)
""")


def test_set_limits_on_a_running_turn_moves_its_processes(mgr):
    turn = mgr.begin_turn("late", "l1")
    dirs = v1_dirs(mgr, *turn.names)
    assert not any(os.path.exists(d) for d in dirs.values())  # no limit anywhere: no v1 directories
    parent = turn.spawn([PY, "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    mine = v1_lines(os.getpid())
    assert v1_lines(child) == v1_lines(parent.pid) == mine
    turn.set_limits(Limits(memory_max=50 * MiB, pids_max=20, cpus=1.0))
    assert turn.limits() == Limits(memory_max=50 * MiB, pids_max=20, cpus=1.0)
    assert in_v1_dirs(parent.pid, dirs) and in_v1_dirs(child, dirs)
    assert v1_lines(os.getpid()) == mine  # the caller stays where it was
    later = turn.spawn(SLEEP)
    assert in_v1_dirs(later.pid, dirs)
    assert read_v1(dirs["pids"], "pids.max") == "20"
    parent.stdin.write("go\n")
    parent.stdin.flush()
    parent.communicate(timeout=60)
    assert parent.returncode == -signal.SIGKILL
    assert turn.usage().oom_kills == 1 and alive(child)
    turn.abandon("test", grace=0)
    assert later.wait(timeout=10) == -signal.SIGKILL
    assert not any(os.path.exists(d) for d in dirs.values())


# --- 7. cleanup: abandon, complete, end_task, remove_root, reap --------------------------------------------

OWNER = textwrap.dedent("""
    import sys, time
    from cgturn import Limits, TurnManager
    mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2], sentinel=False)
    turn = mgr.begin_turn("crash", "c1", limits=Limits(memory_max=64 * 2 ** 20, pids_max=20, cpus=1.0))
    print(turn.spawn(["sleep", "300"]).pid, flush=True)
    time.sleep(300)
""")


def test_reap_removes_the_v1_dirs_of_a_crashed_owners_turn(mgr, state_dir):
    mgr.create_root()
    owner = subprocess.Popen([PY, "-c", OWNER, mgr.root, state_dir], stdout=subprocess.PIPE, text=True,
                             env=cgturn_env())
    try:
        sleeper = int(owner.stdout.readline())
    finally:
        owner.kill()
        owner.wait()
    dirs = v1_dirs(mgr, "crash", "c1")
    assert all(os.path.isdir(d) for d in dirs.values()) and in_v1_dirs(sleeper, dirs)
    out = cli(mgr.root, state_dir, "reap", "--json")
    assert out.returncode == 0, out.stderr
    assert [a["action"] for a in json.loads(out.stdout)] == ["abandoned"]
    assert wait_until(lambda: not alive(sleeper))
    assert not any(os.path.exists(d) for d in dirs.values())
    assert not any(os.path.exists(d) for d in v1_dirs(mgr, "crash").values())


def test_reap_removes_v1_dirs_left_behind_their_turn(mgr, state_dir):
    sibling = mgr.begin_turn("half", "h0", limits=Limits(pids_max=20))
    sibling_proc = sibling.spawn(SLEEP)
    turn = mgr.begin_turn("half", "h1", limits=Limits(pids_max=20))
    dirs = v1_dirs(mgr, *turn.names)
    # An owner that died between the two removals: the cgroup2 directory is gone, the v1 ones are not.
    assert Cgroup(turn_dir(mgr, turn)).remove_tree(timeout=2.0)
    assert all(os.path.isdir(d) for d in dirs.values())
    out = cli(mgr.root, state_dir, "reap", "--json")
    assert out.returncode == 0, out.stderr
    removed = sorted(a["path"] for a in json.loads(out.stdout) if a["action"] == "removed-v1-dirs")
    assert removed == sorted(dirs.values())
    assert not any(os.path.exists(d) for d in dirs.values())
    assert in_v1_dirs(sibling_proc.pid, v1_dirs(mgr, *sibling.names))  # the live turn's are untouched
    sibling.abandon("test", grace=0)


@pytest.mark.parametrize("ending", ["abandon", "complete", "end_task"])
def test_a_turns_v1_dirs_go_with_it(mgr, ending):
    turn = mgr.begin_turn("ends", "e1", limits=Limits(memory_max=64 * MiB, pids_max=20, cpus=1.0))
    dirs = v1_dirs(mgr, *turn.names)
    proc = turn.spawn(SLEEP)
    assert all(os.path.isdir(d) for d in dirs.values()) and in_v1_dirs(proc.pid, dirs)
    if ending == "abandon":
        assert proc.pid in turn.abandon("test", grace=0).killed
    elif ending == "complete":
        proc.kill()
        proc.wait()
        assert wait_until(lambda: turn.pids() == [])
        assert turn.complete() is True
    else:
        mgr.end_task("ends")
    assert not any(os.path.exists(d) for d in dirs.values())
    assert mgr.remove_root() is True
    assert not any(os.path.exists(d) for d in v1_dirs(mgr).values())


# --- 8. refusals: nothing created ------------------------------------------------------------------------

@pytest.mark.parametrize("limits, words", [
    (Limits(memory_high=64 * MiB), "memory_high"),
    (Limits(memory_max=64 * MiB, oom_group=True), "oom_group"),
    (Limits(swap_max=64 * MiB), "swap_max"),
    (Limits(memory_max=64 * MiB, memory_high=32 * MiB, pids_max=10), "memory_high"),
])
def test_v1_refusals_create_nothing(mgr, limits, words):
    with pytest.raises(LimitsUnavailable, match=words):
        mgr.begin_turn("refused", "r1", limits=limits)
    assert not os.path.exists(mgr.root)
    assert not any(os.path.exists(d) for d in v1_dirs(mgr).values())
    with pytest.raises(LimitsUnavailable, match=words):
        mgr.set_task_limits("refused", limits)
    with pytest.raises(LimitsUnavailable, match=words):
        mgr.set_limits(limits)
    assert mgr.turns() == [] and mgr.limits() == Limits()
    with pytest.raises(NoSuchTurn):  # the refused budget did not even create the task
        mgr.task_limits("refused")
    assert not any(os.path.exists(d) for d in v1_dirs(mgr).values())


def test_v1_refusal_on_a_running_turn_changes_nothing(mgr):
    turn = mgr.begin_turn("keep", "k1", limits=Limits(pids_max=10))
    with pytest.raises(LimitsUnavailable, match="memory_high"):
        turn.set_limits(Limits(memory_high=64 * MiB, pids_max=20))
    assert turn.limits() == Limits(pids_max=10)
    assert read_v1(v1_dirs(mgr, *turn.names)["pids"], "pids.max") == "10"
    turn.complete()


def test_registry_backend_refuses_every_limit(tmp_path):
    from conftest import destroy_registry

    mgr = TurnManager(backend="registry", state_dir=str(tmp_path / "state"))
    try:
        for limits in (Limits(memory_max=MiB), Limits(pids_max=5), Limits(cpus=1.0), Limits(oom_group=False)):
            with pytest.raises(LimitsUnavailable, match="registry backend"):
                mgr.begin_turn("reg", "r1", limits=limits)
        with pytest.raises(LimitsUnavailable, match="registry backend"):
            mgr.set_task_limits("reg", Limits(pids_max=5))
        with pytest.raises(LimitsUnavailable, match="registry backend"):
            mgr.set_limits(Limits(pids_max=5))
        assert mgr.turns() == []
        assert mgr.limits_report()["layout"] is None
        turn = mgr.begin_turn("reg", "r1", limits=Limits())  # no limit asked: nothing refused
        with pytest.raises(LimitsUnavailable, match="registry backend"):
            turn.set_limits(Limits(pids_max=5))
        # No limiter: what is read is empty, and there is nothing for the kernel to have enforced.
        assert (mgr.limits(), mgr.usage()) == (Limits(), Usage())
        assert (mgr.task_limits("reg"), mgr.task_usage("reg")) == (Limits(), Usage())
        assert turn.check_limits() == [] and turn.limits() == Limits()
        assert mgr.turns(detail=True)[0].pressure is None
        turn.complete()
    finally:
        destroy_registry(mgr)


@pytest.mark.parametrize("kwargs", [
    {"memory_max": -1}, {"memory_max": 1.5}, {"memory_max": "1G"}, {"memory_max": True},
    {"memory_high": -5}, {"swap_max": "lots"}, {"pids_max": 0}, {"pids_max": -3}, {"pids_max": 2.0},
    {"cpus": 0}, {"cpus": -0.5}, {"cpus": float("inf")}, {"cpus": float("nan")}, {"cpus": "2"},
    {"cpus": True}, {"cpu_weight": 0}, {"cpu_weight": 10001}, {"cpu_weight": 50.0}, {"cpu_weight": "max"},
    {"oom_group": 1}, {"oom_group": "yes"}, {"memory_max": 10, "memory_high": 11},
])
def test_invalid_limits_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        Limits(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"memory_max": 0}, {"swap_max": 0}, {"memory_max": "max"}, {"pids_max": 1}, {"pids_max": "max"},
    {"cpus": 0.01}, {"cpus": 2}, {"cpus": "max"}, {"cpu_weight": 1}, {"cpu_weight": 10000},
    {"oom_group": False}, {"memory_max": 10, "memory_high": 10}, {"memory_max": "max", "memory_high": 5},
])
def test_valid_limits(kwargs):
    assert Limits(**kwargs).to_stored() == kwargs


@pytest.mark.parametrize("parse, text, expected", [
    (parse_size, "12", 12), (parse_size, "1K", 1024), (parse_size, "512m", 512 * MiB),
    (parse_size, "1.5G", 3 * 2 ** 29), (parse_size, " 2T ", 2 * 2 ** 40), (parse_size, "0", 0),
    (parse_size, "1.0001K", 1024), (parse_size, "MAX", "max"),
    (parse_pids, "50", 50), (parse_pids, "max", "max"), (parse_pids, "1", 1),
    (parse_cpus, "1.5", 1.5), (parse_cpus, "0.01", 0.01), (parse_cpus, "Max", "max"),
    (parse_weight, "100", 100), (parse_weight, "1", 1), (parse_weight, "10000", 10000),
])
def test_parsers_accept(parse, text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("parse, text", [
    (parse_size, "12Q"), (parse_size, "-1"), (parse_size, "1.5.3G"), (parse_size, ""), (parse_size, "G"),
    (parse_size, "1 G"), (parse_size, "1KB"), (parse_size, "1e3"),
    (parse_pids, "0"), (parse_pids, "-1"), (parse_pids, "1.5"), (parse_pids, ""), (parse_pids, "ten"),
    (parse_cpus, "0"), (parse_cpus, "-1"), (parse_cpus, "inf"), (parse_cpus, "nan"), (parse_cpus, "x"),
    (parse_weight, "0"), (parse_weight, "10001"), (parse_weight, "max"), (parse_weight, "1.5"),
])
def test_parsers_refuse(parse, text):
    with pytest.raises(ValueError):
        parse(text)


# --- 9. the mapping, the places and the parsers (pure) ------------------------------------------------------

V2_PLACES = {c: Place(V2) for c in controllers.CONTROLLERS}
V1_PLACES = {"memory": Place(V1, "/m/own/root"), "pids": Place(V1, "/p/root"), "cpu": Place(V1, "/c/root")}


@pytest.mark.parametrize("limits, expected", [
    (Limits(memory_max=MiB), [("memory", "memory.max", "1048576")]),
    (Limits(memory_max=2 * MiB, memory_high=MiB, swap_max=0, oom_group=True),
     [("memory", "memory.max", "2097152"), ("memory", "memory.high", "1048576"), ("memory", "memory.swap.max", "0"),
      ("memory", "memory.oom.group", "1")]),
    (Limits(memory_max="max", oom_group=False), [("memory", "memory.max", "max"), ("memory", "memory.oom.group", "0")]),
    (Limits(pids_max=50), [("pids", "pids.max", "50")]),
    (Limits(pids_max="max"), [("pids", "pids.max", "max")]),
    (Limits(cpus=1.5, cpu_weight=200), [("cpu", "cpu.max", "150000 100000"), ("cpu", "cpu.weight", "200")]),
    (Limits(cpus=0.01), [("cpu", "cpu.max", "1000 100000")]),
    (Limits(cpus="max"), [("cpu", "cpu.max", "max 100000")]),
    (Limits(), []),
])
def test_limit_files_v2(limits, expected):
    assert controllers.limit_files(limits, V2_PLACES) == expected


@pytest.mark.parametrize("limits, expected", [
    (Limits(memory_max=MiB), [("memory", "memory.limit_in_bytes", "1048576")]),
    (Limits(memory_max="max"), [("memory", "memory.limit_in_bytes", "-1")]),
    # memsw may never sit below the memory limit: lifted first, then memory, then memory + swap.
    (Limits(memory_max=MiB, swap_max=MiB),
     [("memory", "memory.memsw.limit_in_bytes", "-1"), ("memory", "memory.limit_in_bytes", "1048576"),
      ("memory", "memory.memsw.limit_in_bytes", "2097152")]),
    (Limits(memory_max=MiB, swap_max="max"),
     [("memory", "memory.memsw.limit_in_bytes", "-1"), ("memory", "memory.limit_in_bytes", "1048576"),
      ("memory", "memory.memsw.limit_in_bytes", "-1")]),
    (Limits(memory_max=MiB, oom_group=False), [("memory", "memory.limit_in_bytes", "1048576")]),
    (Limits(pids_max=50), [("pids", "pids.max", "50")]),
    (Limits(cpus=0.5), [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "50000")]),
    (Limits(cpus="max"), [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "-1")]),
    (Limits(cpu_weight=100), [("cpu", "cpu.shares", "1024")]),
    (Limits(cpu_weight=1), [("cpu", "cpu.shares", "10")]),
    (Limits(cpu_weight=10000), [("cpu", "cpu.shares", "102400")]),
    (Limits(memory_max=MiB, pids_max=5, cpus=2),
     [("memory", "memory.limit_in_bytes", "1048576"), ("pids", "pids.max", "5"),
      ("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "200000")]),
])
def test_limit_files_v1(limits, expected):
    assert controllers.limit_files(limits, V1_PLACES) == expected


@pytest.mark.parametrize("limits, places, words", [
    (Limits(memory_high=MiB), V1_PLACES, "memory_high"),
    (Limits(memory_max=MiB, oom_group=True), V1_PLACES, "oom_group"),
    (Limits(swap_max=MiB), V1_PLACES, "swap_max"),
    (Limits(memory_max="max", swap_max=MiB), V1_PLACES, "swap_max"),
    (Limits(pids_max=5), {"memory": Place(V2)}, "no pids controller"),
    (Limits(memory_max=MiB, cpus=1), {}, "no cpu, memory controller"),
])
def test_limit_files_refusals(limits, places, words):
    with pytest.raises(LimitsUnavailable, match=words):
        controllers.limit_files(limits, places)


def test_decide_places():
    mounts = {"memory": "/sys/fs/cgroup/memory", "pids": "/sys/fs/cgroup/pids", "cpu": "/sys/fs/cgroup/cpu",
              "cpuacct": "/sys/fs/cgroup/cpu"}
    own = {"memory": "/process_api/abc", "pids": "/", "cpu": "/"}
    places, problems = controllers.decide_places([], mounts, own, "svc/cgturn")
    assert places == {"memory": Place(V1, "/sys/fs/cgroup/memory/process_api/abc/svc/cgturn",
                                      "/sys/fs/cgroup/memory/process_api/abc"),
                      "pids": Place(V1, "/sys/fs/cgroup/pids/svc/cgturn", "/sys/fs/cgroup/pids"),
                      "cpu": Place(V1, "/sys/fs/cgroup/cpu/svc/cgturn", "/sys/fs/cgroup/cpu")} and problems == []
    assert controllers.layout_name(places) == "v1-hybrid"
    places, problems = controllers.decide_places(["memory", "pids", "cpu", "io"], mounts, own, "x")
    assert places == V2_PLACES and problems == [] and controllers.layout_name(places) == "v2"
    places, problems = controllers.decide_places(["pids"], {"memory": "/m"}, {}, "x")
    assert places == {"pids": Place(V2)} and controllers.layout_name(places) == "v2"
    assert [p.split(":")[0] for p in problems] == ["memory", "cpu"]
    assert "not visible" in problems[0] and "DelegateSubgroup" in problems[1]
    places, problems = controllers.decide_places([], {}, {}, "x")
    assert places == {} and [p.split(":")[0] for p in problems] == ["memory", "pids", "cpu"]
    assert controllers.layout_name({}) is None


def test_place_json_round_trip_and_refusals():
    for place in (Place(V2), Place(V1, "/a/b"), Place(V1, "/a/b", "/a")):
        assert Place.from_json(place.to_json()) == place
    for bad in ({"version": "v3"}, {"version": "v1"}, {"version": "v1", "path": 5}, {}):
        with pytest.raises(ValueError):
            Place.from_json(bad)


MOUNTINFO = r"""31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 /sub /mnt/pids rw,relatime - cgroup cgroup rw,pids
39 31 0:36 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:5 master:1 - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
42 31 0:39 / /sys/fs/cgroup/my\040net rw - cgroup cgroup rw,net_cls,clone_children
"""


def test_parse_mountinfo_cgroup1():
    assert parsers.parse_mountinfo_cgroup1(MOUNTINFO) == [
        ("/sys/fs/cgroup/cpu,cpuacct", ["cpu", "cpuacct"]), ("/sys/fs/cgroup/memory", ["memory"]),
        ("/sys/fs/cgroup/pids", ["pids"]),
        ("/sys/fs/cgroup/my net", ["net_cls"])]
    assert controllers.v1_mounts(MOUNTINFO)["cpuacct"] == "/sys/fs/cgroup/cpu,cpuacct"
    assert parsers.parse_mountinfo_cgroup1("") == [] and parsers.parse_mountinfo_cgroup1("garbage\n") == []


@pytest.mark.parametrize("text, expected", [
    ("9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n1:cpu,cpuacct:/x y\n0::/\n",
     {"pids": "/", "memory": "/process_api/abc", "cpu": "/x y", "cpuacct": "/x y"}),
    ("0::/user.slice\n", {}),
    ("", {}),
    ("junk\n3:cpuset:/a:b\n", {"cpuset": "/a:b"}),
])
def test_parse_proc_cgroup_v1(text, expected):
    assert parsers.parse_proc_cgroup_v1(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("some avg10=1.50 avg60=0.20 avg300=0.00 total=12345\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=7\n",
     {"some": {"avg10": 1.5, "avg60": 0.2, "avg300": 0.0, "total": 12345},
      "full": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 7}}),
    ("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
     {"some": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 0}}),
    ("some avg10=x total=5\nbogus avg10=1\n", {"some": {"total": 5}}),
    # Near misses of the two-line file the kernel prints, read pair by pair: a later pair wins, a
    # total that is not whole is left out.
    ("some avg10=1.00 avg60=1=avg10=7 avg300=0.00 total=3\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=4\n",
     {"some": {"avg10": 7.0, "avg300": 0.0, "total": 3}, "full": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 4}}),
    ("some avg10=1.00 avg60=0.00 avg300=0.00 total=3.5\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=4\n",
     {"some": {"avg10": 1.0, "avg60": 0.0, "avg300": 0.0}, "full": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 4}}),
    ("", {}),
])
def test_parse_pressure(text, expected):
    assert parsers.parse_pressure(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("some avg10=1.50 avg60=0.20 avg300=0.00 total=12345\nfull avg10=0.25 avg60=0.00 avg300=0.00 total=7\n",
     {"some_avg10": 1.5, "full_avg10": 0.25, "some_total_usec": 12345, "full_total_usec": 7}),
    ("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",  # cpu before 5.13: no full line
     {"some_avg10": 0.0, "full_avg10": None, "some_total_usec": 0, "full_total_usec": None}),
    ("some avg10=1.00 avg60=1=avg10=7 avg300=0.00 total=3\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=4.5\n",
     {"some_avg10": 7.0, "full_avg10": 0.0, "some_total_usec": 3, "full_total_usec": None}),
    ("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n", None),
    ("", None),
])
def test_parse_pressure_figures(text, expected):
    """What `ps` shows of a PSI file: the usual file in one match, any other through parse_pressure."""
    got = parsers.parse_pressure_figures(text)
    assert got == expected
    assert got is None or [type(v) for v in got.values()] == [type(v) for v in expected.values()]


# --- 10. ps --json -------------------------------------------------------------------------------------------

def test_ps_json_shows_limits_and_figures(mgr, state_dir):
    turn = mgr.begin_turn("shown", "s1", limits=Limits(memory_max=50 * MiB, pids_max=30, cpus=0.2))
    hog = start_alloc(turn, 200)
    hog.communicate(timeout=60)
    assert hog.returncode == -signal.SIGKILL
    busy = turn.spawn([PY, "-c", BUSY, "30"])
    assert wait_until(lambda: (turn.usage().cpu_throttled_seconds or 0) > 0, timeout=20)
    expected_limits = {"memory_max": 50 * MiB, "memory_high": None, "swap_max": None, "pids_max": 30,
                       "cpus": 0.2, "cpu_weight": None}

    def check(row):
        assert row["limits"] == expected_limits
        assert row["oom_kills"] == 1 and row["pids_max_hits"] == 0
        assert isinstance(row["memory_peak_bytes"], int) and 50 * MiB - 16 * PAGE <= row["memory_peak_bytes"] <= 50 * MiB
        assert isinstance(row["cpu_throttled_seconds"], float) and row["cpu_throttled_seconds"] > 0
        assert set(row["pressure"]) == {"cpu", "memory", "io"}
        for figures in row["pressure"].values():
            assert isinstance(figures["some_avg10"], float) and figures["some_avg10"] >= 0
        assert row["frozen"] is False

    [info] = mgr.turns(detail=True)
    check(info.to_json())
    out = cli(mgr.root, state_dir, "ps", "--json")
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    check(row)
    busy.kill()
    turn.abandon("test", grace=0)


def test_a_root_below_an_intermediate_directory_leaves_no_v1_directory(cgroup2_root, state_dir):
    """The v1 copies of the directories between the caller's own v1 cgroup and the managed root are
    made by cgturn, so remove_root removes them too once empty."""
    os.mkdir(cgroup2_root)
    root = os.path.join(cgroup2_root, "main")
    mgr = TurnManager(root=root, backend="cgroup2", state_dir=state_dir)
    try:
        _v1_hybrid(mgr)
        mgr.set_limits(Limits(pids_max=100))
        intermediate = v1_dirs(mgr)
        assert all(os.path.isdir(path) for path in intermediate.values())
        assert mgr.remove_root()
        for path in intermediate.values():
            assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path)), path
    finally:
        mgr.close()


def test_the_kill_record_carries_what_the_turn_used(mgr, state_dir):
    turn = mgr.begin_turn("figures", "t", limits=Limits(pids_max=64))
    sleeper = turn.spawn(["sleep", "300"])
    result = turn.abandon("stop", grace=0)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    kills = [r for r in audit_records(state_dir) if r.get("action", "kill") == "kill" and r["turn"] == "t"]
    assert len(kills) == 1 and kills[0]["pids"] == [sleeper.pid]
    assert kills[0]["usage"] == result.usage.to_json() and kills[0]["usage"]["pids_max_hits"] == 0


def test_a_dying_turn_loses_its_cpu_quota(mgr):
    """After SIGKILL nothing useful runs in the turn; its exit work may use every core (a 1-core
    quota doubled the abandon of 500 processes here)."""
    turn = mgr.begin_turn("unthrottle", "t", limits=Limits(cpus=0.5, pids_max=64))
    quota = os.path.join(v1_dirs(mgr, *turn.names)["cpu"], "cpu.cfs_quota_us")
    assert open(quota).read().strip() == "50000"
    mgr.backend.limiter.unthrottle(turn.record)
    assert open(quota).read().strip() == "-1"
    assert open(os.path.join(v1_dirs(mgr, *turn.names)["pids"], "pids.max")).read().strip() == "64"
    turn.abandon("done", grace=0)
