"""Issue 9's correctness faults, each proven on the real kernel with real processes:

- read-only commands create nothing (no managed root, no state dir, no gate directory) and never race
  a gateway's begin_turn;
- "gone" and "not allowed to look" are different answers (hidepid=1 /proc, unprivileged reap);
- the pytest plugin with a CGTURN_ROOT that does not exist yet;
- Turn.adopt refuses what must never move.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import struct
import subprocess
import tempfile
import textwrap
import threading
import uuid

import pytest

from cgturn import errors
from cgturn.kernel import procfs
from conftest import CGROUP2_MOUNT, PY, alive, destroy_cgroup_tree, need_cgroup2, wait_until

NOBODY = 65534
# Above PID_MAX_LIMIT (4194304, include/linux/threads.h): no process can ever have this pid.
NO_SUCH_PID = 4194305
READ_ONLY = [["ps"], ["ps", "--json"], ["doctor", "--json"], ["watch", "--once"], ["metrics", "--once"]]


def cgturn_cmd(*args, root=None, state=None, backend=None) -> list[str]:
    argv = [PY, "-m", "cgturn"]
    for flag, value in (("--root", root), ("--state-dir", state), ("--backend", backend)):
        if value is not None:
            argv += [flag, value]
    return argv + list(args)


def run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=60, **kw)


# --- 1. read-only commands create nothing ------------------------------------------------------------

@contextlib.contextmanager
def names_created_in(path: str):
    """The names of entries created directly in `path` while the block runs (inotify IN_CREATE: a
    directory made and removed again in between is seen too)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    names: list[str] = []
    try:
        assert libc.inotify_add_watch(fd, path.encode(), 0x100) >= 0, os.strerror(ctypes.get_errno())
        yield names
        while True:
            try:
                buf = os.read(fd, 65536)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(buf):  # struct inotify_event: wd, mask, cookie, len, name[len]
                _, _, _, size = struct.unpack_from("iIII", buf, offset)
                names.append(buf[offset + 16:offset + 16 + size].rstrip(b"\0").decode())
                offset += 16 + size
    finally:
        os.close(fd)


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_read_only_commands_create_nothing_on_cgroup2(cgroup2_root, tmp_path, command):
    state = str(tmp_path / "state")
    # A private /dev/shm: whatever the command creates there is seen exactly, whoever else runs.
    script = 'mount -t tmpfs cgturn-shm /dev/shm && "$@"; rc=$?; ls -A /dev/shm >&2; exit $rc'
    with names_created_in(os.path.dirname(cgroup2_root)) as created:
        proc = run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                    *cgturn_cmd(*command, root=cgroup2_root, state=state, backend="cgroup2")])
    assert proc.returncode == 0, proc.stderr
    assert os.path.basename(cgroup2_root) not in created  # not even made and removed again
    assert not os.path.exists(cgroup2_root)
    assert not os.path.exists(state)
    assert proc.stderr.split() == [], proc.stderr  # nothing made under /dev/shm


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_read_only_commands_create_nothing_on_the_registry(tmp_path, command):
    state = str(tmp_path / "state")
    proc = run(cgturn_cmd(*command, state=state, backend="registry"))
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(state)


def test_ps_in_a_loop_never_breaks_a_gateways_begin_turn(cgroup2_root, state_dir):
    """The managed root does not exist while `ps` loops; the gateway's begin_turn creates it (and
    removes it again each round): a probe that mkdirs/rmdirs the root would make some of them fail."""
    from cgturn import TurnManager

    stop = threading.Event()
    rounds = []

    def ps_loop():
        while not stop.is_set():
            rounds.append(run(cgturn_cmd("ps", "--json", root=cgroup2_root, state=state_dir,
                                         backend="cgroup2")).returncode)

    looper = threading.Thread(target=ps_loop)
    looper.start()
    failures = []
    try:
        mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
        # Bounded in count; the loop goes on until at least a few ps runs overlapped it.
        for i in range(200):
            if i >= 50 and len(rounds) >= 3:
                break
            try:
                turn = mgr.begin_turn(f"task{i}", "t")
            except errors.CgturnError as err:
                failures.append(repr(err))
                continue
            turn.complete()
            mgr.remove_root()
        mgr.close()
    finally:
        stop.set()
        looper.join()
    assert failures == []
    assert rounds and set(rounds) == {0}


# --- 2. gone vs not allowed to look ------------------------------------------------------------------

HIDEPID = "mount -t proc -o hidepid=1 proc /proc && exec \"$@\""
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def in_hidepid_as_nobody(argv) -> subprocess.CompletedProcess:
    """Run `argv` as uid 65534 in a private mount namespace whose /proc has hidepid=1: other users'
    /proc/PID files give EPERM/EACCES while the processes exist."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}
    return run(["unshare", "--mount", "--propagation", "private", "sh", "-c", HIDEPID, "sh",
                *AS_NOBODY, *argv], env=env)


def need_nobody_can_import():
    probe = run([*AS_NOBODY, PY, "-c", "import cgturn"],
                env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())})
    if probe.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot import cgturn here: {probe.stderr.strip()[-200:]}")


def test_procfs_tells_gone_from_not_allowed_to_look():
    need_nobody_can_import()
    code = textwrap.dedent(f"""
        from cgturn.errors import AccessDenied, NoSuchProcess
        from cgturn.kernel import procfs
        out = []
        for pid in (1, {NO_SUCH_PID}):
            try:
                procfs.ProcFS().stat(pid)
                out.append("read")
            except (AccessDenied, NoSuchProcess) as err:
                out.append(type(err).__name__)
        try:
            out.append(str(procfs.is_alive(1, 0)))
        except AccessDenied:
            out.append("AccessDenied")
        out.append(str(procfs.stat({NO_SUCH_PID})))
        print(" ".join(out))
    """)
    proc = in_hidepid_as_nobody([PY, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["AccessDenied", "NoSuchProcess", "AccessDenied", "None"]


OWNER = textwrap.dedent("""
    import sys
    from cgturn import TurnManager
    mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2], sentinel=False)
    turn = mgr.begin_turn("task", "turn")
    p = turn.spawn(["sleep", "300"])
    print(p.pid, flush=True)
    sys.stdin.read()   # lives until the test closes our stdin
""")


def chown_tree(path: str, uid: int) -> None:
    for top, dirs, files in os.walk(path):
        os.chown(top, uid, uid)
        for name in files:
            try:
                os.chown(os.path.join(top, name), uid, uid)
            except OSError:
                pass  # interface files the kernel does not let anyone own


def test_unprivileged_reap_leaves_a_turn_whose_owner_it_cannot_see(cgroup2_root):
    need_nobody_can_import()
    state = tempfile.mkdtemp(prefix="cgturn-test-state-")
    owner = subprocess.Popen([PY, "-c", OWNER, cgroup2_root, state], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        sleeper = int(owner.stdout.readline())
        chown_tree(cgroup2_root, NOBODY)
        chown_tree(state, NOBODY)
        proc = in_hidepid_as_nobody(cgturn_cmd("reap", "--json", root=cgroup2_root, state=state,
                                               backend="cgroup2"))
        assert proc.returncode == 0, proc.stderr
        actions = json.loads(proc.stdout)
        assert [(a["action"], a["task"], a["turn"]) for a in actions] == [("owner-unknown", "task", "turn")]
        assert alive(sleeper)
        assert os.path.isdir(os.path.join(cgroup2_root, "task", "turn"))
    finally:
        owner.stdin.close()
        owner.wait(30)
        shutil.rmtree(state, ignore_errors=True)


# --- 3. the pytest plugin with a CGTURN_ROOT that does not exist yet -----------------------------------

INNER_TESTS = textwrap.dedent("""
    import os, subprocess

    def where():
        return open("/proc/self/cgroup").read().strip().split("::", 1)[1]

    def test_runs_in_a_turn_below_cgturn_root():
        root = os.environ["CGTURN_ROOT"]
        rel = "/" + os.path.relpath(root, os.environ["CGTURN_TEST_MOUNT"])
        assert where().startswith(rel + "/cgturn-pytest-"), where()

    def test_children_too():
        out = subprocess.run(["cat", "/proc/self/cgroup"], capture_output=True, text=True).stdout
        assert "/cgturn-pytest-" in out, out
""")


def inner_pytest(tmp_path, root, backend):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "test_inner.py").write_text(INNER_TESTS)
    env = {**os.environ, "CGTURN_ROOT": root, "CGTURN_BACKEND": backend, "CGTURN_TEST_MOUNT": CGROUP2_MOUNT or "",
           "CGTURN_STATE_DIR": str(tmp_path / "state")}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    return run([PY, "-m", "pytest", "-p", "no:cacheprovider", "--cgturn", "-q",
                "--rootdir", str(work), str(work / "test_inner.py")], cwd=work, env=env)


def test_plugin_creates_a_missing_cgturn_root_runs_in_turns_and_removes_it(cgroup2_root, tmp_path):
    os.mkdir(cgroup2_root)
    root = os.path.join(cgroup2_root, "sub")
    proc = inner_pytest(tmp_path, root, "cgroup2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
    assert not os.path.exists(root)


@pytest.mark.parametrize("backend", ["cgroup2", "auto"])
@pytest.mark.parametrize("shape", ["parent-missing", "relative"])
def test_plugin_with_an_unusable_cgturn_root_is_one_usage_error(cgroup2_root, tmp_path, backend, shape):
    root = os.path.join(cgroup2_root, "sub") if shape == "parent-missing" else "cgturn-relative/sub"
    proc = inner_pytest(tmp_path, root, backend)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out
    assert "KeyError" not in out and "Traceback" not in out, out
    assert [line for line in out.splitlines() if "cgturn plugin" in line and root in line] != [], out
    assert "passed" not in out
    assert not os.path.exists(cgroup2_root)


# --- 4. Turn.adopt refusals --------------------------------------------------------------------------

ADOPT_PID1 = textwrap.dedent("""
    import os, sys
    from cgturn import TurnManager
    assert os.getpid() == 1
    before = open("/proc/1/cgroup").read()
    mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2], sentinel=False)
    turn = mgr.begin_turn("task", "turn")
    try:
        turn.adopt(1)
        print("adopted")
    except Exception as err:
        print(type(err).__name__)
    print("same" if open("/proc/1/cgroup").read() == before else "moved")
""")


def test_adopt_refuses_pid_1_in_a_private_pid_namespace(cgroup2_root, state_dir):
    proc = run(["unshare", "--pid", "--fork", "--mount-proc", PY, "-c", ADOPT_PID1, cgroup2_root, state_dir])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["UnsafeOperation", "same"]


def test_adopt_refuses_the_caller(manager):
    turn = manager.begin_turn("task", "turn")
    with pytest.raises(errors.UnsafeOperation, match="calling process"):
        turn.adopt(os.getpid())
    assert os.getpid() not in turn.pids()
    assert turn.abandon("test", grace=0).skipped is False


ADOPT_PARENT = textwrap.dedent("""
    import os, sys
    from cgturn import TurnManager
    root = sys.argv[1] or None
    mgr = TurnManager(root=root, backend=sys.argv[2], state_dir=sys.argv[3], sentinel=False)
    turn = mgr.begin_turn("task", "turn")
    try:
        turn.adopt(os.getppid())
        print("adopted")
    except Exception as err:
        print(type(err).__name__)
    turn.abandon("test", grace=0)
    print("abandoned", flush=True)
""")


@pytest.mark.parametrize("backend", ["cgroup2", "registry"])
def test_adopt_refuses_the_callers_parent(cgroup2_root, state_dir, backend):
    """The parent is a shell this test started; the child adopts it and abandons: refused, it lives."""
    if backend == "cgroup2":
        need_cgroup2()
    root = cgroup2_root if backend == "cgroup2" else ""
    wrapper = subprocess.Popen(["sh", "-c", '"$@"; exec sleep 300', "sh", PY, "-c", ADOPT_PARENT, root,
                                backend, state_dir], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert wrapper.stdout.readline().split() == ["UnsafeOperation"]
        assert wrapper.stdout.readline().split() == ["abandoned"]
        # The wrapper outlived the abandon: it goes on to exec sleep (same pid).
        assert wait_until(lambda: procfs.cmdline(wrapper.pid).startswith("sleep"), 10)
        assert wrapper.poll() is None
    finally:
        wrapper.kill()
        wrapper.wait()


KTHREADD = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 5 0 0 20 0 1 0 6 0 0 18446744073709551615"
KWORKER = "57 (kworker/0:1-events) I 2 0 0 0 -1 69238880 0 0 0 0 0 12 0 0 20 0 1 0 40 0 0 0"
USER = "900 (sleep) S 1 900 900 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 4000 8 0 1"
INIT = "1 (init) S 0 1 1 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 3 8 0 1"


def fake_procfs(root, lines: dict[int, str]) -> procfs.ProcFS:
    """A directory laid out like /proc holding `<pid>/stat` for each line: a root to inject."""
    for pid, line in lines.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(line + "\n")
    return procfs.ProcFS(str(root))


def test_kernel_thread_predicate_on_stat_files_of_an_injected_procfs(tmp_path):
    proc = fake_procfs(tmp_path, {1: INIT, 2: KTHREADD, 57: KWORKER, 900: USER, 901: "901 (trunc"})
    stats = [procfs.stat(pid, proc) for pid in (2, 57, 900)]
    assert [procfs.is_kernel_thread(st) for st in stats] == [True, True, False]
    assert procfs.stat(901, proc) is None and procfs.stat(902, proc) is None  # torn down; gone
    assert procfs.ancestors(900, proc) == {1} and sorted(procfs.all_pids(proc)) == [1, 2, 57, 900, 901]
    assert procfs.is_alive(900, 4000, proc) and not procfs.is_alive(900, 4001, proc)
    assert procfs.alive_or_unknown(900, 4000, proc) and not procfs.alive_or_unknown(902, 1, proc)


# Run in a mount namespace of its own (unshare --mount): the stat file of the test's child is replaced
# there by one that names kthreadd (pid 2) as its parent, so adopt's real /proc read sees a kernel
# thread. Nothing is patched; the child itself is never touched.
ADOPT_KTHREAD = textwrap.dedent("""
    import subprocess, sys
    from cgturn import TurnManager
    root, backend, state_dir, pid, fake = sys.argv[1] or None, sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    subprocess.run(["mount", "--bind", fake, f"/proc/{pid}/stat"], check=True)
    mgr = TurnManager(root=root, backend=backend, state_dir=state_dir, sentinel=False)
    turn = mgr.begin_turn("task", "turn")
    try:
        turn.adopt(pid)
        print("adopted")
    except Exception as err:
        print(type(err).__name__, err)
    print(turn.pids())
    turn.abandon("test", grace=0)
""")


def test_adopt_refuses_what_reads_as_a_kernel_thread(manager, bystanders, tmp_path):
    """adopt's kernel-thread branch, driven by our own child's stat file made to name kthreadd as its
    parent in a private mount namespace (a real kernel thread is never adopted by a test)."""
    child = bystanders()
    real = open(f"/proc/{child.pid}/stat").read()
    head, _, rest = real.rpartition(") ")
    fields = rest.split()
    fields[1] = "2"  # ppid: kthreadd
    fake = tmp_path / "stat"
    fake.write_text(f"{head}) {' '.join(fields)}\n")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", PY, "-c", ADOPT_KTHREAD,
                          manager.root or "", manager.backend_name, manager.state_dir, str(child.pid), str(fake)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    verdict, pids = out.stdout.splitlines()
    assert verdict.startswith("UnsafeOperation") and "kernel thread" in verdict
    assert pids == "[]"
    assert child.poll() is None and procfs.stat(child.pid).ppid == os.getpid()  # untouched, outside


def test_adopt_refuses_a_process_of_another_tasks_turn(manager):
    other = manager.begin_turn("other", "turn")
    p = other.spawn(["sleep", "300"])
    turn = manager.begin_turn("task", "turn")
    with pytest.raises(errors.UnsafeOperation, match="another task"):
        turn.adopt(p.pid)
    assert other.pids() == [p.pid] and turn.pids() == []
    other.abandon("test", grace=0)
    assert p.wait(10) == -9


def test_adopt_refuses_a_process_of_another_managers_turn(cgroup2_manager, tmp_path):
    from cgturn import TurnManager

    other_root = os.path.join(need_cgroup2(), f"cgturn-test-{uuid.uuid4().hex[:10]}")
    try:
        other = TurnManager(root=other_root, backend="cgroup2", state_dir=str(tmp_path / "other"))
        theirs = other.begin_turn("task", "turn")
        p = theirs.spawn(["sleep", "300"])
        turn = cgroup2_manager.begin_turn("task", "turn")
        with pytest.raises(errors.UnsafeOperation, match="another manager"):
            turn.adopt(p.pid)
        assert theirs.pids() == [p.pid] and turn.pids() == []
        theirs.abandon("test", grace=0)
        assert p.wait(10) == -9
        other.close()
    finally:
        destroy_cgroup_tree(other_root)


def test_adopt_of_a_pid_that_does_not_exist_is_no_such_process(manager):
    turn = manager.begin_turn("task", "turn")
    with pytest.raises(errors.NoSuchProcess):
        turn.adopt(NO_SUCH_PID)
    assert turn.pids() == []
