"""Resource limits on pure cgroup v2, for real: the v2 layout the development machine cannot test
(its cgroup2 has no memory, pids or cpu controller; there the v1 hierarchies are used).

The managed root is `<unit>/turns` of a transient service with `Delegate=yes` and
`DelegateSubgroup=supervisor` whose command runs through `contrib/enter-leaf`: systemd puts the
process in the `supervisor` leaf but leaves the unit's own `cgroup.subtree_control` empty (the
delegatee's to write); enter-leaf enables memory, pids and cpu there, and cgturn enables them on the
managed root and task directories it creates. The test process drives the manager from outside the
unit (as root): the cgroup structure is the one a gateway in that unit has.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cgturn import Limits, LimitsUnavailable, TurnManager
from conftest import wait_until
from hostlib import GUEST_STATE, MOUNT, SHARE, run_in_unit, systemctl, systemd_host, unit_cgroup, unit_name  # noqa: F401

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host"), GUEST_STATE]
MiB = 1024 * 1024
DELEGATED = ("Delegate=yes", "DelegateSubgroup=supervisor")
ENTER_LEAF = os.path.join(SHARE, "contrib", "enter-leaf")
# Allocates argv[1] MiB, touching every page (bytes * n writes them), prints "done", then, with
# "hold", keeps it until stdin closes. argv[3], if given, is a cgroup file to print after allocating.
ALLOC = ("import sys\n"
         "chunks = [b'x' * (1 << 20) for _ in range(int(sys.argv[1]))]\n"
         "extra = ''\n"
         "if len(sys.argv) > 3:\n"
         "    line = open('/proc/self/cgroup').read().strip()\n"
         "    extra = ' ' + open('/sys/fs/cgroup' + line[3:] + '/' + sys.argv[3]).read().strip()\n"
         "print('done' + extra, flush=True)\n"
         "if sys.argv[2] == 'hold':\n"
         "    sys.stdin.read()\n")
# Forks up to argv[1] children that sleep; prints how many forks worked and how many failed (EAGAIN
# from pids.max), then waits for stdin to close. Bounded in count; the turn's abandon ends them.
FORKER = ("import json, os, sys, time\n"
          "ok = failed = 0\n"
          "for _ in range(int(sys.argv[1])):\n"
          "    try:\n"
          "        pid = os.fork()\n"
          "    except BlockingIOError:\n"
          "        failed += 1\n"
          "        continue\n"
          "    if pid == 0:\n"
          "        time.sleep(120)\n"
          "        os._exit(0)\n"
          "    ok += 1\n"
          "print(json.dumps({'forked': ok, 'failed': failed}), flush=True)\n"
          "sys.stdin.read()\n")
# Two processes busy for argv[1] seconds of wall time (bounded by the clock, not a count).
BUSY = ("import os, sys, time\n"
        "end = time.monotonic() + float(sys.argv[1])\n"
        "child = os.fork()\n"
        "while time.monotonic() < end:\n"
        "    pass\n"
        "if child:\n"
        "    os.waitpid(child, 0)\n")


def read(directory: str, name: str) -> str:
    with open(f"{directory}/{name}") as f:
        return f.read().strip()


def flat(directory: str, name: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in read(directory, name).splitlines())}


def turn_dir(mgr: TurnManager, turn) -> str:
    task_key, turn_key = turn.names
    return f"{mgr.root}/{task_key}/{turn_key}"


def alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def start_unit(argv: list[str]) -> tuple[str, str]:
    """A delegated transient service running `argv`; returns its name and cgroup directory."""
    name = unit_name("cgturn-test-limits")
    subprocess.run(["systemd-run", "--quiet", "--collect", f"--unit={name}",
                    *(f"--property={p}" for p in DELEGATED), "--", *argv],
                   check=True, capture_output=True, timeout=120)
    return name, unit_cgroup(f"{name}.service")


@pytest.fixture
def unit_manager(request, tmp_path):
    """A TurnManager whose managed root is `<unit>/turns` of a delegated service whose process went
    through enter-leaf; with the indirect parameter "+pids", the process did not, and the delegatee
    (this test) enabled only pids for the unit's children. Stopping the unit at teardown kills
    whatever a test left."""
    enable = getattr(request, "param", None)
    name, unit = start_unit(["sleep", "infinity"] if enable else [ENTER_LEAF, "sleep", "infinity"])
    if enable:
        with open(f"{unit}/cgroup.subtree_control", "w") as f:
            f.write(enable)
    else:  # enter-leaf runs before `sleep`: wait for it to have enabled the controllers
        assert wait_until(lambda: read(unit, "cgroup.subtree_control"), timeout=60)
    mgr = TurnManager(root=f"{unit}/turns", backend="cgroup2", state_dir=str(tmp_path / "state"))
    procs: list[subprocess.Popen] = []
    mgr.test_procs = procs  # Popen objects the test started: their pipes close at teardown
    try:
        yield mgr
    finally:
        for proc in procs:
            for stream in (proc.stdin, proc.stdout):
                if stream:
                    stream.close()
        mgr.close()
        systemctl("stop", f"{name}.service", check=False)
        for proc in procs:
            proc.wait(timeout=60)


def spawn(mgr, turn, argv, **kw) -> subprocess.Popen:
    proc = turn.spawn(argv, **kw)
    mgr.test_procs.append(proc)
    return proc


def alloc(mgr, turn, mib: int, hold: bool = False, show: str | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-c", ALLOC, str(mib), "hold" if hold else "exit"] + ([show] if show else [])
    return spawn(mgr, turn, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


# --- 1. doctor ----------------------------------------------------------------------------------------

def _doctor_limits(props: tuple[str, ...], enter_leaf: bool = False) -> tuple[str, dict]:
    name = unit_name()
    unit_dir = f"{MOUNT}/system.slice/{name}.service"
    argv = [ENTER_LEAF] * enter_leaf + [sys.executable, "-m", "cgturn", "doctor", "--json"]
    res = run_in_unit(argv, props=props, name=name,
                      env={"CGTURN_ROOT": f"{unit_dir}/turns"})
    assert res.returncode == 0, res.stderr
    return unit_dir, json.loads(res.stdout)


def test_doctor_reports_the_v2_layout_when_the_unit_delegates_from_a_leaf():
    unit_dir, report = _doctor_limits(DELEGATED, enter_leaf=True)
    assert report["own_cgroup"] == f"{unit_dir}/supervisor"
    assert report["limits"] == {"layout": "v2", "available": ["cpu", "memory", "pids"], "problems": [],
                                "unsupported": {}}


@pytest.mark.parametrize("props", [("Delegate=yes",), DELEGATED], ids=["no-leaf", "leaf-nothing-enabled"])
def test_doctor_names_the_missing_controllers_and_the_fix_when_none_is_enabled(props):
    # Delegate=yes alone: the service's process sits in the unit's own cgroup, so no controller can
    # be enabled for its children (no internal processes, cgroup-v2.rst). With DelegateSubgroup= the
    # process is in a leaf, but systemd still enables nothing for the unit's children: that is
    # enter-leaf's job (the test above).
    unit_dir, report = _doctor_limits(props)
    assert report["own_cgroup"] == unit_dir + ("/supervisor" if "DelegateSubgroup=supervisor" in props else "")
    limits = report["limits"]
    assert limits["layout"] is None and limits["available"] == []
    assert [p.split(":")[0] for p in limits["problems"]] == ["memory", "pids", "cpu"]
    for problem in limits["problems"]:
        assert "DelegateSubgroup=" in problem and "contrib/enter-leaf" in problem, problem


@pytest.mark.parametrize("unit_manager", ["+pids"], indirect=True)
def test_a_partly_delegated_unit_offers_what_it_delegates_and_refuses_the_rest(unit_manager):
    mgr = unit_manager
    report = mgr.limits_report()
    assert report["layout"] == "v2" and report["available"] == ["pids"]
    assert [p.split(":")[0] for p in report["problems"]] == ["memory", "cpu"]
    with pytest.raises(LimitsUnavailable, match="memory"):
        mgr.begin_turn("refused", "t1", limits=Limits(memory_max=50 * MiB))
    assert not os.path.exists(f"{mgr.root}/refused/t1")
    turn = mgr.begin_turn("allowed", "t1", limits=Limits(pids_max=10))
    assert read(turn_dir(mgr, turn), "pids.max") == "10"


@pytest.mark.parametrize("unit_manager", ["+pids +memory"], indirect=True)
def test_a_controller_that_leaves_the_parent_after_the_layout_was_read_does_not_stop_turns(unit_manager, caplog,
                                                                                           monkeypatch):
    """systemd takes a controller off a cgroup's subtree_control when no unit of its own needs it
    any more (seen in this guest while a user logged out: the managed root's `+memory +pids +cpu`
    failed with ENOENT and begin_turn raised). Here the delegatee does the same to the unit right
    after the layout read it (the wrapper only fixes when; the kernel refuses the write): the turn
    starts with what is left."""
    mgr = unit_manager
    unit = os.path.dirname(mgr.root)
    layout_class = type(mgr.backend.layout)
    real_decide = layout_class._decide

    def decide_then_lose_memory(self):
        decided = real_decide(self)
        if os.path.isdir(mgr.root):  # the reading that is recorded on the root just made
            with open(f"{unit}/cgroup.subtree_control", "w") as f:
                f.write("-memory")
        return decided

    monkeypatch.setattr(layout_class, "_decide", decide_then_lose_memory)
    turn = mgr.begin_turn("after", "t1")
    monkeypatch.undo()
    task = os.path.dirname(turn_dir(mgr, turn))
    assert read(mgr.root, "cgroup.subtree_control") == read(task, "cgroup.subtree_control") == "pids"
    assert read(turn_dir(mgr, turn), "pids.max") == "max"
    assert [r.getMessage() for r in caplog.records if "no longer delegated" in r.getMessage()] == [
        f"controllers memory are no longer delegated to {mgr.root} (its parent's cgroup.subtree_control changed): "
        "limits on them are unavailable"]
    # What the root recorded is what it has: a memory limit is refused, for this manager and the next.
    assert sorted(mgr.backend.layout.places()) == ["pids"]
    with pytest.raises(LimitsUnavailable, match="memory"):
        mgr.begin_turn("after", "t2", limits=Limits(memory_max=50 * MiB))
    later = TurnManager(root=mgr.root, backend="cgroup2", state_dir=mgr.state_dir)
    try:
        assert sorted(later.backend.layout.places()) == ["pids"]
    finally:
        later.close()
    turn.complete()


# --- 2. memory.max and memory.oom.group ------------------------------------------------------------------

def test_memory_max_oom_kills_the_whole_turn_by_default(unit_manager):
    mgr = unit_manager
    neighbour = mgr.begin_turn("other", "n1")
    bystander = spawn(mgr, neighbour, ["sleep", "300"])
    turn = mgr.begin_turn("oom", "t1", limits=Limits(memory_max=50 * MiB))
    cg = turn_dir(mgr, turn)
    assert read(cg, "memory.max") == str(50 * MiB)
    assert read(cg, "memory.oom.group") == "1"  # the documented default on v2
    sibling = spawn(mgr, turn, ["sleep", "300"])
    hog = alloc(mgr, turn, 200)
    assert hog.wait(timeout=180) == -9
    assert sibling.wait(timeout=60) == -9  # the group kill took the whole turn
    usage = turn.usage()
    assert usage.oom_kills >= 1
    assert 40 * MiB <= usage.memory_peak_bytes <= 50 * MiB
    assert alive(bystander) and neighbour.usage().oom_kills == 0


def test_oom_group_false_kills_only_the_allocator(unit_manager):
    mgr = unit_manager
    turn = mgr.begin_turn("oom", "t1", limits=Limits(memory_max=50 * MiB, oom_group=False))
    cg = turn_dir(mgr, turn)
    assert read(cg, "memory.oom.group") == "0"
    sibling = spawn(mgr, turn, ["sleep", "300"])
    hog = alloc(mgr, turn, 200)
    assert hog.wait(timeout=180) == -9
    assert turn.usage().oom_kills >= 1
    assert alive(sibling) and sibling.pid in turn.pids()


# --- 3. pids.max and cpu.max -----------------------------------------------------------------------------

def test_pids_max_holds_and_is_counted(unit_manager):
    mgr = unit_manager
    turn = mgr.begin_turn("pids", "t1", limits=Limits(pids_max=20))
    cg = turn_dir(mgr, turn)
    assert read(cg, "pids.max") == "20"
    forker = spawn(mgr, turn, [sys.executable, "-c", FORKER, "40"], stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, text=True)
    result = json.loads(forker.stdout.readline())
    assert result["failed"] > 0 and result["forked"] + result["failed"] == 40
    assert result["forked"] <= 19  # 20 minus the forker itself
    assert int(read(cg, "pids.current")) <= 20
    assert turn.usage().pids_max_hits >= result["failed"]


def test_cpus_throttles_two_busy_processes(unit_manager):
    mgr = unit_manager
    turn = mgr.begin_turn("cpu", "t1", limits=Limits(cpus=0.5))
    cg = turn_dir(mgr, turn)
    assert read(cg, "cpu.max") == "50000 100000"
    wall = 3.0
    busy = spawn(mgr, turn, [sys.executable, "-c", BUSY, str(wall)])
    assert busy.wait(timeout=120) == 0
    stat = flat(cg, "cpu.stat")
    assert stat["nr_throttled"] > 0
    usage = turn.usage()
    assert usage.cpu_throttled_seconds > 0
    # Two busy processes for `wall` seconds would use up to 2 x wall unthrottled; the quota (0.5 of
    # a core per 100 ms period, no burst) keeps them far below even one core's worth.
    assert usage.cpu_seconds < wall


# --- 4. memory.high ----------------------------------------------------------------------------------------

def test_memory_high_throttles_without_killing(unit_manager):
    # Refused on v1 (no equivalent): this is its only proof. No swap here, so the kernel cannot
    # reclaim the anonymous memory: it lets usage pass memory.high and throttles the allocator
    # (mem_cgroup_handle_over_high: a memory stall, counted in memory.pressure), never an OOM kill.
    mgr = unit_manager
    turn = mgr.begin_turn("high", "t1", limits=Limits(memory_high=32 * MiB))
    cg = turn_dir(mgr, turn)
    assert read(cg, "memory.high") == str(32 * MiB) and read(cg, "memory.max") == "max"
    hog = alloc(mgr, turn, 64, hold=True)
    assert wait_until(lambda: flat(cg, "memory.events")["high"] > 0, timeout=120)
    assert wait_until(lambda: int(read(cg, "memory.current")) > 32 * MiB, timeout=120)
    assert wait_until(lambda: int(read(cg, "memory.pressure").split("total=")[1].split()[0]) > 0, timeout=120)
    assert alive(hog)
    assert flat(cg, "memory.events")["oom_kill"] == 0 and turn.usage().oom_kills == 0
    turn.abandon("test", grace=0)
    assert hog.wait(timeout=60) == -9


# --- 5. memory.swap.max --------------------------------------------------------------------------------------

@pytest.fixture
def swapfile():
    """A 256 MiB swap file for this test only (the guest has no swap otherwise)."""
    path = "/var/tmp/cgturn-test.swap"
    subprocess.run(["fallocate", "-l", "256M", path], check=True, timeout=60)
    os.chmod(path, 0o600)
    subprocess.run(["mkswap", path], check=True, capture_output=True, timeout=60)
    subprocess.run(["swapon", path], check=True, capture_output=True, timeout=60)
    try:
        yield path
    finally:
        subprocess.run(["swapoff", path], capture_output=True, timeout=300)
        os.unlink(path)


def test_swap_max_holds(unit_manager, swapfile):
    mgr = unit_manager
    # swap_max=0: nothing may page out, 100 MiB cannot fit in 50 MiB.
    none = mgr.begin_turn("swap", "none", limits=Limits(memory_max=50 * MiB, swap_max=0))
    assert read(turn_dir(mgr, none), "memory.swap.max") == "0"
    assert alloc(mgr, none, 100).wait(timeout=180) == -9
    assert none.usage().oom_kills >= 1
    # swap_max=32M: 50 + 32 MiB is still short of 100 MiB; swap use stops at the limit.
    some = mgr.begin_turn("swap", "some", limits=Limits(memory_max=50 * MiB, swap_max=32 * MiB))
    cg = turn_dir(mgr, some)
    assert read(cg, "memory.swap.max") == str(32 * MiB)
    assert alloc(mgr, some, 100).wait(timeout=300) == -9
    assert some.usage().oom_kills >= 1
    assert 0 < int(read(cg, "memory.swap.peak")) <= 32 * MiB
    # swap_max=max: the same 100 MiB pages out and the allocator finishes.
    free = mgr.begin_turn("swap", "free", limits=Limits(memory_max=50 * MiB, swap_max="max"))
    cg = turn_dir(mgr, free)
    assert read(cg, "memory.swap.max") == "max"
    hog = alloc(mgr, free, 100, show="memory.swap.current")
    out, _ = hog.communicate(timeout=300)
    assert hog.returncode == 0, out
    assert int(out.split()[1]) > 40 * MiB  # at least what did not fit in memory.max
    assert free.usage().oom_kills == 0


# --- 6. budgets: a task's and the managed root's -------------------------------------------------------------

@pytest.mark.parametrize("level", ["task", "root"])
def test_a_budget_holds_when_each_turn_is_under_its_own_limit(unit_manager, level):
    mgr = unit_manager
    budget = Limits(memory_max=80 * MiB)
    if level == "task":
        mgr.set_task_limits("budget", budget)
        assert mgr.task_limits("budget").memory_max == 80 * MiB
        where, tasks = f"{mgr.root}/budget", ("budget", "budget")
    else:
        mgr.set_limits(budget)
        assert mgr.limits().memory_max == 80 * MiB
        where, tasks = mgr.root, ("a", "b")
    assert read(where, "memory.max") == str(80 * MiB)
    # Each turn: 40 MiB plus the interpreter, well under its own 64 MiB; together over 80 MiB.
    turns = [mgr.begin_turn(task, f"t{i}", limits=Limits(memory_max=64 * MiB)) for i, task in enumerate(tasks)]
    first = alloc(mgr, turns[0], 40, hold=True)
    assert first.stdout.readline().strip() == "done"
    second = alloc(mgr, turns[1], 40, hold=True)
    procs = (first, second)
    assert wait_until(lambda: any(p.poll() is not None for p in procs), timeout=180)
    assert sorted(p.poll() for p in procs if p.poll() is not None) == [-9]  # one died, the other lives
    usage = mgr.task_usage("budget") if level == "task" else mgr.usage()
    assert usage.oom_kills >= 1
    for turn in turns:
        assert read(turn_dir(mgr, turn), "memory.max") == str(64 * MiB)
        assert flat(turn_dir(mgr, turn), "memory.events")["max"] == 0  # no turn reached its own limit


# --- 7. inside the limits before the target runs ---------------------------------------------------------------

# The shell's own `read` builtin opens /proc/self/cgroup: the first thing the target does, in the
# target process itself, is look at where it is and what its limits are.
FIRST_ACT = ('read -r l < /proc/self/cgroup; cg=${l#0::}; read -r m < /sys/fs/cgroup$cg/memory.max; '
             'read -r p < /sys/fs/cgroup$cg/pids.max; echo "$cg $m $p"')


def test_the_target_starts_inside_its_limits(unit_manager):
    mgr = unit_manager
    turn = mgr.begin_turn("first", "t1", limits=Limits(memory_max=50 * MiB, pids_max=16))
    proc = spawn(mgr, turn, ["sh", "-c", FIRST_ACT], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert out.split() == [turn_dir(mgr, turn)[len(MOUNT):], str(50 * MiB), "16"]

