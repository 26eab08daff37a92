"""The pytest plugin, exercised by running pytest in a subprocess on small generated test files.

Each inner run gets CGTURN_ROOT = this test's own managed root, so whatever the inner run leaves
(if the plugin were broken) is destroyed by the `cgroup2_root` fixture's teardown.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap

import pytest

from conftest import PY, alive, wait_until

LEAK_RE = re.compile(r"^\s*(\S.*?): pid (\d+): (.*)$")

# A test that leaves a daemon behind: `setsid -f` forks it away from pytest's process tree.
SETTLE = 3.0
LEAKY = textwrap.dedent(r"""
    import os, subprocess, sys, time, pytest

    def _daemon(tag):
        subprocess.run(["setsid", "-f", "sh", "-c", f"exec sleep 300 # {tag}"], check=True)

    @pytest.fixture(scope="module")
    def server():
        p = subprocess.Popen(["sleep", "301"])   # never stopped: a module-scope leak
        yield p

    def test_clean():
        subprocess.run(["true"], check=True)

    def test_leaky():
        _daemon("leaky")

    def test_stops_its_server_at_teardown():
        code = ("import signal, sys, time\n"
                "signal.signal(15, lambda *a: (time.sleep(0.3), sys.exit(0)))\n"
                "print('ready', flush=True)\n"
                "time.sleep(300)\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ready\n"
        p.send_signal(15)            # stopping takes a moment: the settle time covers it

    def test_uses_server(server):
        assert server.poll() is None
""")


@pytest.fixture
def inner(cgroup2_root, tmp_path):
    """Run pytest (with the plugin installed) on generated files; returns (returncode, output)."""
    os.mkdir(cgroup2_root)
    env = {**os.environ, "CGTURN_ROOT": cgroup2_root, "CGTURN_STATE_DIR": str(tmp_path / "state")}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)

    def run(files: dict[str, str], *args, extra_env=None):
        work = tmp_path / "work"
        work.mkdir(exist_ok=True)
        for name, text in files.items():
            (work / name).write_text(text)
        # The settle time must cover a process that takes 0.3 s to stop on SIGTERM even on a loaded
        # host (1.0 s did not, on Python 3.13 in CI at load ~20); leaks wait it out once per scope.
        proc = subprocess.run([PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
                               "-o", f"cgturn_settle={SETTLE}", "--rootdir", str(work), *args],
                              cwd=work, env={**env, **(extra_env or {})}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=120)
        return proc.returncode, proc.stdout

    yield run
    # The inner run must remove its own managed root: nothing may be left under ours.
    assert [e for e in os.listdir(cgroup2_root) if not os.path.isfile(os.path.join(cgroup2_root, e))] == []


def leaks(output: str) -> list[tuple[str, int, str]]:
    """(where, pid, command) of every leak reported, once each.

    pytest repeats an error's whole message in its short summary when CI is set (it truncates it
    otherwise), so one report line may appear twice in the output.
    """
    found = [(m.group(1), int(m.group(2)), m.group(3)) for m in map(LEAK_RE.match, output.splitlines()) if m]
    return list(dict.fromkeys(found))


def assert_all_dead(found):
    pids = [pid for _, pid, _ in found]
    assert wait_until(lambda: not any(alive(pid) for pid in pids)), [p for p in pids if alive(p)]


@pytest.mark.parametrize("mode", ["warn", "fail", "ignore"])
def test_leaks_are_reported_per_mode_and_always_killed(inner, mode):
    code, out = inner({"test_app.py": LEAKY}, "--cgturn", f"--cgturn-leaks={mode}")
    found = leaks(out)
    if mode == "ignore":
        assert code == 0 and found == [] and "cgturn leaks" not in out, out
        return
    where = {w: cmd for w, _, cmd in found}
    assert set(where) == {"test_app.py::test_leaky", "test_app.py (module fixture 'server')"}, out
    assert where["test_app.py::test_leaky"] == "sleep 300"
    assert where["test_app.py (module fixture 'server')"] == "sleep 301"
    assert_all_dead(found)
    if mode == "warn":
        assert code == 0 and "= cgturn leaks =" in out and "4 passed" in out, out
    else:
        assert code == 1 and "cgturn leaks" not in out, out
        # the module fixture's leak is checked when the module ends: at the last test's teardown
        assert "ERROR at teardown of test_leaky" in out and "ERROR at teardown of test_uses_server" in out, out
        assert "4 passed, 2 errors" in out, out


def test_ignore_mode_still_kills(inner, tmp_path):
    pidfile = tmp_path / "pid"
    files = {"test_one.py": textwrap.dedent(f"""
        import subprocess
        def test_leak():
            subprocess.run(["setsid", "-f", "sh", "-c", "echo $$ > {pidfile}; exec sleep 300"], check=True)
    """)}
    code, out = inner(files, "--cgturn", "--cgturn-leaks=ignore")
    assert code == 0, out
    pid = int(pidfile.read_text())
    assert wait_until(lambda: not alive(pid))


def test_class_scope_fixture_is_checked_when_the_class_ends(inner):
    files = {"test_cls.py": textwrap.dedent("""
        import subprocess, pytest

        class TestA:
            @pytest.fixture(scope="class")
            def worker(self):
                return subprocess.Popen(["sleep", "302"])

            def test_first(self, worker):
                pass

            def test_second(self, worker):
                pass

        def test_after_the_class():
            pass
    """)}
    code, out = inner(files, "--cgturn", "--cgturn-leaks=fail")
    assert code == 1, out
    assert "ERROR at teardown of TestA.test_second" in out and "2 errors" not in out, out
    found = leaks(out)
    assert [(w, c) for w, _, c in found] == [("test_cls.py::TestA (class fixture 'worker')", "sleep 302")], out
    assert_all_dead(found)


def test_cgturn_turn_fixture_contains_pytest_and_refuses_abandon(inner):
    files = {"test_turn.py": textwrap.dedent("""
        import os, pytest
        from cgturn import UnsafeOperation

        def test_turn(cgturn_turn):
            p = cgturn_turn.spawn(["sleep", "303"])
            assert os.getpid() in cgturn_turn.pids() and p.pid in cgturn_turn.pids()
            assert cgturn_turn.turn_id.endswith("test_turn.py::test_turn")
            with pytest.raises(UnsafeOperation):
                cgturn_turn.abandon("from inside", grace=0)
            assert cgturn_turn.state == "running"
    """)}
    code, out = inner(files, "--cgturn", "--cgturn-leaks=warn")
    assert code == 0 and "1 passed" in out, out
    found = leaks(out)
    # Turn.spawn runs the resolved program path as argv[0]
    assert [(w, c.rsplit("/", 1)[-1]) for w, _, c in found] == [("test_turn.py::test_turn", "sleep 303")], out
    assert_all_dead(found)


def test_xdist_workers_each_have_their_own_turns(inner):
    files = {f"test_w{i}.py": LEAKY for i in range(2)}
    code, out = inner(files, "--cgturn", "-n", "2")
    assert code == 0 and "8 passed" in out, out
    found = leaks(out)
    assert sorted(w for w, _, _ in found) == sorted(
        [f"test_w{i}.py::test_leaky" for i in range(2)] + [f"test_w{i}.py (module fixture 'server')" for i in range(2)])
    assert_all_dead(found)


def test_ini_enables_it_and_registry_fallback_catches_a_daemon(inner):
    files = {"test_reg.py": LEAKY, "pytest.ini": "[pytest]\ncgturn = true\n"}
    code, out = inner(files, extra_env={"CGTURN_BACKEND": "registry"})
    assert code == 0, out
    found = leaks(out)
    assert {(w, c) for w, _, c in found} == {("test_reg.py::test_leaky", "sleep 300"),
                                             ("test_reg.py (module fixture 'server')", "sleep 301")}, out
    assert_all_dead(found)


def test_inert_without_the_option(inner, tmp_path):
    pidfile = tmp_path / "pid"
    files = {"test_off.py": textwrap.dedent(f"""
        import os, subprocess
        def test_leak():
            subprocess.run(["setsid", "-f", "sh", "-c", "echo $$ > {pidfile}; exec sleep 300"], check=True)
            assert open("/proc/self/cgroup").read() == {open("/proc/self/cgroup").read()!r}

        def test_no_fixture(cgturn_turn):
            pass
    """)}
    code, out = inner(files)
    pid = int(pidfile.read_text())
    try:
        assert code == 1 and "1 passed" in out and "fixture 'cgturn_turn' not found" in out, out
        assert alive(pid) and "cgturn leaks" not in out
    finally:
        os.kill(pid, signal.SIGKILL)
