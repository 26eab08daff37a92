"""cgturn inside real containers: podman with crun in the test host, one container run per kind.

Containers run on a Debian rootfs made when the test host's image was built (scripts/testhost/image.py;
no registry is reachable, nothing is ever pulled), with `podman run --rootfs` read-only; `kube play`
needs an image: the same rootfs, imported as `localhost/cgturn-test` when the image was built. The checkout is mounted
read-only at /share in every container. Each container runs this file as a
script (`python3 /share/tests/testhost/test_testhost_containers.py SCENARIO STATE`), which does all
of that container's checks in one run and prints one JSON line; the tests assert on it. What each
part costs is printed (`containers: ...` lines), as the stage's budget is small under emulation.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOTFS = "/var/lib/cgturn-test/rootfs"
IMAGE = "localhost/cgturn-test:latest"
CGTEST_UID = 1000

# --- inside a container ---------------------------------------------------------------------------

ESCAPERS = r"""
import os, sys
pids = []
for clear_env in (False, True):
    r, w = os.pipe()
    if os.fork() == 0:            # double fork + setsid: no longer our descendant, own session
        os.setsid()
        pid = os.fork()
        if pid == 0:
            env = {} if clear_env else dict(os.environ)   # one clears its environment (CGTURN_* gone)
            os.execve("/bin/sleep", ["sleep", "300"], env)
        os.write(w, f"{pid}\n".encode())
        os._exit(0)
    os.close(w)
    pids.append(int(os.read(r, 32)))
    os.wait()
print(" ".join(map(str, pids)), flush=True)
"""

SERVER = r"""
import os, socket, sys
if os.fork():
    os._exit(0)
os.setsid()
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(os.getpid(), s.getsockname()[1], flush=True)
os.close(1)
while True:
    s.accept()[0].close()
"""

LEAKY_TEST = "import subprocess\n\ndef test_leaks():\n    subprocess.Popen(['setsid', 'sleep', '300'])\n"


def _v2(pid: str | int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return [line for line in f.read().splitlines() if line.startswith("0::")][0]


def _gone(pids, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if not any(_alive(p) for p in pids):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between open and read (ESRCH)
        return False


def _timed_step(out: dict, name: str, started: float) -> None:
    out.setdefault("seconds", {})[name] = round(time.monotonic() - started, 1)


def _doctor(state: str) -> dict:
    from cgturn import doctor_report

    return doctor_report(state_dir=state)


def _turn_checks(state: str, out: dict) -> None:
    """Escapers of an abandoned turn die; a completed turn's server survives until its task ends."""
    from cgturn import TurnManager

    started = time.monotonic()
    with TurnManager(state_dir=state) as mgr:
        out["backend"] = mgr.backend.name
        turn = mgr.begin_turn("ci", "escape")
        p = turn.spawn([sys.executable, "-c", ESCAPERS], stdout=subprocess.PIPE, text=True)
        escapers = [int(x) for x in p.stdout.readline().split()]
        p.wait()
        out["escapers"] = escapers
        out["killed"] = turn.abandon("test", grace=0).killed
        out["escapers_gone"] = _gone(escapers)
        served = mgr.begin_turn("ci", "serve")
        p = served.spawn([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        pid, port = map(int, p.stdout.readline().split())
        p.wait()
        served.complete()
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
        out["server_survives"] = _alive(pid)
        mgr.end_task("ci", grace=0)
        out["server_gone_after_end"] = _gone([pid])
    _timed_step(out, "turns", started)


def _limit_checks(state: str, out: dict) -> None:
    """A memory limit OOM-kills (the whole turn, v2's default), a pids limit refuses forks."""
    from cgturn import Limits, TurnManager

    started = time.monotonic()
    with TurnManager(state_dir=state) as mgr:
        turn = mgr.begin_turn("limits", "oom", limits=Limits(memory_max=64 << 20))
        code = turn.spawn([sys.executable, "-c", "b = bytearray(512 << 20)"]).wait()
        out["oom"] = {"code": code, "oom_kills": turn.usage().oom_kills}
        turn.abandon("done", grace=0)
        turn = mgr.begin_turn("limits", "pids", limits=Limits(pids_max=4))
        turn.spawn(["sh", "-c", "for i in 1 2 3 4 5 6 7 8; do sleep 2 & done; wait"],
                   stderr=subprocess.DEVNULL).wait()
        out["pids_max_hits"] = turn.usage().pids_max_hits
        turn.abandon("done", grace=0)
        mgr.end_task("limits", grace=0)
    _timed_step(out, "limits", started)


def _plugin_check(state: str, out: dict) -> None:
    started = time.monotonic()
    os.makedirs("/tmp/leak", exist_ok=True)
    with open("/tmp/leak/test_leak.py", "w") as f:
        f.write(LEAKY_TEST)
    plugin = subprocess.run([sys.executable, "-m", "pytest", "-p", "cgturn.pytest_plugin", "--cgturn", "-q",
                             "-p", "no:cacheprovider", "/tmp/leak/test_leak.py"],
                            capture_output=True, text=True, timeout=300, cwd="/tmp/leak",
                            env={**os.environ, "CGTURN_STATE_DIR": state})
    left = [int(p) for p in subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True,
                                           text=True).stdout.split()]
    out["plugin"] = {"code": plugin.returncode, "section": "cgturn leaks" in plugin.stdout,
                     "names_test": "test_leak.py::test_leaks" in plugin.stdout, "left": left}
    _timed_step(out, "plugin", started)


def scenario_full(state: str, before: str | None = None, plugin: bool = True) -> dict:
    """Under `cgturn init` with a writable cgroupfs: cgroup2, escapers die, limits, the pytest plugin
    (unless `plugin` is false). `before`: the JSON file where the same container's no-init scenario
    left its result."""
    out: dict = {"cgroup": _v2("self"), "root_env": os.environ.get("CGTURN_ROOT"), "doctor": _doctor(state)}
    if before:
        with open(before) as f:
            out["no_init"] = json.load(f)
    _turn_checks(state, out)
    _limit_checks(state, out)
    if plugin:
        _plugin_check(state, out)
    return out


def scenario_turns_and_limits(state: str) -> dict:
    """The full scenario without the pytest plugin's run (a pytest start is most of the scenario's
    cost under emulation): for the containers whose kernel setup is the privileged one's, which runs
    the plugin."""
    return scenario_full(state, plugin=False)


def scenario_no_init(state: str) -> dict:
    """At the namespace root without `cgturn init`: cgroup2 turns without limits; doctor says why."""
    from cgturn import Limits, LimitsUnavailable, TurnManager

    out: dict = {"cgroup": _v2("self"), "doctor": _doctor(state)}
    _turn_checks(state, out)
    with TurnManager(state_dir=state) as mgr:
        try:
            mgr.begin_turn("limits", "refused", limits=Limits(memory_max=64 << 20))
            out["limits"] = "allowed"
        except LimitsUnavailable as err:
            out["limits"] = f"LimitsUnavailable: {err}"
        # Its managed root recorded a layout without v2 controllers: gone, so that `cgturn init`,
        # which this container runs next, makes it afresh with the controllers it enables.
        out["root_removed"] = mgr.remove_root()
    return out


def _what_the_registry_sees(pid: int, scope: str) -> dict:
    """A missed process as /proc shows it now: its state and parent, its command line, whether its
    environment names the registry's scope."""
    seen: dict = {"scope": scope}
    for name in ("stat", "cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                data = f.read()
        except OSError as err:
            seen[name] = f"{type(err).__name__}: {err}"
            continue
        if name == "stat":
            seen[name] = data.decode().rsplit(")", 1)[1].split()[:2]
        elif name == "cmdline":
            seen[name] = data.decode(errors="replace").replace("\0", " ")
        else:
            seen[name] = sorted(e.decode(errors="replace") for e in data.split(b"\0") if e.startswith(b"CGTURN_"))
    return seen


def scenario_read_only(state: str) -> dict:
    """A read-only cgroupfs: doctor explains, the registry fallback owns turns, nothing crashes."""
    out: dict = {"doctor": _doctor(state), "pid": os.getpid()}
    from cgturn import TurnManager

    with TurnManager(state_dir=state) as mgr:
        out["backend"] = mgr.backend.name
        turn = mgr.begin_turn("ci", "plain")
        p = turn.spawn(["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE, text=True)
        child = int(p.stdout.readline())
        killed = turn.abandon("test", grace=0).killed
        out["child"], out["killed"] = child, sorted(killed)
        out["killed_child"] = child in killed and _gone([child])
        if not out["killed_child"]:  # what the registry would have had to see
            out["missed"] = _what_the_registry_sees(child, mgr.backend.scope)
        p.wait()
    return out


SCENARIOS = {"full": scenario_full, "turns-and-limits": scenario_turns_and_limits, "no-init": scenario_no_init,
             "read-only": scenario_read_only}

if __name__ == "__main__":
    os.makedirs(sys.argv[2], exist_ok=True)
    print(json.dumps(SCENARIOS[sys.argv[1]](*sys.argv[2:])), flush=True)
    sys.exit(0)

# --- on the test host -----------------------------------------------------------------------------

import pytest  # noqa: E402 - the scenarios above run in containers that need no pytest import

from hostlib import (GUEST_STATE, TEST_USER, check_systemd_host, last_json, stop_user_manager, systemd_host,  # noqa: E402,F401
                     user_argv)

pytestmark = [pytest.mark.testhost, GUEST_STATE]
SCRIPT = "/share/tests/testhost/test_testhost_containers.py"
ENV = ["-e", "PYTHONPATH=/share", "-e", "PYTHONDONTWRITEBYTECODE=1"]
# --rootfs with --read-only: the rootfs baked into the test host's image stays pristine (podman puts
# tmpfs on /tmp, /run, /var/tmp) and no image is imported (249 s of a run under emulation).
RUN = ["podman", "run", "--rm", "--network=none", "--read-only", "-v", "/share:/share:ro", *ENV]
INIT = ["python3", "-m", "cgturn", "init", "-v", "--"]
DOCS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", "containers.md")
# Under software emulation (TCG, every CI run on the development machine) one container costs a
# minute or more, so every container here starts at once and they run side by side on the guest's
# CPUs (`started`); each prints what it and its steps cost.


def _say(request, text: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"containers: {text}")


def _mount_points() -> None:
    """What podman mounts over or links in the rootfs, made as root beforehand: rootless podman may not
    create them in a root-owned rootfs ("creating /etc/mtab symlink: permission denied"). The guest's
    disk is a snapshot: nothing outlives the run."""
    os.makedirs(os.path.join(ROOTFS, "share"), exist_ok=True)
    mtab = os.path.join(ROOTFS, "etc", "mtab")
    if not os.path.lexists(mtab):
        os.symlink("/proc/mounts", mtab)
    for name in ("hosts", "hostname", "resolv.conf"):
        path = os.path.join(ROOTFS, "etc", name)
        if not os.path.lexists(path):
            open(path, "a").close()


class _Running:
    """Work that runs in the background (a `podman run`, or the steps of `kube play`): several run side
    by side on the guest's CPUs. `work` returns (exit code, stdout, stderr) and may note what its
    steps cost in `self.steps`."""

    def __init__(self, what: str, work):
        self.what, self.started = what, time.monotonic()
        self.ended: float | None = None
        self.steps: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._data: dict | None = None
        self._result: tuple[int, str, str] = (1, "", "did not finish")
        self._done = threading.Event()  # the result is in (cleanup steps may still run)
        # Collected as it comes, so that the time printed is this run's own, not the time a test asked.
        self._thread = threading.Thread(target=self._collect, args=(work,), name=f"podman {what}", daemon=True)
        self._thread.start()

    def _collect(self, work) -> None:
        try:
            result = work(self)
        except Exception as err:  # reported by data(), in the test that asks
            result = (1, "", f"{type(err).__name__}: {err}")
        self.result_ready(result)

    def result_ready(self, result: tuple[int, str, str]) -> None:
        """The work's result is in (exit code, stdout, stderr): data() may return while cleanup steps
        still run. The first result given counts."""
        if not self._done.is_set():
            self._result, self.ended = result, time.monotonic()
            self._done.set()

    def run(self, step: str, argv: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
        """Run one step of the work (a process this object starts and kills on its deadline), timed."""
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # the podman client this object started; --rm / kube down remove the container
            out, err = proc.communicate()
        self.steps.append(f"{step} {time.monotonic() - started:.1f} s (exit {proc.returncode})")
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def join(self, timeout: float = 900) -> None:
        """Wait for the whole work (cleanup steps included); kill what still runs after `timeout`."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
            self._thread.join()

    def data(self, request, timeout: float = 900) -> dict:
        """Its scenario's JSON (with `init_stderr`); fails the calling test when the run failed."""
        if self._data is not None:
            return self._data
        if not self._done.wait(timeout):
            self.join(0)
            raise AssertionError(f"{self.what}: still running after {timeout:.0f} s")
        code, stdout, stderr = self._result
        _say(request, f"{self.what}: {self.ended - self.started:.1f} s (exit {code}; {', '.join(self.steps)})")
        if code != 0:
            _say(request, f"{self.what}: stdout {stdout[-1500:]!r} stderr {stderr[-1500:]!r}")
        assert code == 0, f"{self.what}: exit {code}\n{stdout}\n{stderr}"
        data = last_json(stdout)
        data["init_stderr"] = stderr
        _say(request, f"{self.what}: {json.dumps(data)[:3000]}")
        self._data = data
        return data


def _start(what: str, podman_args: list[str], command: list[str], runner=lambda argv: argv,
           rootfs: list[str] | None = None) -> _Running:
    _mount_points()
    run = RUN if rootfs is None else [a for a in RUN if a != "--read-only"]
    argv = runner([*run, *podman_args, *(rootfs or ["--rootfs", ROOTFS]), *command])

    def work(running: _Running) -> tuple[int, str, str]:
        res = running.run("podman run", argv)
        return res.returncode, res.stdout, res.stderr

    return _Running(what, work)


def _full(scenario: str = "turns-and-limits", scenario_state: str = "/tmp/cgturn-state") -> list[str]:
    return [*INIT, "python3", SCRIPT, scenario, scenario_state]


def _assert_full(data: dict, plugin: bool = False) -> None:
    """What `cgturn init` gives: cgroup2 at /sys/fs/cgroup/cgturn, v2 limits, escapers dead, a completed
    turn's server alive until its task ends, and (`plugin`) the pytest plugin's leak report."""
    assert data["cgroup"] == "0::/init", data
    assert data["root_env"] == "/sys/fs/cgroup/cgturn"
    doctor = data["doctor"]
    assert doctor["backend"] == "cgroup2" and doctor["managed_root"] == "/sys/fs/cgroup/cgturn", doctor
    assert doctor["limits"]["layout"] == "v2" and {"memory", "pids"} <= set(doctor["limits"]["available"]), doctor
    assert data["backend"] == "cgroup2"
    assert set(data["escapers"]) <= set(data["killed"]) and data["escapers_gone"], data
    assert data["server_survives"] and data["server_gone_after_end"]
    assert data["oom"]["code"] == -9 and data["oom"]["oom_kills"] >= 1, data["oom"]
    assert data["pids_max_hits"] >= 1
    if plugin:
        report = data["plugin"]
        assert report["section"] and report["names_test"] and report["left"] == [], report
    else:
        assert "plugin" not in data


def _kube(what: str) -> _Running:
    """`podman kube play` of the Pod docs/containers.md tells Kubernetes users to write, changed only
    where a test host differs from a cluster: the image is the local one (imported from the rootfs when
    the image was built, never pulled), the command runs the scenario from the checkout, mounted as a
    hostPath. Its steps: play (the pod and its infra container, then the container), wait, logs; then,
    after the result is in, `kube down` (still timed; the fixture's teardown waits for it)."""
    text = kube_yaml_from_docs()
    assert "privileged: true" in text and '["cgturn", "init", "--",' in text, text
    text = text.replace("registry.example.com/my-gateway:1", IMAGE).replace("IfNotPresent", "Never")
    text = text.replace('["cgturn", "init", "--", "my-gateway"]', json.dumps(_full()))
    text += ("      env:\n      - {name: PYTHONPATH, value: /share}\n      - {name: PYTHONDONTWRITEBYTECODE, value: '1'}\n"
             "      volumeMounts:\n      - {name: share, mountPath: /share, readOnly: true}\n"
             "  volumes:\n  - name: share\n    hostPath: {path: /share, type: Directory}\n")
    pod_file = os.path.join(tempfile.mkdtemp(prefix="cgturn-test-kube-"), "pod.yaml")
    with open(pod_file, "w") as f:
        f.write(text)
    container = "cgturn-gateway-gateway"

    def work(running: _Running) -> tuple[int, str, str]:
        play = running.run("kube play", ["podman", "kube", "play", "--network", "none", pod_file])
        if play.returncode != 0:
            return play.returncode, play.stdout, play.stderr
        try:
            waited = running.run("pod's run (podman wait)", ["podman", "wait", container])
            logs = running.run("logs", ["podman", "logs", container], timeout=120)
            code = int(waited.stdout.strip()) if waited.stdout.strip().isdigit() else 1
            # The result is in: the test may check it while the pod (its infra container still runs)
            # goes down; the fixture's teardown waits for that.
            running.result_ready((code, logs.stdout, logs.stderr))
        finally:
            running.run("kube down", ["podman", "kube", "down", pod_file], timeout=300)
        return code, logs.stdout, logs.stderr

    return _Running(what, work)


@pytest.fixture(scope="module")
def started(request, systemd_host_module):
    """The containers, all started at once (each its scenarios in one run), side by side on the
    guest's CPUs:

    - `privileged`: `--privileged --cgroupns=private`, first the no-init scenario at the namespace
      root (a child of a shell that is PID 1), then that shell execs `cgturn init` for the full one,
      the pytest plugin's run included (the others, the same kernel setup under `cgturn init`, leave
      that run out: a pytest start is most of a scenario's cost under emulation);
    - `delegated`: not privileged, the cgroupfs left writable by the runtime, under `cgturn init`;
    - `rootless`: the delegated one's flags, run by cgtest's own podman;
    - `read-only`: podman's default, the cgroupfs read-only, under `cgturn init --plain-if-refused`;
    - `kube`: the documented Pod through `podman kube play`.
    """
    assert subprocess.run(["podman", "image", "exists", IMAGE], timeout=300).returncode == 0, \
        f"{IMAGE} is not in the guest's storage (scripts/testhost/image.py imports it)"
    script = (f"python3 {SCRIPT} no-init /tmp/s0 > /tmp/no-init.json && "
              f"exec {' '.join(INIT)} python3 {SCRIPT} full /tmp/s1 /tmp/no-init.json")
    running = {
        "privileged": _start("privileged (no init, then cgturn init)", ["--privileged", "--cgroupns=private"],
                             ["sh", "-c", script]),
        "delegated": _start("unprivileged, writable cgroupfs + cgturn init",
                            ["--cgroupns=private", "--security-opt", "unmask=/sys/fs/cgroup"], _full()),
        "read-only": _start("read-only cgroupfs", [],
                            ["python3", "-m", "cgturn", "init", "--plain-if-refused", "--",
                             "python3", SCRIPT, "read-only", "/tmp/cgturn-state"]),
    }
    try:
        running["kube"] = _kube("kube play of the documented Pod")
        # Rootless: as cgtest, whose own systemd manager (started by lingering) delegates to podman.
        subprocess.run(["loginctl", "enable-linger", TEST_USER], check=True, capture_output=True, timeout=60)
        bus = f"/run/user/{CGTEST_UID}/bus"
        deadline = time.monotonic() + 120
        while not os.path.exists(bus) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(bus), "the test user's manager did not start"
        running["rootless"] = _start("rootless + cgturn init",
                                     ["--cgroupns=private", "--security-opt", "unmask=/sys/fs/cgroup"], _full(),
                                     runner=lambda argv: _as_user(TEST_USER, argv))
        yield running
    finally:
        for run in running.values():
            run.join()
        for run in running.values():
            if run.steps:
                _say(request, f"{run.what}: steps {', '.join(run.steps)}")
        stop_user_manager(TEST_USER)  # and with it the user's podman processes (the disk is a snapshot)


@pytest.fixture(scope="module")
def systemd_host_module():
    """`systemd_host` for module fixtures: fail (not skip) unless this is the test host."""
    check_systemd_host()


@pytest.fixture(scope="module")
def privileged_run(request, started):
    return started["privileged"].data(request)


def test_privileged_container_with_init_gets_full_cgroup2(systemd_host, privileged_run):
    """`--privileged` with a private cgroup namespace (Docker's default on v2, GitHub Actions'
    `container:` jobs with `options: --privileged`): with `cgturn init`, everything, limits included."""
    _assert_full(privileged_run, plugin=True)
    assert "moved 1 process(es) into /sys/fs/cgroup/init" in privileged_run["init_stderr"]


def test_privileged_container_without_init_owns_turns_without_limits(systemd_host, privileged_run):
    data = privileged_run["no_init"]
    assert data["cgroup"] == "0::/"
    doctor = data["doctor"]
    assert doctor["backend"] == "cgroup2" and doctor["own_cgroup"] == "/sys/fs/cgroup"
    assert {"memory", "pids"} <= set(doctor["container_init"]["would_enable"]), doctor
    assert any("cgturn init -- CMD" in p for p in doctor["problems"])
    assert set(data["escapers"]) <= set(data["killed"]) and data["escapers_gone"]
    assert data["server_survives"] and data["server_gone_after_end"]
    assert data["limits"].startswith("LimitsUnavailable"), data["limits"]


def test_unprivileged_container_with_a_read_only_cgroupfs_falls_back(systemd_host, request, started):
    """podman's default: /sys/fs/cgroup read-only. `cgturn init --plain-if-refused` warns and runs the
    scenario as a plain init; doctor explains; the registry owns turns."""
    data = started["read-only"].data(request)
    assert "read-only" in data["init_stderr"] and "no cgroup step" in data["init_stderr"], data["init_stderr"]
    assert data["pid"] != 1                      # the scenario ran under init, as its child
    assert data["doctor"]["backend"] == "registry" and data["doctor"]["usable"]
    assert any("read-only" in p for p in data["doctor"]["problems"]), data["doctor"]["problems"]
    assert data["backend"] == "registry" and data["killed_child"], data


def test_runtime_delegated_cgroupfs_without_privileged(systemd_host, request, started):
    """Not privileged, but the runtime leaves the cgroupfs writable (`--security-opt
    unmask=/sys/fs/cgroup` with a private cgroup namespace; crun honours it): full cgroup2."""
    _assert_full(started["delegated"].data(request))


def _as_user(user: str, argv: list[str]) -> list[str]:
    """`argv` as `user` with its own HOME (runuser -u keeps root's, where rootless podman keeps its
    storage) and working directory, talking to its systemd user manager."""
    import pwd

    home = pwd.getpwnam(user).pw_dir
    return user_argv(user, ["env", f"HOME={home}", "sh", "-c", 'cd "$HOME" && exec "$@"', "-", *argv])


def test_rootless_podman_with_init(systemd_host, request, started):
    """Rootless podman as cgtest (its own systemd user manager, delegated by user@.service): the same
    scenario under `cgturn init`, on the same read-only rootfs (mount points made beforehand)."""
    _assert_full(started["rootless"].data(request))


def kube_yaml_from_docs() -> str:
    """The Pod YAML docs/containers.md tells Kubernetes users to write (between its markers)."""
    with open(DOCS) as f:
        text = f.read()
    match = re.search(r"<!-- kube-pod:begin -->\s*```yaml\n(.*?)```\s*<!-- kube-pod:end -->", text, re.S)
    assert match, f"no kube-pod YAML in {DOCS}"
    return match.group(1)


def test_kubernetes_pod_through_kube_play(systemd_host, request, started):
    """The Pod docs/containers.md tells Kubernetes users to write, through `podman kube play` (the
    changes a test host needs are in `_kube`): full cgroup2 under `cgturn init`, as the privileged row."""
    _assert_full(started["kube"].data(request))
