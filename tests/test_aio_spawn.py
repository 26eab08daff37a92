"""`await Turn.create_subprocess_exec/_shell` (cgturn/kernel/aioprocess.py): an asyncio Process in the
turn before its program runs, its exit watched through a pidfd (no thread per child), and pipes that
end when the command exits even while a server it left running holds them. Every spawn path:
the cgroup2 backend's native clone3 and posix_spawn paths and its shim (each forced), and the registry backend.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest

from cgturn import AlreadyRunning, NoSuchTurn, TurnManager
from conftest import alive, destroy_registry, force_spawn_path, wait_until

pytestmark = [pytest.mark.cgroup2, pytest.mark.root]

PIPE = subprocess.PIPE


@pytest.fixture(params=["clone3", "posix_spawn", "shim", "registry"])
def turn(request, monkeypatch, tmp_path):
    """A running turn, its spawns forced down one path (torn down with its manager)."""
    force_spawn_path(monkeypatch, request.param)
    if request.param == "registry":
        mgr = TurnManager(backend="registry", state_dir=str(tmp_path / "state"))
        try:
            yield mgr.begin_turn("aio")
        finally:
            destroy_registry(mgr)
    else:
        yield request.getfixturevalue("cgroup2_manager").begin_turn("aio")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_the_process_is_in_its_turn_from_its_first_act(turn):
    async def main():
        proc = await turn.create_subprocess_exec("cat", "/proc/self/cgroup", "/proc/self/environ", stdout=PIPE)
        out, _ = await proc.communicate()
        return proc, out

    proc, out = run(main())
    assert isinstance(proc, asyncio.subprocess.Process)
    assert proc.returncode == 0
    if turn.manager.backend.name == "cgroup2":
        task_key, turn_key = turn.names
        assert f"0::/{os.path.basename(turn.manager.backend.root.path)}/{task_key}/{turn_key}\n".encode() in out
    assert f"CGTURN_TURN={turn.names[1]}".encode() in out


def test_pipes_end_when_the_command_exits_while_its_server_keeps_them(turn, tmp_path):
    """The README's gateway case: the command backgrounds a server that holds stdout. communicate()
    returns at the command's exit with all the command wrote (more than a pipe holds); the server
    keeps running, and its later output (a megabyte, written after the loop that started it is gone:
    it would block on a full pipe, or die of SIGPIPE on a closed one) is drained until it finishes."""
    done = tmp_path / "server-wrote-everything"
    script = (f"(sleep 0.3; head -c 1048576 /dev/zero && touch {done}; exec sleep 300) & "
              "head -c 200000 /dev/zero | tr '\\0' x; echo $! >&2")

    async def main():
        proc = await turn.create_subprocess_shell(script, stdout=PIPE, stderr=PIPE)
        out, err = await proc.communicate()
        return proc, out, err

    proc, out, err = run(main())
    assert proc.returncode == 0
    assert out == b"x" * 200000
    server = int(err)
    assert server in turn.pids() and alive(server)
    assert wait_until(done.exists, timeout=30), "the server blocked on (or died of) the pipe the command left it"
    assert alive(server)


def test_streaming_lines_ends_at_exit_and_wait_returns(turn):
    async def main():
        proc = await turn.create_subprocess_shell("sleep 300 & echo one; echo two", stdout=PIPE)
        lines = [line async for line in proc.stdout]
        return lines, await proc.wait()

    lines, code = run(main())
    assert lines == [b"one\n", b"two\n"]
    assert code == 0
    assert len(turn.pids()) == 1  # the sleep, kept


def test_until_exit_false_reads_to_end_of_file_as_asyncio(turn):
    async def main():
        proc = await turn.create_subprocess_shell("(sleep 0.2; echo late) & echo early", stdout=PIPE,
                                                  until_exit=False)
        out, _ = await proc.communicate()
        return out

    assert run(main()) == b"early\nlate\n"


def test_stdin_pipe_and_exit_status(turn):
    async def main():
        proc = await turn.create_subprocess_exec("sh", "-c", "read line; echo got $line; exit 3",
                                                 stdin=PIPE, stdout=PIPE)
        out, _ = await proc.communicate(b"hello\n")
        return proc.returncode, out

    assert run(main()) == (3, b"got hello\n")


def test_exits_are_watched_without_a_thread_per_child(turn):
    before = threading.active_count()

    async def main():
        procs = [await turn.create_subprocess_exec("sleep", "0.3") for _ in range(20)]
        during = threading.active_count()
        codes = await asyncio.gather(*(p.wait() for p in procs))
        return during, codes

    during, codes = run(main())
    assert codes == [0] * 20
    # The registry backend's reaper thread may start with the first spawn; nothing per child.
    assert during <= before + 1


def test_an_abandon_ends_the_wait_with_the_signal(turn):
    async def main():
        proc = await turn.create_subprocess_exec("sleep", "300")
        assert wait_until(lambda: proc.pid in turn.pids())
        result = await turn.aabandon("stop", grace=0)
        return proc.pid, await proc.wait(), result

    pid, code, result = run(main())
    assert code == -9
    assert pid in result.killed


def test_exec_failure_raises_as_asyncio_and_starts_nothing(turn):
    async def main():
        with pytest.raises(FileNotFoundError):
            await turn.create_subprocess_exec("/nonexistent/program")
        proc = await turn.create_subprocess_exec("true")
        return await proc.wait()

    assert run(main()) == 0


@pytest.mark.parametrize("option", [{"text": True}, {"encoding": "utf-8"}, {"universal_newlines": True},
                                    {"bufsize": 1}, {"executable": "/bin/true"}])
def test_refused_options_start_nothing(turn, option):
    async def main():
        with pytest.raises(ValueError):
            await turn.create_subprocess_exec("sleep", "300", **option)

    run(main())
    assert turn.pids() == []


def test_a_turn_that_ended_refuses(turn):
    turn.complete()

    async def main():
        with pytest.raises(NoSuchTurn):
            await turn.create_subprocess_exec("true")

    run(main())


def test_a_key_holds_one_instance(turn):
    async def main():
        first = await turn.create_subprocess_exec("sleep", "300", key="dev-server")
        with pytest.raises(AlreadyRunning) as err:
            await turn.create_subprocess_exec("sleep", "300", key="dev-server")
        return first.pid, err.value.pid

    first, holder = run(main())
    assert first == holder


@pytest.mark.parametrize("shell", [False, True])
def test_popen_args_are_what_the_caller_passed(turn, shell):
    argv = "echo $0" if shell else ["echo", "hi"]
    proc = turn.spawn(argv, shell=shell, stdout=subprocess.DEVNULL)
    proc.wait()
    assert proc.args == argv


async def ticks_during(awaitable):
    """(its result, how often a 10 ms ticker ran while it was awaited): > 0 when the loop stayed free."""
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        result = await awaitable
        return result, ticks
    finally:
        task.cancel()


def test_await_empty_waits_off_the_loop(turn):
    async def main():
        await turn.create_subprocess_exec("sleep", "0.3")
        return await ticks_during(turn.await_empty(30))

    emptied, ticks = run(main())
    assert emptied is True and turn.pids() == []
    assert ticks > 0


def test_the_manager_as_an_async_context_manager(cgroup2_root, state_dir):
    closed = []

    class Listener:
        def manager_closed(self):
            closed.append(True)

    async def main():
        async with TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir) as mgr:
            mgr.add_listener(Listener())
            turn = await mgr.abegin_turn("aio-manager")
            listed = await mgr.aturns("aio-manager")
            recovered = await mgr.arecover()
            turn.complete()
        return turn, listed, recovered

    turn, listed, recovered = run(main())
    assert [(info.task, info.turn, info.state) for info in listed] == [("aio-manager", turn.turn_id, "running")]
    assert recovered == []  # its owner (this process) lives: nothing to recover
    assert closed == [True]
