"""Code a gateway developer writes against cgturn's public API: must pass `mypy --strict` (tests/test_typing.py)."""
import asyncio
import subprocess
from typing import Any, assert_type

import cgturn
from cgturn import AbandonResult, Port, Turn, TurnEnded, TurnInfo, TurnListener, TurnManager


class Hooks(TurnListener):
    def turn_ended(self, event: TurnEnded) -> None:
        assert_type(event.reason, str | None)
        assert_type(event.killed, list[int])


def use(mgr: TurnManager) -> None:
    mgr.add_listener(Hooks())
    turn = mgr.begin_turn("task", limits=cgturn.Limits(memory_max=1 << 30))
    assert_type(turn, Turn)
    handle: cgturn.TurnHandle = turn  # what listener hooks receive: a Turn satisfies it
    assert_type(handle.names, tuple[str, str])
    assert_type(turn.record, cgturn.TurnRecord)
    proc = turn.spawn(["sleep", "1"], stdout=subprocess.DEVNULL)
    assert_type(proc, subprocess.Popen[Any])
    infos = mgr.turns("task")
    assert_type(infos, list[TurnInfo])
    assert_type(infos[0].ports, list[Port])
    assert_type(infos[0].age_seconds, float)
    assert_type(turn.abandon("stop", grace=0), AbandonResult)
    assert_type(mgr.end_task("task"), AbandonResult)


async def supervise(turn: Turn) -> None:
    outcome = await cgturn.Supervisor(turn, timeout=5).run(asyncio.sleep, 0.1)
    assert_type(outcome, cgturn.Outcome)
    assert_type(outcome.usage, cgturn.Usage | None)


async def run_async(turn: Turn) -> None:
    proc = await turn.create_subprocess_exec("sh", "-c", "echo hi", stdout=asyncio.subprocess.PIPE)
    assert_type(proc, asyncio.subprocess.Process)
    shell = await turn.create_subprocess_shell("echo hi")
    assert_type(await shell.wait(), int)
