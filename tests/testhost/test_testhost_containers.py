"""cgturn inside real containers: podman with crun in the test host, one container run per kind.

The image is `localhost/cgturn-test`, imported from a Debian rootfs tarball made when the test host's
image was built (scripts/testhost/image.py; no registry is reachable, nothing is ever pulled). The
checkout is mounted read-only at /share in every container. Each container runs this file as a
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOTFS_TAR = "/var/lib/cgturn-test/rootfs.tar"
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
    except FileNotFoundError:
        return False


def _cgturn(state: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cgturn", "--state-dir", state, *args],
                          capture_output=True, text=True, timeout=120)


def _turn_checks(state: str) -> dict:
    """Escapers of an abandoned turn die; a completed turn's server survives until its task ends."""
    from cgturn import TurnManager

    out: dict = {}
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
    return out


def scenario_full(state: str) -> dict:
    """Under `cgturn init` with a writable cgroupfs: cgroup2, escapers die, limits, the pytest plugin."""
    out = {"cgroup": _v2("self"), "root_env": os.environ.get("CGTURN_ROOT")}
    doctor = _cgturn(state, "doctor", "--json")
    out["doctor"] = json.loads(doctor.stdout) if doctor.stdout else {"stderr": doctor.stderr}
    out.update(_turn_checks(state))
    oom = _cgturn(state, "run", "--memory", "64M", "--", sys.executable, "-c", "b = bytearray(512 << 20)")
    out["oom"] = {"code": oom.returncode, "memory_limit_line": "memory limit" in oom.stderr}
    pids = _cgturn(state, "run", "--pids", "4", "--", "sh", "-c",
                   "for i in 1 2 3 4 5 6 7 8; do sleep 5 & done; wait")
    out["pids"] = {"code": pids.returncode, "pids_limit_line": "pids limit" in pids.stderr}
    os.makedirs("/tmp/leak", exist_ok=True)
    with open("/tmp/leak/test_leak.py", "w") as f:
        f.write(LEAKY_TEST)
    plugin = subprocess.run([sys.executable, "-m", "pytest", "-p", "cgturn.pytest_plugin", "--cgturn", "-q",
                             "-p", "no:cacheprovider", "/tmp/leak/test_leak.py"],
                            capture_output=True, text=True, timeout=300, cwd="/tmp/leak",
                            env={**os.environ, "CGTURN_STATE_DIR": state})
    out["plugin"] = {"code": plugin.returncode, "section": "cgturn leaks" in plugin.stdout,
                     "names_test": "test_leak.py::test_leaks" in plugin.stdout,
                     "left": [int(p) for p in subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True,
                                                             text=True).stdout.split()]}
    return out


def scenario_no_init(state: str) -> dict:
    """At the namespace root without `cgturn init`: cgroup2 turns without limits; doctor says why."""
    doctor = _cgturn(state, "doctor", "--json")
    out = {"doctor": json.loads(doctor.stdout)}
    out.update(_turn_checks(state))
    limited = _cgturn(state, "run", "--memory", "64M", "--", "true")
    out["limited_run"] = {"code": limited.returncode, "stderr": limited.stderr.strip()}
    return out


def scenario_read_only(state: str) -> dict:
    """A read-only cgroupfs: doctor explains, the registry fallback owns turns, nothing crashes."""
    doctor = _cgturn(state, "doctor", "--json")
    out = {"doctor_code": doctor.returncode, "doctor": json.loads(doctor.stdout), "pid": os.getpid()}
    from cgturn import TurnManager

    with TurnManager(state_dir=state) as mgr:
        out["backend"] = mgr.backend.name
        turn = mgr.begin_turn("ci", "plain")
        p = turn.spawn(["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE, text=True)
        child = int(p.stdout.readline())
        out["killed_child"] = child in turn.abandon("test", grace=0).killed and _gone([child])
        p.wait()
    run = _cgturn(state, "run", "--", "sh", "-c", "exit 3")
    out["run_code"] = run.returncode
    return out


SCENARIOS = {"full": scenario_full, "no-init": scenario_no_init, "read-only": scenario_read_only}

if __name__ == "__main__":
    os.makedirs(sys.argv[2], exist_ok=True)
    print(json.dumps(SCENARIOS[sys.argv[1]](sys.argv[2])), flush=True)
    sys.exit(0)

# --- on the test host -----------------------------------------------------------------------------

import pytest  # noqa: E402 - the scenarios above run in containers that need no pytest import

from hostlib import TEST_USER, last_json, systemd_host, user_argv  # noqa: E402,F401

pytestmark = pytest.mark.testhost
SCRIPT = "/share/tests/testhost/test_testhost_containers.py"
SCENARIO_ENV = ["-e", "PYTHONPATH=/share", "-e", "PYTHONDONTWRITEBYTECODE=1"]
COMMON = ["--rm", "--network=none", "-v", "/share:/share:ro", *SCENARIO_ENV]
INIT = ["python3", "-m", "cgturn", "init", "-v", "--"]
DOCS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", "containers.md")


def _say(request, text: str) -> None:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"containers: {text}")


def _timed(request, what: str, argv: list[str], timeout: float = 420) -> subprocess.CompletedProcess:
    started = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    _say(request, f"{what}: {time.monotonic() - started:.1f} s (exit {res.returncode})")
    return res


@pytest.fixture(scope="module")
def image(request):
    """localhost/cgturn-test, imported once from the tarball baked into the test host's image."""
    res = _timed(request, "podman import (root)", ["podman", "import", ROOTFS_TAR, IMAGE])
    assert res.returncode == 0, res.stderr
    return IMAGE


def _scenario(request, what: str, podman_args: list[str], scenario: str, *, init: bool = True,
              runner=lambda argv: argv) -> dict:
    cmd = [*(INIT if init else []), "python3", SCRIPT, scenario, "/tmp/cgturn-state"]
    res = _timed(request, what, runner(["podman", "run", *COMMON, *podman_args, IMAGE, *cmd]))
    assert res.returncode == 0, f"{what}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    data = last_json(res.stdout)
    data["init_stderr"] = res.stderr
    return data


def _assert_full(data: dict) -> None:
    assert data["cgroup"] == "0::/init", data
    assert data["root_env"] == "/sys/fs/cgroup/cgturn"
    doctor = data["doctor"]
    assert doctor["backend"] == "cgroup2" and doctor["managed_root"] == "/sys/fs/cgroup/cgturn", doctor
    assert {"memory", "pids"} <= set(doctor["limits"]["available"]), doctor["limits"]
    assert doctor["limits"]["layout"] == "v2"
    assert data["backend"] == "cgroup2"
    assert set(data["escapers"]) <= set(data["killed"]) and data["escapers_gone"], data
    assert data["server_survives"] and data["server_gone_after_end"]
    assert data["oom"] == {"code": 137, "memory_limit_line": True}, data["oom"]
    assert data["pids"]["pids_limit_line"], data["pids"]
    plugin = data["plugin"]
    assert plugin["section"] and plugin["names_test"] and plugin["left"] == [], plugin


def test_privileged_container_with_init_gets_full_cgroup2(systemd_host, image, request):
    """`--privileged` with a private cgroup namespace (Docker's default on v2, GitHub Actions'
    `container:` jobs with `options: --privileged`): with `cgturn init`, everything, limits included."""
    data = _scenario(request, "privileged + cgturn init", ["--privileged", "--cgroupns=private"], "full")
    _assert_full(data)
    assert "moved 1 process(es) into /sys/fs/cgroup/init" in data["init_stderr"]


def test_privileged_container_without_init_owns_turns_without_limits(systemd_host, image, request):
    data = _scenario(request, "privileged, no init", ["--privileged", "--cgroupns=private"], "no-init", init=False)
    doctor = data["doctor"]
    assert doctor["backend"] == "cgroup2" and doctor["own_cgroup"] == "/sys/fs/cgroup"
    assert {"memory", "pids"} <= set(doctor["container_init"]["would_enable"]), doctor
    assert any("cgturn init -- CMD" in p for p in doctor["problems"])
    assert set(data["escapers"]) <= set(data["killed"]) and data["escapers_gone"]
    assert data["server_survives"] and data["server_gone_after_end"]
    assert data["limited_run"]["code"] == 125, data["limited_run"]


def test_unprivileged_container_with_a_read_only_cgroupfs_falls_back(systemd_host, image, request):
    """podman's default: /sys/fs/cgroup read-only. `cgturn init --plain-if-refused` warns and runs the
    scenario as a plain init; doctor explains; the registry owns turns."""
    data = _scenario(request, "read-only cgroupfs", [], "read-only", init=False,
                     runner=lambda argv: argv[:-4] + ["python3", "-m", "cgturn", "init", "--plain-if-refused",
                                                      "--", *argv[-4:]])
    assert "read-only" in data["init_stderr"] and "no cgroup step" in data["init_stderr"], data["init_stderr"]
    assert data["pid"] != 1                      # the scenario ran under init, as its child
    assert data["doctor_code"] == 0 and data["doctor"]["backend"] == "registry"
    assert any("read-only" in p for p in data["doctor"]["problems"]), data["doctor"]["problems"]
    assert data["backend"] == "registry" and data["killed_child"]
    assert data["run_code"] == 3


def test_runtime_delegated_cgroupfs_without_privileged(systemd_host, image, request):
    """Not privileged, but the runtime leaves the cgroupfs writable (`--security-opt
    unmask=/sys/fs/cgroup` with a private cgroup namespace; crun honours it): full cgroup2."""
    data = _scenario(request, "unprivileged, writable cgroupfs + cgturn init",
                     ["--cgroupns=private", "--security-opt", "unmask=/sys/fs/cgroup"], "full")
    _assert_full(data)


@pytest.fixture(scope="module")
def lingering_user():
    subprocess.run(["loginctl", "enable-linger", TEST_USER], check=True, capture_output=True, timeout=60)
    bus = f"/run/user/{CGTEST_UID}/bus"
    deadline = time.monotonic() + 120
    while not os.path.exists(bus) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.exists(bus), "the test user's manager did not start"
    yield TEST_USER
    subprocess.run(user_argv(TEST_USER, ["podman", "system", "reset", "--force"]), capture_output=True, timeout=300)
    subprocess.run(["loginctl", "disable-linger", TEST_USER], capture_output=True, timeout=60)


def test_rootless_podman_with_init(systemd_host, lingering_user, request):
    """Rootless podman as cgtest (its own systemd user manager, delegated by user@.service): the same
    scenario under `cgturn init`, with the image imported into cgtest's own storage."""
    as_user = lambda argv: user_argv(lingering_user, ["sh", "-c", 'cd / && exec "$@"', "-", *argv])  # noqa: E731
    res = _timed(request, "podman import (rootless)", as_user(["podman", "import", ROOTFS_TAR, IMAGE]))
    assert res.returncode == 0, res.stderr
    data = _scenario(request, "rootless + cgturn init",
                     ["--cgroupns=private", "--security-opt", "unmask=/sys/fs/cgroup"], "full", runner=as_user)
    _assert_full(data)


def kube_yaml_from_docs() -> str:
    """The Pod YAML docs/containers.md tells Kubernetes users to write (between its markers)."""
    with open(DOCS) as f:
        text = f.read()
    match = re.search(r"<!-- kube-pod:begin -->\s*```yaml\n(.*?)```\s*<!-- kube-pod:end -->", text, re.S)
    assert match, f"no kube-pod YAML in {DOCS}"
    return match.group(1)


def test_kubernetes_pod_through_kube_play(systemd_host, image, request, tmp_path):
    """The documented Pod, changed only where a test host differs from a cluster: the image is the
    local one (never pulled), the command runs the scenario from the checkout mounted as a hostPath."""
    text = kube_yaml_from_docs()
    assert "privileged: true" in text and "cgturn init" in text
    text = text.replace("registry.example.com/my-gateway:1", IMAGE).replace("IfNotPresent", "Never")
    text = text.replace('["cgturn", "init", "--", "my-gateway"]',
                        json.dumps(["python3", "-m", "cgturn", "init", "-v", "--", "python3", SCRIPT, "full",
                                    "/tmp/cgturn-state"]))
    text += ("      env:\n      - {name: PYTHONPATH, value: /share}\n      - {name: PYTHONDONTWRITEBYTECODE, value: '1'}\n"
             "      volumeMounts:\n      - {name: share, mountPath: /share, readOnly: true}\n"
             "  volumes:\n  - name: share\n    hostPath: {path: /share, type: Directory}\n")
    pod_file = tmp_path / "pod.yaml"
    pod_file.write_text(text)
    play = _timed(request, "kube play", ["podman", "kube", "play", "--network", "none", str(pod_file)])
    try:
        assert play.returncode == 0, play.stderr
        container = "cgturn-gateway-gateway"
        waited = _timed(request, "kube pod run", ["podman", "wait", container])
        logs = subprocess.run(["podman", "logs", container], capture_output=True, text=True, timeout=60)
        assert waited.stdout.strip() == "0", logs.stdout + logs.stderr
        data = last_json(logs.stdout)
        _assert_full(data)
    finally:
        subprocess.run(["podman", "kube", "down", str(pod_file)], capture_output=True, timeout=120)
