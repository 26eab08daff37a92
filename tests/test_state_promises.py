"""Promises about state a user relies on, tried on the real kernel the way a race or a crash breaks them:
no spawn slips past a limit set while it runs, a lease holds after `run` exits, `limits` shows what
holds, an emptied completed turn (or managed root) does not linger, and a turn ended by another process
gives back its network namespace. (A crashed pressure guard's frozen turns: tests/test_guard.py.)

Every spawn storm is bounded in count and time; every wait has a deadline.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import pytest

from cgturn import Limits, NoSuchTurn, TurnManager
from cgturn.sentinel import attach as attach_sentinel
from conftest import alive, audit_records, cli, force_spawn_path, v1_mirrors, wait_until

MiB = 2 ** 20
LIVE = ["sleep", "120"]  # spawned processes live long enough to be checked, and die with their turn
DEADLINE = 60  # generous: other test runs share these cores


def _v1_hybrid(mgr) -> None:
    report = mgr.limits_report()
    if report["layout"] != "v1-hybrid" or "memory" not in report["available"]:
        pytest.skip(f"needs memory in a v1 hierarchy (a hybrid host); here: {report}")


@pytest.fixture
def hybrid(cgroup2_manager):
    """A manager on a hybrid host: memory in v1, so a limit set later gives a turn v1 directories."""
    _v1_hybrid(cgroup2_manager)
    return cgroup2_manager


def _v1_memory_of(pid: int) -> str | None:
    """The path of `pid`'s v1 memory cgroup (None once it has exited)."""
    from cgturn.kernel import controllers, parsers

    try:
        with open(f"/proc/{pid}/cgroup") as f:
            mine = parsers.parse_proc_cgroup_v1(f.read())
    except FileNotFoundError:
        return None
    with open("/proc/self/mountinfo") as f:
        mounts = controllers.v1_mounts(f.read())
    return os.path.normpath(os.path.join(mounts["memory"], mine["memory"].lstrip("/")))


def _spawn_while(turn, started: threading.Event, stop: threading.Event, out: list, limit: int) -> None:
    """Spawn into `turn` until `stop` (or `limit` spawns), recording the processes in `out`."""
    while not stop.is_set() and len(out) < limit:
        try:
            out.append(turn.spawn(LIVE))
        except NoSuchTurn:
            return
        started.set()


def _storm(turn, change, threads: int = 3, per_thread: int = 150) -> list[subprocess.Popen]:
    """Run `change()` while `threads` threads spawn into `turn`; returns every process spawned."""
    started, stop = threading.Event(), threading.Event()
    spawned: list[list[subprocess.Popen]] = [[] for _ in range(threads)]
    workers = [threading.Thread(target=_spawn_while, args=(turn, started, stop, spawned[i], per_thread))
               for i in range(threads)]
    for w in workers:
        w.start()
    try:
        assert started.wait(30), "no spawn went through"
        change()
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    return [p for procs in spawned for p in procs]


def _left_out(procs: list[subprocess.Popen], v1_dir: str) -> list[int]:
    """The pids of `procs` still alive outside the v1 memory directory `v1_dir`."""
    return [p.pid for p in procs if p.poll() is None and _v1_memory_of(p.pid) not in (None, v1_dir)]


# --- 1. a limit set while spawns run leaves none behind ---------------------------------------------


SPAWN_PATHS = ["clone3", "shim"]


@pytest.mark.parametrize("level", ["turn", "task"])
@pytest.mark.parametrize("path", SPAWN_PATHS)
def test_limits_set_while_spawning_leave_no_process_outside_the_turns_v1_dirs(hybrid, monkeypatch, path, level):
    """Every process spawned while Turn.set_limits (or TurnManager.set_task_limits) gives a running
    turn its v1 directories ends up inside them, none in the gateway's own memory cgroup
    (docs/limits.md: the turn is frozen while its processes move in)."""
    force_spawn_path(monkeypatch, path)
    budget = Limits(memory_max=512 * MiB)
    for n in range(4):
        task = f"race{n}"
        turn = hybrid.begin_turn(task, "t")
        change = (lambda: turn.set_limits(budget)) if level == "turn" else \
            (lambda: hybrid.set_task_limits(task, budget))
        memory_dir = os.path.join(v1_mirrors(hybrid.backend.root.path)["memory"], *turn.names)
        procs = _storm(turn, change)
        try:
            assert _left_out(procs, memory_dir) == [], f"round {n}: of {len(procs)} spawned, these escaped"
        finally:
            turn.abandon("test over")
            for p in procs:
                p.wait(30)


def _begin_while(mgr, task: str, prefix: str, started: threading.Event, stop: threading.Event, out: list,
                 limit: int) -> None:
    """Begin turns of `task` and spawn one process in each until `stop` (or `limit` turns)."""
    n = 0
    while not stop.is_set() and n < limit:
        turn = mgr.begin_turn(task, f"{prefix}-{n}")
        out.append((turn, turn.spawn(LIVE)))
        n += 1
        started.set()


def test_task_limits_cover_turns_begun_while_they_are_set(hybrid):
    """Turns begun (and spawned into) while set_task_limits runs are limited too: each process ends up
    in its own turn's v1 directories, none in the gateway's memory cgroup."""
    task = "grow"
    started, stop = threading.Event(), threading.Event()
    made: list[list] = [[], []]
    workers = [threading.Thread(target=_begin_while, args=(hybrid, task, f"w{i}", started, stop, made[i], 60))
               for i in range(2)]
    for w in workers:
        w.start()
    try:
        assert started.wait(30), "no turn began"
        hybrid.set_task_limits(task, Limits(memory_max=512 * MiB))
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    memory = v1_mirrors(hybrid.backend.root.path)["memory"]
    pairs = [pair for turns in made for pair in turns]
    try:
        escaped = [(turn.turn_id, proc.pid) for turn, proc in pairs
                   if _v1_memory_of(proc.pid) not in (None, os.path.join(memory, *turn.names))]
        assert escaped == [], f"of {len(pairs)} turns, these kept a process outside their v1 directories"
    finally:
        for turn, proc in pairs:
            turn.abandon("test over", grace=0)
            proc.wait(30)


def test_a_turn_whose_creator_stalls_past_a_task_budget_still_gets_its_v1_dirs(hybrid, monkeypatch):
    """A creator stopped between its turn's mkdir and its record for longer than set_task_limits waits
    for records (1 s) re-checks the budgets once recorded: the turn gets its v1 directories, and what
    it spawns is limited, not left in the gateway's memory cgroup."""
    task = "stalled"
    hybrid.begin_turn(task, "first").complete()   # the task exists, with no limits yet
    resume, saving = threading.Event(), threading.Event()
    meta = hybrid.backend.meta
    real_save = meta.save

    def stalled_save(cg, record, *args, **kwargs):
        if record.turn_id == "slow" and not saving.is_set():
            saving.set()      # the directory exists, the budgets were read: stall here
            assert resume.wait(DEADLINE)
        return real_save(cg, record, *args, **kwargs)

    monkeypatch.setattr(meta, "save", stalled_save)
    made: list = []
    creator = threading.Thread(target=lambda: made.append(hybrid.begin_turn(task, "slow")))
    creator.start()
    try:
        assert saving.wait(DEADLINE), "the creator never reached its record"
        hybrid.set_task_limits(task, Limits(memory_max=512 * MiB))  # waits 1 s for the record, in vain
    finally:
        resume.set()
        creator.join(DEADLINE)
    [turn] = made
    proc = turn.spawn(LIVE)
    try:
        memory = v1_mirrors(hybrid.backend.root.path)["memory"]
        assert _v1_memory_of(proc.pid) == os.path.join(memory, *turn.names)
    finally:
        turn.abandon("test over", grace=0)
        proc.wait(30)


def test_a_pause_made_while_set_limits_moves_a_turn_stays(hybrid, monkeypatch):
    """A user's pause that lands while Turn.set_limits holds the turn frozen to move it into its v1
    directories is not undone by the end of that move."""
    turn = hybrid.begin_turn("paused", "t")
    proc = turn.spawn(LIVE)
    limiter = hybrid.backend.limiter
    real_join = limiter._join_all

    def join_then_pause(record, cg, settled):
        real_join(record, cg, settled)
        turn.freeze()          # a `cgturn pause` in the middle of the move

    monkeypatch.setattr(limiter, "_join_all", join_then_pause)
    try:
        turn.set_limits(Limits(memory_max=512 * MiB))
        with open(os.path.join(hybrid.backend.root.path, *turn.names, "cgroup.events")) as f:
            assert "frozen 1" in f.read().split("\n"), "the pause was thawed by set_limits"
        assert turn.frozen
        turn.thaw()
        assert not turn.frozen
    finally:
        turn.abandon("test over", grace=0)
        proc.wait(30)


# --- 2. promises a user reads ------------------------------------------------------------------------

DAEMON = "sleep 300 </dev/null >/dev/null 2>&1 & echo $!"


def _rows(root, state_dir) -> list[dict]:
    out = cli(root, state_dir, "ps", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _sentinels_of(state_dir: str) -> list[int]:
    """Pids of the sentinel processes serving this test's state directory (started by this test)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"cgturn.sentinel_main" in argv and state_dir.encode() in argv:
            found.append(int(name))
        elif _holds(int(name), os.path.join(state_dir, "sentinel.log")):  # forked: the owner's argv
            found.append(int(name))
    return found


def _holds(pid: int, path: str) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def test_run_keep_for_is_enforced_after_run_exits(cgroup2_root, state_dir):
    """`run --keep-for 2`: what CMD left running is killed when the lease runs out, though `run` (and
    its owner process) is long gone; by the sentinel, reason lease-expired, and the turn goes."""
    out = cli(cgroup2_root, state_dir, "run", "--task", "lease", "--turn", "t", "--keep-for", "2", "--",
              "sh", "-c", DAEMON)
    assert out.returncode == 0, out.stderr
    daemon = int(out.stdout)
    [row] = _rows(cgroup2_root, state_dir)
    assert row["state"] == "completed" and row["pids"] == [daemon]
    try:
        assert wait_until(lambda: not alive(daemon), timeout=DEADLINE)
        assert wait_until(lambda: _rows(cgroup2_root, state_dir) == [], timeout=DEADLINE)
        [kill] = [r for r in audit_records(state_dir, "t") if r.get("action", "kill") == "kill"]
        assert kill["reason"] == "lease-expired" and kill["pids"] == [daemon]
        assert wait_until(lambda: _sentinels_of(state_dir) == [], timeout=DEADLINE)  # and then it goes
    finally:
        if alive(daemon):
            cli(cgroup2_root, state_dir, "end", "lease")


def test_a_leased_turn_whose_survivors_exit_is_removed_and_the_sentinel_goes(cgroup2_root, state_dir):
    """A lease holds the sentinel only while there is something to kill: survivors that exit on their
    own leave no `completed` turn behind and no sentinel waiting for the lease's end."""
    out = cli(cgroup2_root, state_dir, "run", "--task", "lease", "--turn", "t", "--keep-for", "3600", "--",
              "sh", "-c", DAEMON)
    assert out.returncode == 0, out.stderr
    daemon = int(out.stdout)
    try:
        assert _sentinels_of(state_dir) != []  # staying for the lease
        os.kill(daemon, signal.SIGKILL)  # the survivor exits (this test started it, through `run`)
        assert wait_until(lambda: _rows(cgroup2_root, state_dir) == [], timeout=DEADLINE)
        assert wait_until(lambda: _sentinels_of(state_dir) == [], timeout=DEADLINE)
    finally:
        if alive(daemon):
            cli(cgroup2_root, state_dir, "end", "lease")


def test_a_completed_turn_whose_survivors_exit_is_removed_by_its_owners_sentinel(cgroup2_root, state_dir):
    """A completed turn (no lease) whose survivors all exit does not linger as `completed` with no
    pids while its owner runs: the owner's sentinel removes it, as completion removes an empty turn."""
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
    try:
        attach_sentinel(mgr)
        turn = mgr.begin_turn("plain", "t")
        survivor = turn.spawn(LIVE)
        turn.complete()
        assert [(i.turn, i.state) for i in mgr.turns("plain")] == [("t", "completed")]
        survivor.kill()
        survivor.wait(30)
        assert wait_until(lambda: mgr.turns("plain") == [], timeout=DEADLINE)
        assert [r for r in audit_records(state_dir, "t") if r.get("action", "kill") == "kill"] == []  # nothing killed
    finally:
        mgr.close()


def test_limits_shows_what_holds_on_this_layout(cgroup2_root, state_dir):
    """`cgturn limits`: a weight has no max (its unset value is the kernel's default, 100), and a
    limit this layout cannot set reads `unsupported here` with the reason the setter would give."""
    out = cli(cgroup2_root, state_dir, "limits")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in out.stdout.splitlines()[1:8]}
    assert rows["cpu_weight"] == "default (100)"
    assert "max" not in rows["cpu_weight"] and "max" not in rows["oom_group"]
    data = json.loads(cli(cgroup2_root, state_dir, "limits", "--json").stdout)
    with open(os.path.join(os.path.dirname(cgroup2_root), "cgroup.controllers")) as f:
        memory_in_v2 = "memory" in f.read().split()
    if not memory_in_v2 and "memory" in v1_mirrors(cgroup2_root):  # a hybrid host: no memory.high anywhere
        assert rows["memory_high"].startswith("unsupported here (") and "v1" in rows["memory_high"]
        assert set(data["unsupported"]) == {"memory_high", "oom_group"}
        refused = cli(cgroup2_root, state_dir, "limits", "--memory-high", "100M")
        assert refused.returncode == 1 and data["unsupported"]["memory_high"] in refused.stderr
    else:
        assert rows["memory_high"] == "max" and "memory_high" not in data["unsupported"]


def test_reap_remove_root_removes_an_emptied_managed_root(cgroup2_root, state_dir):
    """`cgturn reap --remove-root`: a managed root with nothing left in it (a completed turn whose
    survivor exited, a task budget, a root budget, v1 directories on a hybrid host) goes, all of it."""
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        turn = mgr.begin_turn("done", "t")
        survivor = turn.spawn(LIVE)
        turn.complete()
        survivor.kill()
        survivor.wait(30)
        if "memory" in mgr.limits_report()["available"]:
            mgr.set_task_limits("budget", Limits(memory_max=512 * MiB))
            mgr.set_limits(Limits(memory_max=1024 * MiB))
    finally:
        mgr.close()
    assert os.path.isdir(cgroup2_root)
    out = cli(cgroup2_root, state_dir, "reap", "--remove-root", "--json")
    assert out.returncode == 0, out.stderr
    assert {"action": "removed-root", "task": "", "turn": "", "path": cgroup2_root} in json.loads(out.stdout)
    assert not os.path.exists(cgroup2_root)
    assert not any(os.path.exists(d) for d in v1_mirrors(cgroup2_root).values())


def test_reap_remove_root_leaves_a_root_that_holds_a_turn(cgroup2_root, state_dir):
    """A root with a live owner's running turn is not removed: exit 1 naming what is left; the turn and
    its process are untouched."""
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        turn = mgr.begin_turn("busy", "t")
        proc = turn.spawn(LIVE)
        out = cli(cgroup2_root, state_dir, "reap", "--remove-root")
        assert out.returncode == 1 and "managed root not removed: it still holds 1 turn(s)" in out.stdout, out
        assert os.path.isdir(cgroup2_root) and proc.poll() is None and turn.state == "running"
        turn.abandon("test over", grace=0)
        proc.wait(30)
    finally:
        mgr.close()


def _netns_fds() -> set[str]:
    """The network namespaces this process holds an fd of ('net:[inode]')."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("net:["):
            out.add(target)
    return out


def test_an_owner_lets_go_of_the_netns_of_a_turn_another_process_ended(cgroup2_manager, cgroup2_root, state_dir):
    """network="none": when `cgturn stop` (another process) ends the turn, its owner's Supervisor
    notices, and the owner closes its fd of the turn's network namespace then, not at its next
    begin_turn."""
    from cgturn import Supervisor

    before = _netns_fds()
    turn = cgroup2_manager.begin_turn("net", "t", network="none")
    [netns] = _netns_fds() - before  # held by the owner while the turn runs
    proc = turn.spawn(["sh", "-c", "readlink /proc/self/ns/net; exec sleep 120"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == netns  # the turn's processes live in it
    stopped = threading.Event()
    sup = Supervisor(turn, timeout=300, grace=0, use_sentinel=False, on_interrupt=lambda why: stopped.set())

    def worker():
        assert stopped.wait(DEADLINE)

    def stop_from_outside():
        out = cli(cgroup2_root, state_dir, "stop", "net", "t", "--grace", "0")
        assert out.returncode == 0, out.stderr

    stopper = threading.Timer(0.0, stop_from_outside)
    stopper.start()
    outcome = sup.run_blocking(worker)
    stopper.join(60)
    assert outcome.external and not outcome.completed
    proc.wait(30)
    proc.stdout.close()
    assert netns not in _netns_fds()


@pytest.mark.parametrize("learns", ["state", "spawn"])
def test_an_owner_without_a_supervisor_lets_go_of_the_netns_when_it_looks(cgroup2_manager, cgroup2_root, state_dir,
                                                                         learns):
    """network="none", a bare Turn: once `cgturn stop` (another process) ended it, the owner closes its
    namespace fd the first time its Turn finds out (reading the state, or a refused spawn), not at its
    next begin_turn."""
    before = _netns_fds()
    turn = cgroup2_manager.begin_turn("net", "bare", network="none")
    [netns] = _netns_fds() - before
    out = cli(cgroup2_root, state_dir, "stop", "net", "bare", "--grace", "0")
    assert out.returncode == 0, out.stderr
    assert netns in _netns_fds()   # nothing has told the owner yet
    if learns == "state":
        assert turn.state == "abandoned"
    else:
        with pytest.raises(NoSuchTurn):
            turn.spawn(["true"])
    assert netns not in _netns_fds()


@pytest.mark.parametrize("backend", ["cgroup2", "registry"])
def test_a_completed_turn_whose_survivors_exit_is_removed_by_its_owners_listing(cgroup2_root, state_dir, backend):
    """No sentinel: once the survivors of a completed turn have exited, the owner's next `turns()`
    removes the turn (its cgroup, or its registry row) instead of listing it; `cgturn ps` from another
    process, read-only, lists it until then and removes nothing."""
    from cgturn import TurnManager

    mgr = TurnManager(root=cgroup2_root, backend=backend, state_dir=state_dir, sentinel=False)
    try:
        turn = mgr.begin_turn("quiet", "t")
        daemon = int(turn.spawn(["sh", "-c", DAEMON], stdout=subprocess.PIPE, text=True).communicate(timeout=30)[0])
        turn.complete()
        assert [(i.turn, i.state, i.pids) for i in mgr.turns("quiet")] == [("t", "completed", [daemon])]
        os.kill(daemon, signal.SIGKILL)   # the survivor (this test started it) exits
        assert wait_until(lambda: not alive(daemon), timeout=DEADLINE)
        out = cli(cgroup2_root, state_dir, "ps", "--json", backend=backend)
        assert out.returncode == 0, out.stderr
        [row] = json.loads(out.stdout)
        assert row["state"] == "completed" and row["pids"] == []   # another process's listing keeps it
        assert mgr.turns("quiet") == []
        assert mgr.turns() == []
        if backend == "cgroup2":
            assert not os.path.exists(os.path.join(cgroup2_root, *turn.names))
        else:
            assert mgr.backend.records() == []
        later = mgr.begin_turn("quiet", "t")    # its names are free again
        later.complete()
    finally:
        mgr.end_task("quiet", grace=0)
        mgr.close()
