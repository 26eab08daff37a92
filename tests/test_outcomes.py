"""A supervised turn abandoned by someone else: the outcome carries that abandon's reason, killer and
kill, and `on_interrupt` fires with that reason (both backends, real processes, a real CLI)."""
import asyncio
import json
import os
import signal
import subprocess
import threading

from cgturn import Supervisor, outcomes
from conftest import alive, audit_records, cgturn_argv, cgturn_env, wait_until

SLEEP = ["sleep", "300"]


def _cli_stop(manager, task, turn, *extra):
    """`cgturn stop` as a real process; returns (its pid, its status)."""
    argv = cgturn_argv(manager.root, manager.state_dir, "stop", task, turn, *extra, backend=manager.backend_name)
    proc = subprocess.Popen(argv, env=cgturn_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return proc.pid, proc.returncode


def test_cli_stop_while_a_coroutine_worker_runs(manager):
    """The worker waits on nothing the kill touches: the watchdog notices the abandon by another process."""
    turn = manager.begin_turn("gw", "ext-1")
    pid = turn.spawn(SLEEP).pid
    interrupts = []
    stopper = {}

    async def main():
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        sup = Supervisor(turn, on_interrupt=lambda r: (interrupts.append(r), loop.call_soon_threadsafe(stopped.set)),
                         use_sentinel=False)

        async def worker():
            await asyncio.wait_for(stopped.wait(), 60)
            return "unreached"

        async def stop_later():
            await asyncio.sleep(0)
            stopper["pid"], _ = await asyncio.to_thread(_cli_stop, manager, "gw", "ext-1", "--reason", "operator")

        outcome, _ = await asyncio.gather(sup.run(worker), stop_later())
        return outcome

    outcome = asyncio.run(main())
    assert outcome.abandoned and outcome.external and outcome.reason == "operator"
    assert outcome.killed_by == stopper["pid"] and outcome.abandon.killed_by == stopper["pid"]
    assert pid in outcome.abandon.killed and outcome.abandon.skipped is False
    assert interrupts == ["operator"]
    assert not alive(pid)
    assert os.listdir(os.path.join(manager.state_dir, outcomes.NOTES_DIR)) == []  # the owner took its note


def test_end_task_in_another_thread_while_a_blocking_worker_waits(manager):
    """The worker waits for its command, which the kill ends: the outcome is end_task's, not `completed`."""
    turn = manager.begin_turn("gw", "ext-2")
    proc = turn.spawn(SLEEP)
    interrupts = []
    sup = Supervisor(turn, on_interrupt=interrupts.append, use_sentinel=False)
    killer = threading.Thread(target=lambda: wait_until(lambda: alive(proc.pid)) and manager.end_task("gw", grace=0),
                              daemon=True)

    def worker():
        # The other thread starts from the worker, so the supervision is under way when it kills (a
        # thread started before run_blocking could end the turn before the supervisor watched it).
        killer.start()
        return proc.wait(timeout=60)

    outcome = sup.run_blocking(worker)
    assert outcome.abandoned and outcome.external and outcome.reason == "end-task"
    assert outcome.killed_by == os.getpid() and outcome.abandon.killed == [proc.pid]
    assert interrupts == ["end-task"]


def test_a_note_for_a_dead_owner_is_swept_by_reap(manager, tmp_path):
    """A kill by another process leaves a note; reap removes it once its owner is gone."""
    state = manager.state_dir
    outcomes.write_note(state, {"task_key": "t", "turn_key": "u", "started_at": 1.0, "owner_pid": 2 ** 22 + 7,
                                "owner_start": 1, "reason": "stop", "killed_by": 1, "killed": [], "signals": [],
                                "duration_ms": 0.0})
    mine = {"task_key": "t", "turn_key": "v", "started_at": 2.0, "owner_pid": os.getpid(),
            "owner_start": _my_start(), "reason": "stop", "killed_by": 1, "killed": [5], "signals": [],
            "duration_ms": 0.0}
    outcomes.write_note(state, mine)
    manager.reap()
    assert outcomes.take_note(state, "t", "u", 1.0) is None  # its owner does not exist: swept
    assert outcomes.take_note(state, "t", "v", 1.5) is None  # not this turn's (another start time)
    assert outcomes.take_note(state, "t", "v", 2.0) == mine
    assert outcomes.take_note(state, "t", "v", 2.0) is None  # taken once


def _my_start():
    from cgturn.kernel import procfs

    return procfs.start_time(os.getpid())


def test_end_task_terms_then_kills_with_one_grace_and_true_figures(manager):
    """SIGTERM to every turn (the graces run side by side), SIGKILL after `grace`; duration_ms is real."""
    polite = manager.begin_turn("eg", "polite").spawn(SLEEP)
    done = manager.begin_turn("eg", "done")
    survivor = done.spawn(SLEEP)
    done.complete()
    stubborn_turns = [manager.begin_turn("eg", f"stubborn-{i}") for i in range(2)]
    stubborn = [t.spawn(["sh", "-c", "trap '' TERM; echo ready; exec sleep 300"], stdout=subprocess.PIPE, text=True)
                for t in stubborn_turns]
    assert [p.stdout.readline() for p in stubborn] == ["ready\n", "ready\n"]
    result = manager.end_task("eg", grace=0.5)
    assert polite.wait(timeout=10) == survivor.wait(timeout=10) == -signal.SIGTERM
    assert [p.wait(timeout=10) for p in stubborn] == [-signal.SIGKILL] * 2
    assert set(result.killed) >= {polite.pid, survivor.pid, *(p.pid for p in stubborn)}
    assert result.signals == ["SIGKILL", "SIGTERM"] and result.refused == [] and result.killed_by == os.getpid()
    assert result.duration_ms >= 500  # it waited out the grace (figures, not timing: the floor is the grace)
    kills = [r for r in audit_records(manager.state_dir) if r.get("task") == "eg"]
    assert sorted(r["turn"] for r in kills) == ["done", "polite", "stubborn-0", "stubborn-1"]
    assert manager.turns("eg") == []


def test_cli_end_with_grace_and_reason(manager):
    proc = manager.begin_turn("ce", "t").spawn(SLEEP)
    argv = cgturn_argv(manager.root, manager.state_dir, "end", "ce", "--grace", "5", "--reason", "session-over",
                       "--json", backend=manager.backend_name)
    out = subprocess.run(argv, env=cgturn_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["killed"] == [proc.pid] and data["signals"] == ["SIGTERM"] and data["refused"] == []
    assert data["reason"] == "session-over" and data["duration_ms"] > 0
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert audit_records(manager.state_dir, "t")[-1]["reason"] == "session-over"


def test_async_counterparts_never_block_the_loop(manager):
    """aabandon, aend_task and aabandon_disconnected wait out a grace (SIGTERM ignored) in a thread: the
    loop keeps running meanwhile (a ticker advances), and each returns the sync call's result."""
    from cgturn import Run, aabandon_disconnected

    stubborn = ["sh", "-c", "trap '' TERM; echo ready; exec sleep 300"]

    def start(task, turn_id):
        turn = manager.begin_turn(task, turn_id)
        proc = turn.spawn(stubborn, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        return turn, proc

    async def ticking(coro):
        ticks = 0
        task = asyncio.ensure_future(coro)
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return await task, ticks

    async def main():
        turn, proc = start("as", "a")
        one, ticks_a = await ticking(turn.aabandon("bye", grace=0.3))
        assert one.killed == [proc.pid] and one.signals == ["SIGTERM", "SIGKILL"] and ticks_a > 1
        _, proc2 = start("as", "b")
        two, ticks_b = await ticking(manager.aend_task("as", grace=0.3))
        assert two.killed == [proc2.pid] and ticks_b > 1
        turn3, proc3 = start("as", "c")
        run = Run("r")
        run.mark("as", turn3)
        three, ticks_c = await ticking(aabandon_disconnected(run, grace=0.3))
        assert three.killed == [proc3.pid] and three.reason == "disconnect" and ticks_c > 1
        assert await aabandon_disconnected(Run("idle")) is None

    asyncio.run(main())


def test_a_kill_that_loses_the_mark_to_another_process_waits_for_that_kill(manager):
    """The watchdog decides the timeout, but another process marks the turn abandoned first and is still
    killing (the sentinel's copy of the timeout wins this way on a loaded host): the supervisor's own
    abandon is skipped, and the outcome is that other kill's, given once it is done, never a skipped
    kill with the turn's processes still alive."""
    turn = manager.begin_turn("gw", "lost-mark")
    proc = turn.spawn(["sh", "-c", "trap '' TERM; echo ready; exec sleep 300"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    stopper = []

    def other_process_marks_first():
        # Called by the supervisor's kill just before its abandon: `cgturn stop` marks the turn, then
        # waits out its grace on the process that ignores SIGTERM, while this abandon goes on.
        argv = cgturn_argv(manager.root, manager.state_dir, "stop", "gw", "lost-mark", "--reason", "operator",
                           "--grace", "3", backend=manager.backend_name)
        stopper.append(subprocess.Popen(argv, env=cgturn_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True))
        assert wait_until(lambda: turn.record.state == "abandoned", timeout=60)
        return True

    interrupts = []
    release = threading.Event()
    sup = Supervisor(turn, timeout=0.2, grace=0, use_sentinel=False, is_still_current=other_process_marks_first,
                     on_interrupt=lambda why: (interrupts.append(why), release.set()))
    outcome = sup.run_blocking(lambda: release.wait(60))
    assert not alive(proc.pid), "the outcome came while the turn's process was still alive"
    assert outcome.abandoned and outcome.reason == "timeout" and interrupts == ["timeout"]
    assert outcome.external and outcome.killed_by == stopper[0].pid
    assert outcome.abandon.skipped is False and outcome.abandon.killed == [proc.pid]
    assert outcome.abandon.reason == "operator" and outcome.abandon.signals == ["SIGTERM", "SIGKILL"]
    assert [r["reason"] for r in audit_records(manager.state_dir, "lost-mark")] == ["operator"]
    _, err = stopper[0].communicate(timeout=60)
    assert stopper[0].returncode == 0, err
