"""Turn.spawn's paths (cgturn/backends/spawn_paths.py): the native clone3(CLONE_INTO_CGROUP) path and the
shim, each forced in turn (the capability flag, as trio does), behave as subprocess.Popen for the options
they honour; the target is in its turn from its first act; spawns racing abandons never leave a target
running after the mark; threads spawning while others fork neither deadlock nor lose a child.
"""
from __future__ import annotations

import errno
import inspect
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from cgturn import NoSuchTurn
from cgturn.backends import spawn_paths
from cgturn.kernel import posix_spawn
from cgturn.kernel import spawn as kspawn
from cgturn.limits import Limits
from conftest import PY, force_spawn_path, turn_dir, v1_mirrors, wait_until

pytestmark = [pytest.mark.cgroup2, pytest.mark.root]

PATHS = [spawn_paths.CLONE3, spawn_paths.POSIX_SPAWN, spawn_paths.SHIM]
POPEN_CLASS = {spawn_paths.CLONE3: kspawn.CgroupPopen, spawn_paths.POSIX_SPAWN: posix_spawn.PosixSpawnPopen}


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Force one spawn path; a native path is skipped (with its reason) where it is not available."""
    force_spawn_path(monkeypatch, request.param)
    return request.param


@pytest.fixture
def turn(cgroup2_manager, path):
    return cgroup2_manager.begin_turn("native")


def took(proc, path) -> None:
    """The spawn went the forced way."""
    assert type(proc) is POPEN_CLASS.get(path, subprocess.Popen)


def cgroup_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("0::"))


def test_doctor_lists_the_paths_preferred_first():
    from cgturn.host import doctor_report

    paths = doctor_report()["spawn_paths"]
    assert paths == ["clone3"] * kspawn.clone3_built() + ["posix_spawn"] * posix_spawn.available() + ["shim"]


def test_each_choice_is_one_debug_line(turn, path, caplog):
    with caplog.at_level(logging.DEBUG, logger="cgturn"):
        turn.spawn(["true"]).wait(timeout=10)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("spawn path for turn")]
    assert len(lines) == 1 and lines[0].startswith(f"spawn path for turn {turn.turn_id!r}: {path} (")


# --- Popen behaviour, on every path ---------------------------------------------------------------

def test_first_act_is_in_the_turn_with_popen_attributes(cgroup2_manager, turn, path):
    argv = ["cat", "/proc/self/cgroup"]
    proc = turn.spawn(argv, stdout=subprocess.PIPE, text=True)
    took(proc, path)
    out, err = proc.communicate(timeout=10)
    assert (proc.returncode, err) == (0, None)
    if path != spawn_paths.SHIM:  # the shim's Popen shows the shim's argv
        assert proc.args == argv
    assert cgroup_line(out) == "0::" + turn_dir(cgroup2_manager, turn)[len(cgroup2_manager.backend.mount):]


def test_pipes_both_ways(turn, path):
    proc = turn.spawn(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    took(proc, path)
    assert proc.communicate(b"hello\n", timeout=10) == (b"hello\n", b"")
    proc = turn.spawn([PY, "-c", "import sys; sys.stderr.write('e')"], stderr=subprocess.STDOUT, stdout=subprocess.PIPE)
    assert proc.communicate(timeout=10) == (b"e", None)


def devnull_fds() -> int:
    """How many fds of this process are open on /dev/null."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == os.devnull
        except FileNotFoundError:  # the listing's own fd
            pass
    return count


def test_streams_given_every_way(turn, path, tmp_path):
    """DEVNULL, a pipe, a file, STDOUT and no stream at all, as Popen: the parent closes Popen's
    DEVNULL fd and the child's pipe ends once the child has them (EOF comes when it exits)."""
    held = devnull_fds()
    proc = turn.spawn([PY, "-c", "import sys; sys.stdout.write(sys.stdin.read() or 'empty'); sys.stderr.write('e')"],
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    took(proc, path)
    assert proc.communicate(timeout=10) == (b"empty", None)
    assert devnull_fds() == held
    assert turn.spawn(["true"], stdout=subprocess.DEVNULL).wait(timeout=10) == 0  # DEVNULL without a pipe
    assert devnull_fds() == held
    with open(tmp_path / "out", "wb") as out:
        proc = turn.spawn([PY, "-c", "import sys; print('to file'); sys.stderr.write('e')"], stdout=out,
                          stderr=subprocess.STDOUT)
        assert proc.wait(timeout=10) == 0
    assert (tmp_path / "out").read_bytes() == b"to file\ne"
    proc = turn.spawn(["true"])
    took(proc, path)
    assert (proc.stdin, proc.stdout, proc.stderr, proc.wait(timeout=10)) == (None, None, None, 0)


def test_argv_items_as_popen_takes_them(turn, path):
    """A path-like program, bytes and str arguments reach the target as Popen passes them; an
    embedded NUL raises Popen's ValueError and starts nothing."""
    import pathlib

    proc = turn.spawn([pathlib.Path(PY), b"-c", "import sys; print(sys.argv[1:])", b"bytes", "str"],
                      stdout=subprocess.PIPE)
    took(proc, path)
    assert proc.communicate(timeout=10) == (b"['bytes', 'str']\n", None)
    with pytest.raises(ValueError, match="embedded null byte"):
        turn.spawn(["echo", "a\0b"])
    with pytest.raises(ValueError, match="embedded null byte"):
        turn.spawn(["echo"], env={"A": "x\0y"})
    assert turn.pids() == []


def test_cwd_env_umask(turn, path, tmp_path):
    umask = {} if path == spawn_paths.POSIX_SPAWN else {"umask": 0o027}  # posix_spawn hands umask over
    proc = turn.spawn([PY, "-c", "import os; print(os.getcwd(), os.environ['X'], os.environ['CGTURN_TURN'], "
                       "oct(os.umask(0)))"], cwd=str(tmp_path), env={"X": "y", "PATH": os.environ["PATH"]},
                      stdout=subprocess.PIPE, text=True, **umask)
    took(proc, path)
    out = proc.communicate(timeout=10)[0].split()
    assert out[:3] == [str(tmp_path), "y", turn.record.turn_key]
    mine = os.umask(0o022)
    os.umask(mine)
    assert out[3] == ("0o27" if umask else oct(mine))


def test_inherited_environment_follows_os_environ(turn, path, monkeypatch):
    """Without env=, the child gets this process's environment as it is now, plus CGTURN_*, which
    win over variables of the same name."""
    code = "import os; print(os.environ.get('CGTURN_SPAWN_PROBE'), os.environ['CGTURN_TASK'])"
    monkeypatch.setenv("CGTURN_TASK", "not-this")
    for value in ("one", "two"):
        monkeypatch.setenv("CGTURN_SPAWN_PROBE", value)
        proc = turn.spawn([PY, "-c", code], stdout=subprocess.PIPE, text=True)
        took(proc, path)
        assert proc.communicate(timeout=10)[0].split() == [value, turn.record.task_key]
    monkeypatch.delenv("CGTURN_SPAWN_PROBE")
    proc = turn.spawn([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=10)[0].split() == ["None", turn.record.task_key]


def test_program_resolved_along_the_env_path_in_the_child(turn, path, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "cgturn-only-here"
    tool.write_text("#!/bin/sh\necho found\n")
    tool.chmod(0o755)
    proc = turn.spawn(["cgturn-only-here"], env={"PATH": f"/nonexistent:{bin_dir}"}, stdout=subprocess.PIPE)
    assert proc.communicate(timeout=10)[0] == b"found\n"


def test_pass_fds_and_close_fds(turn, path):
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    os.set_inheritable(r2, True)  # close_fds must close it anyway
    try:
        code = "import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"
        proc = turn.spawn([PY, "-c", code], pass_fds=(r1,), stdout=subprocess.PIPE, text=True)
        fds = set(eval(proc.communicate(timeout=10)[0]))
        assert r1 in fds and r2 not in fds and w1 not in fds
        if path == spawn_paths.CLONE3:  # the shim passes its gate, and Popen then closes the rest
            proc = turn.spawn([PY, "-c", code], close_fds=False, stdout=subprocess.PIPE, text=True)
            assert r2 in set(eval(proc.communicate(timeout=10)[0]))
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)


@pytest.mark.parametrize("option", ["start_new_session", "process_group"])
def test_session_and_process_group(turn, path, option):
    kwargs = {"start_new_session": True} if option == "start_new_session" else {"process_group": 0}
    proc = turn.spawn([PY, "-c", "import os; print(os.getpid(), os.getsid(0), os.getpgid(0))"],
                      stdout=subprocess.PIPE, text=True, **kwargs)
    took(proc, path)
    pid, sid, pgid = map(int, proc.communicate(timeout=10)[0].split())
    assert pid == proc.pid and pgid == pid
    assert (sid == pid) == (option == "start_new_session")


def test_exec_failures_raise_as_popen(turn, path, tmp_path):
    with pytest.raises(FileNotFoundError) as missing:
        turn.spawn(["cgturn-no-such-program"])
    assert (missing.value.errno, missing.value.filename) == (errno.ENOENT, "cgturn-no-such-program")
    plain = tmp_path / "plain"
    plain.write_text("x")
    with pytest.raises(PermissionError) as denied:
        turn.spawn([str(plain)])
    assert (denied.value.errno, denied.value.filename) == (errno.EACCES, str(plain))
    if path != spawn_paths.SHIM:  # the shim's parent-side resolution names the program, not cwd
        with pytest.raises(FileNotFoundError) as no_cwd:
            turn.spawn(["true"], cwd=str(tmp_path / "gone"))
        assert no_cwd.value.filename == str(tmp_path / "gone")


def test_exit_codes_and_signals(turn, path):
    assert turn.spawn(["sh", "-c", "exit 7"]).wait(timeout=10) == 7
    proc = turn.spawn(["sleep", "30"])
    took(proc, path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_signal_state_is_reset_in_the_child(turn, path):
    """Python's ignored SIGPIPE/SIGXFSZ and a handler of the caller's are default in the target."""
    old = signal.signal(signal.SIGUSR1, lambda *a: None)
    try:
        proc = turn.spawn(["grep", "-E", "^Sig(Ign|Cgt|Blk)", "/proc/self/status"], stdout=subprocess.PIPE, text=True)
        fields = dict(line.split(":\t") for line in proc.communicate(timeout=10)[0].splitlines())
    finally:
        signal.signal(signal.SIGUSR1, old)
    ignored, caught = int(fields["SigIgn"], 16), int(fields["SigCgt"], 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGUSR1):
        assert not ignored & (1 << (sig - 1)) and not caught & (1 << (sig - 1)), sig


# --- which path, and when the native one hands over ----------------------------------------------

def test_requests_the_native_path_cannot_honour_take_the_shim(cgroup2_manager, path):
    turn = cgroup2_manager.begin_turn("handover")
    proc = turn.spawn(["true"], preexec_fn=os.getpid)
    took(proc, spawn_paths.SHIM)
    assert proc.wait(timeout=10) == 0
    assert spawn_paths.choose(turn.record, {"stdout": subprocess.PIPE}) == path
    assert spawn_paths.choose(turn.record, {"stdout": None, "startupinfo": object()}) == spawn_paths.SHIM


def test_every_popen_keyword_is_in_the_table_of_spawn_options():
    """A keyword a new Python adds to Popen must be classified (which paths honour it, its default)
    instead of silently sending every spawn that uses it down the slower shim."""
    from cgturn.backends.spawn_options import SPAWN_OPTIONS

    params = inspect.signature(subprocess.Popen.__init__).parameters
    popen = {name: p.default for name, p in params.items() if name not in ("self", "args")}
    assert set(SPAWN_OPTIONS) == set(popen)
    assert {name: default for name, (_, default) in SPAWN_OPTIONS.items()} == popen


@pytest.mark.parametrize("native", [spawn_paths.CLONE3, spawn_paths.POSIX_SPAWN])
def test_the_table_decides_the_path_and_a_slower_choice_names_the_option(native, monkeypatch, caplog):
    """Every option, given at a value other than its default: the native path when the table says it
    honours it, else the shim with one debug line naming the option; at its default, the native path."""
    from cgturn.backends.spawn_options import SPAWN_OPTIONS
    from cgturn.model import TurnRecord

    for flag, value in spawn_paths.forced(native).items():
        monkeypatch.setattr(spawn_paths, flag, value)
    record = TurnRecord("t", "u", "t", "u")
    for name, (honoured, default) in SPAWN_OPTIONS.items():
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="cgturn"):
            way = spawn_paths.choose(record, {name: object()})
        assert way == (native if native in honoured else spawn_paths.SHIM), name
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("spawn path for turn")]
        assert (f"cannot honour {name})" in line) is (way == spawn_paths.SHIM), line
        assert spawn_paths.choose(record, {name: default}) == native, name


def test_a_frozen_turn_spawns_through_the_shim(cgroup2_manager, path):
    turn = cgroup2_manager.begin_turn("frozen")
    turn.freeze()
    try:
        proc = turn.spawn(["true"])  # a vfork child frozen before exec would block this call
        took(proc, spawn_paths.SHIM)
    finally:
        turn.thaw()
    assert proc.wait(timeout=10) == 0


def test_spawns_while_freezes_come_and_go_never_wait_for_a_thaw(cgroup2_manager, path):
    """A freeze is marked before cgroup.freeze is written, and a native spawn reads the mark under the
    turn's lock: spawns keep returning while the turn is frozen (through the shim), never holding
    their caller until the thaw (a vfork child cloned into a frozen cgroup would)."""
    turn = cgroup2_manager.begin_turn("freezes")
    procs, stop, errors = [], threading.Event(), []

    def spawner():
        try:
            while not stop.is_set():
                procs.append(turn.spawn(["true"]))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    worker = threading.Thread(target=spawner)
    worker.start()
    try:
        for _ in range(5):
            turn.freeze()
            try:
                count = len(procs)
                assert wait_until(lambda: len(procs) >= count + 3 or errors, timeout=20), \
                    "a spawn waited for the thaw"
            finally:
                turn.thaw()
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not worker.is_alive() and errors == []
    assert all(proc.wait(timeout=30) == 0 for proc in procs)


def test_a_turn_made_again_under_the_same_name_gets_the_spawn(cgroup2_manager, path):
    """The native path keeps the directory fd and record bytes of a turn between spawns; a turn
    removed and made again under the same ids is a new directory, and its spawns land there."""
    first = cgroup2_manager.begin_turn("again", "same")
    first.spawn(["true"]).wait(timeout=10)
    first.complete()
    assert not os.path.exists(turn_dir(cgroup2_manager, first))
    second = cgroup2_manager.begin_turn("again", "same")
    proc = second.spawn(["sleep", "30"])
    took(proc, path)
    with open(os.path.join(turn_dir(cgroup2_manager, second), "cgroup.procs")) as f:
        assert proc.pid in {int(line) for line in f}
    second.abandon("done", grace=0)
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_a_kernel_refusal_switches_to_the_shim(cgroup2_manager, path, monkeypatch):
    """ENOSYS from clone3 (an old kernel or a container's seccomp filter) cannot be produced here:
    the extension call (or the C library's posix_spawn) is replaced for this error branch only; the
    shim then runs for real."""
    if path == spawn_paths.SHIM:
        pytest.skip("the refusal is a native path's")

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    if path == spawn_paths.CLONE3:
        monkeypatch.setattr(kspawn, "_spawn", type("Refusing", (), {"spawn": staticmethod(refuse)}))
    else:
        monkeypatch.setattr(posix_spawn.libc, "spawn", refuse)
    turn = cgroup2_manager.begin_turn("refused")
    proc = turn.spawn(["cat", "/proc/self/cgroup"], stdout=subprocess.PIPE, text=True)
    took(proc, spawn_paths.SHIM)
    assert cgroup_line(proc.communicate(timeout=10)[0]).endswith("/" + turn.record.turn_key)
    assert spawn_paths.available() == ["shim"]


def test_posix_spawn_hands_over_what_it_cannot_honour(cgroup2_manager, path, tmp_path):
    """umask, pass_fds, a standard stream given as another one, a program looked up along env='s own
    PATH: the shim runs them, exactly."""
    if path != spawn_paths.POSIX_SPAWN:
        pytest.skip("posix_spawn's own limits")
    turn = cgroup2_manager.begin_turn("posix-limits")
    proc = turn.spawn(["sh", "-c", "umask"], umask=0o077, stdout=subprocess.PIPE, text=True)
    took(proc, spawn_paths.SHIM)
    assert proc.communicate(timeout=10)[0].strip() == "0077"
    r, w = os.pipe()
    try:
        proc = turn.spawn(["sh", "-c", f"test -e /proc/self/fd/{r}"], pass_fds=(r,))
        took(proc, spawn_paths.SHIM)
        assert proc.wait(timeout=10) == 0
    finally:
        os.close(r)
        os.close(w)
    proc = turn.spawn(["sh", "-c", "echo out >&2"], stderr=1, stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=10)[0] in ("out\n", "")  # fd 1 of this process, not the pipe
    took(proc, spawn_paths.SHIM)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cgturn-only-here").write_text("#!/bin/sh\necho found\n")
    (bin_dir / "cgturn-only-here").chmod(0o755)
    proc = turn.spawn(["cgturn-only-here"], env={"PATH": str(bin_dir)}, stdout=subprocess.PIPE, text=True)
    took(proc, spawn_paths.SHIM)
    assert proc.communicate(timeout=10)[0] == "found\n"


def test_v1_directories_are_joined_before_the_target(cgroup2_manager, path):
    report = cgroup2_manager.limits_report()
    if report["layout"] != "v1-hybrid" or "pids" not in report["available"]:
        pytest.skip(f"needs pids in a v1 hierarchy (a hybrid host); here: {report['layout']}")
    turn = cgroup2_manager.begin_turn("v1", limits=Limits(pids_max=20))
    assert turn.record.v1_dirs
    proc = turn.spawn(["cat", "/proc/self/cgroup"], stdout=subprocess.PIPE, text=True)
    took(proc, path)
    lines = dict(line.split(":", 1)[1].split(":", 1) for line in proc.communicate(timeout=10)[0].splitlines())
    want = v1_mirrors(cgroup2_manager.backend.root.path)["pids"]
    assert lines["pids"].endswith(f"/{turn.record.task_key}/{turn.record.turn_key}"), (lines["pids"], want)


# --- races and threads ----------------------------------------------------------------------------

def test_spawns_racing_abandons_never_outlive_the_mark(cgroup2_manager, path):
    """A spawner hammers a turn while it is abandoned: every spawn either raises NoSuchTurn or its
    process dies in the abandon; after the abandon returns, no spawn succeeds."""
    for round_ in range(15):
        turn = cgroup2_manager.begin_turn("race", f"r{round_}")
        started, stop, errors = [], threading.Event(), []

        def spawner():
            while not stop.is_set():
                try:
                    started.append(turn.spawn(["sleep", "30"]))
                except NoSuchTurn:
                    return
                except BaseException as err:  # noqa: BLE001 - reported below
                    errors.append(err)
                    return

        worker = threading.Thread(target=spawner)
        worker.start()
        assert wait_until(lambda: len(started) >= 1 + round_ % 4, timeout=10)
        turn.abandon("race", grace=0.0)
        stop.set()
        worker.join(timeout=20)
        assert not worker.is_alive() and errors == []
        with pytest.raises(NoSuchTurn):
            turn.spawn(["sleep", "30"])
        for proc in started:  # a target that ran after the kill would still be sleeping
            assert proc.wait(timeout=10) in (-signal.SIGKILL, -signal.SIGTERM)


# issue 16: 10,000 spawns from 8 threads while others fork, on every path; 1,000 on the test host,
# whose emulated CPU (TCG) is some 20 times slower
SPAWNS = 1_000 if os.environ.get("CGTURN_TESTHOST") == "1" else 10_000


# Python 3.12+ warns of os.fork in a threaded process: forking beside spawning threads is the point
FORK_WITH_THREADS = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")


@FORK_WITH_THREADS
def test_threads_spawning_while_others_fork(cgroup2_manager, path):
    """8 threads spawn `cat /proc/self/cgroup` in their own turns (SPAWNS in all) while 2 threads
    fork: no deadlock (bounded by a deadline), every child reports its own turn as its first act."""
    per_thread = SPAWNS // 8
    turns = [cgroup2_manager.begin_turn("threads", f"t{i}") for i in range(8)]
    mount = cgroup2_manager.backend.mount
    expected = ["0::" + turn_dir(cgroup2_manager, t)[len(mount):] for t in turns]
    done, bad, forks, spawned = threading.Event(), [], [0], [0] * 8

    def spawn_many(i):
        try:
            for _ in range(per_thread):
                proc = turns[i].spawn(["cat", "/proc/self/cgroup"], stdout=subprocess.PIPE, text=True)
                line = cgroup_line(proc.communicate(timeout=30)[0])
                if line != expected[i] or proc.returncode != 0:
                    bad.append((i, line, proc.returncode))
                spawned[i] += 1
        except BaseException as err:  # noqa: BLE001 - reported below
            bad.append((i, repr(err)))

    def fork_loop():
        while not done.is_set() and forks[0] < 20_000:
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            forks[0] += 1

    forkers = [threading.Thread(target=fork_loop) for _ in range(2)]
    spawners = [threading.Thread(target=spawn_many, args=(i,)) for i in range(8)]
    for t in forkers + spawners:
        t.start()
    deadline = time.monotonic() + 600
    for t in spawners:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    done.set()
    for t in forkers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in spawners + forkers), f"deadlock: threads not done; spawned {spawned}"
    assert bad == []
    assert sum(spawned) == SPAWNS and forks[0] > 0


@FORK_WITH_THREADS
def test_a_forked_child_does_not_keep_a_spawn_lock(cgroup2_manager, path):
    """os.fork in another thread while a spawn holds its shared lock: the child closes its copy, so
    an abandon (which takes the lock exclusively) is not held off by a long-lived forked child."""
    turn = cgroup2_manager.begin_turn("forked")
    children, stop = [], threading.Event()

    def forker():
        while not stop.is_set() and len(children) < 200:
            pid = os.fork()
            if pid == 0:
                # A long-lived Python child, as a worker pool makes. It closes the pipes it inherited:
                # a spawn's error pipe copied into it would hold that spawn until the child's exit
                # (CPython's fork-in-a-thread hazard, not the lock's), and by the abandon every child
                # would be gone. Every other fd stays open, a spawn lock's copy too unless cgturn
                # closed it.
                for fd in range(3, 1024):
                    try:
                        if stat.S_ISFIFO(os.fstat(fd).st_mode):
                            os.close(fd)
                    except OSError:
                        pass
                time.sleep(30)
                os._exit(0)
            children.append(pid)

    t = threading.Thread(target=forker)
    t.start()
    try:
        for _ in range(100):
            turn.spawn(["true"]).wait(timeout=10)
        stop.set()
        t.join(timeout=10)
        assert any(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in children), \
            "no forked child is alive at the abandon: the test would prove nothing"
        result = [None]
        abandoner = threading.Thread(target=lambda: result.__setitem__(0, turn.abandon("done", grace=0.0)))
        abandoner.start()
        abandoner.join(timeout=20)
        assert not abandoner.is_alive(), "an abandon waited for a forked child's copy of a spawn lock"
    finally:
        stop.set()
        for pid in children:  # this test's own children
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass  # reaped by the liveness check above


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
