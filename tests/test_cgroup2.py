"""cgroup v2 backend specifics: layout, metadata, race-free spawn, kill paths, safety refusals."""
import dataclasses
import errno
import json
import os
import signal
import subprocess
import textwrap
import threading

import pytest

from cgturn import NoSuchTurn, TurnManager, UnsafeOperation
from cgturn.backends.metadata import GENERATION_KEY, XATTR_KEY
from cgturn.kernel import procfs
from cgturn.kernel.cgroupfs import Cgroup
from conftest import ESCAPER_NAMES, PY, alive, cgturn_env, explain_escaper, launch_escaper, turn_dir, wait_until


@pytest.fixture
def mgr(cgroup2_manager):
    return cgroup2_manager


def test_layout_and_metadata_live_on_the_cgroup(mgr):
    turn = mgr.begin_turn("telegram:123/abc", "turn 1")
    path = turn_dir(mgr, turn)
    assert path == os.path.join(mgr.backend.root.path, "telegram:123%2Fabc", "turn%201")
    meta = json.loads(os.getxattr(path, XATTR_KEY))
    assert meta["task_id"] == "telegram:123/abc" and meta["turn_id"] == "turn 1"
    assert meta["state"] == "running" and meta["owner_pid"] == os.getpid()
    assert meta["owner_start"] == procfs.start_time(os.getpid())
    turn.complete()
    assert not os.path.exists(path)  # completed and empty: removed


def test_metadata_falls_back_to_the_state_dir_when_xattrs_are_refused(mgr, state_dir):
    mgr.backend.meta.use_xattrs = False  # the capability flag the backend sets on ENOTSUP/EPERM
    turn = mgr.begin_turn("no-xattr", "t")
    path = turn_dir(mgr, turn)
    with pytest.raises(OSError) as refused:
        os.getxattr(path, XATTR_KEY)
    assert refused.value.errno == errno.ENODATA  # no such attribute: nothing was written there
    stored = os.path.join(state_dir, "meta", "no-xattr", "t.json")
    assert json.load(open(stored))["state"] == "running"
    p = turn.spawn(["sleep", "300"])
    assert turn.abandon("x", grace=0).killed == [p.pid]
    p.wait(timeout=10)
    assert not os.path.exists(stored) and not os.path.exists(path)


def test_hostile_ids_each_get_their_own_directory(mgr):
    hostile = ["..", ".", "cgroup.procs", "a/b", "a%2Fb", "x" * 4096, "x" * 4095 + "y", "😀 ünï", "~", "-"]
    turns = [mgr.begin_turn(t, t) for t in hostile]
    paths = {turn_dir(mgr, t) for t in turns}
    assert len(paths) == len(hostile)
    for path in paths:
        assert os.path.dirname(os.path.dirname(path)) == mgr.backend.root.path
        assert os.path.isfile(os.path.join(path, "cgroup.procs"))
    listed = {(i.task, i.turn) for i in mgr.turns()}
    assert listed == {(t, t) for t in hostile}
    for t in turns:
        t.complete()
    assert not any(os.path.exists(path) for path in paths)  # each turn's cgroup goes with its complete
    mgr.close()  # the task directories the owner kept for its next turns go with its manager
    assert os.listdir(mgr.backend.root.path) == [] or all(
        not os.path.isdir(os.path.join(mgr.backend.root.path, d)) for d in os.listdir(mgr.backend.root.path))


def test_process_is_in_the_turn_before_its_first_instruction_even_with_threads(mgr):
    """`cat /proc/self/cgroup` reads its cgroup as its first act; every copy must see the turn."""
    turn = mgr.begin_turn("threads")
    expected = "0::" + turn_dir(mgr, turn)[len(mgr.backend.mount):]
    outputs, errors = [], []

    def worker():
        try:
            for _ in range(15):
                out = turn.spawn(["cat", "/proc/self/cgroup"], stdout=subprocess.PIPE, text=True).communicate()[0]
                outputs.append(out)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(outputs) == 90
    for out in outputs:
        assert expected in out.splitlines()
    turn.complete()


@pytest.mark.parametrize("name", ESCAPER_NAMES)
@pytest.mark.parametrize("use_cgroup_kill", [True, False], ids=["cgroup.kill", "freeze-fallback"])
def test_abandon_kills_every_escaper(mgr, escapers, name, use_cgroup_kill, bystanders):
    """Every escaper, the environment-clearing one included: membership is the cgroup."""
    mgr.backend.killer.cgroup_kill_works = use_cgroup_kill
    before = bystanders("sleep", "300")
    done_turn = mgr.begin_turn("task", "done")
    survivor = done_turn.spawn(["sleep", "300"])
    done_turn.complete()
    other = mgr.begin_turn("other-task")
    keeper = other.spawn(["sleep", "300"])
    turn = mgr.begin_turn("task", "abandoned")
    recipe = escapers[name]
    try:
        pids = launch_escaper(turn, recipe)
        assert len(pids) == recipe.leftovers, explain_escaper(recipe)
        assert set(pids) <= set(turn.pids())
        result = turn.abandon("stop", grace=0.5)
        assert set(pids) <= set(result.killed)
        assert wait_until(lambda: not any(alive(pid) for pid in pids))
        assert before.poll() is None and survivor.poll() is None and keeper.poll() is None
    finally:
        mgr.end_task("task")
        mgr.end_task("other-task")


def test_fork_storm_ends_with_zero_survivors(mgr, tmp_path):
    """A bounded storm (at most ~400 processes, 20 s) killed mid-flight, on both kill paths."""
    storm = textwrap.dedent("""
        import os, sys, time
        deadline = time.monotonic() + 20
        print("go", flush=True)
        for _ in range(8):            # 2**8 = 256 leaves at most, plus parents
            if time.monotonic() > deadline:
                break
            try:
                os.fork()
            except OSError:
                pass
        time.sleep(max(0, deadline - time.monotonic()))
    """)
    for use_kill in (True, False):
        mgr.backend.killer.cgroup_kill_works = use_kill
        turn = mgr.begin_turn("storm", str(use_kill))
        p = turn.spawn([PY, "-c", storm], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "go"
        assert wait_until(lambda: len(turn.pids()) >= 64, timeout=10)
        path = turn_dir(mgr, turn)
        result = turn.abandon("storm", grace=0)
        assert len(result.killed) >= 64
        assert not os.path.exists(path)
        assert not any(alive(pid) for pid in result.killed)
        assert p.wait(timeout=10) == -signal.SIGKILL


def test_payload_that_makes_and_freezes_a_sub_cgroup_still_dies(mgr):
    turn = mgr.begin_turn("sub")
    script = textwrap.dedent("""
        import os, subprocess, sys, time
        me = open("/proc/self/cgroup").read().split("0::", 1)[1].strip()
        base = sys.argv[1] + me
        sub = os.path.join(base, "hide")
        os.mkdir(sub)
        child = subprocess.Popen(["sleep", "300"])
        open(os.path.join(sub, "cgroup.procs"), "w").write(str(child.pid))
        open(os.path.join(sub, "cgroup.freeze"), "w").write("1")
        for f in ("cgroup.procs", "cgroup.freeze", "cgroup.kill"):
            os.chmod(os.path.join(sub, f), 0)
        print(child.pid, flush=True)
        time.sleep(300)
    """)
    p = turn.spawn([PY, "-c", script, mgr.backend.mount], stdout=subprocess.PIPE, text=True)
    hidden = int(p.stdout.readline())
    assert hidden in turn.pids()
    mgr.backend.killer.cgroup_kill_works = False  # the freeze fallback; torture covers deeper nesting on cgroup.kill
    result = turn.abandon("x", grace=0)
    assert hidden in result.killed
    assert wait_until(lambda: not alive(hidden))
    assert not os.path.exists(turn_dir(mgr, turn))


def test_abandon_is_refused_when_the_turn_contains_the_caller(mgr):
    turn = mgr.begin_turn("me")
    original = procfs.cgroup_of("self")
    with pytest.raises(UnsafeOperation, match="use Turn.enter"):
        turn.adopt(os.getpid())
    assert procfs.cgroup_of("self") == original
    turn.enter()  # the explicit way for the caller to join a turn
    try:
        assert procfs.cgroup_of("self") != original
        with pytest.raises(UnsafeOperation, match="calling process"):
            turn.abandon("suicide", grace=0)
        ended = mgr.end_task("me", grace=0)  # CONTRACT: the turns it must spare are listed, not raised
        assert [r["turn"] for r in ended.refused] == [turn.turn_id] and "calling process" in ended.refused[0]["error"]
        assert turn.state == "running"
    finally:
        mgr.leave_turn()
    assert procfs.cgroup_of("self") == original
    assert turn.abandon("done", grace=0).skipped is False


def test_kills_outside_the_managed_root_are_refused(mgr, tmp_path):
    turn = mgr.begin_turn("guard")
    rec = dataclasses.replace(turn.record)
    for forged in ("..", ".", "a/../.."):  # forged records pointing out of the managed root
        rec.task_key = forged
        with pytest.raises(ValueError):
            mgr.backend.kill_members(rec)
    for outside in (mgr.backend.mount, mgr.backend.root.path, mgr.backend.root.path + "/../x"):
        with pytest.raises(UnsafeOperation):
            mgr.backend.killer._refuse_protected(Cgroup(outside))
    link = tmp_path / "link"
    os.symlink(mgr.backend.mount, link)
    with pytest.raises(UnsafeOperation):
        mgr.backend.killer._refuse_protected(Cgroup(str(link)))
    turn.complete()


def test_adopt_moves_an_existing_process_and_its_future_children(mgr):
    p = subprocess.Popen(["sh", "-c", "read go; sleep 300"], stdin=subprocess.PIPE, text=True)  # forks once told
    try:
        turn = mgr.begin_turn("adopt")
        turn.adopt(p.pid)
        assert turn.pids() == [p.pid]
        p.stdin.write("go\n")
        p.stdin.flush()
        assert wait_until(lambda: len(turn.pids()) == 2)  # its child, forked after the move, is in the turn
        turn.abandon("x", grace=0)
        assert p.wait(timeout=10) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_spawn_into_a_turn_abandoned_meanwhile_never_runs_outside(mgr, tmp_path):
    turn = mgr.begin_turn("late")
    rec = turn.record
    marker = tmp_path / "ran"
    turn.abandon("gone", grace=0)
    with pytest.raises(NoSuchTurn):
        mgr.backend.spawn(rec, ["touch", str(marker)], {})
    assert not marker.exists()


def test_reap_abandons_turns_of_a_dead_owner_and_keeps_completed_survivors(mgr, cgroup2_root, state_dir):
    code = textwrap.dedent(f"""
        import os
        from cgturn import TurnManager
        m = TurnManager(root={cgroup2_root!r}, backend="cgroup2", state_dir={state_dir!r})
        done = m.begin_turn("gw", "done"); s = done.spawn(["sleep", "300"]); done.complete()
        live = m.begin_turn("gw", "live"); w = live.spawn(["sleep", "300"])
        print(s.pid, w.pid, flush=True)
        os._exit(0)
    """)
    owner = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True, env=cgturn_env())
    survivor, worker = map(int, owner.stdout.readline().split())  # its children keep the pipe open
    assert owner.wait(timeout=30) == 0
    states = {i.turn: i.state for i in mgr.turns("gw")}
    assert states == {"done": "completed", "live": "running"}
    actions = mgr.reap()
    assert [(a.turn, a.reason) for a in actions if a.action == "abandoned"] == [("live", "owner-died")]
    assert wait_until(lambda: not alive(worker))
    assert alive(survivor)
    mgr.end_task("gw")


def test_fast_listing_agrees_with_the_generic_composition(mgr):
    """views() answers ps in one pass; it must see what records/members/cgroup_dir see, sub-cgroups too."""
    plain = mgr.begin_turn("list", "plain")
    p1 = plain.spawn(["sleep", "300"])
    nested = mgr.begin_turn("list", "nested")
    p2 = nested.spawn(["sleep", "300"])
    sub = Cgroup(turn_dir(mgr, nested)).child("sub")
    sub.create()
    sub.move_in(p2.pid)  # now the pid lives only in a sub-cgroup of the turn
    fast = {v.record.turn_id: v for v in mgr.backend.views("list")}
    slow = {rec.turn_id: (sorted(pid for pid, _ in mgr.backend.members(rec)), mgr.backend.cgroup_dir(rec))
            for rec in mgr.backend.records("list")}
    assert fast.keys() == slow.keys() == {"plain", "nested"}
    for name in fast:
        assert (fast[name].pids, fast[name].path) == slow[name]
    assert fast["nested"].pids == [p2.pid] and fast["plain"].pids == [p1.pid]
    assert len(fast["nested"].cgroup_ids) == 2 and os.stat(sub.path).st_ino in fast["nested"].cgroup_ids
    mgr.end_task("list")
    p1.wait(timeout=10)
    p2.wait(timeout=10)


def test_repeated_listings_see_every_record_write_of_another_manager(cgroup2_root, state_dir):
    """A lister reuses parsed records between calls; a write by another manager must still show."""
    lister = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
    owner = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
    try:
        turn = owner.begin_turn("watched", "t1")
        survivor = turn.spawn(["sleep", "300"])
        first_start = turn.record.started_at
        assert [(i.turn, i.state) for i in lister.turns()] == [("t1", "running")]
        assert [(i.turn, i.state) for i in lister.turns()] == [("t1", "running")]
        turn.complete()  # the sleep survives, so the turn stays, now completed
        assert [(i.turn, i.state) for i in lister.turns()] == [("t1", "completed")]
        owner.end_task("watched")
        survivor.wait(timeout=10)
        assert lister.turns() == []
        again = owner.begin_turn("watched", "t1")  # same name, a new cgroup and record
        second_start = again.record.started_at
        assert second_start > first_start
        assert [(i.turn, i.state, i.started_at) for i in lister.turns()] == [("t1", "running", second_start)]
        again.complete()
    finally:
        owner.close()
        lister.close()


def test_listings_trust_parsed_records_only_while_the_task_generation_holds(mgr):
    turn = mgr.begin_turn("gen", "t")
    proc = turn.spawn(["sleep", "300"])  # not empty: the owner's listing removes an emptied completed turn
    path = turn_dir(mgr, turn)
    assert [i.state for i in mgr.turns()] == ["running"]
    forged = json.loads(os.getxattr(path, XATTR_KEY))
    forged["state"] = "completed"
    os.setxattr(path, XATTR_KEY, json.dumps(forged).encode())  # a write that skips the generation
    assert [i.state for i in mgr.turns()] == ["running"]  # proof that the parsed record was reused
    os.removexattr(os.path.dirname(path), GENERATION_KEY)
    assert [i.state for i in mgr.turns()] == ["completed"]  # no token: nothing is reused
    turn.abandon("test", grace=0, force=True)
    proc.wait(timeout=10)


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_a_spawn_whose_turn_vanished_never_runs_its_target(mgr, tmp_path):
    """The gate holds the shim until the parent moved it; if the move fails the target never runs."""
    turn = mgr.begin_turn("vanish")
    rec = turn.record
    marker = tmp_path / "ran"
    Cgroup(turn_dir(mgr, turn)).remove_tree()  # the turn's cgroup is gone before the spawn
    before = open_fds()
    with pytest.raises(NoSuchTurn):
        mgr.backend.spawn(rec, ["touch", str(marker)], {})
    assert not marker.exists()
    assert mgr.backend.gates._pending == [] and open_fds() <= before  # its gate is closed


def test_gates_are_closed_once_their_shims_have_read_them(mgr):
    turn = mgr.begin_turn("gates")
    turn.spawn(["true"]).wait(timeout=10)
    mgr.backend.gates.sweep()
    before = open_fds()
    for _ in range(20):
        assert turn.spawn(["true"]).wait(timeout=10) == 0
    mgr.backend.gates.sweep()
    assert mgr.backend.gates._pending == [] and open_fds() <= before  # no fd kept per spawn
    turn.complete()


def test_a_gate_whose_shim_died_before_reading_go_is_closed(mgr):
    from cgturn.backends.shim import SPAWN_SHIM

    spawn_gates = mgr.backend.gates
    gate = spawn_gates.open()
    # a shim that stops itself before it reads, as if frozen, then is killed unread
    shim = subprocess.Popen(["/bin/sh", "-c", 'kill -STOP $$; ' + SPAWN_SHIM, gate.path, "t", "u", "s", "true"],
                            pass_fds=gate.pass_fds)
    assert wait_until(lambda: procfs.stat(shim.pid).state == "T")
    rfd = gate.rfd
    spawn_gates.release(gate, shim.pid)
    spawn_gates.sweep()
    assert gate in spawn_gates._pending and os.fstat(rfd)  # unread, shim alive: kept
    shim.kill()
    shim.wait(timeout=10)
    spawn_gates.sweep()
    assert gate not in spawn_gates._pending and gate.rfd == -1


def test_records_kept_between_listings_stay_bounded_when_tasks_are_listed_one_by_one(mgr, monkeypatch):
    from cgturn.backends import metadata

    monkeypatch.setattr(metadata, "MAX_CACHED_TASKS", 3)
    for i in range(5):
        turn = mgr.begin_turn(f"one-by-one-{i}", "t")
        assert [info.turn for info in mgr.turns(f"one-by-one-{i}")] == ["t"]
        turn.complete()  # completed and empty: removed, and never listed again
    assert len(mgr.backend.meta._parsed) <= 3


def test_a_forked_child_closes_its_copies_of_its_parents_gates(mgr):
    """Held open in a child, a gate would not read EOF when the parent dies (os.register_at_fork)."""
    spawn_gates = mgr.backend.gates
    gate = spawn_gates.open()
    shim = subprocess.Popen(["/bin/sh", "-c", "kill -STOP $$"])
    spawn_gates.release(gate, shim.pid)  # pending: its "shim" never reads
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether the gate's read end is still open here, then _exit
        try:
            os.close(r)
            try:
                os.fstat(gate.rfd)
                os.write(w, b"open")
            except OSError:
                os.write(w, b"closed")
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        childs = f.read()
    os.waitpid(pid, 0)
    assert childs == "closed" and os.fstat(gate.rfd)  # closed in the child, still the parent's
    shim.kill()
    shim.wait(timeout=10)
    spawn_gates.sweep()
    assert spawn_gates._pending == []


def test_a_stopped_holder_of_the_turn_lock_does_not_stop_an_abandon(mgr):
    """A spawner stopped while it holds the turn's shared lock (the native spawn path takes one across
    its state check and clone) must not hold off an abandon: the sentinel exists for stopped owners."""
    turn = mgr.begin_turn("locked", "t")
    sleeper = turn.spawn(["sleep", "300"])
    holder = subprocess.Popen([PY, "-c", textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({turn_dir(mgr, turn)!r}, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        print("locked", flush=True)
        os.kill(os.getpid(), 19)  # SIGSTOP, holding the lock
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        assert wait_until(lambda: procfs.stat(holder.pid).state == "T")
        result = turn.abandon("stop", grace=0)
        assert result.killed == [sleeper.pid] and sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        holder.kill()
        holder.wait()
