"""The real thing for the Celery tests: a Redis server, Celery workers and their exporters, each started
on loopback ports and stopped by the fixture that started it (bounded waits, finally blocks).

A worker is a "machine": its own managed root `<cgroup2>/cgturn-celery-<random>-<name>` and state dir,
its own queue (so a test picks the worker a task runs on), and `cgturn.celery.setup(app)` from the app
module APP_SOURCE, written to a temporary directory.
"""
from __future__ import annotations

import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass

from conftest import REPO, alive, destroy_cgroup_tree, wait_until

PY = sys.executable

APP_SOURCE = r'''
import json, os, socket, subprocess, sys, time
from celery import Celery
from celery.exceptions import Retry
import cgturn.celery

app = Celery("fleet", broker=os.environ["FLEET_REDIS"], backend=os.environ["FLEET_REDIS"])
app.conf.update(task_acks_late=False, worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True,
                result_expires=600, task_default_queue="default")
OUT = os.environ["FLEET_OUT"]
BENCH = os.environ.get("FLEET_BENCH") == "1"  # scripts/bench_celery.py: time what surrounds the task body
_times = {}
if BENCH:
    from celery import signals

    @signals.task_prerun.connect(weak=False)
    def _first_prerun(task_id=None, **_):  # connected before cgturn's receivers: runs before them
        _times[task_id] = [time.perf_counter()]
    @signals.task_postrun.connect(weak=False)
    def _first_postrun(task_id=None, **_):  # before cgturn's: what Celery did after the body (its result store)
        t = _times.get(task_id)
        if t is not None and len(t) == 3:
            t.append(time.perf_counter())
if os.environ.get("FLEET_CGTURN", "1") == "1":
    cgturn.celery.setup(app, grace=0.2, **json.loads(os.environ.get("FLEET_DEFAULTS", "{}")))
_steps = {}
if BENCH and os.environ.get("FLEET_CGTURN", "1") == "1":
    # Each cgturn call the integration makes per task, timed where it runs (in the pool process).
    def _timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _steps[name] = time.perf_counter() - t0
        return wrapper
    cgturn.TurnManager.begin_turn = _timed("begin_turn", cgturn.TurnManager.begin_turn)
    cgturn.TurnManager.leave_turn = _timed("leave_turn", cgturn.TurnManager.leave_turn)
    cgturn.Turn.enter = _timed("enter", cgturn.Turn.enter)
    cgturn.Turn.complete = _timed("complete", cgturn.Turn.complete)
    cgturn.celery.Integration.begin = _timed("receiver_prerun", cgturn.celery.Integration.begin)
    cgturn.celery.Integration.end = _timed("receiver_postrun", cgturn.celery.Integration.end)
if BENCH:
    @signals.task_postrun.connect(weak=False)
    def _last_postrun(task_id=None, **_):  # connected after cgturn's receivers: runs after them
        t = _times.pop(task_id, None)
        if t is not None and len(t) == 4:
            t.append(time.perf_counter())
            with open(os.path.join(OUT, "bench-%d.jsonl" % os.getpid()), "a") as f:
                f.write(json.dumps({"task": task_id, "overhead_s": (t[1] - t[0]) + (t[4] - t[2]),
                                    "pre_s": t[1] - t[0], "post_s": t[4] - t[2], "body_s": t[2] - t[1],
                                    "store_s": t[3] - t[2], "steps_s": dict(_steps)}) + "\n")
            open(os.path.join(OUT, "done-" + task_id), "w").close()  # the bench waits for it
        _steps.clear()


@app.task(bind=True, name="fleet.true")
def run_true(self):
    t = _times.get(self.request.id)
    if t is not None:
        t.append(time.perf_counter())
    subprocess.run(["/bin/true"], check=True)
    if t is not None:
        t.append(time.perf_counter())
    return True


@app.task(bind=True, name="fleet.setsid_child")
def setsid_child(self):
    """A setsid child that outlives the task's pool process unless something kills it."""
    base = os.path.join(OUT, self.request.id)
    subprocess.run(["setsid", "-f", "sh", "-c", "echo $$ > %s.tmp; mv %s.tmp %s.child; exec sleep 300"
                    % (base, base, base)], check=True)
    _wait_file(base + ".child")
    while True:
        time.sleep(0.05)

DOUBLE_FORK_SERVER = """
import os, socket, sys, time
if os.fork(): os._exit(0)
os.setsid()
if os.fork(): os._exit(0)
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
with open(sys.argv[1] + ".tmp", "w") as f: f.write("%d %d" % (os.getpid(), s.getsockname()[1]))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True: time.sleep(60)
"""


def _wait_file(path):
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError("no " + path)
        time.sleep(0.005)
    with open(path) as f:
        return f.read().split()


def spawn_all(tag):
    """A setsid daemon, a double-forking server and a busy loop, started with plain subprocess."""
    base = os.path.join(OUT, tag)
    subprocess.run(["setsid", "-f", "sh", "-c", "echo $$ > %s.daemon.tmp; mv %s.daemon.tmp %s.daemon; exec sleep 300"
                    % (base, base, base)], check=True)
    subprocess.run([sys.executable, "-c", DOUBLE_FORK_SERVER, base + ".server"], check=True)
    subprocess.Popen(["sh", "-c", "echo $$ > %s.busy.tmp; mv %s.busy.tmp %s.busy; while :; do :; done"
                      % (base, base, base)])
    daemon = int(_wait_file(base + ".daemon")[0])
    server, port = map(int, _wait_file(base + ".server"))
    busy = int(_wait_file(base + ".busy")[0])
    spawned = {"daemon": daemon, "server": server, "port": port, "busy": busy, "pool": os.getpid()}
    with open(base + ".json.tmp", "w") as f:
        json.dump(spawned, f)
    os.rename(base + ".json.tmp", base + ".json")
    return spawned


def behave(self, mode):
    spawned = spawn_all(self.request.id + "." + str(self.request.retries))
    if mode == "return":
        return spawned
    if mode == "raise":
        raise RuntimeError("the task failed")
    if mode == "exit":
        sys.exit(3)
    if mode == "retry-once":
        if self.request.retries == 0:
            raise self.retry(countdown=0, max_retries=1)
        return spawned
    if mode == "sleep-then-return":
        time.sleep(float(os.environ.get("FLEET_SLEEP", "3")))
        return spawned
    if mode == "oom-child":
        subprocess.run([sys.executable, "-c", "x = bytearray(b'x' * (400 << 20))"], check=True)
        return spawned
    if mode == "oom-self":
        hog = bytearray(b"x" * (400 << 20))
        return len(hog)
    while True:  # "hang": until revoked, time-limited, killed
        time.sleep(0.05)


@app.task(bind=True, name="fleet.work")
def work(self, mode):
    return behave(self, mode)


@app.task(bind=True, name="fleet.leased", cgturn={"keep_for": 1.0})
def leased(self, mode):
    return behave(self, mode)


@app.task(bind=True, name="fleet.lenient", cgturn={"on_error": "complete"})
def lenient(self, mode):
    return behave(self, mode)


@app.task(bind=True, name="fleet.limited", cgturn={"memory_max": 96 << 20, "pids_max": 64})
def limited(self, mode):
    return behave(self, mode)


@app.task(bind=True, name="fleet.tight", cgturn={"memory_max": 32 << 20})
def tight(self, mode):
    return behave(self, mode)


@app.task(bind=True, name="fleet.session", cgturn={"task": lambda session, mode: "session:" + session})
def session(self, session, mode):
    return behave(self, mode)
'''


def need_module(name: str):
    """The module `name`; skip without it (fail in CI, whose .ci/run installs the celery extra: a skip
    there would hide the tests)."""
    import importlib

    import pytest

    try:
        return importlib.import_module(name)
    except ImportError as err:
        message = f"{name} is not installed ({err}; pip install '.[celery]', which .ci/run installs)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=True)


def need_tool(name: str, package: str) -> None:
    """Skip without `name` (fail in CI, whose .ci/run installs it: a skip there would hide the tests)."""
    if shutil.which(name) is None:
        import pytest

        message = f"{name} is not installed (Debian package {package}; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def write_app(tmp: str) -> str:
    """Write the app module into `tmp` and make the directory tasks report to; returns that directory."""
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    with open(os.path.join(tmp, "fleet_app.py"), "w") as f:
        f.write(APP_SOURCE)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
    """Stop a process this module started: `sig`, then SIGKILL after `timeout` s; always reaped."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Redis:
    """redis-server on a loopback port of its own, no persistence, in a temporary directory."""

    def __init__(self, workdir: str):
        if shutil.which("redis-server") is None:
            raise FileNotFoundError("redis-server (Debian package redis-server) is not installed")
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir, "--daemonize", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until(lambda: self.proc.poll() is not None or listening(self.port), timeout=15):
            self.stop()
            raise RuntimeError("redis-server did not listen within 15 s")
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass
class Worker:
    """One Celery worker ("machine"): its process, managed root, state dir, queue and exporter."""

    name: str
    root: str
    state_dir: str
    queue: str
    proc: subprocess.Popen
    log_path: str
    exporter: subprocess.Popen | None = None
    exporter_port: int | None = None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]

    def manager(self):
        import cgturn

        return cgturn.TurnManager(root=self.root, state_dir=self.state_dir, sentinel=False)


def fleet_env(redis_url: str, appdir: str, out: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (appdir, REPO, env.get("PYTHONPATH")) if p)
    env.update(FLEET_REDIS=redis_url, FLEET_OUT=out)
    return env


def start_worker(name: str, env: dict, mount: str, tmp: str, pool: str = "prefork", concurrency: int = 2,
                 ready: bool = True) -> Worker:
    root = os.path.join(mount, f"cgturn-celery-{uuid.uuid4().hex[:8]}-{name}")
    state = os.path.join(tmp, f"state-{name}")
    os.makedirs(state, exist_ok=True)
    log_path = os.path.join(tmp, f"worker-{name}.log")
    wenv = dict(env, CGTURN_ROOT=root, CGTURN_STATE_DIR=state)
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(
            [PY, "-m", "celery", "-A", "fleet_app", "worker", "-P", pool, "-c", str(concurrency), "-n",
             f"{name}@cgturn-test", "-Q", name, "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-l", "info"], env=wenv, stdout=logf, stderr=subprocess.STDOUT, cwd=tmp)
    worker = Worker(name, root, state, name, proc, log_path)
    if ready and not wait_until(lambda: proc.poll() is not None or " ready." in worker.log(), timeout=60):
        stop_worker(worker)
        raise RuntimeError(f"worker {name} not ready within 60 s:\n{worker.log()}")
    if ready and proc.poll() is not None:
        raise RuntimeError(f"worker {name} exited with {proc.returncode}:\n{worker.log()}")
    return worker


def start_exporter(worker: Worker, env: dict) -> None:
    proc = subprocess.Popen([PY, "-m", "cgturn", "--root", worker.root, "--state-dir", worker.state_dir, "metrics",
                             "--listen", "127.0.0.1:0"], env=env, stdout=subprocess.PIPE, text=True)
    worker.exporter = proc
    line = proc.stdout.readline()  # the bound address, first line: "... http://127.0.0.1:PORT/metrics"
    match = re.search(r":(\d+)(/metrics)?\s*$", line)
    if match is None:
        raise RuntimeError(f"the exporter of {worker.name} printed {line!r}")
    worker.exporter_port = int(match.group(1))


def stop_worker(worker: Worker) -> None:
    """Stop the worker (warm, then SIGKILL of its whole tree after a bound), its exporter, its root."""
    import psutil

    try:
        if worker.exporter is not None:
            stop_process(worker.exporter, timeout=5)
        if worker.proc.poll() is None:
            children = psutil.Process(worker.proc.pid).children(recursive=True)
            stop_process(worker.proc, signal.SIGTERM, timeout=20)
            for child in children:  # pool processes we started, if the main process left any
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
    finally:
        destroy_cgroup_tree(worker.root)


def spawned(out: str, celery_id: str, attempt: int = 0, timeout: float = 30) -> dict:
    """What the task attempt reported it started (it writes the file once all three run)."""
    path = os.path.join(out, f"{celery_id}.{attempt}.json")
    assert wait_until(lambda: os.path.exists(path), timeout=timeout), f"task {celery_id} never spawned"
    with open(path) as f:
        return json.load(f)


def survivors(what: dict) -> list[str]:
    """Which of the task's processes and its server's port are still alive."""
    out = [name for name in ("daemon", "server", "busy") if alive(what[name])]
    if listening(what["port"]):
        out.append(f"port {what['port']}")
    return out


def all_gone(what: dict, timeout: float = 15) -> bool:
    return wait_until(lambda: not survivors(what), timeout=timeout)


def reap_orphans(what: dict) -> None:
    """Kill what a failed test left of a task (pids this test's task started, checked alive)."""
    for name in ("daemon", "server", "busy"):
        if alive(what[name]):
            try:
                os.kill(what[name], signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_turns(worker: Worker, reason: str) -> None:
    """Test teardown helper: end every task of the worker's root (survivors of completed turns)."""
    mgr = worker.manager()
    for task in {t.task for t in mgr.turns()}:
        mgr.end_task(task, reason=reason, grace=0)
