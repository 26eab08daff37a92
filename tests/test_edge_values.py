"""Values that pass the edge and break inside (issue 22): every value cgturn takes is checked against
what the kernel (or Popen) accepts before anything is created, and a value that still fails inside
gives a documented outcome, never a traceback or a silent other number.

Real kernel, real CLI subprocesses where the exit status and stderr are the promise. Every turn here
is bounded (`true`, `echo`, one short sleep) and every allocation is the kernel's own exec.
"""
import errno
import os
import subprocess

import pytest

from cgturn import Limits, TurnManager, testing
from cgturn import limits as limits_module
from cgturn.cli import main
from cgturn.errors import KernelError
from cgturn.kernel import controllers
from conftest import PY, cgturn_argv, cgturn_env, cli, v1_mirrors

MAX_BYTES, MAX_PIDS = limits_module.MAX_BYTES, limits_module.MAX_PIDS
MIN_CPUS, MAX_CPUS = limits_module.MIN_CPUS, limits_module.MAX_CPUS


def hierarchies(root: str) -> list[str]:
    """Every directory below the managed root `root` in cgroup v2 and in its v1 mirrors (memory, pids,
    cpu), the roots themselves included: what "nothing created" compares."""
    out = []
    for base in (root, *v1_mirrors(root).values()):
        for path, _, _ in os.walk(base):
            out.append(path)
    return sorted(out)


def one_line(text: str) -> bool:
    return text.count("\n") == 1 and text.startswith("cgturn: ") and "Traceback" not in text


# --- the bounds are the kernel's -------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("pids_max", 0), ("pids_max", MAX_PIDS + 1), ("pids_max", 2 ** 32), ("pids_max", 2 ** 62), ("pids_max", 2 ** 70),
    ("memory_max", MAX_BYTES + 1), ("memory_max", 2 ** 64), ("memory_high", 2 ** 70), ("swap_max", MAX_BYTES + 1),
    ("cpus", 1e-9), ("cpus", 0.009), ("cpus", MAX_CPUS + 1), ("cpus", 1e300),
    ("cpu_weight", 0), ("cpu_weight", 10001),
])
def test_limits_refuses_what_the_kernel_would_refuse_cut_or_wrap(field, value):
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})


def test_limits_takes_the_bounds_themselves():
    Limits(memory_max=MAX_BYTES, memory_high=0, swap_max=MAX_BYTES, pids_max=MAX_PIDS, cpus=MIN_CPUS, cpu_weight=1)
    Limits(pids_max=1, cpus=MAX_CPUS, cpu_weight=10000)


def test_the_cpu_bounds_are_the_quota_cgturn_writes():
    # controllers.py maps cores to a quota per CPU_PERIOD_US: MIN_CPUS is its 1 ms floor, MAX_CPUS
    # stays under max_cfs_runtime (2**44 - 1 us).
    assert limits_module.CPU_PERIOD_US == controllers.CPU_PERIOD_US
    assert int(MIN_CPUS * controllers.CPU_PERIOD_US) == 1000
    assert int(MAX_CPUS * controllers.CPU_PERIOD_US) <= 2 ** 44 - 1


@pytest.mark.parametrize("text, expected", [
    ("12345678901234567", 12345678901234567),  # exact: a float made this 12345678901234568
    ("8388607T", 8388607 * 1024 ** 4), ("1.5K", 1536), (str(MAX_BYTES), MAX_BYTES),
])
def test_sizes_are_exact(text, expected):
    assert limits_module.parse_size(text) == expected


def _limit_file(manager, turn, controller: str, v1_name: str, v2_name: str) -> str | None:
    """The path of a turn's limit file for `controller`, in v1 or v2 as the layout places it; None
    where the controller has no place here."""
    v1 = testing.v1_dirs(manager, turn)
    if controller in v1:
        return os.path.join(v1[controller], v1_name)
    path = os.path.join(manager.root, turn.record.task_key, turn.record.turn_key, v2_name)
    return path if os.path.exists(path) else None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def test_the_kernel_takes_each_bound_and_refuses_one_past_it(cgroup2_manager):
    turn = cgroup2_manager.begin_turn("bounds", limits=Limits(pids_max=MAX_PIDS, cpus=MIN_CPUS, memory_max=MAX_BYTES))
    try:
        pids = _limit_file(cgroup2_manager, turn, "pids", "pids.max", "pids.max")
        if pids is None:
            pytest.skip("no pids controller for the managed root here")
        assert _read(pids) == str(MAX_PIDS)
        with pytest.raises(OSError) as refused:
            _write(pids, str(MAX_PIDS + 1))
        assert refused.value.errno == errno.EINVAL
        quota = _limit_file(cgroup2_manager, turn, "cpu", "cpu.cfs_quota_us", "cpu.max")
        if quota is not None:
            assert _read(quota).split()[0] == "1000"
            with pytest.raises(OSError) as refused:
                _write(quota, "999" if quota.endswith("_us") else "999 100000")
            assert refused.value.errno == errno.EINVAL
        memory = _limit_file(cgroup2_manager, turn, "memory", "memory.limit_in_bytes", "memory.max")
        if memory is not None:
            # Why sizes stop at MAX_BYTES: the kernel's parser wraps 2**64 to a limit of 0 bytes.
            _write(memory, str(2 ** 64))
            assert _read(memory) == "0"
    finally:
        turn.abandon("test", grace=0)


# --- bad values at the edge: exit 2, one line, nothing created -------------------------------------

@pytest.mark.parametrize("args", [
    ["run", "--pids", "4294967296", "--", "true"],
    ["run", "--pids", str(2 ** 70), "--", "true"],
    ["run", "--pids", str(MAX_PIDS + 1), "--", "true"],
    ["run", "--cpus", "1e-9", "--", "true"],
    ["run", "--cpus", "0.005", "--", "true"],
    ["run", "--cpus", "1e12", "--", "true"],
    ["run", "--memory", "99999999999T", "--", "true"],
    ["run", "--memory", "1G", "--swap", "8388608T", "--", "true"],
    ["limits", "--memory-high", "16777216T"],
    ["limits", "t", "--pids", "4611686018427387904"],
])
def test_out_of_range_values_exit_2_with_one_line_and_create_nothing(cgroup2_root, state_dir, args, capsys):
    code = main(["--root", cgroup2_root, "--state-dir", state_dir, *args])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert one_line(captured.err) and captured.out == ""
    assert hierarchies(cgroup2_root) == [] and os.listdir(state_dir) == []


def test_an_out_of_range_limit_on_a_turn_exits_2_and_changes_nothing(cgroup2_manager, cgroup2_root, state_dir, capsys):
    turn = cgroup2_manager.begin_turn("t", "u", limits=Limits(pids_max=50))
    try:
        code = main(["--root", cgroup2_root, "--state-dir", state_dir, "limits", "t", "u", "--pids",
                     "4611686018427387904"])
        captured = capsys.readouterr()
        assert code == 2 and one_line(captured.err), captured.err
        assert turn.limits().pids_max == 50
        pids = _limit_file(cgroup2_manager, turn, "pids", "pids.max", "pids.max")
        if pids is not None:
            assert _read(pids) == "50"
    finally:
        turn.abandon("test", grace=0)


def _cpu_in_v1(manager) -> bool:
    return "cpu" in testing.v1_dirs(manager)


# How each call meets the refused budget: begin_turn with the turn's own limits, set_task_limits
# with the task's (on a task that has no directory yet, then on one a turn keeps).
REFUSED_CALLS = {
    "begin_turn": lambda mgr: mgr.begin_turn("refused", limits=Limits(cpus=2)),
    "set_task_limits": lambda mgr: mgr.set_task_limits("refused", Limits(cpus=2, pids_max=50)),
}


@pytest.mark.parametrize("call", sorted(REFUSED_CALLS))
def test_a_limit_the_kernel_refuses_on_a_new_task_leaves_no_directory(cgroup2_manager, cgroup2_root, call):
    # v1 refuses a child CFS quota above its parent's (kernel/sched/core.c, tg_cfs_schedulable_down):
    # the one limit write this host's kernel refuses after every value check passed.
    cgroup2_manager.set_limits(Limits(cpus=1))
    if not _cpu_in_v1(cgroup2_manager):
        pytest.skip("needs the cpu controller in a v1 hierarchy (a hybrid host)")
    refused = REFUSED_CALLS[call]
    before = hierarchies(cgroup2_root)
    for _ in range(2):  # the second time the task is new again: the first left nothing behind
        with pytest.raises(KernelError, match="cfs_quota_us"):
            refused(cgroup2_manager)
        assert hierarchies(cgroup2_root) == before   # neither the v2 task directory nor its v1 ones
    # a task that exists keeps its directories (another turn of it is there)
    kept = cgroup2_manager.begin_turn("refused", "kept", limits=Limits(pids_max=10))
    try:
        with_kept = hierarchies(cgroup2_root)
        with pytest.raises(KernelError):
            refused(cgroup2_manager)
        assert hierarchies(cgroup2_root) == with_kept
    finally:
        kept.abandon("test", grace=0)


def test_run_with_a_refused_limit_exits_125_and_leaves_no_directory(cgroup2_manager, cgroup2_root, state_dir):
    cgroup2_manager.set_limits(Limits(cpus=1))
    if not _cpu_in_v1(cgroup2_manager):
        pytest.skip("needs the cpu controller in a v1 hierarchy (a hybrid host)")
    before = hierarchies(cgroup2_root)
    out = cli(cgroup2_root, state_dir, "run", "--task", "refused", "--cpus", "2", "--", "echo", "ran")
    assert out.returncode == 125 and one_line(out.stderr) and out.stdout == "", out.stderr
    assert hierarchies(cgroup2_root) == before


# --- a memory limit too small to start the command -------------------------------------------------

# `run` without its sentinel: what these check is how CMD starts inside the limit, and the sentinel's
# own start has a bound of its own (sentinel.READY_TIMEOUT, then 10 s) that the test host under emulation
# and a loaded machine missed (exit 125, "the sentinel could not start": the right answer to another
# question). The sentinel's start is tested in tests/test_sentinel*.py.
NO_SENTINEL = {**os.environ, "CGTURN_SENTINEL": "0"}


@pytest.mark.parametrize("size", ["0", "1", "2", "4095", "4096", "4K", "8K", "16K", "64K"])
def test_a_memory_limit_too_small_to_start_cmd_exits_125_naming_it(cgroup2_root, state_dir, size):
    # Below one page (0-4095 here) `run` refuses before anything is made: the kernel rounds the limit to
    # 0 pages and the clone3 child could not even report its failed exec (it "exited 255").
    out = cli(cgroup2_root, state_dir, "run", "--memory", size, "--", "echo", "ran", env=NO_SENTINEL)
    assert out.stdout == ""
    if out.returncode == 137:  # the shim (or the exec chain) was OOM-killed before CMD: the limit line
        assert "memory limit" in out.stderr and "Traceback" not in out.stderr
    else:
        assert out.returncode == 125 and one_line(out.stderr), (out.returncode, out.stderr)
        assert "memory limit" in out.stderr and "cannot start echo" in out.stderr
    if limits_module.parse_size(size) < os.sysconf("SC_PAGE_SIZE"):
        assert "less than one page" in out.stderr and hierarchies(cgroup2_root) == []


@pytest.mark.parametrize("size", ["1M", "256M"])
def test_a_memory_limit_that_fits_runs_cmd(cgroup2_root, state_dir, size):
    out = cli(cgroup2_root, state_dir, "run", "--memory", size, "--", "echo", "ran", env=NO_SENTINEL)
    assert (out.returncode, out.stdout, out.stderr) == (0, "ran\n", "")


@pytest.mark.parametrize("pages", [1, 2, 4, 16])
@pytest.mark.parametrize("path", testing.SPAWN_PATHS)
def test_each_spawn_path_gives_a_documented_outcome_in_a_tiny_memory_limit(cgroup2_manager, path, pages):
    """A few pages: the exec fails and says so, or what started is OOM-killed and counted; never a
    hang (glibc's posix_spawn child is in vfork, which the OOM killer skips), never a clean exit."""
    why = testing.spawn_path_unavailable(path)
    if why:
        pytest.skip(why)
    turn = cgroup2_manager.begin_turn("tiny", limits=Limits(memory_max=pages * os.sysconf("SC_PAGE_SIZE")))
    try:
        with testing.forced_spawn_path(path):
            try:
                proc = turn.spawn(["echo", "ran"], stdout=subprocess.PIPE)
            except OSError as err:  # the exec failed inside the limit and said so
                assert err.errno in (errno.ENOMEM, errno.E2BIG)
            else:  # the shim (or the exec chain) was OOM-killed before the target: the kernel counts it
                out, _ = proc.communicate(timeout=30)
                assert (proc.returncode, out) == (-9, b"")
                assert turn.usage().oom_kills >= 1
    finally:
        turn.abandon("test", grace=0)


def assert_refused_under_one_page(turn) -> None:
    """Turn.spawn raises ENOMEM naming the page, and nothing of it runs in the turn."""
    with pytest.raises(OSError) as err:
        proc = turn.spawn(["echo", "ran"], stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"spawn looked clean: the process exited {proc.returncode} with {out!r}")
    assert err.value.errno == errno.ENOMEM and "less than one page" in str(err.value), err.value
    assert turn.pids() == []


@pytest.mark.parametrize("path", testing.SPAWN_PATHS)
def test_a_memory_limit_under_one_page_is_a_clear_spawn_error(cgroup2_manager, path):
    """Below one page the kernel leaves a spawn no memory at all: the native child cannot even write
    its failed exec to its pipe (the pipe's buffer is charged to its memory cgroup), glibc's vfork
    child may hang its caller, and the shim is OOM-killed before it can speak. Turn.spawn raises
    ENOMEM on every path, from the turn's record alone — never a process that seems to have started
    and exits 255."""
    why = testing.spawn_path_unavailable(path)
    if why:
        pytest.skip(why)
    turn = cgroup2_manager.begin_turn("tiny", limits=Limits(memory_max=100))
    try:
        with testing.forced_spawn_path(path):
            assert_refused_under_one_page(turn)
    finally:
        turn.abandon("test", grace=0)


@pytest.mark.parametrize("path", testing.SPAWN_PATHS)
def test_a_limit_lowered_under_one_page_behind_the_callers_record_is_still_refused(cgroup2_manager, path):
    """Another process (here another manager, as `cgturn limits T U --memory 100` would be) lowers the
    turn's limit after this Turn read its record: the spawn's own look at the record (under the turn's
    lock on the native paths, after the move on the shim's) refuses it, and nothing ran."""
    why = testing.spawn_path_unavailable(path)
    if why:
        pytest.skip(why)
    turn = cgroup2_manager.begin_turn("lowered")
    try:
        with testing.forced_spawn_path(path):
            # A clone3 spawn remembers the record it cleared. (No limit before it: on a hybrid host v1
            # refuses a limit under what a cgroup holds, EBUSY, and the v1 directories made for the
            # new limit hold nothing yet.)
            turn.spawn(["true"]).wait(timeout=30)
            with TurnManager(root=cgroup2_manager.root, state_dir=cgroup2_manager.state_dir) as other:
                other.turn("lowered", turn.turn_id).set_limits(Limits(memory_max=100))
            assert_refused_under_one_page(turn)
    finally:
        turn.abandon("test", grace=0)


@pytest.mark.parametrize("level", ["task", "root"])
@pytest.mark.parametrize("size", [0, 100, os.sysconf("SC_PAGE_SIZE") - 1])
def test_a_budget_under_one_page_is_refused_where_it_is_set_and_nothing_changes(cgroup2_manager, cgroup2_root,
                                                                                  level, size):
    """A task's or the root's memory budget under one page would let the kernel make no turn below it
    (a cgroup's own structures are charged to its parent: ENOMEM at mkdir) and start nothing in the
    turns already there: refused by the call that sets it, before anything is made or written."""
    set_budget = (lambda limits: cgroup2_manager.set_task_limits("tiny", limits)) if level == "task" \
        else cgroup2_manager.set_limits
    existing = cgroup2_manager.begin_turn("other")
    try:
        before = hierarchies(cgroup2_root)
        with pytest.raises(ValueError, match="less than one page"):
            set_budget(Limits(memory_max=size))
        assert hierarchies(cgroup2_root) == before
        assert cgroup2_manager.task_limits("other").memory_max is None and cgroup2_manager.limits().memory_max is None
        set_budget(Limits(memory_max=os.sysconf("SC_PAGE_SIZE") * 64 * 1024))  # a page and up is taken
    finally:
        existing.abandon("test", grace=0)


def test_cli_limits_refuses_a_budget_under_one_page_with_exit_2(cgroup2_root, state_dir, capsys):
    code = main(["--root", cgroup2_root, "--state-dir", state_dir, "limits", "t", "--memory", "100"])
    captured = capsys.readouterr()
    assert code == 2 and one_line(captured.err) and "less than one page" in captured.err, captured.err
    assert hierarchies(cgroup2_root) == [] and os.listdir(state_dir) == []


def test_the_clone3_child_reports_its_errno_when_its_pipe_cannot_take_it(cgroup2_manager, monkeypatch):
    """Past the record's check (a limit file lowered behind cgturn's back): the clone3 child's failed
    exec still reaches the parent, through the memory it shares with it until exec, though its memory
    cgroup cannot grow the pipe's buffer for its report."""
    why = testing.spawn_path_unavailable("clone3")
    if why:
        pytest.skip(why)
    from cgturn.backends import shim

    monkeypatch.setattr(shim, "refuse_under_one_page", lambda *args: None)
    turn = cgroup2_manager.begin_turn("tiny", limits=Limits(memory_max=100))
    try:
        with testing.forced_spawn_path("clone3"), pytest.raises(OSError) as err:
            proc = turn.spawn(["echo", "ran"], stdout=subprocess.PIPE)
            pytest.fail(f"spawn looked clean: the process exited {proc.wait(timeout=30)}")
        assert err.value.errno in (errno.ENOMEM, errno.E2BIG), err.value
    finally:
        turn.abandon("test", grace=0)


# --- pass_fds as Popen checks it, on every spawn path ----------------------------------------------

@pytest.mark.parametrize("fds", [(2 ** 32 + 1,), (-1,), (2 ** 31,), (2 ** 70,), (3, -5)])
@pytest.mark.parametrize("path", testing.SPAWN_PATHS)
def test_out_of_range_pass_fds_raise_value_error_as_popen_does(cgroup2_manager, path, fds):
    why = testing.spawn_path_unavailable(path)
    if why:
        pytest.skip(why)
    with pytest.raises(ValueError, match="bad value") as reference:
        subprocess.Popen(["true"], pass_fds=fds)
    turn = cgroup2_manager.begin_turn("fds")
    try:
        with testing.forced_spawn_path(path), pytest.raises(ValueError) as ours:
            turn.spawn(["true"], pass_fds=fds)
        assert str(ours.value) == str(reference.value)
        assert turn.pids() == []
    finally:
        turn.abandon("test", grace=0)


# --- ids in the tables ------------------------------------------------------------------------------

HOSTILE_TASK = "evil\x1b[2J\x1b]0;owned\x07"
HOSTILE_TURN = "split\nrow\u202e"


def test_ps_and_watch_escape_ids_and_json_keeps_them_exact(cgroup2_manager, cgroup2_root, state_dir):
    turn = cgroup2_manager.begin_turn(HOSTILE_TASK, HOSTILE_TURN)
    try:
        for args in (("ps",), ("watch", "--once")):
            out = cli(cgroup2_root, state_dir, *args)
            assert out.returncode == 0, out.stderr
            assert "\x1b" not in out.stdout and "\x07" not in out.stdout and "\u202e" not in out.stdout
            row = [line for line in out.stdout.splitlines() if "evil" in line]
            assert len(row) == 1 and repr(HOSTILE_TASK) in row[0] and repr(HOSTILE_TURN) in row[0]
            assert len(out.stdout.splitlines()) == (2 if args == ("ps",) else 3)
        import json
        rows = json.loads(cli(cgroup2_root, state_dir, "ps", "--json").stdout)
        assert [(r["task"], r["turn"]) for r in rows] == [(HOSTILE_TASK, HOSTILE_TURN)]
    finally:
        turn.abandon("test", grace=0)


def test_end_quotes_the_ids_it_leaves_as_stop_does(cgroup2_manager, cgroup2_root, state_dir):
    # `cgturn end` run from inside one of the task's turns must leave that turn (it holds the caller)
    # and name it on its "still present" line.
    turn = cgroup2_manager.begin_turn(HOSTILE_TASK, HOSTILE_TURN)
    try:
        proc = turn.spawn(cgturn_argv(cgroup2_root, state_dir, "end", "--grace", "0", HOSTILE_TASK),
                          env=cgturn_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err
        assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
        left = [line for line in out.splitlines() if line.startswith("still present: ")]
        assert left == [f"still present: {HOSTILE_TURN!r}"], out
    finally:
        turn.abandon("test", grace=0)


def test_printable_ids_show_as_they_are(cgroup2_manager, cgroup2_root, state_dir):
    turn = cgroup2_manager.begin_turn("telegram:123 ü", "turn-1")
    try:
        out = cli(cgroup2_root, state_dir, "ps")
        assert "telegram:123 ü" in out.stdout and "'" not in out.stdout
    finally:
        turn.abandon("test", grace=0)


# --- the state directory is an absolute path, as the root is ---------------------------------------

@pytest.mark.parametrize("where", ["before", "after", "env"])
@pytest.mark.parametrize("command", [["run", "--", "true"], ["ps"]])
def test_a_relative_state_dir_exits_2_and_creates_nothing(cgroup2_root, tmp_path, where, command):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = cgturn_env()
    argv = [PY, "-m", "cgturn", "--root", cgroup2_root]
    if where == "before":
        argv += ["--state-dir", "rel", *command]
    elif where == "after":
        argv += [command[0], "--state-dir", "rel", *command[1:]]
    else:
        argv += command
        env["CGTURN_STATE_DIR"] = "rel"
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=cwd)
    assert out.returncode == 2 and one_line(out.stderr), out.stderr
    assert "not an absolute path" in out.stderr
    assert os.listdir(cwd) == [] and hierarchies(cgroup2_root) == []


def test_turn_manager_refuses_a_relative_state_dir(cgroup2_root, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="not an absolute path"):
        TurnManager(root=cgroup2_root, state_dir="rel")
    monkeypatch.setenv("CGTURN_STATE_DIR", "rel/state")
    with pytest.raises(ValueError, match="not an absolute path"):
        TurnManager(root=cgroup2_root)
    assert os.listdir(tmp_path) == []


def test_the_limit_options_help_states_the_bounds():
    from cgturn.cli.common import LIMIT_OPTIONS
    helps = {option: text for option, _, _, text in LIMIT_OPTIONS}
    assert str(MAX_PIDS) in helps["--pids"] and str(MIN_CPUS) in helps["--cpus"]
