"""Locks no other user can take, every wait on one bounded, and no state change without its lock
(issue 22): a holder of the gateway's own user makes a state change fail cleanly (LockTimeout) while
a kill still kills.

Each lock test starts a real process holding (or trying to hold) the flock, and ends it itself."""
import contextlib
import errno
import fcntl
import logging
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from cgturn import CgturnError, TurnManager
from cgturn.backends import guard_state
from cgturn.errors import GuardUnavailable, KernelError, LockTimeout
from cgturn.kernel import procfs
from conftest import REPO, alive, cli, force_spawn_path, turn_dir

NOBODY_PY = "/usr/bin/python3"  # pyenv's interpreter under /root cannot be run by nobody
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
SLEEP = ["sleep", "300"]
DEADLINE = 30.0  # how long a bounded operation may take before the test calls it a hang

# Opens each path read-only and flocks it without waiting; prints one word per path (locked, or the
# errno's name), then holds what it got until its stdin closes.
HOLDER = textwrap.dedent("""
    import errno, fcntl, os, sys
    kind = fcntl.LOCK_EX if sys.argv[1] == "ex" else fcntl.LOCK_SH
    fds, out = [], []
    for path in sys.argv[2:]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            fds.append(fd)
            out.append("locked")
        except OSError as err:
            out.append(errno.errorcode[err.errno])
    print(" ".join(out), flush=True)
    sys.stdin.read()
""")


def need_nobody():
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process as nobody")
    if not os.access(NOBODY_PY, os.X_OK):
        pytest.skip(f"{NOBODY_PY} is missing")


@contextlib.contextmanager
def holder(paths, *, nobody: bool, kind: str = "ex"):
    """A separate process (as nobody, or as the caller's own user) that flocks `paths`; yields what
    it got per path, and holds it until the block ends."""
    argv = [*AS_NOBODY, NOBODY_PY, "-I"] if nobody else [sys.executable, "-I"]
    proc = subprocess.Popen([*argv, "-c", HOLDER, kind, *paths], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        yield proc.stdout.readline().split()
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bounded(fn):
    """fn() in a thread: what it returned or raised, failing the test if it has not ended by DEADLINE
    (an unbounded lock wait: the holder's exit at the end of the test lets the thread finish)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"still waiting after {DEADLINE} s: an unbounded lock wait"
    return out


def locked_paths(mgr, turn):
    root = mgr._control.backend.root.path
    here = turn_dir(mgr, turn)
    return [root, os.path.dirname(here), here]


def guard_state_of_mine():
    me = os.getpid()
    return {"owner_pid": me, "owner_start": procfs.start_time(me), "armed": False, "over": False}


# --- no other user can take a lock --------------------------------------------------------------------


def _clone3_spawn(mgr, turn):
    return turn.spawn(["true"]).wait(timeout=10) == 0


def _keyed_spawn(mgr, turn):
    proc = turn.spawn(SLEEP, key="server")
    proc.kill()
    return proc.wait(timeout=10) == -9


def _guard_claim(mgr, turn):
    state = guard_state_of_mine()
    claimed = guard_state.claim(mgr._control.backend, state) is None
    guard_state.release(mgr._control.backend, state)
    return claimed


def _complete(mgr, turn):
    return turn.complete()


@pytest.mark.parametrize("operation", [_clone3_spawn, _keyed_spawn, _guard_claim, _complete],
                         ids=["clone3-spawn", "keyed-spawn", "guard-claim", "complete"])
def test_a_nobody_process_cannot_stall_the_gateway(cgroup2_manager, monkeypatch, operation):
    """A nobody process that flocks the managed root, the task and the turn directory (it cannot:
    it cannot even open them, whatever their age) holds up no spawn, keyed spawn, guard claim or
    completion; with the directories open to it, the first three waited for ever and complete()
    went on without the lock."""
    need_nobody()
    force_spawn_path(monkeypatch, "clone3")
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    turn.spawn(["true"]).wait(timeout=10)  # the extension keeps the turn directory's fd from now on
    paths = locked_paths(mgr, turn)
    modes = [stat.S_IMODE(os.stat(path).st_mode) for path in paths]
    with holder(paths, nobody=True) as got:
        assert bounded(lambda: operation(mgr, turn)) == {"value": True}
        assert got == ["EACCES"] * 3, dict(zip(paths, got))
    assert all(mode & 0o066 == 0 for mode in modes), [oct(m) for m in modes]  # 0o711 under the usual umask


def test_a_turn_process_running_as_nobody_cannot_lock_its_own_turn(cgroup2_manager):
    need_nobody()
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    paths = locked_paths(mgr, turn)
    proc = turn.spawn([NOBODY_PY, "-I", "-c", HOLDER, "sh", *paths], user="nobody",
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["EACCES"] * 3
        assert bounded(turn.complete) == {"value": True}
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def test_directories_an_older_cgturn_left_open_are_made_private(cgroup2_root, state_dir):
    """A managed root and a task directory made 0755 (by an earlier version, or by hand) are closed to
    others by the first manager that uses them."""
    need_nobody()
    os.mkdir(cgroup2_root, 0o755)
    os.mkdir(os.path.join(cgroup2_root, "task"), 0o755)
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        turn = mgr.begin_turn("task", "turn")
        paths = locked_paths(mgr, turn)
        with holder(paths, nobody=True) as got:
            assert got == ["EACCES"] * 3, dict(zip(paths, got))
        turn.complete()
    finally:
        mgr.close()


def test_no_other_user_can_open_or_lock_the_registry():
    """SQLite's locks are fcntl locks a read-only fd can take: the database and its -wal and -shm
    files are the owner's alone, in a state directory everyone may enter."""
    need_nobody()
    state = tempfile.mkdtemp(prefix="cgturn-test-locks-")
    os.chmod(state, 0o755)
    mgr = TurnManager(backend="registry", state_dir=state, sentinel=False)
    try:
        turn = mgr.begin_turn("task", "turn")
        proc = turn.spawn(SLEEP)
        db = mgr._control.backend.db_path
        paths = [db, f"{db}-wal", f"{db}-shm"]
        assert all(os.path.exists(p) for p in paths)
        with holder(paths, nobody=True, kind="sh") as got:
            assert got == ["EACCES"] * 3, dict(zip(paths, got))
            assert bounded(lambda: turn.abandon("test", grace=0)).get("value") is not None
        assert proc.wait(timeout=10) == -9
    finally:
        mgr.close()
        subprocess.run(["rm", "-rf", state], check=False)


@pytest.mark.parametrize("backend", ["cgroup2", "registry"])
def test_another_users_ps_lists_nothing_and_says_why_in_one_line(cgroup2_root, backend):
    """What the private locks cost: another user's `cgturn ps` sees no turn (docs/operations.md#ps)."""
    need_nobody()
    env = {**os.environ, "PYTHONPATH": REPO}
    probe = subprocess.run([*AS_NOBODY, NOBODY_PY, "-c", "import cgturn"], env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"nobody cannot import cgturn from {REPO}: {probe.stderr.strip()[-200:]}")
    state = tempfile.mkdtemp(prefix="cgturn-test-locks-")
    os.chmod(state, 0o755)
    mgr = TurnManager(root=cgroup2_root if backend == "cgroup2" else None, backend=backend, state_dir=state,
                      sentinel=False)
    try:
        turn = mgr.begin_turn("task", "turn")
        proc = turn.spawn(SLEEP)
        out = subprocess.run([*AS_NOBODY, NOBODY_PY, "-m", "cgturn", "--backend", backend, "--state-dir", state,
                              *(["--root", cgroup2_root] if backend == "cgroup2" else []), "ps", "--json"],
                             env=env, capture_output=True, text=True, cwd="/", timeout=60)
        assert (out.returncode, out.stdout) == (1, ""), out
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert ("not writable" if backend == "cgroup2" else "cannot open registry") in out.stderr
        turn.abandon("test", grace=0)
        proc.wait(timeout=10)
    finally:
        mgr.close()
        subprocess.run(["rm", "-rf", state], check=False)


# --- the same user's holder: bounded waits, clear errors, kills that still kill -------------------------


def test_complete_fails_cleanly_while_another_process_holds_the_turns_lock(cgroup2_manager):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    proc = turn.spawn(SLEEP)
    here = turn_dir(mgr, turn)
    with holder([here], nobody=False) as got:
        assert got == ["locked"]
        out = bounded(turn.complete)
        err = out.get("error")
        assert isinstance(err, LockTimeout) and isinstance(err, CgturnError), out
        assert err.path == here and "completed" in err.what and here in str(err)
        assert mgr._control.record(*turn.names).state == "running"
        assert alive(proc.pid)
    assert turn.complete() is True  # once the holder let go
    assert alive(proc.pid)  # a completed turn's survivor lives
    proc.kill()
    proc.wait(timeout=10)


def test_abandon_kills_without_the_lock_and_the_first_transition_still_wins(cgroup2_manager):
    """With `complete()` and an abandon both facing a held lock: complete fails and changes nothing,
    the abandon kills every process of the turn and reports the mark it could not make, and the turn
    it ended cannot be completed afterwards."""
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    procs = [turn.spawn(SLEEP), turn.spawn(["sh", "-c", "sleep 300 & sleep 300 & wait"])]
    here = turn_dir(mgr, turn)
    with holder([here], nobody=False) as got:
        assert got == ["locked"]
        assert isinstance(bounded(turn.complete).get("error"), LockTimeout)
        out = bounded(lambda: turn.abandon("operator", grace=0))
        result = out.get("value")
        assert result is not None, out
        assert not result.skipped and result.unrecorded and "not marked abandoned" in result.unrecorded
        for proc in procs:
            assert proc.wait(timeout=10) == -9
        assert set(result.killed) >= {p.pid for p in procs}
        assert not os.path.exists(here)  # emptied and removed, record and all
    assert turn.complete() is False  # the abandon came first; nothing completes it now


SQLITE_HOLDER = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")  # the registry's write lock, what every state change takes
    print("locked", flush=True)
    sys.stdin.read()
""")


def test_registry_state_changes_fail_cleanly_while_its_write_lock_is_held_and_abandon_still_kills(
        monkeypatch, tmp_path):
    from cgturn.backends import registry_db

    monkeypatch.setattr(registry_db, "BUSY_TIMEOUT", 0.5)  # read when the manager connects
    mgr = TurnManager(backend="registry", state_dir=str(tmp_path / "state"), sentinel=False)
    try:
        turn = mgr.begin_turn("task", "turn")
        procs = [turn.spawn(SLEEP), turn.spawn(SLEEP)]
        db = mgr._control.backend.db_path
        holder_proc = subprocess.Popen([sys.executable, "-I", "-c", SQLITE_HOLDER, db], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        try:
            assert holder_proc.stdout.readline().split() == ["locked"]
            err = bounded(turn.complete).get("error")
            assert isinstance(err, LockTimeout) and err.path == db and "registry" in err.what, err
            assert mgr._control.record(*turn.names).state == "running"
            assert all(alive(p.pid) for p in procs)
            result = bounded(lambda: turn.abandon("operator", grace=0)).get("value")
            assert result is not None and result.unrecorded and "not marked abandoned" in result.unrecorded
            for proc in procs:
                assert proc.wait(timeout=10) == -9
        finally:
            holder_proc.stdin.close()
            holder_proc.wait(timeout=10)
    finally:
        mgr.close()


def test_abandon_with_the_lock_free_reports_nothing_unrecorded(cgroup2_manager):
    turn = cgroup2_manager.begin_turn("task", "turn")
    proc = turn.spawn(SLEEP)
    result = turn.abandon("operator", grace=0)
    assert proc.wait(timeout=10) == -9 and result.unrecorded is None


@pytest.mark.parametrize("records", ["xattr", "file"])
def test_a_clone3_spawn_fails_within_its_bound_while_the_turns_lock_is_held(cgroup2_manager, monkeypatch, records):
    """The clone3 path's shared lock: taken in the extension (xattr records) or in Python (records in
    files); bounded both ways, and nothing is started."""
    force_spawn_path(monkeypatch, "clone3")
    mgr = cgroup2_manager
    if records == "file":
        mgr._control.backend.meta.use_xattrs = False
    turn = mgr.begin_turn("task", "turn")
    turn.spawn(["true"]).wait(timeout=10)  # the extension keeps this directory's fd from now on
    here = turn_dir(mgr, turn)
    with holder([here], nobody=False) as got:
        assert got == ["locked"]
        err = bounded(lambda: turn.spawn(SLEEP)).get("error")
        assert isinstance(err, LockTimeout), err
        assert err.path == here and "spawn" in err.what
        assert mgr._control.backend.members(turn.record) == []
    turn.spawn(["true"]).wait(timeout=10)  # free again
    turn.complete()


def test_a_keyed_spawn_fails_within_its_bound_while_the_task_lock_is_held(cgroup2_manager):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    task = os.path.dirname(turn_dir(mgr, turn))
    with holder([task], nobody=False) as got:
        assert got == ["locked"]
        err = bounded(lambda: turn.spawn(SLEEP, key="server")).get("error")
        assert isinstance(err, LockTimeout) and err.path == task, err
        assert mgr._control.backend.members(turn.record) == []
    proc = turn.spawn(SLEEP, key="server")
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)


def test_a_guard_cannot_claim_the_root_while_its_lock_is_held(cgroup2_manager):
    mgr = cgroup2_manager
    mgr.begin_turn("task", "turn").complete()
    backend = mgr._control.backend
    with holder([backend.root.path], nobody=False) as got:
        assert got == ["locked"]
        err = bounded(lambda: guard_state.claim(backend, guard_state_of_mine())).get("error")
        assert isinstance(err, GuardUnavailable) and backend.root.path in str(err), err
        assert guard_state.load(backend) is None  # nothing written
    state = guard_state_of_mine()
    assert guard_state.claim(backend, state) is None
    guard_state.release(backend, state)


def test_a_wait_on_a_lock_says_what_it_waited_for(tmp_path):
    """dirlock's own bound, on a plain directory: the error names the path and the operation."""
    from cgturn.kernel import dirlock

    with holder([str(tmp_path)], nobody=False) as got:
        assert got == ["locked"]
        with pytest.raises(LockTimeout) as err:
            with dirlock.exclusive(str(tmp_path), "do the thing", timeout=0.2):
                pytest.fail("ran without the lock")
        assert err.value.path == str(tmp_path) and err.value.what == "do the thing" and err.value.waited == 0.2
    fd = os.open(str(tmp_path), os.O_RDONLY)
    try:
        assert dirlock.flock_within(fd, fcntl.LOCK_SH, 0.2)
    finally:
        os.close(fd)


def test_a_timed_out_wait_leaves_one_thread_until_the_holder_lets_go_and_then_polls(tmp_path, monkeypatch):
    """The helper thread of a wait that timed out is released with the holder's lock; past
    MAX_STRANDED of them a wait polls instead of starting another thread."""
    from cgturn.kernel import dirlock
    from conftest import wait_until

    with holder([str(tmp_path)], nobody=False) as got:
        assert got == ["locked"]
        before = threading.active_count()
        with pytest.raises(LockTimeout):
            with dirlock.exclusive(str(tmp_path), "first", timeout=0.1):
                pass
        assert dirlock._stranded == 1 and threading.active_count() == before + 1
        monkeypatch.setattr(dirlock, "MAX_STRANDED", 1)
        with pytest.raises(LockTimeout):
            with dirlock.exclusive(str(tmp_path), "second", timeout=0.1):
                pass
        assert dirlock._stranded == 1 and threading.active_count() == before + 1  # it polled
    assert wait_until(lambda: dirlock._stranded == 0 and threading.active_count() == before, timeout=10)
    with dirlock.exclusive(str(tmp_path), "third", timeout=0.1) as present:
        assert present


def test_limit_events_wait_for_the_turns_lock_and_reap_goes_on(cgroup2_manager):
    """The audited counters live on the record: while its lock is held the events stay unaudited
    (a warning, no error) and `reap` still runs; the next look audits them."""
    from cgturn import Limits
    from conftest import wait_until

    mgr = cgroup2_manager
    if "pids" not in mgr.limits_report()["available"]:
        pytest.skip("needs a pids controller")
    turn = mgr.begin_turn("task", "turn", limits=Limits(pids_max=3))
    forks = turn.spawn(["sh", "-c", "for i in 1 2 3 4 5 6; do sleep 300 & done; wait"],
                       stderr=subprocess.DEVNULL)
    assert wait_until(lambda: turn.usage().pids_max_hits > 0, timeout=10)
    with holder([turn_dir(mgr, turn)], nobody=False) as got:
        assert got == ["locked"]
        assert bounded(turn.check_limits) == {"value": []}
        assert "error" not in bounded(mgr.recover)
    assert [r["reason"] for r in turn.check_limits()] == ["pids-max"]
    turn.abandon("test", grace=0)
    forks.wait(timeout=10)


# --- a lock taken in the middle of an operation: the operation ends cleanly --------------------------


def test_a_keyed_spawn_whose_key_cannot_be_recorded_kills_its_process(cgroup2_manager, monkeypatch):
    """The turn's lock taken between the spawn and the record of its key: the spawn fails with a clear
    LockTimeout naming the key, and the process it started does not run on unguarded."""
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    backend = mgr._control.backend
    real_spawn = backend.spawn
    spawned = []
    with contextlib.ExitStack() as hold:
        def spawn_then_lock(rec, argv, kwargs):
            proc = real_spawn(rec, argv, kwargs)
            spawned.append(proc)
            assert hold.enter_context(holder([turn_dir(mgr, turn)], nobody=False)) == ["locked"]
            return proc

        monkeypatch.setattr(backend, "spawn", spawn_then_lock)
        err = bounded(lambda: turn.spawn(SLEEP, key="server")).get("error")
        assert isinstance(err, LockTimeout) and "key 'server'" in str(err) and "killed" in str(err), err
        assert spawned and spawned[0].returncode == -9
        monkeypatch.undo()
    proc = turn.spawn(SLEEP, key="server")   # free again: the key was never held
    assert alive(proc.pid)
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)


def test_a_supervised_turn_that_cannot_be_completed_is_abandoned(cgroup2_manager):
    """The worker returns while another process holds the turn's lock: the completion fails, and the
    Supervisor abandons the turn (its kill needs no lock) instead of leaving it running unsupervised."""
    from cgturn import Supervisor

    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    proc = turn.spawn(SLEEP)
    with contextlib.ExitStack() as hold:
        def worker():
            assert hold.enter_context(holder([turn_dir(mgr, turn)], nobody=False)) == ["locked"]
            return "done"

        out = bounded(lambda: Supervisor(turn, grace=0, use_sentinel=False).run_blocking(worker))
    outcome = out.get("value")
    assert outcome is not None, out
    assert not outcome.completed and isinstance(outcome.error, LockTimeout), outcome
    assert proc.wait(timeout=10) == -9


def _failing_freeze(mgr, turn, hold, monkeypatch):
    """freeze_members that takes the turn's lock (another process) first; a freeze then fails as the
    kernel would refuse it, a thaw is carried out."""
    backend = mgr._control.backend
    real = backend.freeze_members

    def freeze_members(rec, frozen):
        if frozen:
            assert hold.enter_context(holder([turn_dir(mgr, turn)], nobody=False)) == ["locked"]
            raise KernelError("write", os.path.join(turn_dir(mgr, turn), "cgroup.freeze"), OSError(errno.EBUSY, "busy"))
        pids = real(rec, frozen)
        assert hold.enter_context(holder([turn_dir(mgr, turn)], nobody=False)) == ["locked"]
        return pids

    monkeypatch.setattr(backend, "freeze_members", freeze_members)


def test_a_failed_freeze_whose_mark_cannot_be_cleared_raises_its_own_error(cgroup2_manager, monkeypatch, caplog):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    with contextlib.ExitStack() as hold, caplog.at_level(logging.WARNING, logger="cgturn"):
        _failing_freeze(mgr, turn, hold, monkeypatch)
        err = bounded(turn.freeze).get("error")
        assert isinstance(err, KernelError), err          # the freeze's error, not the lock's
        assert "cannot clear the freeze mark of turn 'turn'" in caplog.text
    monkeypatch.undo()
    turn.thaw()     # sets the record right
    assert not turn.frozen
    turn.abandon("test", grace=0)


def test_a_thaw_whose_mark_cannot_be_cleared_still_thaws(cgroup2_manager, monkeypatch, caplog):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    proc = turn.spawn(SLEEP)
    turn.freeze()
    events = os.path.join(turn_dir(mgr, turn), "cgroup.events")
    with contextlib.ExitStack() as hold, caplog.at_level(logging.WARNING, logger="cgturn"):
        _failing_freeze(mgr, turn, hold, monkeypatch)
        out = bounded(turn.thaw)
        assert "error" not in out, out
        with open(events) as f:
            assert "frozen 0" in f.read().splitlines()
        assert "cannot clear the freeze mark of turn 'turn'" in caplog.text
    monkeypatch.undo()
    turn.thaw()
    assert not turn.frozen
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)


def test_cgturn_stop_prints_what_its_abandon_could_not_record(cgroup2_manager, cgroup2_root, state_dir):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("task", "turn")
    proc = turn.spawn(SLEEP)
    with holder([turn_dir(mgr, turn)], nobody=False) as got:
        assert got == ["locked"]
        out = cli(cgroup2_root, state_dir, "stop", "--grace", "0", "task", "turn")
    assert out.returncode == 0, out.stderr
    assert proc.wait(timeout=10) == -9
    assert "abandoned turn 'turn'" in out.stdout
    assert "cannot record the abandon: turn 'turn' of task 'task' was not marked abandoned" in out.stderr
