"""Trust nothing on disk or on the wire (issue 10): bounded ids, a sentinel that survives bad input and
a broken state directory, spawn shims that die with their owner, state files that are not regular
files, damaged audit lines, undecodable reasons. Real kernel, real processes, each test on its own
managed root; faults come from files and mounts the test makes (tmpfs only in a private mount
namespace) and from SIGKILLs of processes the test started."""
import json
import os
import signal
import socket
import subprocess
import time
import types
import uuid

import pytest

from cgturn import audit, ids, sentinel
from cgturn.manager import TurnManager
from cgturn.kernel import procfs
from conftest import PY, alive, destroy_cgroup_tree, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
ID_LIMIT = 4096  # the documented maximum id length, bytes of UTF-8 (cgturn.ids.MAX_ID_BYTES)


def cgturn(root, state_dir, *args, timeout=60, **kwargs):
    """`python -m cgturn` as a real subprocess (bytes argv allowed, for undecodable input)."""
    return subprocess.run([PY, "-m", "cgturn", "--root", root, "--state-dir", state_dir, *args],
                          capture_output=True, timeout=timeout, cwd=REPO, env=ENV, **kwargs)


def one_line(stderr: bytes) -> str:
    text = stderr.decode(errors="replace")
    assert text.count("\n") == 1 and "Traceback" not in text, text
    return text


# --- item 5: ids have a documented maximum length ------------------------------------------------------

@pytest.mark.parametrize("value", ["x" * (ID_LIMIT + 1), "é" * (ID_LIMIT // 2 + 1)], ids=["ascii", "2-byte"])
def test_ids_over_the_limit_are_refused(value):
    with pytest.raises(ValueError, match=f"bytes long; the limit is {ID_LIMIT}"):
        ids.validate(value, "turn")


def test_ids_at_the_limit_are_valid():
    assert ids.validate("é" * (ID_LIMIT // 2), "task")
    assert ids.validate("x" * ID_LIMIT, "task")


def test_begin_turn_refuses_an_over_long_id_and_creates_nothing(cgroup2_manager):
    with pytest.raises(ValueError, match="the limit is"):
        cgroup2_manager.begin_turn("t", "x" * 70_000)
    with pytest.raises(ValueError, match="the limit is"):
        cgroup2_manager.begin_turn("x" * (ID_LIMIT + 1))
    assert not os.path.exists(cgroup2_manager.backend.root.path)


def test_cli_refuses_an_over_long_id_with_exit_2(cgroup2_root, state_dir):
    out = cgturn(cgroup2_root, state_dir, "stop", "t", "x" * (ID_LIMIT + 1))
    assert out.returncode == 2
    assert "the limit is" in one_line(out.stderr)


def test_the_longest_worst_case_ids_are_guarded_by_the_sentinel(cgroup2_root, state_dir):
    # Every byte a control character: JSON escapes each as \\u00XX, the largest a message can get.
    task, turn = "\x01" * ID_LIMIT, "\x02" * ID_LIMIT
    p = subprocess.Popen([PY, "-m", "cgturn", "--root", cgroup2_root, "--state-dir", state_dir, "run",
                          "--task", task, "--turn", turn, "--", "sh", "-c", "echo $$; exec sleep 300"],
                         stdout=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    try:
        pid = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGKILL)
        assert wait_until(lambda: not alive(pid), timeout=5.0)
    finally:
        p.kill()
        p.wait()


@pytest.fixture
def live_sentinel(cgroup2_manager):
    client = sentinel.attach(cgroup2_manager)
    yield cgroup2_manager, client
    client.close()


def test_sentinel_survives_oversized_and_malformed_messages(live_sentinel):
    mgr, client = live_sentinel
    turn = mgr.begin_turn("t", "u")
    proc = turn.spawn(["sleep", "300"])
    for junk in (b"{" * (sentinel.MAX_MESSAGE + 10),              # would be cut to 64 KiB of garbage
                 json.dumps({"op": "track", "key": ["a", "b"], "task": "a", "turn": "b",
                             "pad": "x" * sentinel.MAX_MESSAGE}).encode(),  # valid JSON, too long
                 b"\xff\xfe", b"{", b"[]", b"{}", b'{"op": "track"}', b'{"op": "touch", "key": 5}'):
        client._sock.settimeout(10)  # the client's socket is non-blocking: wait for room, as _send does
        client._sock.sendall(junk)
    client._sock.setblocking(False)
    # Still serving: a deadline tracked after the junk is enforced.
    client.track(turn, deadline=time.monotonic())
    assert wait_until(lambda: proc.poll() is not None, timeout=30)
    # the record is written once the kill is complete, a moment after the process died
    assert wait_until(lambda: [r["reason"] for r in audit.read_records(mgr.state_dir)] == ["deadline"], timeout=30)
    assert client.process.poll() is None


def test_sentinel_client_refuses_to_send_an_oversized_message(live_sentinel):
    _mgr, client = live_sentinel
    fake = types.SimpleNamespace(task_id="t", turn_id="x" * (sentinel.MAX_MESSAGE + 1), last_activity=0.0)
    with pytest.raises(ValueError, match="limit"):
        client.track(fake)
    assert client.process.poll() is None and not client.closed


def test_the_documented_limit_is_the_one_enforced():
    assert ids.MAX_ID_BYTES == ID_LIMIT


# --- items 7, 8: spawn shims die with their owner; gates have no names to collide on -----------------

# The owner: 4 threads spawn `true MARKER` back to back; one byte on stdout per spawn.
SPAWNING_OWNER = """
import os, subprocess, sys, threading
from cgturn.manager import TurnManager
root, state, marker = sys.argv[1:4]
mgr = TurnManager(root=root, backend="cgroup2", state_dir=state, sentinel=False)
turn = mgr.begin_turn("storm")
def loop():
    while True:
        turn.spawn(["true", marker], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        os.write(1, b".")
for _ in range(4):
    threading.Thread(target=loop, daemon=True).start()
threading.Event().wait()
"""


def carrying(marker: str) -> list[int]:
    """Live processes whose argv holds `marker` (only processes this test started can)."""
    out = []
    for pid in procfs.all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv and alive(pid):
            out.append(pid)
    return out


def test_spawn_shims_never_outlive_a_sigkilled_owner(cgroup2_root, state_dir):
    marker = f"cgturn-shim-marker-{uuid.uuid4().hex}"
    left: list[int] = []
    try:
        for spawned in range(20, 20 + 15 * 6, 6):  # kill at a different point of the storm each round
            owner = subprocess.Popen([PY, "-c", SPAWNING_OWNER, cgroup2_root, state_dir, marker],
                                     stdout=subprocess.PIPE, cwd=REPO, env=ENV)
            try:
                got = 0
                while got < spawned:
                    chunk = owner.stdout.read1(spawned - got)
                    assert chunk, "the owner died on its own"
                    got += len(chunk)
                os.kill(owner.pid, signal.SIGKILL)
            finally:
                owner.kill()
                owner.wait()
                owner.stdout.close()
            if not wait_until(lambda: not carrying(marker), timeout=5.0):
                left = carrying(marker)
                break
    finally:
        for pid in carrying(marker):  # ours: they carry this test's marker
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"shims left behind by a SIGKILLed owner: {left}"


def test_two_managers_in_one_process_both_spawn(cgroup2_root, state_dir, tmp_path):
    second_root = cgroup2_root + "-second"
    try:
        with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir) as first, \
                TurnManager(root=second_root, backend="cgroup2", state_dir=str(tmp_path / "second")) as second:
            for mgr in (first, second, first, second):
                turn = mgr.begin_turn("two")
                assert turn.spawn(["true"]).wait(timeout=10) == 0
                turn.complete()
    finally:
        destroy_cgroup_tree(second_root)


@pytest.mark.parametrize("native", [False, True], ids=["shim", "clone3"])
def test_the_target_gets_the_fds_popen_gives_plus_its_drained_gate(cgroup2_manager, monkeypatch, native):
    """The shim keeps the gate's read end (so a parent that exits right after spawn cannot take the
    gate away); dash cannot close it, so the target has exactly that one fd more, at EOF. The clone3
    path has no gate: exactly Popen's fds."""
    from cgturn.backends import spawn_paths
    from cgturn.kernel import spawn as kspawn

    if native and not kspawn.clone3_built():
        pytest.skip("cgturn._spawn is not built here")
    for flag, value in spawn_paths.forced(spawn_paths.CLONE3 if native else spawn_paths.SHIM).items():
        monkeypatch.setattr(spawn_paths, flag, value)
    turn = cgroup2_manager.begin_turn("fds")
    keep_r, keep_w = os.pipe()
    try:
        for kwargs, expected in (({}, {0, 1, 2}), ({"pass_fds": (keep_w,)}, {0, 1, 2, keep_w})):
            out = turn.spawn(["sh", "-c", "ls /proc/$$/fd"], stdout=subprocess.PIPE, text=True, **kwargs)
            fds = {int(fd) for fd in out.communicate(timeout=10)[0].split()}
            assert expected <= fds and len(fds - expected) == (0 if native else 1)
    finally:
        os.close(keep_r)
        os.close(keep_w)
    turn.complete()


def test_a_process_that_is_not_dumpable_still_spawns(cgroup2_manager, monkeypatch):
    """Its children may not open its fds through /proc: the gate's read end is passed instead."""
    from cgturn.kernel import procfd

    dropped = subprocess.run([PY, "-c", "import os; from cgturn.kernel import procfd; "
                              "os.setgroups([]); os.setgid(65534); os.setuid(65534); "
                              "print(procfd.children_can_open_our_fds())"],
                             capture_output=True, text=True, cwd=REPO, env=ENV, timeout=30)
    assert dropped.stdout.split() == ["False"], dropped.stderr  # a uid change makes it non-dumpable
    assert procfd.children_can_open_our_fds() is True
    monkeypatch.setattr(procfd, "children_can_open_our_fds", lambda: False)
    from cgturn.backends import spawn_paths

    for flag, value in spawn_paths.forced(spawn_paths.SHIM).items():  # the gate is the shim's
        monkeypatch.setattr(spawn_paths, flag, value)
    turn = cgroup2_manager.begin_turn("undumpable")
    out = turn.spawn(["sh", "-c", "ls /proc/$$/fd"], stdout=subprocess.PIPE, text=True)
    fds = {int(fd) for fd in out.communicate(timeout=10)[0].split()}
    assert out.returncode == 0 and len(fds - {0, 1, 2}) == 1  # the one drained gate fd
    turn.complete()


# --- item 9: state files that are not regular files ----------------------------------------------------

def _running_turn(root, state_dir, task="t", turn="u"):
    """A turn of a cgroup2 manager (closed again) with `sleep 300` in it; returns its pid."""
    with TurnManager(root=root, backend="cgroup2", state_dir=state_dir, sentinel=False) as mgr:
        return mgr.begin_turn(task, turn).spawn(["sleep", "300"]).pid


def test_a_fifo_at_the_audit_log_never_blocks_an_abandon(cgroup2_root, state_dir):
    os.mkfifo(os.path.join(state_dir, "audit.jsonl"))
    pid = _running_turn(cgroup2_root, state_dir)
    try:
        out = cgturn(cgroup2_root, state_dir, "stop", "t", "u", "--grace", "0", timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("cgturn stop hung on a FIFO at audit.jsonl")
    assert out.returncode == 0, out.stderr
    assert b"killed 1 process" in out.stdout and not alive(pid)
    assert b"not a regular file" in out.stderr  # the failed append is logged, not raised


def _limit_memory(nbytes: int):
    import resource
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero"])
def test_metrics_never_hangs_on_an_audit_log_that_is_not_a_file(cgroup2_root, state_dir, kind):
    path = os.path.join(state_dir, "audit.jsonl")
    os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)
    try:  # bounded in memory too: reading /dev/zero to its end would never end
        out = cgturn(cgroup2_root, state_dir, "metrics", "--once", timeout=30,
                     preexec_fn=_limit_memory(2 << 30))
    except subprocess.TimeoutExpired:
        pytest.fail(f"cgturn metrics hung on a {kind} at audit.jsonl")
    assert out.returncode == 0, out.stderr
    assert b"cgturn_turns{" in out.stdout and b"cgturn_kills_total{" not in out.stdout
    assert b"audit.jsonl" in out.stderr


# --- item 12: reasons that are not valid UTF-8 ---------------------------------------------------------

@pytest.mark.parametrize("reason", [b"\xff", b"bad\xed\xb3\xbf", b"  ", b"x" * 1025])
def test_stop_refuses_a_bad_reason_and_touches_nothing(cgroup2_root, state_dir, reason):
    pid = _running_turn(cgroup2_root, state_dir)
    out = cgturn(cgroup2_root, state_dir, "stop", "t", "u", "--grace", "0", b"--reason", reason)
    assert out.returncode == 2
    assert "reason" in one_line(out.stderr)
    assert alive(pid)
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir, sentinel=False) as mgr:
        assert mgr.turn("t", "u").state == "running"
    assert audit.read_records(state_dir) == []


def test_an_audit_record_never_fails_on_a_reasons_encoding(state_dir):
    entry = audit.record_kill(state_dir, task="t", turn="u", reason="bad\udcff", pids=[1], signals=["SIGKILL"],
                              duration_ms=1.0, backend="cgroup2")
    assert entry["reason"] == "bad\udcff"
    assert [r["reason"] for r in audit.read_records(state_dir)] == ["bad\udcff"]  # one valid JSON line


# --- item 13: `cgturn run` checks its input before it starts anything ---------------------------------

@pytest.mark.parametrize("args", [["--task", "   "], ["--task", b"\xff"], ["--turn", "x" * (ID_LIMIT + 1)],
                                  ["--task", "ok", "--turn", ""]], ids=["blank", "undecodable", "long", "blank-turn"])
def test_run_with_bad_ids_exits_2_having_started_nothing(cgroup2_root, tmp_path, args):
    state = str(tmp_path / "never-made")  # a sentinel would create it (and its log) at start-up
    out = cgturn(cgroup2_root, state, "run", *args, "--", "true")
    assert out.returncode == 2
    one_line(out.stderr)
    assert not os.path.exists(state) and not os.path.exists(cgroup2_root)


# --- item 11: the state directory is a regular file ----------------------------------------------------

@pytest.fixture
def state_is_a_file(tmp_path):
    path = tmp_path / "state"
    path.write_text("not a directory\n")
    return str(path)


def test_kills_finish_and_report_when_the_state_dir_is_a_file(cgroup2_root, state_is_a_file):
    out = cgturn(cgroup2_root, state_is_a_file, "run", "--timeout", "0.3", "--grace", "0", "--", "sleep", "300")
    assert out.returncode == 124 and b"Traceback" not in out.stderr, out.stderr
    pid = _running_turn(cgroup2_root, state_is_a_file)
    out = cgturn(cgroup2_root, state_is_a_file, "stop", "t", "u", "--grace", "0")
    assert out.returncode == 0 and b"killed 1 process" in out.stdout, out.stderr
    assert not alive(pid) and b"Traceback" not in out.stderr
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_is_a_file, sentinel=False) as mgr:
        turn = mgr.begin_turn("lib")
        proc = turn.spawn(["sleep", "300"])
        assert turn.abandon("x", grace=0).killed == [proc.pid]
        assert mgr.end_task("lib").killed == []


# --- item 6: the sentinel lives without its log, and an owner always knows whether it is guarded --------

def _sigkill_run_and_expect_cmd_gone(argv_prefix):
    p = subprocess.Popen([*argv_prefix, "run", "--", "sh", "-c", "echo $$; exec sleep 300"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        pid = int(line)
        os.kill(p.pid, signal.SIGKILL)
        assert wait_until(lambda: not alive(pid), timeout=5.0), "the command outlived a SIGKILLed cgturn run"
    finally:
        p.kill()
        p.wait()


def test_sentinel_guards_when_the_state_dir_is_a_file(cgroup2_root, state_is_a_file):
    _sigkill_run_and_expect_cmd_gone([PY, "-m", "cgturn", "--root", cgroup2_root, "--state-dir", state_is_a_file])


def test_sentinel_guards_when_the_state_dir_is_a_read_only_tmpfs(cgroup2_root, tmp_path):
    """The tmpfs is mounted in a private mount namespace of the run's own: the host never sees it, and
    it goes away with the namespace's last process."""
    state = tmp_path / "ro-state"
    state.mkdir()
    mount_then_exec = 'mount -t tmpfs -o ro,size=64k cgturn-test-ro "$0" && exec "$@"'
    _sigkill_run_and_expect_cmd_gone(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                      mount_then_exec, str(state), PY, "-m", "cgturn", "--root", cgroup2_root,
                                      "--state-dir", str(state)])
    assert os.listdir(state) == []  # nothing was written to the directory under the mount


def test_sentinel_without_a_log_file_says_so(cgroup2_root, state_is_a_file, caplog):
    with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_is_a_file) as mgr:
        client = sentinel.attach(mgr)
        assert client.process.poll() is None
    assert any("logs to nowhere" in r.getMessage() and "sentinel.log" in r.getMessage() for r in caplog.records)


def test_an_owner_is_told_when_its_sentinel_cannot_start(cgroup2_manager, monkeypatch):
    from cgturn.errors import SentinelUnavailable

    from cgturn import sentinel_start

    # A program that is not there: the sentinel, exec'd or forked, exits at once and says nothing.
    monkeypatch.setattr(sentinel_start, "PROGRAM", "cgturn.no_such_program")
    with pytest.raises(SentinelUnavailable, match="could not start.*not guarded"):
        sentinel.attach(cgroup2_manager)
    monkeypatch.undo()
    assert sentinel.attach(cgroup2_manager).process.poll() is None  # a later attach tries again
