"""cgturn.celery with the real thing: Redis (broker and results), prefork Celery workers with two pool
processes each, tasks that start a setsid daemon, a double-forking server and a busy loop with plain
subprocess. Every ending either leaves nothing the task started alive (pids and the port checked) and
audits the reason docs/celery.md gives, or keeps a completed task's server until its lease or end_task.
"""
from __future__ import annotations

import os
import signal
import types

import pytest

from celery_fleet import need_module  # noqa: E402

celery = need_module("celery")
need_module("redis")

import cgturn  # noqa: E402
import cgturn.celery as cc  # noqa: E402
from celery_fleet import (  # noqa: E402
    Redis, all_gone, fleet_env, kill_turns, need_tool, reap_orphans, spawned, start_worker,
    stop_worker, survivors, write_app)
from conftest import alive, audit_records, need_cgroup2, wait_until  # noqa: E402

pytestmark = [pytest.mark.cgroup2, pytest.mark.root]
RESULT_TIMEOUT = 60


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Redis and two prefork workers (queues `a` and `b`, concurrency 2, each its own root and state)."""
    mount = need_cgroup2()
    if os.geteuid() != 0:
        pytest.skip("needs root")
    need_tool("redis-server", "redis-server")
    tmp = str(tmp_path_factory.mktemp("celery"))
    out = write_app(tmp)
    redis = Redis(tmp)
    workers = []
    try:
        env = fleet_env(redis.url, tmp, out)
        workers = [start_worker("a", env, mount, tmp), start_worker("b", env, mount, tmp)]
        client = celery.Celery("client", broker=redis.url, backend=redis.url)
        yield Fleet(client, workers, out, env, mount, tmp, redis)
    finally:
        for w in workers:
            stop_worker(w)
        redis.stop()


class Fleet:
    def __init__(self, client, workers, out, env, mount, tmp, redis):
        self.client, self.workers, self.out, self.env = client, workers, out, env
        self.mount, self.tmp, self.redis = mount, tmp, redis
        self.a, self.b = workers

    def send(self, name, *args, queue="a", **options):
        return self.client.send_task(name, args=args, queue=queue, **options)


@pytest.fixture
def leftovers():
    """Spawn reports of the test's tasks: whatever a failed test left alive is killed at teardown."""
    reports: list[dict] = []
    yield reports
    for what in reports:
        reap_orphans(what)


def reasons_of(worker, celery_id: str) -> list[str]:
    return [r["reason"] for r in audit_records(worker.state_dir)
            if str(r.get("turn", "")).startswith(celery_id + "#") and r.get("action", "kill") == "kill"]


def wait_reason(worker, celery_id: str, timeout: float = 20) -> list[str]:
    wait_until(lambda: reasons_of(worker, celery_id), timeout=timeout)
    return reasons_of(worker, celery_id)


def turn_states(worker, celery_id: str, settled: bool = True) -> dict[str, str]:
    """The task's turns and their states; with `settled`, once none is running (Celery stores the result
    before task_postrun ends the turn, so a client may see the result first)."""
    def states():
        return {t.turn: t.state for t in worker.manager().turns() if t.turn.startswith(celery_id + "#")}
    if settled:
        wait_until(lambda: cgturn.RUNNING not in states().values(), timeout=20)
    return states()


def everything(what: dict) -> set[str]:
    """What survivors() lists while all the task started is alive."""
    return {"daemon", "server", "busy", f"port {what['port']}"}


def running_task(fleet, leftovers, queue: str, mode: str = "hang", name: str = "fleet.work", **options) -> tuple:
    """Send a task; returns (result, what it started) once all of it runs."""
    res = fleet.send(name, mode, queue=queue, **options)
    what = spawned(fleet.out, res.id)
    leftovers.append(what)
    return res, what


def failed_task(fleet, leftovers, name: str, mode: str, error, queue: str = "a") -> tuple:
    """Send a task that fails; returns (result, what it started) once the client saw the failure."""
    res = fleet.send(name, mode, queue=queue)
    with pytest.raises(error[0], match=error[1]):
        res.get(timeout=RESULT_TIMEOUT)
    what = spawned(fleet.out, res.id)
    leftovers.append(what)
    return res, what


# --- returns: the turn completes, its server lives until end_task or its lease ------------------------

def test_return_completes_and_the_server_lives_until_end_task(fleet, leftovers):
    res = fleet.send("fleet.work", "return")
    what = res.get(timeout=RESULT_TIMEOUT)
    leftovers.append(what)
    assert set(survivors(what)) == everything(what)
    assert turn_states(fleet.a, res.id) == {f"{res.id}#0": cgturn.COMPLETED}
    assert what["pool"] not in fleet.a.manager().turn(res.id, f"{res.id}#0").pids()  # the pool process left
    fleet.a.manager().end_task(res.id, grace=0)
    assert all_gone(what), survivors(what)


def test_a_lease_from_the_task_option_ends_the_survivors(fleet, leftovers):
    res = fleet.send("fleet.leased", "return", queue="b")
    what = res.get(timeout=RESULT_TIMEOUT)
    leftovers.append(what)
    assert all_gone(what, timeout=20), survivors(what)
    assert wait_reason(fleet.b, res.id) == ["lease-expired"]


def test_the_task_key_can_come_from_the_arguments(fleet, leftovers):
    res = fleet.send("fleet.session", "chat-7", "return")
    what = res.get(timeout=RESULT_TIMEOUT)
    leftovers.append(what)
    mgr = fleet.a.manager()
    assert [t.turn for t in mgr.turns("session:chat-7")] == [f"{res.id}#0"]
    mgr.end_task("session:chat-7", grace=0)
    assert all_gone(what), survivors(what)


# --- raises: abandon by default, complete when the task says so -----------------------------------------

def test_a_raising_task_is_abandoned_by_default(fleet, leftovers):
    res, what = failed_task(fleet, leftovers, "fleet.work", "raise", (RuntimeError, "the task failed"))
    assert all_gone(what), survivors(what)
    assert wait_reason(fleet.a, res.id) == ["error"]
    assert alive(what["pool"])  # the worker's pool process lives on


def test_on_error_complete_keeps_what_a_raising_task_started(fleet, leftovers):
    res, what = failed_task(fleet, leftovers, "fleet.lenient", "raise", (RuntimeError, "the task failed"))
    assert set(survivors(what)) == everything(what)
    fleet.a.manager().end_task(res.id, grace=0)
    assert all_gone(what), survivors(what)


def test_a_retry_gets_a_turn_of_its_own(fleet, leftovers):
    res = fleet.send("fleet.work", "retry-once", queue="b")
    second = res.get(timeout=RESULT_TIMEOUT)
    first = spawned(fleet.out, res.id, attempt=0)
    leftovers.extend([first, second])
    assert all_gone(first), survivors(first)
    assert turn_states(fleet.b, res.id) == {f"{res.id}#1": cgturn.COMPLETED}
    assert set(survivors(second)) == everything(second)
    assert wait_reason(fleet.b, res.id) == ["error"]
    fleet.b.manager().end_task(res.id, grace=0)
    assert all_gone(second), survivors(second)


# --- endings Celery decides: every one leaves nothing, with its reason ---------------------------------------

def revoke(fleet, res, what):
    fleet.client.control.revoke(res.id, terminate=True)


def kill_pool_process(fleet, res, what):
    os.kill(what["pool"], signal.SIGKILL)  # a pool process of a worker this test started


# (name, mode, queue, send options, what the test does once the task runs, the error the client
# gets or None, the audited reason). The time limits leave a task 5 s to start its three processes: at
# 1.5 s a loaded machine let the limit end the task before its double-forking server had started.
ENDINGS = [
    ("revoke-terminate", "hang", "a", {}, revoke, None, cc.REVOKED),
    ("soft-time-limit", "hang", "b", {"soft_time_limit": 5}, None, "SoftTimeLimitExceeded", cc.TIME_LIMIT),
    ("hard-time-limit", "hang", "a", {"time_limit": 5}, None, "TimeLimitExceeded", cc.TIME_LIMIT),
    ("pool-process-sigkill", "hang", "b", {}, kill_pool_process, None, "owner-died"),
    ("sys-exit-mid-task", "exit", "a", {}, None, "WorkerLost|exited prematurely", cc.WORKER_LOST),
]


@pytest.mark.parametrize("mode, queue, options, action, error, reason", [e[1:] for e in ENDINGS],
                         ids=[e[0] for e in ENDINGS])
def test_an_ending_celery_decides_leaves_nothing_and_says_why(fleet, leftovers, mode, queue, options, action,
                                                               error, reason):
    res, what = running_task(fleet, leftovers, queue, mode, **options)
    if action is not None:
        action(fleet, res, what)
    if error is not None:
        with pytest.raises(Exception, match=error):
            res.get(timeout=RESULT_TIMEOUT)
    assert all_gone(what), survivors(what)
    worker = fleet.a if queue == "a" else fleet.b
    assert wait_reason(worker, res.id) == [reason]
    if reason == cc.TIME_LIMIT and "soft_time_limit" in options:
        assert alive(what["pool"])  # the soft limit is the task's exception: its pool process lives on


# --- memory: the task's limit, not the worker's ---------------------------------------------------------------

def test_a_child_past_the_memory_limit_gives_an_oom_reason(fleet, leftovers):
    res, what = failed_task(fleet, leftovers, "fleet.limited", "oom-child", (Exception, "died with|non-zero exit"),
                            queue="b")
    assert all_gone(what), survivors(what)
    assert wait_reason(fleet.b, res.id) == ["oom"]
    assert alive(what["pool"])  # the pool process's own memory was not the task's


def test_the_pool_process_memory_is_not_charged_to_the_task(fleet, leftovers):
    import psutil

    res = fleet.send("fleet.tight", "return", queue="b")
    what = res.get(timeout=RESULT_TIMEOUT)
    leftovers.append(what)
    rss = psutil.Process(what["pool"]).memory_info().rss
    assert rss > 32 << 20, f"the pool process uses only {rss} bytes: the test proves nothing here"
    mgr = fleet.b.manager()
    turn = mgr.turn(res.id, f"{res.id}#0")
    assert turn.usage().oom_kills == 0  # a 32 MiB limit held a task whose pool process is larger
    assert set(survivors(what)) == everything(what)
    mgr.end_task(res.id, grace=0)
    assert all_gone(what), survivors(what)


def test_a_task_past_its_memory_limit_in_the_pool_process_is_an_audited_oom(fleet, leftovers):
    res, what = failed_task(fleet, leftovers, "fleet.limited", "oom-self", (Exception, "WorkerLost|exited prematurely"))
    assert all_gone(what), survivors(what)
    assert wait_reason(fleet.a, res.id) in (["owner-died"], [cc.WORKER_LOST])
    assert wait_until(lambda: any(r.get("action") == "limit" and r.get("reason") == "oom"
                                  and str(r.get("turn")).startswith(res.id) for r in audit_records(fleet.a.state_dir)),
                      timeout=10), "no OOM limit record for the task's turn"
    assert not alive(what["pool"])


# --- the worker itself: SIGKILL, cold and warm shutdown --------------------------------------------------------

@pytest.fixture
def lone_worker(fleet):
    started = []

    def start(name, env=None, **kw):
        w = start_worker(name, env or fleet.env, fleet.mount, fleet.tmp, **kw)
        started.append(w)
        return w
    yield start
    for w in started:
        stop_worker(w)


def test_a_sigkilled_worker_leaves_nothing_behind(fleet, lone_worker, leftovers):
    w = lone_worker("k")
    res, what = running_task(fleet, leftovers, "k", "hang")
    import psutil

    pool = psutil.Process(w.proc.pid).children()
    w.proc.kill()  # the whole worker: the main process; its pool processes die of PDEATHSIG
    w.proc.wait(timeout=10)
    for p in pool:
        try:
            p.wait(timeout=10)
        except psutil.NoSuchProcess:
            pass
    assert all_gone(what), survivors(what)
    assert wait_reason(w, res.id) == ["owner-died"]


def test_a_lost_pool_process_without_a_sentinel_is_abandoned_by_the_main_process(fleet, lone_worker, leftovers):
    """sentinel=False: nothing watches the pool process, so the main process's task_failure
    (WorkerLostError) is what ends the turn when the pool process is SIGKILLed."""
    w = lone_worker("n", env=dict(fleet.env, FLEET_DEFAULTS='{"sentinel": false}'))
    res, what = running_task(fleet, leftovers, "n", "hang")
    os.kill(what["pool"], signal.SIGKILL)  # a pool process of the worker this test started
    with pytest.raises(Exception, match="WorkerLost|exited prematurely|signal 9"):
        res.get(timeout=RESULT_TIMEOUT)
    assert all_gone(what), survivors(what)
    assert wait_reason(w, res.id) == [cc.WORKER_LOST]


def test_a_cold_shutdown_abandons_the_running_task(fleet, lone_worker, leftovers):
    w = lone_worker("c")
    res, what = running_task(fleet, leftovers, "c", "hang")
    w.proc.send_signal(signal.SIGQUIT)
    w.proc.wait(timeout=30)
    assert all_gone(what), survivors(what)
    assert wait_reason(w, res.id) == [cc.SHUTDOWN]


def test_a_warm_shutdown_lets_the_task_finish_and_complete(fleet, lone_worker, leftovers):
    w = lone_worker("w")
    res, first = running_task(fleet, leftovers, "w", "sleep-then-return")
    w.proc.send_signal(signal.SIGTERM)
    what = res.get(timeout=RESULT_TIMEOUT)
    w.proc.wait(timeout=30)
    assert set(survivors(what)) == everything(what)
    assert turn_states(w, res.id) == {f"{res.id}#0": cgturn.COMPLETED}
    w.manager().end_task(res.id, grace=0)
    assert all_gone(what), survivors(what)


def test_worker_wide_defaults_and_the_task_option_set_the_turn_limits(fleet, lone_worker, leftovers):
    env = dict(fleet.env, FLEET_DEFAULTS='{"pids_max": 50, "memory_max": 268435456}')
    w = lone_worker("l", env=env)
    plain = fleet.send("fleet.work", "hang", queue="l")
    limited = fleet.send("fleet.limited", "hang", queue="l")
    leftovers.extend([spawned(fleet.out, plain.id), spawned(fleet.out, limited.id)])
    mgr = w.manager()
    assert mgr.turn(plain.id, f"{plain.id}#0").limits() == cgturn.Limits(memory_max=256 << 20, pids_max=50)
    assert mgr.turn(limited.id, f"{limited.id}#0").limits() == cgturn.Limits(memory_max=96 << 20, pids_max=64)
    for res in (plain, limited):
        fleet.client.control.revoke(res.id, terminate=True)
    for what in leftovers:
        assert all_gone(what), survivors(what)


# --- pools ------------------------------------------------------------------------------------------------------

def test_the_solo_pool_runs_each_task_in_its_turn(fleet, lone_worker, leftovers):
    w = lone_worker("s", pool="solo", concurrency=1)
    ok = fleet.send("fleet.work", "return", queue="s")
    what = ok.get(timeout=RESULT_TIMEOUT)
    leftovers.append(what)
    assert turn_states(w, ok.id) == {f"{ok.id}#0": cgturn.COMPLETED}
    bad = fleet.send("fleet.work", "raise", queue="s")
    with pytest.raises(RuntimeError):
        bad.get(timeout=RESULT_TIMEOUT)
    failed = spawned(fleet.out, bad.id)
    leftovers.append(failed)
    assert all_gone(failed), survivors(failed)
    kill_turns(w, "end-task")
    assert all_gone(what), survivors(what)


@pytest.mark.parametrize("pool", ["threads"])
def test_a_pool_of_threads_is_refused_with_a_reason(fleet, lone_worker, pool):
    w = lone_worker("t", pool=pool, ready=False)
    assert w.proc.wait(timeout=60) != 0
    assert "cannot get a turn of its own" in w.log() and "--pool prefork" in w.log()


# --- settings ---------------------------------------------------------------------------------------------------

def test_unknown_or_invalid_settings_are_refused_at_setup():
    app = celery.Celery("settings")
    with pytest.raises(ValueError, match="unknown key"):
        cc.setup(app, memory=1)
    with pytest.raises(ValueError, match="on_error"):
        cc.setup(app, on_error="ignore")
    with pytest.raises(ValueError):
        cc.setup(app, memory_max=100, memory_high=200)


class _Turn:
    def enter(self):
        pass

    def complete(self, keep_for=None):
        self.kept_for = keep_for
        return True


class _Manager:
    """Stands for the TurnManager: what the integration asks of it, without a cgroup."""

    def __init__(self):
        self.begun = []

    def begin_turn(self, task_id, turn_id, **options):
        self.begun.append((task_id, turn_id, options))
        return _Turn()

    def leave_turn(self):
        pass


def test_a_task_s_settings_are_made_at_its_first_attempt_not_at_every_one(monkeypatch):
    # A pool process runs thousands of attempts: each must only look its task's settings up, not
    # merge, check and build its Limits again (the per-task cost docs/celery.md gives).
    made = []
    limits_class = cgturn.Limits

    def counting_limits(**fields):
        made.append(fields)
        return limits_class(**fields)

    monkeypatch.setattr(cgturn, "Limits", counting_limits)
    app = types.SimpleNamespace()
    mgr = _Manager()
    it = cc.Integration(app, cc.check_settings({"pids_max": 50, "keep_for": 9.0}, "setup()"), role="pool", manager=mgr)
    task = types.SimpleNamespace(name="t.limited", app=app, request=types.SimpleNamespace(retries=0),
                                 cgturn={"memory_max": 64 << 20, "network": "none"})
    for n in range(5):
        it.begin(task, f"celery-{n}", (), {})
        turn = it.attempt.turn
        it.end("SUCCESS", True)
        assert turn.kept_for == 9.0
        if n == 0:
            after_first = len(made)
    assert len(made) == after_first
    assert [b[:2] for b in mgr.begun] == [(f"celery-{n}", f"celery-{n}#0") for n in range(5)]
    for _, _, options in mgr.begun:
        assert options == {"limits": limits_class(memory_max=64 << 20, pids_max=50), "seal": False, "network": "none"}
