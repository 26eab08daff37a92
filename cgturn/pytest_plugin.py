"""pytest plugin: every test runs in its own turn; what a test leaves running is reported and killed.

Inert unless `--cgturn` (or ini `cgturn = true`): without it this module only adds its options.

cgroup v2: the pytest process moves into the test's turn for the test's duration, so everything the
test (and its function-scoped fixtures) starts lands there, daemons included; at teardown it moves
back to the cgroup it came from (the one move outside the managed root). A fixture of wider scope
(class, module, package, session) is set up with pytest inside a turn of its own, checked when that
scope ends. The managed root is `<own cgroup or CGTURN_ROOT>/cgturn-pytest-<random>[-<xdist worker>]`,
unique per run and per worker, and removed at session end.

Registry fallback (no usable cgroup v2): pytest cannot be moved, so during a test the turn's
CGTURN_* variables are put into os.environ (every exec'd child inherits them; the registry attributes
processes by them, setsid/double-fork daemons included), the registry makes pytest a child subreaper
(orphans reparent to it), and at teardown pytest's children that did not exist before the test are
adopted into the turn before it is killed.
"""
from __future__ import annotations

import os
import uuid

import pytest

import cgturn
from cgturn import reasons
from cgturn.errors import CgroupUnavailable, CgturnError, TurnExists, UnsafeOperation

MODES = ("fail", "warn", "ignore")
TASK = "pytest"
# user_properties key carrying leak report lines from the process that ran a test (an xdist worker)
# to the one printing the terminal summary.
REPORT_KEY = "cgturn_leaks"
ROOT_PREFIX = "cgturn-pytest-"
DEFAULT_SETTLE = 0.5


def pytest_addoption(parser):
    group = parser.getgroup("cgturn", "leak-free tests: every test in its own cgturn turn")
    group.addoption("--cgturn", action="store_true", default=None,
                    help="run every test in its own turn; report and kill what a test leaves running")
    group.addoption("--cgturn-leaks", choices=MODES, default=None,
                    help="what a leak does: fail (the test errors), warn (terminal summary; default), ignore")
    parser.addini("cgturn", "enable the cgturn plugin (like --cgturn)", type="bool", default=False)
    parser.addini("cgturn_leaks", "fail|warn|ignore (like --cgturn-leaks)", default="warn")
    parser.addini("cgturn_settle", "seconds a test's processes get to exit after teardown before they "
                  "count as leaks", default=str(DEFAULT_SETTLE))


def pytest_configure(config):
    enabled = config.getoption("--cgturn") or config.getini("cgturn")
    if not enabled:
        return
    mode = config.getoption("--cgturn-leaks") or config.getini("cgturn_leaks")
    if mode not in MODES:
        raise pytest.UsageError(f"cgturn_leaks must be one of {', '.join(MODES)}, not {mode!r}")
    try:
        settle = float(config.getini("cgturn_settle"))
    except ValueError as err:
        raise pytest.UsageError(f"cgturn_settle must be a number of seconds: {err}") from None
    parent, root = plan_roots()
    config.pluginmanager.register(LeakGuard(config, mode, settle, parent, root), "cgturn-leakguard")


def leak_line(where: str, pid: int, command: str) -> str:
    """One report line: who leaked (node id), the pid and its command line."""
    return f"{where}: pid {pid}: {command or '?'}"


def run_name() -> str:
    """`cgturn-pytest-<random>[-<xdist worker>]`: unique per run and per worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return ROOT_PREFIX + uuid.uuid4().hex[:10] + (f"-{worker}" if worker else "")


def plan_roots() -> tuple[str | None, str | None]:
    """(parent, managed root) for this run: `<parent>/<run_name()>`, the parent being CGTURN_ROOT,
    else pytest's own cgroup; (None, None) where cgroup v2 is not usable and the user's settings do
    not ask for it (the registry fallback then owns the tests' processes).

    Raises:
        pytest.UsageError: CGTURN_BACKEND=cgroup2 or CGTURN_ROOT ask for cgroup v2 and it cannot
            be used: the plugin never downgrades silently. Decided without creating anything.
    """
    explicit = os.environ.get("CGTURN_ROOT") or None
    wanted = os.environ.get("CGTURN_BACKEND") or "auto"
    if wanted == "registry":
        return None, None
    host = cgturn.discover_host(explicit)
    try:
        with cgturn.TurnManager(root=explicit, backend=wanted):
            pass  # creates nothing: only the decision is wanted here
    except (ValueError, CgroupUnavailable) as err:
        raise pytest.UsageError(f"cgturn plugin: cannot use cgroup v2 as configured: {err}") from None
    parent = explicit or host.own_cgroup
    # The plugin moves pytest between its own cgroup and the tests' turns, so it needs that cgroup
    # writable; cgturn's systemd scope (docs/where.md) is for a caller that moves into it for good.
    if not host.usable or parent is None or (explicit is None and host.systemd_scope is not None):
        return None, None
    return parent, os.path.join(parent, run_name())


class _Scope:
    """The turn of one test or one wider-scope fixture, and what to call it in a report."""

    def __init__(self, turn: "cgturn.Turn", label: str, baseline: frozenset[int] = frozenset()):
        self.turn, self.label, self.baseline = turn, label, baseline
        self.claimed: set[int] = set()


class LeakGuard:
    """The plugin's state for one pytest process (one xdist worker); registered only when enabled."""

    def __init__(self, config, mode: str, settle: float, parent: str | None, root: str | None):
        self.config, self.mode, self.settle = config, mode, settle
        self.leaks: list[str] = []          # report lines, gathered from every test report
        self._mgr: cgturn.TurnManager | None = None
        self._parent_mgr: cgturn.TurnManager | None = None  # owns CGTURN_ROOT if we created it
        self._cgroup2 = root is not None
        self._parent, self._root = parent, root
        # One task per run (and per xdist worker): runs sharing a registry never meet.
        self._task = os.path.basename(root) if root else run_name()
        self._test: _Scope | None = None    # the running test's turn
        self._inside: list[cgturn.Turn] = []  # where pytest is now: test turn, then nested fixture turns
        self._item = None
        self._seq = 0
        self._claimed: set[int] = set()     # registry: children adopted by wider-scope fixture turns

    # --- the manager, made on first use so an xdist controller (which runs no test) creates nothing

    @property
    def mgr(self) -> "cgturn.TurnManager":
        if self._mgr is None:
            if self._cgroup2:
                parent = cgturn.TurnManager(root=self._parent, backend="cgroup2")
                if parent.create_root():  # CGTURN_ROOT did not exist: ours to remove at the end
                    self._parent_mgr = parent
                self._mgr = cgturn.TurnManager(root=self._root, backend="cgroup2")
            else:
                self._mgr = cgturn.TurnManager(backend="registry")
        return self._mgr

    # --- entering and leaving a turn --------------------------------------------------------------

    def _begin(self, turn_id: str) -> "cgturn.Turn":
        for attempt in range(1, 100):
            try:
                return self.mgr.begin_turn(self._task, turn_id if attempt == 1 else f"{turn_id}#{attempt}")
            except TurnExists:
                continue  # the same node id ran before (reruns) and its turn still exists
        raise CgturnError(f"cannot begin a turn for {turn_id!r}")

    def _switch(self, turn: "cgturn.Turn | None") -> None:
        """Make `turn` (None: no turn) the place where what pytest starts from now on belongs."""
        if turn is None:
            self.mgr.leave_turn()   # back to pytest's own cgroup: the one move outside the managed root
        else:
            turn.enter()

    def _push(self, turn: "cgturn.Turn") -> None:
        self._inside.append(turn)
        self._switch(turn)

    def _pop(self) -> None:
        self._inside.pop()
        self._switch(self._inside[-1] if self._inside else None)

    def _children(self) -> frozenset[int]:
        """Pytest's live child processes (registry backend: what a test started directly)."""
        if self._cgroup2:
            return frozenset()
        return frozenset(child.pid for child in cgturn.processes.children())

    def _finish(self, scope: _Scope) -> list[str]:
        """Wait up to the settle time for the scope's turn to empty, then kill and report the rest."""
        turn = scope.turn
        if not self._cgroup2:
            for pid in self._children() - scope.baseline - self._claimed:
                try:
                    turn.adopt(pid)
                except CgturnError:
                    pass  # it exited meanwhile
        turn.wait_empty(self.settle)
        pids = turn.pids()
        commands = {pid: cgturn.processes.command_line(pid) for pid in pids}
        result = turn.abandon(reasons.PYTEST_LEAK, grace=0, force=True)
        killed = sorted(set(result.killed) | set(commands))
        return [leak_line(scope.label, pid, commands.get(pid, "")) for pid in killed]

    # --- per test ---------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._item = item
        turn = self._begin(item.nodeid)
        self._test = _Scope(turn, item.nodeid, self._children())
        self._push(turn)
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item, nextitem):
        try:
            outcome = yield
        except BaseException:
            self._publish(item, self._end_test())
            raise
        lines = self._end_test()
        self._publish(item, lines)
        if lines and self.mode == "fail":
            pytest.fail("cgturn: the test left processes running (killed):\n  " + "\n  ".join(lines),
                        pytrace=False)
        return outcome

    def _end_test(self) -> list[str]:
        scope, self._test = self._test, None
        if scope is None:
            return []
        self._inside.clear()
        self._switch(None)
        return self._finish(scope)

    def _publish(self, item, lines: list[str]) -> None:
        if lines:
            item.user_properties.append((REPORT_KEY, lines))

    # --- fixtures of wider scope ------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope == "function" or not self._inside:
            return (yield)
        where = request.node.nodeid or "session"
        label = f"{where} ({fixturedef.scope} fixture {fixturedef.argname!r})"
        self._seq += 1
        turn = self._begin(f"{fixturedef.scope}:{fixturedef.argname}@{where}#{self._seq}")
        scope = _Scope(turn, label, self._children())
        # Registered before the fixture runs, so it runs after the fixture's own teardown (LIFO).
        fixturedef.addfinalizer(lambda: self._end_scope(scope))
        self._push(turn)
        try:
            return (yield)
        finally:
            self._pop()
            self._claim(scope)

    def _claim(self, scope: _Scope) -> None:
        """Registry: pytest's children started by a wider-scope fixture belong to its turn, not the test's."""
        for pid in self._children() - scope.baseline - self._claimed:
            try:
                scope.turn.adopt(pid)
                scope.claimed.add(pid)
                self._claimed.add(pid)
            except CgturnError:
                pass  # it exited meanwhile

    def _end_scope(self, scope: _Scope) -> None:
        lines = self._finish(scope)
        self._claimed -= scope.claimed
        if self._item is not None:
            self._publish(self._item, lines)
        if lines and self.mode == "fail":
            pytest.fail("cgturn: a fixture left processes running (killed):\n  " + "\n  ".join(lines),
                        pytrace=False)

    # --- the fixture ------------------------------------------------------------------------------

    @pytest.fixture
    def cgturn_turn(self) -> "cgturn.Turn":
        """The current test's turn. It contains pytest, so abandoning it is refused."""
        if self._test is None:
            raise UnsafeOperation("cgturn_turn is only available while a test runs")
        return self._test.turn

    # --- reporting (runs where the terminal is: the xdist controller, or the only process) --------

    def pytest_runtest_logreport(self, report):
        if report.when != "teardown":
            return
        for key, value in getattr(report, "user_properties", ()):
            if key == REPORT_KEY:
                self.leaks.extend(value)

    def pytest_terminal_summary(self, terminalreporter):
        if self.leaks and self.mode == "warn":
            terminalreporter.section("cgturn leaks")
            terminalreporter.write_line(f"{len(self.leaks)} process(es) left running by tests (killed):")
            for line in self.leaks:
                terminalreporter.write_line("  " + line)

    # --- session end ------------------------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        self._shutdown()

    def pytest_unconfigure(self, config):
        self._shutdown()

    def _shutdown(self) -> None:
        """Back home, kill whatever is left in any turn, remove the managed root (interrupts too)."""
        if self._mgr is None:
            return
        try:
            if self._inside:
                self._inside.clear()
                self._switch(None)
            self._test = None
            self._mgr.end_task(self._task, reason=reasons.PYTEST_SESSION_END, grace=0)
        finally:
            self._mgr.remove_root()
            self._mgr.close()
            self._mgr = None
            if self._parent_mgr is not None:
                self._parent_mgr.remove_root()  # only if empty: another run may use it now
                self._parent_mgr.close()
                self._parent_mgr = None
