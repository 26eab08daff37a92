"""What makes a small turn cheap (issue 26) keeps every promise: the owner keeps its emptied task
directory for its next turn, and nobody else does; a record this process wrote is reused only while
its bytes are on the directory; a record file is dropped by the xattr write that supersedes it; a
leaf turn's members are read without a walk; the caller's ancestors are kept only while none of them
has exited. Real kernel, real processes."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from conftest import PY, REPO, cgturn_env, turn_dir, wait_until
from cgturn import TurnManager
from cgturn.backends import cgroup2 as cgroup2_backend
from cgturn.backends.metadata import GENERATION_KEY, XATTR_KEY, MetadataStore
from cgturn.kernel import ancestry, procfs
from cgturn.kernel.cgroupfs import Cgroup


@pytest.fixture
def mgr(cgroup2_manager):
    return cgroup2_manager


def task_path(mgr, task: str) -> str:
    return os.path.join(mgr.root, task)


# --- the owner's task directory ----------------------------------------------------------------------

def test_the_owner_keeps_its_emptied_task_directory_for_its_next_turn_until_close(mgr):
    first = mgr.begin_turn("chat", "1")
    first_dir = turn_dir(mgr, first)
    assert first.complete() is True
    assert not os.path.exists(first_dir)  # the turn's own cgroup goes with its complete
    kept = os.stat(task_path(mgr, "chat")).st_ino  # its task directory stays for the owner
    second = mgr.begin_turn("chat", "2")
    assert os.stat(task_path(mgr, "chat")).st_ino == kept  # the next turn made no task directory
    second.spawn(["true"]).wait(timeout=30)
    assert second.complete() is True
    mgr.close()
    assert not os.path.exists(task_path(mgr, "chat"))


OTHER_ABANDON = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from cgturn import TurnManager
    mgr = TurnManager(root=sys.argv[2], backend="cgroup2", state_dir=sys.argv[3], sentinel=False)
    mgr.turn("chat", "stopped").abandon("elsewhere", grace=0)
    print(os.path.exists(os.path.join(sys.argv[2], "chat")))  # before its manager closes
    mgr.close()
""")


def test_a_turn_someone_else_ends_takes_its_task_directory_with_it_at_once(mgr, cgroup2_root, state_dir):
    """Another process (a sentinel, `cgturn stop`, a gateway's peer) that ends a turn is not its owner:
    it keeps nothing, not even until its own manager closes."""
    turn = mgr.begin_turn("chat", "stopped")
    proc = turn.spawn(["sleep", "300"])
    out = subprocess.run([PY, "-c", OTHER_ABANDON, REPO, cgroup2_root, state_dir], capture_output=True, text=True,
                         timeout=60, env=cgturn_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
    proc.wait(timeout=30)
    assert not os.path.exists(task_path(mgr, "chat"))


def test_end_task_and_another_managers_reap_remove_a_kept_task_directory(mgr, cgroup2_root, state_dir):
    mgr.begin_turn("ended", "1").complete()
    mgr.begin_turn("reaped", "1").complete()
    assert os.path.isdir(task_path(mgr, "ended")) and os.path.isdir(task_path(mgr, "reaped"))
    mgr.end_task("ended")
    assert not os.path.exists(task_path(mgr, "ended"))
    other = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
    try:
        other.reap()  # an empty task without limits is reap's to remove, whoever kept it
    finally:
        other.close()
    assert not os.path.exists(task_path(mgr, "reaped"))
    again = mgr.begin_turn("reaped", "2")  # the owner finds its kept directory gone and makes it again
    again.spawn(["true"]).wait(timeout=30)
    assert again.complete() is True


def test_past_kept_tasks_max_the_least_recently_emptied_task_directory_goes(mgr, monkeypatch):
    monkeypatch.setattr(cgroup2_backend, "KEPT_TASKS_MAX", 2)
    for task in ("a", "b", "c"):
        mgr.begin_turn(task, "1").complete()
    assert not os.path.exists(task_path(mgr, "a"))
    assert os.path.isdir(task_path(mgr, "b")) and os.path.isdir(task_path(mgr, "c"))


# --- records ---------------------------------------------------------------------------------------------

def test_a_record_written_meanwhile_by_another_writer_is_read_not_the_remembered_one(mgr):
    turn = mgr.begin_turn("rec", "1")
    path = turn_dir(mgr, turn)
    other = json.loads(os.getxattr(path, XATTR_KEY))
    other.update(state="abandoned", reason="elsewhere")  # another process's abandon, as it writes it
    os.setxattr(path, XATTR_KEY, json.dumps(other).encode())
    assert turn.complete() is False  # the bytes changed: the record is read from them, abandoned
    assert turn.state == "abandoned"
    turn.abandon("cleanup", grace=0, force=True)


def test_a_record_file_goes_with_the_xattr_write_that_supersedes_it(cgroup2_root, state_dir):
    """A record too large for an xattr (E2BIG: values over 64 KiB, XATTR_SIZE_MAX) goes to a file; the
    next, smaller one goes back to the xattr and removes the file, so no file outlives its turn."""
    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
    try:
        turn = mgr.begin_turn("big", "1")
        cg = Cgroup(turn_dir(mgr, turn))
        store: MetadataStore = mgr.backend.meta
        rec = store.load(cg)
        rec.keys = json.dumps({"k" * 70_000: [1, 1]})
        store.save(cg, rec)
        record_file = store._file(cg)
        assert os.path.isfile(record_file) and cg.get_xattr(XATTR_KEY) is None
        reread = MetadataStore(state_dir).load(cg)  # another process's store reads the file
        assert reread is not None and reread.keys == rec.keys
        won, after = mgr.backend.transition("big", "1", {"running"}, "running", {"keys": None})
        assert won and after is not None and after.keys is None
        assert cg.get_xattr(XATTR_KEY) is not None and not os.path.exists(record_file)
        assert turn.complete() is True and not os.path.exists(record_file)
    finally:
        mgr.close()


# --- completion: the removal is the check ----------------------------------------------------------------

def _generation(mgr, task: str) -> bytes:
    return os.getxattr(task_path(mgr, task), GENERATION_KEY)


def test_a_completion_that_removes_its_turn_leaves_the_task_stamp_alone(mgr, cgroup2_root, state_dir):
    """The generation stamp tells other processes' listings that a record changed; a completion whose
    rmdir removes the turn owes none (its directory is gone from every later listing), and one that
    leaves survivors pays it, so a listing that kept the task's parsed records reads the new state."""
    first = mgr.begin_turn("stamp", "1")  # a new task directory: its first record stamps it
    stamped = _generation(mgr, "stamp")
    assert first.complete() is True and not os.path.exists(turn_dir(mgr, first))
    assert _generation(mgr, "stamp") == stamped

    lister = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    try:
        second = mgr.begin_turn("stamp", "2")
        proc = second.spawn(["sleep", "300"])
        assert [i.state for i in lister.turns("stamp")] == ["running"]  # parsed under the stamp read
        assert second.complete() is True  # its sleep survives: the turn stays, completed
        assert os.path.isdir(turn_dir(mgr, second)) and _generation(mgr, "stamp") != stamped
        assert [(i.state, i.pids) for i in lister.turns("stamp")] == [("completed", [proc.pid])]
        second.abandon("cleanup", grace=0, force=True)
        proc.wait(timeout=30)
    finally:
        lister.close()


def test_a_completion_that_cannot_remove_its_turn_stamps_the_task(mgr, monkeypatch):
    """The stamp a completion left to the removal is paid whatever stops the rmdir: processes, or an
    error (the turn stays, and listings must see it completed)."""
    turn = mgr.begin_turn("stuck", "1")
    mgr.begin_turn("stuck", "other")  # the task stays
    stamped = _generation(mgr, "stuck")

    def refused(self) -> bool:
        raise PermissionError(13, "refused", self.path)

    monkeypatch.setattr(Cgroup, "remove_if_empty", refused)
    with pytest.raises(PermissionError):
        turn.complete()
    monkeypatch.undo()
    assert _generation(mgr, "stuck") != stamped
    assert turn.state == "completed" and os.path.isdir(turn_dir(mgr, turn))


# --- members -----------------------------------------------------------------------------------------------

def test_members_below_a_sub_cgroup_of_a_turn_are_listed_and_killed(mgr):
    turn = mgr.begin_turn("nested", "1")
    inner = os.path.join(turn_dir(mgr, turn), "inner")
    proc = turn.spawn(["sh", "-c", f"mkdir {inner} && echo $$ > {inner}/cgroup.procs && exec sleep 300"])
    assert wait_until(lambda: os.path.exists(inner) and Cgroup(inner).procs() == [proc.pid], timeout=30)
    assert turn.pids() == [proc.pid]  # the link count says "not a leaf": the walk finds it
    result = turn.abandon("test", grace=0)
    assert result.killed == [proc.pid]
    proc.wait(timeout=30)


# --- the caller's ancestors --------------------------------------------------------------------------------

CHAIN = textwrap.dedent("""
    import json, os, select, sys
    sys.path.insert(0, sys.argv[1])
    from cgturn.kernel import procfs
    out = int(sys.argv[2])
    top = os.getpid()
    procfs.ancestors(top)  # the top process pins its own chain before it forks
    ready_r, ready_w = os.pipe()
    if os.fork():
        os.close(ready_w)
        os.read(ready_r, 1)  # until the grandchild has pinned its chain
        os._exit(0)  # then the top process exits: its child is re-parented, its grandchild is not
    middle = os.getpid()
    if os.fork():
        os.wait()
        os._exit(0)
    first = sorted(procfs.ancestors(os.getpid()))
    top_fd = os.pidfd_open(top)
    os.write(ready_w, b"x")
    select.select([top_fd], [], [], 30)  # until the top process has exited
    after = sorted(procfs.ancestors(os.getpid()))
    os.write(out, json.dumps({"top": top, "middle": middle, "first": first, "after": after,
                              "ppid": os.getppid()}).encode())
    os._exit(0)
""")


def test_a_kept_ancestry_is_walked_again_when_an_ancestor_above_the_parent_exits():
    """The grandchild's parent stays the same (getppid unchanged): only the pidfd of the exited
    grandparent can tell its reading that the chain changed."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([PY, "-c", CHAIN, REPO, str(w)], pass_fds=(w,), env=cgturn_env())
        os.close(w)
        w = -1
        assert proc.wait(timeout=60) == 0
        chunks = []
        while True:  # until the grandchild has written and exited (it holds the pipe's other end)
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        seen = json.loads(b"".join(chunks))
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert seen["ppid"] == seen["middle"]
    assert {seen["top"], seen["middle"]} <= set(seen["first"])  # a forked child walks its own chain
    assert seen["middle"] in seen["after"] and seen["top"] not in seen["after"]


def test_the_callers_ancestry_is_pinned_by_pidfds_and_reused_while_it_holds():
    me = os.getpid()
    ancestry.forget()
    first = procfs.ancestors(me)
    pinned = ancestry._PINNED
    assert pinned is not None and pinned.me == me and set(pinned.pids) == first
    assert os.getppid() in first and 1 in first
    assert procfs.ancestors(me) == first and ancestry._PINNED is pinned  # no walk: the same reading
    assert pinned.fds and all(os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]" for fd in pinned.fds)


def test_an_abandons_mark_is_stamped_right_after_its_first_signal(mgr, monkeypatch):
    """The kill follows the mark at once, so the task's stamp waits for it (what a listing made in
    between sees is the turn as it was just before); it is paid whether the turn goes or stays."""
    from cgturn.kernel.cgroupfs import Cgroup as KernelCgroup

    mgr.begin_turn("marks", "other")  # the task stays
    seen_at_kill: list[bytes] = []
    real_kill = KernelCgroup.kill
    monkeypatch.setattr(KernelCgroup, "kill", lambda self: seen_at_kill.append(_generation(mgr, "marks"))
                        or real_kill(self))
    stamps = []
    for grace in (0.0, 0.2):  # SIGKILL at once; SIGTERM first (a sleep dies of it: no cgroup.kill)
        turn = mgr.begin_turn("marks", f"grace-{grace}")
        proc = turn.spawn(["sleep", "300"])
        assert wait_until(lambda: turn.pids() == [proc.pid])
        stamps.append(_generation(mgr, "marks"))
        result = turn.abandon("test", grace=grace)
        proc.wait(timeout=30)
        assert result.killed == [proc.pid] and _generation(mgr, "marks") != stamps[-1]
    assert seen_at_kill == [stamps[0]]  # the mark was written, its stamp not yet: the kill came first
    assert mgr.backend._unstamped == set()  # nothing owed is left behind
