"""A sentinel that dies while its owner lives shows in the exporter (`cgturn_turns_unwatched`): each
sentinel holds a private lock file in the state dir (cgturn.sentinel_locks). Real owners, real
sentinels (forked and exec'd, both backends), real SIGKILLs, real `cgturn metrics --once` scrapes.
Every owner is a process the test starts and kills; every sentinel is found through its owner's own
handle (`Supervisor.start_sentinel`), never by name."""
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import textwrap
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cgturn import Supervisor, TurnManager, sentinel_locks
from cgturn.kernel import ofdlock
from cgturn.processes import start_time
from conftest import PY, alive, cgturn_env, cli, destroy_cgroup_tree, destroy_registry, need_cgroup2, wait_until

BOUND = 20.0  # how long a test waits for a process to act: a bound, not a measurement
NOBODY_PY = "/usr/bin/python3"  # pyenv's interpreter under /root cannot be run by nobody
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]

# The owner: a manager (its sentinel forked when this process runs one thread, else exec'd; or none),
# one running turn; prints its sentinel's pid and the turn's process, then waits. A line on stdin
# ends it cleanly: it abandons its turn and closes its manager (the sentinel exits by itself).
OWNER = textwrap.dedent("""
    import json, sys, threading
    from cgturn import Supervisor, TurnManager
    root, backend, state, threaded, sentinel = sys.argv[1:6]
    if threaded == "1":  # a second thread: fork would copy only this one, so the sentinel is exec'd
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    mgr = TurnManager(root=root or None, backend=backend, state_dir=state, sentinel=sentinel == "1")
    pid = Supervisor.start_sentinel(mgr)
    turn = mgr.begin_turn("watched", "t")
    child = turn.spawn(["sleep", "300"])
    print(json.dumps({"sentinel": pid, "child": child.pid}), flush=True)
    sys.stdin.readline()
    turn.abandon("done", grace=0)
    mgr.close()
""")


# OWNER whose (forked) sentinel fails while it serves: an exception out of its loop, as a bug would.
FAILING_SENTINEL = textwrap.dedent("""
    from cgturn import sentinel_server
    def fail(self):
        raise RuntimeError("injected sentinel failure")
    sentinel_server.Sentinel._fire_due = fail
""") + OWNER


@pytest.fixture(params=["cgroup2", "registry"])
def owners(request, tmp_path):
    """Start OWNER processes on one backend: `start(threaded, sentinel)` -> (Popen, info, state, root).
    Every owner is SIGKILLed and everything it made removed at teardown."""
    state = str(tmp_path / "state")
    root = os.path.join(need_cgroup2(), f"cgturn-test-{uuid.uuid4().hex[:10]}") if request.param == "cgroup2" else None
    procs = []

    def start(threaded=False, sentinel=True, script=OWNER):
        p = subprocess.Popen([PY, "-c", script, root or "", request.param, state, "1" if threaded else "0",
                              "1" if sentinel else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=cgturn_env())
        procs.append(p)
        return p, json.loads(p.stdout.readline()), state, root

    start.backend = request.param
    yield start
    for p in procs:
        p.kill()
        p.wait()
    mgr = TurnManager(root=root, backend=request.param, state_dir=state, sentinel=False)
    if root is not None:
        mgr.close()
        destroy_cgroup_tree(root)
    else:
        destroy_registry(mgr)


def scrape(root, state, backend) -> dict:
    """{sample name: value} of one real `cgturn metrics --once` (labels joined to the name:
    `cgturn_turns{state=running}`)."""
    out = cli(root, state, "metrics", "--once", backend=backend)
    assert out.returncode == 0, out.stderr
    return {s.name + ("{%s}" % ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) if s.labels else ""): s.value
            for family in text_string_to_metric_families(out.stdout) for s in family.samples}


def lock_files(state) -> list[str]:
    path = os.path.join(state, sentinel_locks.DIR)
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def made_files(state, n=1) -> list[str]:
    """The lock files once `n` are made (a sentinel makes its file just after it reports ready)."""
    assert wait_until(lambda: len(lock_files(state)) >= n, timeout=BOUND)
    return lock_files(state)


def locked(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return ofdlock.is_locked(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("threaded", [False, True], ids=["forked", "execd"])
def test_a_sigkilled_sentinel_of_a_live_owner_shows_until_the_owner_dies_and_reap_cleans_up(owners, threaded):
    owner, info, state, root = owners(threaded=threaded)
    sentinel = info["sentinel"]
    [name] = made_files(state)
    assert sentinel_locks.parse_name(name) == (owner.pid, start_time(owner.pid), sentinel)
    assert locked(os.path.join(state, sentinel_locks.DIR, name))
    before = scrape(root, state, owners.backend)
    assert before["cgturn_turns_unwatched"] == 0 and before["cgturn_turns_owner_gone"] == 0  # a live sentinel

    os.kill(sentinel, signal.SIGKILL)  # the pid its owner's manager handed out: a process of the owner's
    assert wait_until(lambda: not alive(sentinel), timeout=BOUND)
    after = scrape(root, state, owners.backend)
    assert after["cgturn_turns_unwatched"] == 1 and after["cgturn_turns_owner_gone"] == 0
    assert alive(info["child"]) and lock_files(state) == [name]  # the scrape removed nothing

    owner.kill()  # now the owner dies too: nobody abandons its turn
    owner.wait()
    dead = scrape(root, state, owners.backend)
    assert dead["cgturn_turns_unwatched"] == 0 and dead["cgturn_turns_owner_gone"] == 1
    out = cli(root, state, "reap", "--json", backend=owners.backend)
    assert out.returncode == 0, out.stderr
    assert [a["reason"] for a in json.loads(out.stdout) if a["action"] == "abandoned"] == ["owner-died"]
    assert lock_files(state) == []  # the dead owner's file went with its turn
    assert wait_until(lambda: not alive(info["child"]), timeout=BOUND)


def test_a_sentinel_that_fails_while_serving_says_why_and_leaves_its_owner_unwatched(owners):
    """A sentinel whose loop raises logs the error and keeps its lock file (unlocked once it is gone),
    so the exporter shows the owner's turns unwatched, as after a SIGKILL; a clean exit removes it."""
    owner, info, state, root = owners(script=FAILING_SENTINEL)
    assert wait_until(lambda: not alive(info["sentinel"]), timeout=BOUND)
    assert scrape(root, state, owners.backend)["cgturn_turns_unwatched"] == 1
    with open(os.path.join(state, "sentinel.log"), encoding="utf-8") as f:
        logged = f.read()
    assert "injected sentinel failure" in logged and "no longer watched" in logged


def test_an_owner_without_a_sentinel_is_not_unwatched(owners):
    owner, info, state, root = owners(sentinel=False)
    assert info["sentinel"] is None and alive(info["child"])
    scraped = scrape(root, state, owners.backend)
    assert scraped["cgturn_turns_unwatched"] == 0 and scraped["cgturn_turns{state=running}"] == 1
    assert lock_files(state) == []


@pytest.mark.parametrize("threaded", [False, True], ids=["forked", "execd"])
def test_a_sentinel_that_exits_normally_leaves_no_file(owners, threaded):
    owner, info, state, root = owners(threaded=threaded)
    [name] = made_files(state)
    assert sentinel_locks.parse_name(name)[2] == info["sentinel"]
    owner.stdin.write("done\n")  # the owner abandons its turn and closes its manager: its sentinel exits
    owner.stdin.flush()
    assert owner.wait(timeout=BOUND) == 0
    assert wait_until(lambda: not alive(info["sentinel"]), timeout=BOUND)
    assert lock_files(state) == []
    assert scrape(root, state, owners.backend)["cgturn_turns_unwatched"] == 0


@pytest.fixture
def registry_manager():
    """A registry-backend manager of this process whose state dir others may traverse (0755), so only
    the sentinels' own directory and files stand between another user and them."""
    state = tempfile.mkdtemp(prefix="cgturn-test-locks-")
    os.chmod(state, 0o755)
    mgr = TurnManager(backend="registry", state_dir=state)
    try:
        yield mgr
    finally:
        destroy_registry(mgr)
        shutil.rmtree(state, ignore_errors=True)


def test_an_owner_is_watched_while_any_of_its_sentinels_lives(registry_manager, tmp_path):
    """Two managers of one process, each with a sentinel: one dead sentinel is not an unwatched
    owner while the other lives (a new sentinel tracks every running turn of its owner)."""
    second = TurnManager(backend="registry", state_dir=registry_manager.state_dir)
    try:
        pids = [Supervisor.start_sentinel(m) for m in (registry_manager, second)]
        registry_manager.begin_turn("watched", "t")
        assert len(made_files(registry_manager.state_dir, 2)) == 2
        assert sentinel_locks.unwatched_owners(registry_manager.state_dir) == set()
        os.kill(pids[0], signal.SIGKILL)
        assert wait_until(lambda: not alive(pids[0]), timeout=BOUND)
        assert sentinel_locks.unwatched_owners(registry_manager.state_dir) == set()
        os.kill(pids[1], signal.SIGKILL)
        assert wait_until(lambda: sentinel_locks.unwatched_owners(registry_manager.state_dir) == {os.getpid()},
                          timeout=BOUND)
    finally:
        second.close()


def test_no_other_user_can_open_a_sentinels_lock_file(registry_manager):
    if os.geteuid() != 0 or not os.access(NOBODY_PY, os.X_OK) or not shutil.which("setpriv"):
        pytest.skip("needs root, setpriv and the system python3 to run a process as nobody")
    Supervisor.start_sentinel(registry_manager)
    where = os.path.join(registry_manager.state_dir, sentinel_locks.DIR)
    [name] = made_files(registry_manager.state_dir)
    path = os.path.join(where, name)
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    probe = textwrap.dedent("""
        import errno, os, sys
        out = []
        for path in sys.argv[1:]:
            try:
                os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
                out.append("opened")
            except OSError as err:
                out.append(errno.errorcode[err.errno])
        print(" ".join(out))
    """)

    def as_nobody(*paths):
        out = subprocess.run([*AS_NOBODY, NOBODY_PY, "-I", "-c", probe, *paths], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert as_nobody(where, path) == ["EACCES", "EACCES"]
    os.chmod(where, 0o711)  # let nobody through the directory: the file refuses on its own
    try:
        assert as_nobody(path) == ["EACCES"]
    finally:
        os.chmod(where, 0o700)
    assert locked(path)  # nobody's tries took nothing from the sentinel


@pytest.mark.parametrize("name, parsed", [
    ("12-345-67", (12, 345, 67)),
    (".12-345-67", None),  # being made: not locked yet
    ("12-345", None), ("12-345-67-8", None), ("a-1-2", None), ("1--2", None), ("١-1-2", None),
])
def test_lock_file_names(name, parsed):
    assert sentinel_locks.parse_name(name) == parsed
    if parsed is not None:
        assert sentinel_locks.file_name(*parsed) == name
