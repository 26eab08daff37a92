"""The short paths of small turns and of `cgturn run`'s start, and that each keeps its promise: an abandon
reads the protected processes once and still refuses to kill them; the C library is found without
running ldconfig; a one-thread owner's sentinel is forked (no second interpreter), a threaded owner's
is exec'd, and either one abandons the turns of an owner that dies."""
import json
import os
import signal
import subprocess
import textwrap
import threading
import time
from dataclasses import replace

import pytest

from cgturn import TurnManager
from cgturn.backends.cgroup2_killer import CgroupKiller
from cgturn.errors import UnsafeOperation
from cgturn.kernel import ancestry, procfs
from cgturn.kernel.cgroupfs import Cgroup
from cgturn.sentinel_start import SENTINEL_NAME
from conftest import PY, alive, cgturn_env, wait_until

BOUND = 20.0  # a bound on a wait, not a measurement


def test_one_reading_of_the_protected_processes_serves_a_whole_kill():
    with procfs.protected_once():
        first = procfs.protected()
        assert procfs.protected() is first and os.getpid() in first.pids and 1 in first.pids
        with procfs.protected_once():  # a kill path below an abandon shares the abandon's reading
            assert procfs.protected() is first
        procfs.reread_protected()  # after a wait: a new reading
        assert procfs.protected() is not first and procfs.protected().pids == first.pids
    assert procfs.protected() is not procfs.protected()  # outside one: read at every question


def test_an_abandon_reads_the_callers_ancestry_once(cgroup2_manager, monkeypatch):
    turn = cgroup2_manager.begin_turn("fast", "one")
    proc = turn.spawn(["sleep", "300"])
    assert wait_until(lambda: turn.pids() == [proc.pid])
    reads = []
    real = procfs.ancestors
    monkeypatch.setattr(procfs, "ancestors", lambda pid, *a: reads.append(pid) or real(pid, *a))
    result = turn.abandon("test", grace=0)
    proc.wait(timeout=BOUND)
    assert result.killed == [proc.pid] and reads == [os.getpid()]


def test_the_callers_ancestry_is_walked_without_its_own_or_pid_1s_stat(monkeypatch):
    """getppid(2) gives the first step and PID 1 ends the walk: neither /proc/self/stat nor
    /proc/1/stat is read, and the answer is the full walk's."""
    def full_walk(pid: int) -> set[int]:
        out: set[int] = set()
        while (ppid := procfs.HOST.stat(pid).ppid) > 0:
            out.add(ppid)
            pid = ppid
        return out

    expected = full_walk(os.getpid())
    ancestry.forget()  # a reading kept by an earlier test (kernel/ancestry.py) would need no read at all
    read: list[str] = []
    real = procfs.ProcFS.read
    monkeypatch.setattr(procfs.ProcFS, "read", lambda self, pid, what, whole=False:
                        read.append(f"{pid}/{what}") or real(self, pid, what, whole))
    assert procfs.ancestors(os.getpid()) == expected and 1 in expected
    assert f"{os.getpid()}/stat" not in read and "1/stat" not in read
    assert len(read) == len(expected) - 1  # one stat read per ancestor but PID 1
    assert procfs.ancestors(os.getpid()) == expected and len(read) == len(expected) - 1  # kept: no second walk


def test_an_abandon_reads_the_record_once_under_the_lock(cgroup2_manager, monkeypatch):
    """The refusal is answered from the cgroup's member list: the only record read is the mark's."""
    turn = cgroup2_manager.begin_turn("fast", "read-once")
    proc = turn.spawn(["sleep", "300"])
    assert wait_until(lambda: turn.pids() == [proc.pid])
    meta = cgroup2_manager.backend.meta
    loads: list[str] = []
    real = meta.load
    monkeypatch.setattr(meta, "load", lambda cg: loads.append(cg.path) or real(cg))
    result = turn.abandon("test", grace=0)
    proc.wait(timeout=BOUND)
    assert result.killed == [proc.pid] and len(loads) == 1, loads


def test_a_begin_makes_no_mkdir_of_a_root_it_has_seen_and_remakes_a_removed_one(cgroup2_manager, monkeypatch):
    cgroup2_manager.begin_turn("fast", "first").complete()
    root = cgroup2_manager.backend.location
    made: list[str] = []
    real = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: made.append(os.fspath(path)) or real(path, *a, **k))
    cgroup2_manager.begin_turn("fast", "second").complete()
    assert root not in made and made, made
    cgroup2_manager.remove_root()  # removed meanwhile: the next begin makes it again
    assert not os.path.isdir(root)
    turn = cgroup2_manager.begin_turn("fast", "third")
    assert os.path.isdir(os.path.join(root, "fast")) and turn.state == "running"
    turn.complete()


def test_an_abandon_that_finds_the_turn_gone_skips_it(cgroup2_manager):
    """The mark reads the record under the lock (the abandon no longer reads it before): a turn removed
    meanwhile is skipped, as before."""
    turn = cgroup2_manager.begin_turn("fast", "gone")
    other = TurnManager(root=cgroup2_manager.backend.location, backend="cgroup2", state_dir=cgroup2_manager.state_dir)
    try:
        other.turn("fast", "gone").complete()
    finally:
        other.close()
    assert turn.abandon("test", grace=0).skipped


# What `cgturn run -- CMD` (no options) has no use for, each imported only where it is used.
NOT_IMPORTED_BY_RUN = (
    "asyncio", "concurrent.futures",  # a blocking supervisor needs no event loop, nor a kill pool
    "secrets", "hmac",  # a turn id is drawn from os.urandom
    "shutil",  # a program is looked up with shutil.which's own test; helpers only for isolation
    "fractions", "decimal",  # parse_size, for --memory and the like
    "platform",  # the seal's filter asks os.uname()
    "pwd", "grp", "cgturn.identity",  # the user database, for --user/--group only
    "termios", "cgturn.backends.gates",  # the shim's gates, for a spawn the native paths cannot make
    "cgturn.backends.seal", "cgturn.backends.isolation", "cgturn.kernel.sandbox",  # --seal, --network none
    "cgturn.ports",  # listing shows ports
    "socket",  # the sentinel's channel is made with socket.py's C core, _socket
)


def test_cgturn_run_imports_nothing_it_does_not_use(cgroup2_root, state_dir):
    """An import is a cost of every `cgturn run`: none of NOT_IMPORTED_BY_RUN is paid for."""
    code = textwrap.dedent("""
        import sys
        before = set(sys.modules)  # what the interpreter's own start imported (site may import shutil)
        from cgturn.cli import main
        status = main(sys.argv[1:-1])
        print(sorted(m for m in sys.argv[-1].split() if m in sys.modules and m not in before))
        sys.exit(status)
    """)
    out = subprocess.run([PY, "-c", code, "--root", cgroup2_root, "--state-dir", state_dir, "run", "--", "true",
                          " ".join(NOT_IMPORTED_BY_RUN)], capture_output=True, text=True, env=cgturn_env(), timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


CONSOLE = textwrap.dedent("""
    import atexit, sys
    from cgturn import cli

    class Torn:
        def __del__(self):  # runs only when the interpreter tears its modules down
            sys.stderr.write("torn down\\n")

    kept = Torn()
    atexit.register(lambda: sys.stderr.write("atexit ran\\n"))
    cli.console()
""")


def test_the_console_script_exits_without_tearing_the_interpreter_down(cgroup2_root, state_dir):
    """`cgturn` (and `python -m cgturn`) skip the interpreter's teardown, keeping what an exit owes:
    the atexit functions, stdout flushed (run's `--report -` line), the command's exit status."""
    out = subprocess.run([PY, "-c", CONSOLE, "--root", cgroup2_root, "--state-dir", state_dir, "run", "--report", "-",
                          "--", "sh", "-c", "echo out; exit 3"], capture_output=True, text=True, env=cgturn_env(),
                         timeout=60)
    assert out.returncode == 3, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "out" and json.loads(lines[-1])["exit_status"] == 3, out.stdout
    assert "atexit ran" in out.stderr and "torn down" not in out.stderr, out.stderr


def test_the_console_exits_normally_while_a_thread_must_be_waited_for_or_a_flush_fails(monkeypatch):
    """A thread that is not a daemon is waited for, and a failed flush is reported (status 120), by
    the interpreter's own exit: console() takes it then."""
    from cgturn import cli

    def no_fast_exit(code):
        raise AssertionError(f"os._exit({code}) with a thread to wait for or a failed flush")

    monkeypatch.setattr(cli, "main", lambda: 7)
    monkeypatch.setattr(cli.os, "_exit", no_fast_exit)
    monkeypatch.setattr("atexit._run_exitfuncs", lambda: None)  # pytest's own must not run here
    release = threading.Event()
    waiting = threading.Thread(target=release.wait)
    waiting.start()
    try:
        with pytest.raises(SystemExit) as exited:
            cli.console()
        assert exited.value.code == 7
    finally:
        release.set()
        waiting.join()

    class Broken:
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli.sys, "stdout", Broken())
    with pytest.raises(SystemExit) as exited:
        cli.console()
    assert exited.value.code == 7


def test_a_program_is_found_on_path_as_shutil_which_finds_it(tmp_path):
    import shutil

    from cgturn.backends.base import resolve_program

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "tool").write_text("")  # not executable: skipped
    (tmp_path / "a" / "dir").mkdir()  # a directory: skipped
    for name in ("tool", "dir"):
        (tmp_path / "b" / name).write_text("#!/bin/sh\n")
        (tmp_path / "b" / name).chmod(0o755)
    path = os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b"), "/usr/bin"])
    for program in ("tool", "dir", "true"):
        assert resolve_program(program, path) == shutil.which(program, path=path), program
    with pytest.raises(FileNotFoundError):
        resolve_program("no-such-program-here", path)


def test_a_turn_holding_the_caller_is_still_refused(cgroup2_manager):
    turn = cgroup2_manager.begin_turn("fast", "me")
    turn.enter()
    try:
        with pytest.raises(UnsafeOperation, match="calling process"):
            turn.abandon("test", grace=0)
    finally:
        cgroup2_manager.leave_turn()
    assert turn.state == "running"
    turn.abandon("test", grace=0)


@pytest.mark.parametrize("grace", [0, 5])
def test_an_abandons_first_kill_takes_the_member_reading_made_before_its_mark(cgroup2_manager, monkeypatch,
                                                                               grace):
    """grace 0: the turn's members are read once, for the refusal before the mark, and the kill that
    follows takes them as its check and as the pids it hit. With a grace period the SIGTERM and the
    kill after its wait read them again (processes may have come and gone meanwhile)."""
    turn = cgroup2_manager.begin_turn("fast", "one-read")
    proc = turn.spawn(["sh", "-c", "trap '' TERM; echo ready; exec sleep 300"], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    turn_dir = cgroup2_manager.backend.cgroup_dir(turn.record)
    reads: list[str] = []
    real = Cgroup.procs_recursive
    monkeypatch.setattr(Cgroup, "procs_recursive", lambda self: (reads.append(self.path), real(self))[1])
    result = turn.abandon("test", grace=grace and 0.2)
    proc.wait(timeout=BOUND)
    proc.stdout.close()
    assert result.killed == [proc.pid] and result.signals == (["SIGTERM", "SIGKILL"] if grace else ["SIGKILL"])
    assert reads.count(turn_dir) == (3 if grace else 1)


def test_a_kill_given_a_reading_still_refuses_a_cgroup_outside_the_root(cgroup2_manager, cgroup2_root):
    outside = Cgroup(f"{cgroup2_root}-outside")  # the test's own, empty: beside the managed root
    outside.make()
    try:
        with pytest.raises(UnsafeOperation, match="outside the managed root"):
            cgroup2_manager.backend.killer.kill(outside, checked=[])
    finally:
        os.rmdir(outside.path)


def test_the_c_library_is_loaded_without_running_a_program():
    """ctypes.util.find_library runs `/sbin/ldconfig -p`; loading libc by name runs nothing."""
    code = textwrap.dedent("""
        import subprocess
        def refuse(*args, **kwargs):
            raise SystemExit(f"ran {args[0]!r}")
        subprocess.Popen = refuse
        from cgturn.kernel import libc
        libc._libc()
        print(libc.filesystem_magic("/"))
    """)
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=cgturn_env())
    assert out.returncode == 0 and out.stdout.strip().isdigit(), out.stdout + out.stderr


OWNER = textwrap.dedent("""
    import json, sys, threading
    from cgturn import Supervisor, TurnManager
    root, state, threaded = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    if threaded:  # a second thread: fork would copy only this one, so the sentinel is exec'd
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    mgr = TurnManager(root=root, backend="cgroup2", state_dir=state)
    pid = Supervisor.start_sentinel(mgr)
    turn = mgr.begin_turn("fast", "owned")
    child = turn.spawn(["sleep", "300"])
    print(json.dumps({"sentinel": pid, "child": child.pid}), flush=True)
    threading.Event().wait()
""")


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


@pytest.mark.parametrize("threaded", [False, True], ids=["one-thread-forked", "threaded-execd"])
def test_the_sentinel_of_a_sigkilled_owner_abandons_its_turn(cgroup2_root, state_dir, threaded):
    owner = subprocess.Popen([PY, "-c", OWNER, cgroup2_root, state_dir, "1" if threaded else "0"],
                             stdout=subprocess.PIPE, text=True, env=cgturn_env())
    try:
        started = json.loads(owner.stdout.readline())
        sentinel, child = started["sentinel"], started["child"]
        if threaded:
            assert "cgturn.sentinel_main" in _cmdline(sentinel)
        else:  # forked: no exec, so its argv is its owner's; its name says what it is
            assert _comm(sentinel) == SENTINEL_NAME and _cmdline(sentinel) == _cmdline(owner.pid)
            assert os.getsid(sentinel) == sentinel  # a session of its own, as the exec'd one
        assert alive(child)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=BOUND)
        assert wait_until(lambda: not alive(child), timeout=BOUND)
        with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False) as mgr:
            assert wait_until(lambda: mgr.turns() == [], timeout=BOUND)
        assert wait_until(lambda: not alive(sentinel), timeout=BOUND)  # nothing left to guard: it goes
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_a_process_that_began_no_turn_finds_it_owns_none_without_reading_records(cgroup2_manager, cgroup2_root,
                                                                                  state_dir):
    """A new sentinel tracks the running turns its owner began before: a process that began none (a
    `cgturn run` beside thousands of turns) is answered without reading every record of the root."""
    for i in range(3):
        cgroup2_manager.begin_turn("fast", f"other{i}")  # begun by this process: not the child's
    code = textwrap.dedent("""
        import json, sys
        from cgturn import TurnManager
        mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2], sentinel=False)
        reads = []
        backend = mgr._control.backend
        real = backend.records
        backend.records = lambda *a, **k: (reads.append(1), real(*a, **k))[1]
        none = mgr._control.running_turns_of_caller()
        before = len(reads)
        turn = mgr.begin_turn("fast", "mine")
        mine = mgr._control.running_turns_of_caller()
        turn.complete()
        mgr.close()
        print(json.dumps([none, before, mine, len(reads) > before]))
    """)
    out = subprocess.run([PY, "-c", code, cgroup2_root, state_dir], capture_output=True, text=True, env=cgturn_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[], 0, [["fast", "mine"]], True]


EARLY_DEATH = textwrap.dedent("""
    import json, os, select, signal, sys
    from cgturn import Supervisor, TurnManager, processes
    real = processes.open_owner

    def late(pid, start):  # the sentinel looks at its owner only once the owner is dead
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # dead and reaped already (a slow start under load)
            return real(pid, start)
        select.select([fd], [], [])
        os.close(fd)
        return real(pid, start)

    processes.open_owner = late
    mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2])
    sentinel = Supervisor.start_sentinel(mgr, wait=False)
    child = mgr.begin_turn("fast", "early").spawn(["sleep", "300"])
    print(json.dumps({"sentinel": sentinel, "child": child.pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_an_owner_sigkilled_before_its_sentinel_is_ready_still_loses_its_turn(cgroup2_root, state_dir):
    """`cgturn run` makes its turn while its sentinel starts (start_sentinel(wait=False)): a sentinel
    that finds its owner dead at its start abandons the turns it was told of."""
    owner = subprocess.Popen([PY, "-c", EARLY_DEATH, cgroup2_root, state_dir], stdout=subprocess.PIPE, text=True,
                             env=cgturn_env())
    try:
        started = json.loads(owner.stdout.readline())
        assert owner.wait(timeout=BOUND) == -signal.SIGKILL
        assert wait_until(lambda: not alive(started["child"]), timeout=BOUND)
        with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False) as mgr:
            assert wait_until(lambda: mgr.turns() == [], timeout=BOUND)
        assert wait_until(lambda: not alive(started["sentinel"]), timeout=BOUND)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


# An owner whose (forked) sentinel fails as it starts watching it: prints what start_sentinel raised.
CANNOT_WATCH = textwrap.dedent("""
    import sys
    from cgturn import Supervisor, TurnManager, processes
    from cgturn.errors import SentinelUnavailable

    def fail(pid, start):
        raise RuntimeError("injected open_owner failure")

    processes.open_owner = fail
    with TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2]) as mgr:
        try:
            Supervisor.start_sentinel(mgr)
        except SentinelUnavailable as err:
            print(err, flush=True)
""")


def test_a_sentinel_that_fails_to_start_tells_its_owner_why_and_logs_it(cgroup2_root, state_dir):
    out = subprocess.run([PY, "-c", CANNOT_WATCH, cgroup2_root, state_dir], capture_output=True, text=True,
                         env=cgturn_env(), timeout=60)
    assert out.returncode == 0 and "injected open_owner failure" in out.stdout, (out.stdout, out.stderr)
    with open(os.path.join(state_dir, "sentinel.log"), encoding="utf-8") as f:
        assert "sentinel cannot start" in f.read()


def test_cgturn_run_whose_sentinel_cannot_start_runs_nothing_and_leaves_no_turn(cgroup2_root, state_dir, tmp_path):
    """The sentinel's `ready` is waited for after the turn is made: when it never comes, the turn is
    abandoned, CMD never starts, and run exits 125."""
    code = textwrap.dedent("""
        import sys
        from cgturn import sentinel_start
        from cgturn.cli import main
        sentinel_start.PROGRAM = "cgturn.no_such_program"  # the forked sentinel exits at once, saying nothing
        sys.exit(main(sys.argv[1:]))
    """)
    marker = tmp_path / "ran"
    out = subprocess.run([PY, "-c", code, "--root", cgroup2_root, "--state-dir", state_dir, "run", "--",
                          "touch", str(marker)], capture_output=True, text=True, env=cgturn_env(), timeout=60)
    assert out.returncode == 125 and "the sentinel could not start" in out.stderr, out.stderr
    assert not marker.exists()
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False) as mgr:
        assert mgr.turns() == []


def test_a_forked_sentinel_holds_none_of_its_owners_descriptors(cgroup2_root, state_dir):
    """What the owner's caller waits on (a pipe) must not be held open by the sentinel it leaves behind."""
    read_end, write_end = os.pipe()
    owner = subprocess.Popen([PY, "-c", OWNER, cgroup2_root, state_dir, "0"], stdout=subprocess.PIPE, text=True,
                             env=cgturn_env(), pass_fds=(write_end,))
    os.close(write_end)
    try:
        sentinel = json.loads(owner.stdout.readline())["sentinel"]
        assert _comm(sentinel) == SENTINEL_NAME
        targets = {os.readlink(f"/proc/{sentinel}/fd/{fd}") for fd in os.listdir(f"/proc/{sentinel}/fd")}
        assert not any(t.startswith("pipe:") for t in targets), targets
    finally:
        owner.kill()
        owner.wait()
        os.close(read_end)
        with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False) as mgr:
            wait_until(lambda: mgr.turns() == [], timeout=BOUND)


def test_a_thread_count_is_read_from_the_kernel():
    from cgturn import processes

    before = processes.own_thread_count()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert processes.own_thread_count() == before + 1
    finally:
        stop.set()
        thread.join()


def test_ps_json_is_one_array_with_a_turn_per_line(cgroup2_manager, cgroup2_root, state_dir):
    from conftest import cli

    turns = [cgroup2_manager.begin_turn("fast", f"t{i}") for i in range(3)]
    out = cli(cgroup2_root, state_dir, "ps", "--json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) == 2 + len(turns)
    assert [json.loads(line.rstrip(","))["turn"] for line in lines[1:-1]] == ["t0", "t1", "t2"]
    assert json.loads(out.stdout) == [json.loads(line.rstrip(",")) for line in lines[1:-1]]
    for turn in turns:
        turn.complete()
    assert cli(cgroup2_root, state_dir, "ps", "--json").stdout == "[]\n"


def test_a_detailed_listing_reads_each_turns_files_once_relative_to_its_task(cgroup2_manager, cgroup2_root,
                                                                               monkeypatch):
    """`ps` over thousands of turns is kernfs opens: a detailed listing opens each file of a turn once
    (cpu.stat serves its seconds and its usage), relative to the open task directory (the kernel walks
    one component, not the mount path), and lists what the per-turn calls list."""
    turns = [cgroup2_manager.begin_turn("fast", f"t{i}") for i in range(3)]
    procs = [turn.spawn(["sleep", "60"]) for turn in turns]
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=cgroup2_manager.state_dir) as fresh:
        opened = []
        real_open = os.open

        def recording_open(path, flags, mode=0o777, *, dir_fd=None):
            opened.append((os.fsdecode(path), dir_fd))
            return real_open(path, flags, mode, dir_fd=dir_fd)

        monkeypatch.setattr(os, "open", recording_open)
        listed = fresh.turns(detail=True)
        monkeypatch.undo()
        for info, turn in zip(listed, turns):  # what the per-turn reads give (but the CPU a starting sleep uses)
            assert (replace(info.usage, cpu_seconds=0), info.frozen) == (replace(turn.usage(), cpu_seconds=0),
                                                                         turn.frozen)
    turn_files = [(path, fd) for path, fd in opened if path.startswith(("t0/", "t1/", "t2/"))
                  or "/fast/t" in path]
    assert not [path for path, fd in turn_files if fd is None], turn_files  # none by its mount path
    for name in ("cpu.stat", "cpu.pressure", "memory.pressure", "io.pressure", "cgroup.events", "cgroup.procs"):
        assert sorted(path for path, _ in turn_files if path.endswith("/" + name)) == \
            [f"t{i}/{name}" for i in range(3)], name
    assert [(i.turn, i.pids, i.frozen) for i in listed] == [(f"t{i}", [p.pid], False) for i, p in enumerate(procs)]
    assert all(set(i.pressure) == {"cpu", "memory", "io"} and i.usage is not None for i in listed)
    for turn in turns:
        turn.abandon("test", grace=0)


def _subparsers(parser):
    import argparse

    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_a_parser_of_one_command_parses_and_helps_as_the_full_one(monkeypatch):
    """`cgturn run ...` builds run's subparser alone: the map of commands names every command of the
    full parser, and each one's subparser alone reads and explains the same options."""
    from cgturn import cli

    monkeypatch.setenv("COLUMNS", "100")
    full = _subparsers(cli.build_parser())
    assert set(full) == set(cli.COMMAND_MODULES)
    for name in full:
        alone = _subparsers(cli.build_parser(name))
        assert list(alone) == [name] or set(alone) == {"pause", "resume"}, name
        assert alone[name].format_help() == full[name].format_help(), name


def test_the_command_is_found_only_behind_global_options():
    from cgturn.cli import command_named

    assert command_named(["run", "--", "ps"]) == "run"
    assert command_named(["--root", "/r", "--state-dir=/s", "--backend", "cgroup2", "ps", "--json"]) == "ps"
    assert command_named(["--root", "ps", "run"]) == "run"  # `ps` is --root's value here
    for argv in (["--help"], ["--version"], [], ["--ro", "/r", "ps"], ["rnu"], ["-h", "run"]):
        assert command_named(argv) is None, argv  # the full parser reads these


def test_the_help_width_is_shutils(monkeypatch):
    import shutil

    from cgturn.cli.common import terminal_columns

    for columns in ("123", "", "junk", "-4"):
        monkeypatch.setenv("COLUMNS", columns)
        assert terminal_columns() == shutil.get_terminal_size().columns, columns


# --- what a small turn's complete and abandon no longer do (issue "Performance II", item 1) ----------------

def test_a_completion_reads_no_cgroup_events_its_rmdir_is_the_check(cgroup2_manager, monkeypatch):
    waits: list[str] = []
    real = Cgroup.wait_events
    monkeypatch.setattr(Cgroup, "wait_events", lambda self, *a, **kw: waits.append(self.path) or real(self, *a, **kw))
    empty = cgroup2_manager.begin_turn("fast", "empty")
    assert empty.complete() is True and waits == []
    kept = cgroup2_manager.begin_turn("fast", "kept")
    proc = kept.spawn(["sleep", "300"])
    assert kept.complete() is True  # EBUSY: populated, read once after the rmdir, and kept at once
    assert [i.turn for i in cgroup2_manager.turns("fast")] == ["kept"]
    kept.abandon("test", grace=0, force=True)
    proc.wait(timeout=BOUND)


def test_the_wait_for_an_emptied_turn_tests_the_bytes_it_reads(cgroup2_manager, monkeypatch):
    """The spin after a kill re-reads cgroup.events while the dying processes need the CPU: it looks
    for `populated 0` in the bytes it read, without decoding and parsing them."""
    from cgturn.kernel import parsers

    turn = cgroup2_manager.begin_turn("fast", "spin")
    proc = turn.spawn(["sleep", "300"])
    assert wait_until(lambda: turn.pids() == [proc.pid])
    parsed: list[str] = []
    real = parsers.parse_cgroup_events
    monkeypatch.setattr(parsers, "parse_cgroup_events", lambda text: parsed.append(text) or real(text))
    result = turn.abandon("test", grace=0)
    proc.wait(timeout=BOUND)
    assert result.killed == [proc.pid] and parsed == []


def test_an_audit_append_looks_at_the_log_once(tmp_path, monkeypatch):
    """One fstat(2) serves the regular-file check, the half-line check and the rotation's size and
    inode; a half line left by a short write is still never glued onto."""
    from cgturn import audit

    (tmp_path / audit.AUDIT_FILE).write_text('{"v": 1, "half": ')
    looks: list[int] = []
    real = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: looks.append(fd) or real(fd))
    audit.record_kill(str(tmp_path), task="t", turn="u", reason="test", pids=[1234], signals=["SIGKILL"],
                      duration_ms=0.5, backend="cgroup2")
    monkeypatch.undo()
    assert len(looks) == 1
    lines = (tmp_path / audit.AUDIT_FILE).read_text().splitlines()
    assert lines[0] == '{"v": 1, "half": ' and json.loads(lines[1])["pids"] == [1234]


def test_leaving_a_turn_without_v1_limits_writes_only_cgroup2(cgroup2_manager, monkeypatch):
    """A turn without limits never took the caller into v1 cgroups, so leaving it (Celery's pool
    process does, after every task) writes the caller's own cgroup2 cgroup.procs and nothing in the
    v1 hierarchies, whose cgroups cgturn did not create. A turn with a v1 limit (a hybrid host) still
    brings the caller back to its own v1 cgroups."""
    from cgturn import Limits

    written: list[str] = []
    real_move_in = Cgroup.move_in

    def move_in(self, pid):  # a spy: the real write happens
        written.append(self.path)
        return real_move_in(self, pid)

    monkeypatch.setattr(Cgroup, "move_in", move_in)
    with open("/proc/self/cgroup") as f:
        original = f.read()
    mount = cgroup2_manager.backend.placement.mount
    plain = cgroup2_manager.begin_turn("fast", "plain")
    plain.enter()
    cgroup2_manager.leave_turn()
    assert written and all(p.startswith(mount + "/") or p == mount for p in written), written
    with open("/proc/self/cgroup") as f:
        assert f.read() == original

    limited = cgroup2_manager.begin_turn("fast", "limited", limits=Limits(memory_max=1 << 30))
    limited.enter()
    try:
        with open("/proc/self/cgroup") as f:
            assert f.read() != original
    finally:
        cgroup2_manager.leave_turn()
    with open("/proc/self/cgroup") as f:
        assert f.read() == original, "the caller was not brought back to its own cgroups"
    plain.abandon("test", grace=0)
    limited.abandon("test", grace=0)


def test_a_wait_spins_only_within_its_window_from_when_the_signal_went(cgroup2_manager, monkeypatch):
    """The spin on cgroup.events is counted from `spin_from` when given: a wait that starts after
    the window (a kill write the woken processes preempted for milliseconds) sleeps in poll(2) at
    once, so they keep the CPU; without it the window starts with the wait."""
    turn = cgroup2_manager.begin_turn("fast", "window")
    proc = turn.spawn(["sleep", "300"])
    assert wait_until(lambda: turn.pids() == [proc.pid])
    events = Cgroup(cgroup2_manager.backend.cgroup_dir(turn.record))
    yields: list[int] = []
    real_yield = os.sched_yield
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1) or real_yield())
    assert events.wait_unpopulated(0.03, spin_from=time.monotonic() - 1) is False
    assert yields == []
    assert events.wait_unpopulated(0.03) is False
    assert yields  # it spun at first
    monkeypatch.undo()
    turn.abandon("test", grace=0)
    proc.wait(timeout=BOUND)


@pytest.mark.parametrize("grace", [0, 5])
def test_the_wait_after_a_signal_counts_its_spin_from_the_signal(cgroup2_manager, monkeypatch, grace):
    sent: list[float] = []
    spins: list[float | None] = []
    real_kill, real_wait = Cgroup.kill, Cgroup.wait_unpopulated
    real_signal = CgroupKiller.signal

    def kill(self):
        sent.append(time.monotonic())
        real_kill(self)

    def signal_(self, *a, **kw):
        sent.append(time.monotonic())
        return real_signal(self, *a, **kw)

    def wait(self, timeout, spin_from=None):
        spins.append(spin_from)
        return real_wait(self, timeout, spin_from)

    monkeypatch.setattr(Cgroup, "kill", kill)
    monkeypatch.setattr(CgroupKiller, "signal", signal_)
    monkeypatch.setattr(Cgroup, "wait_unpopulated", wait)
    turn = cgroup2_manager.begin_turn("fast", "spin-from")
    # The SIGTERM is ignored, so the grace runs out and the SIGKILL follows with a wait of its own.
    proc = turn.spawn(["sh", "-c", "trap '' TERM; echo ready; exec sleep 300"], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    began = time.monotonic()
    turn.abandon("test", grace=grace and 0.2)
    proc.wait(timeout=BOUND)
    proc.stdout.close()
    assert len(spins) == len(sent) == (2 if grace else 1)
    for spin_from, signalled in zip(spins, sent):
        assert spin_from is not None and began <= spin_from <= signalled
