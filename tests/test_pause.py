"""Pause and resume on both backends (the `manager` fixture is parametrised), through the library and
the real CLI: the processes really stop (they stop writing to a pipe; the registry's are in state T),
run again after a resume, die when the paused turn is abandoned; refusals and audit records."""
import json
import os
import select
import signal
import subprocess

import pytest

from cgturn import NoSuchTurn, UnsafeOperation
from cgturn.kernel import procfs
from conftest import PY, alive, audit_records, cli, wait_until

# Prints a line every 20 ms: while it is frozen the pipe stays empty.
TICKER = [PY, "-c", "import os, time\nwhile True:\n    os.write(1, b'tick\\n')\n    time.sleep(0.02)"]
# How long a frozen ticker must stay silent: 15 ticks' worth (no timed assertion on how fast it stops).
QUIET = 0.3


def cli_of(manager, *args):
    """The real `cgturn` CLI on `manager`'s root or registry."""
    return cli(manager.root, manager.state_dir, *args, backend=manager.backend_name)


def drain(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out


def silent_for(fd: int, seconds: float) -> bool:
    """True if nothing arrives on `fd` for `seconds` (the writer is stopped)."""
    drain(fd)
    return not select.select([fd], [], [], seconds)[0]


def ticks_again(fd: int) -> bool:
    if not select.select([fd], [], [], 10)[0]:
        return False
    data = os.read(fd, 65536)
    assert b"tick" in data, data
    return True


def stopped(pid: int) -> bool:
    st = procfs.stat(pid)
    return st is not None and st.state in ("T", "t")


def test_pause_and_resume_round_trip_in_the_library(manager):
    turn = manager.begin_turn("pause", "lib")
    ticker = turn.spawn(TICKER, stdout=subprocess.PIPE)
    fd = ticker.stdout.fileno()
    assert ticks_again(fd)
    assert turn.freeze() == [ticker.pid]
    assert turn.frozen and turn.record.frozen_by == "user"
    assert silent_for(fd, QUIET)
    if manager.backend_name == "registry":
        assert stopped(ticker.pid)
    [info] = manager.turns("pause", detail=True)
    assert info.frozen is True
    assert turn.thaw() == [ticker.pid]
    assert not turn.frozen and turn.record.frozen_by is None and turn.record.frozen_seconds > 0
    assert ticks_again(fd)
    turn.abandon("test", grace=0)
    assert ticker.wait(timeout=10) == -signal.SIGKILL
    actions = [(r["action"], r["reason"], r["pids"]) for r in audit_records(manager.state_dir, "lib")
               if r.get("action") in ("freeze", "thaw")]
    assert actions == [("freeze", "user", [ticker.pid]), ("thaw", "user", [ticker.pid])]


def test_cli_pause_resume_and_ps_show_it(manager):
    turn = manager.begin_turn("pause", "cli")
    ticker = turn.spawn(TICKER, stdout=subprocess.PIPE)
    fd = ticker.stdout.fileno()
    assert ticks_again(fd)
    out = cli_of(manager, "pause", "pause", "cli")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"paused turn 'cli' of task 'pause': 1 process(es) {ticker.pid}"
    assert silent_for(fd, QUIET)
    rows = json.loads(cli_of(manager, "ps", "--json").stdout)
    assert [(r["turn"], r["frozen"]) for r in rows] == [("cli", True)]
    table = cli_of(manager, "ps").stdout.splitlines()
    # EVENTS lists what holds, comma-separated: a loaded host adds the turn's pressure (psi:cpu=…).
    assert table[0].split()[-1] == "EVENTS" and "frozen" in table[1].split()[-1].split(",")
    out = cli_of(manager, "resume", "pause", "cli", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"task": "pause", "turn": "cli", "frozen": False, "pids": [ticker.pid]}
    assert ticks_again(fd)
    assert json.loads(cli_of(manager, "ps", "--json").stdout)[0]["frozen"] is False
    turn.abandon("test", grace=0)


def test_cli_pause_of_no_such_turn_exits_1(manager):
    manager.begin_turn("pause", "there")
    for command in ("pause", "resume"):
        out = cli_of(manager, command, "pause", "not-there")
        assert out.returncode == 1
        assert out.stderr.startswith("cgturn: no turn 'not-there' in task 'pause'")
    out = cli_of(manager, "pause", "pause", "   ")
    assert out.returncode == 2


def test_abandon_of_a_paused_turn_kills_it(manager):
    turn = manager.begin_turn("pause", "kill")
    # Both ignore SIGTERM: a default SIGTERM is fatal even to a frozen task (the kernel turns it into
    # a group exit when it is sent, kernel/signal.c complete_signal), so only the SIGKILL may end them.
    ticker = turn.spawn([*TICKER[:2], "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + TICKER[-1]],
                        stdout=subprocess.PIPE)
    child = turn.spawn(["sh", "-c", "trap '' TERM; sleep 300 & wait"])
    assert ticks_again(ticker.stdout.fileno())  # past its signal() call
    assert wait_until(lambda: len(turn.pids()) == 3)  # the shell is past its trap
    pids = turn.pids()
    turn.freeze()
    # a grace that the frozen processes cannot use: SIGTERM stays pending, SIGKILL ends them
    result = turn.abandon("test", grace=0.2)
    assert not result.skipped and set(pids) <= set(result.killed)
    assert ticker.wait(timeout=10) == -signal.SIGKILL and child.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: not any(alive(pid) for pid in pids))
    assert manager.turns("pause") == []
    with pytest.raises(NoSuchTurn):
        manager._control.freeze_turn(*turn.names)


def test_a_completed_turns_survivor_can_be_paused(manager):
    turn = manager.begin_turn("pause", "done")
    ticker = turn.spawn(TICKER, stdout=subprocess.PIPE)
    assert ticks_again(ticker.stdout.fileno())
    turn.complete()
    assert turn.freeze() == [ticker.pid]
    assert silent_for(ticker.stdout.fileno(), QUIET)
    turn.thaw()
    assert ticks_again(ticker.stdout.fileno())
    manager.end_task("pause", grace=0)
    assert ticker.wait(timeout=10) == -signal.SIGKILL


def test_freeze_is_refused_when_the_turn_holds_the_caller(manager):
    turn = manager.begin_turn("pause", "me")
    sleeper = turn.spawn(["sleep", "300"])
    turn.enter()
    try:
        with pytest.raises(UnsafeOperation, match="calling process"):
            turn.freeze()
        # The CLI is the caller's child, so inside too (on the registry: a descendant of a member).
        # Started without the turn's variables: the registry's orphan reaper would take a tagged
        # child of this process for a turn orphan and reap it before subprocess could read its status.
        env = {k: v for k, v in os.environ.items() if not k.startswith("CGTURN_")}
        out = cli(manager.root, manager.state_dir, "pause", "pause", "me", backend=manager.backend_name, env=env)
    finally:
        manager.leave_turn()
    assert out.returncode == 1 and "refusing" in out.stderr, (out.stdout, out.stderr)
    assert turn.record.frozen_by is None and not stopped(sleeper.pid)
    assert [r for r in audit_records(manager.state_dir, "me") if r.get("action") == "freeze"] == []
    turn.abandon("test", grace=0)
