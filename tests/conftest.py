"""Shared fixtures: every test that touches cgroups gets its own managed root, removed at teardown.

Safety: a test root is `<cgroup2 mount>/cgturn-test-<random>`; teardown kills what is left inside it
(never a cgroup holding the test process) and removes it, failures included. Registry-backend tests
get their own state directory; teardown kills only processes carrying that registry's scope.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

import escapers as _escapers  # helper module (also used by scripts/bench.py): tests reach it through here
from cgturn import audit
from cgturn.errors import CgturnError
from cgturn.kernel import discovery, procfs
from cgturn.kernel.cgroupfs import Cgroup, KillUnsupported

REQUIRE_CGROUP2 = os.environ.get("CGTURN_REQUIRE_CGROUP2") == "1" or os.environ.get("CI") == "true"
PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The escaper recipes (tests/escapers.py), for test modules: they import from conftest only.
ESCAPER_NAMES = _escapers.NAMES
launch_escaper = _escapers.launch
explain_escaper = _escapers.explain


def pytest_runtest_setup(item):
    # Tests marked `testhost` need systemd as PID 1 on pure cgroup v2 (tests/testhost/hostlib.py).
    if item.get_closest_marker("testhost") and os.environ.get("CGTURN_TESTHOST") != "1":
        pytest.skip("needs systemd as PID 1 on pure cgroup v2: runs in the test-host stage "
                    "(python3 scripts/testhost/run.py, part of .ci/run)")


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Poll `predicate` until true or the deadline passes (tests bound every wait this way)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def alive(pid: int) -> bool:
    """True while `pid` exists and has not exited (a zombie is dead)."""
    st = procfs.stat(pid)
    return st is not None and st.state not in ("Z", "X")


def cgturn_argv(root: str | None, state_dir: str, *args: str, backend: str | None = None) -> list[str]:
    """argv of `python -m cgturn` with the global options (`root=None`: the default root)."""
    argv = [PY, "-m", "cgturn"]
    if root is not None:
        argv += ["--root", root]
    if backend is not None:
        argv += ["--backend", backend]
    return [*argv, "--state-dir", state_dir, *args]


def cgturn_env(env: dict | None = None) -> dict:
    """The environment for a cgturn subprocess: it imports this checkout's cgturn."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def cli(root: str | None, state_dir: str, *args: str, env: dict | None = None,
        backend: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m cgturn` as a real subprocess; returns its status and text output."""
    return subprocess.run(cgturn_argv(root, state_dir, *args, backend=backend), capture_output=True, text=True,
                          timeout=60, env=cgturn_env(env))


def cgturn_popen(root: str | None, state_dir: str, *args: str, env: dict | None = None,
                 backend: str | None = None, **popen_kwargs) -> subprocess.Popen:
    """Start `python -m cgturn` in the background (stdout piped, text); the caller waits for it."""
    popen_kwargs.setdefault("stdout", subprocess.PIPE)
    return subprocess.Popen(cgturn_argv(root, state_dir, *args, backend=backend), text=True,
                            env=cgturn_env(env), **popen_kwargs)


# A `cgturn run` command that keeps running and prints the pid of a daemon it left in the background.
DAEMON_AND_WAIT = "setsid sleep 300 >/dev/null 2>&1 & echo $!; exec sleep 300"


def completed_turn(root: str, state_dir: str, task: str, turn: str) -> int:
    """`cgturn run` a turn that completes and leaves a daemon running; returns the daemon's pid."""
    out = cli(root, state_dir, "run", "--task", task, "--turn", turn, "--", "sh", "-c",
              "setsid sleep 300 >/dev/null 2>&1 & echo $!")
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def audit_records(state_dir: str, turn: str | None = None) -> list[dict]:
    """The audit log's records (oldest first), only those of turn id `turn` when given."""
    return [r for r in audit.read_records(state_dir) if turn is None or r.get("turn") == turn]


def audit_reasons(state_dir: str, turn: str | None = None) -> list[str]:
    """The reasons of the audit log's records, oldest first."""
    return [r["reason"] for r in audit_records(state_dir, turn)]


def _cgroup2_mount() -> str | None:
    info = discovery.discover(root=None)
    if info.cgroup2_mount and os.access(info.cgroup2_mount, os.W_OK):
        return info.cgroup2_mount
    return None


CGROUP2_MOUNT = _cgroup2_mount()


def need_cgroup2() -> str:
    if CGROUP2_MOUNT is None:
        msg = "cgroup v2 is not mounted writable here"
        if REQUIRE_CGROUP2:
            pytest.fail(f"{msg}, and CI/CGTURN_REQUIRE_CGROUP2 demands it")
        pytest.skip(msg)
    return CGROUP2_MOUNT


def destroy_cgroup_tree(path: str) -> None:
    """Kill everything under a test root this test created, then remove it. Never touches our own cgroup."""
    cg = Cgroup(path)
    if not os.path.isdir(path):
        remove_v1_mirrors(path)
        return
    mine = procfs.cgroup_of("self") or ""
    mine_abs = os.path.normpath(os.path.join(CGROUP2_MOUNT or "/", mine.lstrip("/")))
    if mine_abs == path or mine_abs.startswith(path + "/"):
        raise RuntimeError(f"test process is inside {path}; refusing to kill it")
    for _ in range(5):
        try:
            cg.kill()
        except KillUnsupported:
            for pid in cg.procs_recursive():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        except FileNotFoundError:
            remove_v1_mirrors(path)
            return
        for sub in [cg, *cg.descendants()]:
            try:
                sub.set_frozen(False)
            except (OSError, CgturnError):  # removed meanwhile, or a hostile payload's chmod
                pass
        cg.wait_unpopulated(5.0)
        if cg.remove_tree(timeout=2.0):
            remove_v1_mirrors(path)
            return
    raise RuntimeError(f"could not remove test cgroup {path}")


def v1_mirrors(root: str) -> dict[str, str]:
    """controller -> where a managed root at `root` has (or would have) its directory in the v1 memory,
    pids and cpu hierarchies of a hybrid host: below this process's own v1 cgroup, at the root's place
    relative to this process's own cgroup2 cgroup. {} where there is no v1 hierarchy."""
    from cgturn.kernel import controllers, parsers

    with open("/proc/self/mountinfo") as f:
        mounts = controllers.v1_mounts(f.read())
    with open("/proc/self/cgroup") as f:
        own = parsers.parse_proc_cgroup_v1(f.read())
    own_v2 = os.path.join(CGROUP2_MOUNT or "/", (procfs.cgroup_of("self") or "").lstrip("/"))
    relative = os.path.relpath(root, own_v2)
    return {c: os.path.normpath(os.path.join(mounts[c], own[c].lstrip("/"), relative))
            for c in ("memory", "pids", "cpu") if c in mounts and c in own}


def remove_v1_mirrors(root: str) -> None:
    """Remove what a test's managed root left in the v1 hierarchies (a failed test's turns): only
    directories named after a cgturn test root, below this process's own v1 cgroups. Their processes
    were in the root's cgroup2 tree, killed before this is called."""
    for path in v1_mirrors(root).values():
        if "cgturn" in os.path.basename(path) and os.path.isdir(path) and not Cgroup(path).remove_tree(timeout=2.0):
            raise RuntimeError(f"could not remove the v1 directory {path} of test root {root}")


@pytest.fixture
def cgroup2_root():
    """A fresh managed-root path `<mount>/cgturn-test-<random>` (not created), removed at teardown."""
    mount = need_cgroup2()
    path = os.path.join(mount, f"cgturn-test-{uuid.uuid4().hex[:10]}")
    yield path
    destroy_cgroup_tree(path)


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    return str(d)


def kill_scope(scope: str) -> None:
    """Kill processes whose environment names this registry scope (registry-backend test teardown)."""
    me = procfs.protected_pids()
    for _ in range(3):
        hit = False
        for pid in procfs.all_pids():
            if pid in me:
                continue
            env = procfs.environ(pid)
            if env and env.get("CGTURN_SCOPE") == scope:
                try:
                    os.kill(pid, signal.SIGKILL)
                    hit = True
                except ProcessLookupError:
                    pass
        if not hit:
            return


def destroy_registry(mgr) -> None:
    """Teardown of a registry-backend manager: end its tasks, close it, kill what carries its scope."""
    scope = mgr.backend.scope
    for rec in mgr.backend.records():
        try:
            mgr.end_task(rec.task_id, grace=0)
        except Exception:  # noqa: BLE001 - teardown must go on
            pass
    mgr.close()
    kill_scope(scope)


@pytest.fixture
def cgroup2_manager(cgroup2_root, state_dir):
    """A cgroup2-backend TurnManager in its own test root (destroyed by `cgroup2_root`)."""
    from cgturn import TurnManager

    mgr = TurnManager(root=cgroup2_root, backend="cgroup2", state_dir=state_dir)
    yield mgr
    mgr.close()


def force_spawn_path(monkeypatch, path: str) -> None:
    """Make `path` the way Turn.spawn takes on cgroup2 (spawn_paths' capability flags, trio-style).
    A native path this host lacks is skipped with its reason; the clone3 extension fails in CI,
    which builds it. Any other name (the registry backend) leaves both native paths off."""
    from cgturn import testing
    from cgturn.backends import spawn_paths

    why = testing.spawn_path_unavailable(path) if path in testing.SPAWN_PATHS else None
    if why is not None and path == testing.CLONE3 and os.environ.get("CI") == "true":
        pytest.fail("cgturn._spawn is not built in CI (pip install -e . builds it with gcc)")
    if why is not None:
        pytest.skip(why + ("; tests/testhost/test_testhost_spawn.py runs this path on the test host"
                           if path == testing.POSIX_SPAWN else ""))
    # monkeypatch (not testing.forced_spawn_path) so the flags come back at the test's own teardown
    for flag, value in spawn_paths.forced(path).items():
        monkeypatch.setattr(spawn_paths, flag, value)


def turn_dir(mgr, turn) -> str:
    """The cgroup directory of a cgroup2 turn."""
    rec = turn.record
    return os.path.join(mgr.backend.root.path, rec.task_key, rec.turn_key)


@pytest.fixture(params=["cgroup2", "registry"])
def manager(request, tmp_path):
    """A TurnManager on each backend, torn down completely (processes and cgroups)."""
    from cgturn import TurnManager

    state = str(tmp_path / "state")
    if request.param == "cgroup2":
        mount = need_cgroup2()
        root = os.path.join(mount, f"cgturn-test-{uuid.uuid4().hex[:10]}")
        mgr = TurnManager(root=root, backend="cgroup2", state_dir=state)
        try:
            yield mgr
        finally:
            mgr.close()
            destroy_cgroup_tree(root)
    else:
        mgr = TurnManager(backend="registry", state_dir=state)
        try:
            yield mgr
        finally:
            destroy_registry(mgr)


@pytest.fixture
def bystanders():
    """Start processes outside any turn (they predate it); all are killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*argv):
        p = subprocess.Popen(list(argv) or ["sleep", "300"], stdin=subprocess.DEVNULL)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def escapers(tmp_path):
    """Fresh escaper recipes {name: Escaper} (tests/escapers.py); whatever they leave is killed (by
    unique marker) at teardown."""
    recipes = _escapers.recipes(str(tmp_path))
    yield recipes
    for recipe in recipes.values():
        _escapers.destroy(recipe)


@pytest.fixture
def runs(cgroup2_root, state_dir):
    """Start `cgturn run` processes (they sit outside the test root); all are killed at teardown.
    `runs(task, turn, script=DAEMON_AND_WAIT, env=None)` returns the process and the first line it
    printed, as an int (the daemon's pid)."""
    started = []

    def start(task, turn, script=DAEMON_AND_WAIT, env=None):
        p = cgturn_popen(cgroup2_root, state_dir, "run", "--task", task, "--turn", turn, "--", "sh", "-c", script,
                         env=env)
        started.append(p)
        return p, int(p.stdout.readline())

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
