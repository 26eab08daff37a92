"""Deployment for real: a non-root user in a delegated subtree, a container's cgroup view, the unit file.

Every scenario runs as processes inside the test's own root (`cgroup2_root`), so teardown kills
whatever they leave.
"""
import json
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import uuid

import pytest


from conftest import PY, alive, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTRIB = os.path.join(REPO, "contrib")
DELEGATED_FILES = ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads")  # what Delegate= chowns
# The unprivileged user cannot reach a Python installed under /root; the system one imports cgturn
# (stdlib only for this scenario) from the checkout.
USER_PYTHON = "/usr/bin/python3"

# A turn's life as the delegated user: spawn a setsid daemon, abandon, then try to reach outside.
USER_SCENARIO = r"""
import json, os, subprocess, sys
from cgturn import TurnManager
root, outside, state = sys.argv[1:4]
v2 = [line for line in open("/proc/self/cgroup").read().splitlines() if line.startswith("0::")]
out = {"euid": os.geteuid(), "cgroup": v2[0]}
with TurnManager(root=root, backend="cgroup2", state_dir=state) as mgr:
    turn = mgr.begin_turn("chat", "t-1")
    p = turn.spawn(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE, text=True)
    out["daemon"] = int(p.stdout.readline())
    p.wait()
    out["killed"] = turn.abandon("test", grace=0).killed
def attempt(fn):
    try:
        fn()
        return "allowed"
    except PermissionError:
        return "refused"
def write(path, data):
    with open(path, "w") as f:
        f.write(data)
out["move_outside"] = attempt(lambda: write(outside + "/cgroup.procs", str(os.getpid())))
out["kill_outside"] = attempt(lambda: write(outside + "/sibling/cgroup.kill", "1"))
out["mkdir_outside"] = attempt(lambda: os.mkdir(outside + "/intruder"))
try:
    TurnManager(root=outside + "/cgturn", backend="cgroup2", state_dir=state)
    out["manager_outside"] = "allowed"
except Exception as err:
    out["manager_outside"] = type(err).__name__
print(json.dumps(out))
"""

# Inside `unshare --cgroup --mount` with cgroup2 mounted afresh on /sys/fs/cgroup.
CONTAINER_SCENARIO = r"""
import json, os, subprocess, sys
state, ro = sys.argv[1:3]
def doctor(**env):
    r = subprocess.run([sys.executable, "-m", "cgturn", "--state-dir", state, "doctor", "--json"],
                       capture_output=True, text=True, env={**os.environ, **env})
    return {"code": r.returncode, **json.loads(r.stdout)}
v2 = [line for line in open("/proc/self/cgroup").read().splitlines() if line.startswith("0::")]
out = {"cgroup": v2[0], "doctor": doctor()}
from cgturn import TurnManager
with TurnManager(backend="cgroup2", state_dir=state) as mgr:
    turn = mgr.begin_turn("chat", "t-1")
    p = turn.spawn(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE, text=True)
    out["daemon"] = int(p.stdout.readline())
    p.wait()
    out["visible"] = sorted(e.name for e in os.scandir("/sys/fs/cgroup") if e.is_dir())
    out["ps"] = [(i.task, i.turn, i.pids) for i in mgr.turns()]
    out["killed"] = turn.abandon("test", grace=0).killed
# A read-only view of the same cgroupfs (a per-mount flag: the host's cgroupfs stays writable).
subprocess.run(["mount", "--bind", "/sys/fs/cgroup", ro], check=True)
subprocess.run(["mount", "-o", "remount,bind,ro", ro], check=True)
out["doctor_ro"] = doctor(CGTURN_CGROUP2_MOUNT=ro)
print(json.dumps(out))
"""


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed")
    return path


@pytest.fixture
def throwaway_user():
    """A system user named cgturn-<random>, deleted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root")
    need("useradd")
    name = f"cgturn-{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    user = pwd.getpwnam(name)
    try:
        yield user
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def run_in_cgroup(cgroup_dir: str, argv: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run argv with its first instruction already inside `cgroup_dir` (a shell moves itself, then execs)."""
    shim = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    return subprocess.run(["sh", "-c", shim, cgroup_dir, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_non_root_user_in_a_delegated_subtree(cgroup2_root, throwaway_user):
    if not os.access(USER_PYTHON, os.X_OK):
        pytest.skip(f"{USER_PYTHON} is missing")
    need("setpriv")
    user = throwaway_user
    deleg = os.path.join(cgroup2_root, "deleg")
    for path in (cgroup2_root, deleg, os.path.join(cgroup2_root, "sibling")):
        os.mkdir(path)
    for path in (deleg, *(os.path.join(deleg, f) for f in DELEGATED_FILES)):
        os.chown(path, user.pw_uid, user.pw_gid)
    state = tempfile.mkdtemp(prefix="cgturn-deleg-")
    os.chown(state, user.pw_uid, user.pw_gid)
    try:
        env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": REPO, "PYTHONDONTWRITEBYTECODE": "1",
               "CGTURN_CGROUP2_MOUNT": os.path.dirname(cgroup2_root)}
        user_argv = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                     os.path.join(CONTRIB, "enter-leaf"), USER_PYTHON, "-c", USER_SCENARIO,
                     os.path.join(deleg, "turns"), cgroup2_root, state]
        out = run_in_cgroup(deleg, user_argv, env)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    assert data["euid"] == user.pw_uid != 0
    # enter-leaf put the manager in a leaf of the delegated subtree; its turns live beside it
    assert data["cgroup"] == f"0::/{os.path.basename(cgroup2_root)}/deleg/supervisor"
    assert data["daemon"] in data["killed"]
    assert wait_until(lambda: not alive(data["daemon"]))
    assert (data["move_outside"], data["kill_outside"], data["mkdir_outside"]) == ("refused",) * 3
    assert data["manager_outside"] in ("PermissionDenied", "CgroupUnavailable")
    assert not os.path.exists(os.path.join(cgroup2_root, "intruder"))


def test_container_view_with_a_private_cgroup_namespace(cgroup2_root, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("unshare --mount needs root")
    need("unshare")
    ns = os.path.join(cgroup2_root, "container")
    os.makedirs(ns)
    ro = tmp_path / "ro"
    ro.mkdir()
    inner = ("mount -t tmpfs none /sys/fs/cgroup && mount -t cgroup2 none /sys/fs/cgroup && "
             'exec "$0" "$@"')
    env = {**os.environ, "PYTHONPATH": REPO, "CGTURN_CGROUP2_MOUNT": "/sys/fs/cgroup"}
    env.pop("CGTURN_ROOT", None)
    argv = ["unshare", "--cgroup", "--mount", "--propagation", "private", "sh", "-c", inner,
            PY, "-c", CONTAINER_SCENARIO, str(tmp_path), str(ro)]
    out = run_in_cgroup(ns, argv, env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["cgroup"] == "0::/"  # the manager's own cgroup reads as the root
    doctor = data["doctor"]
    assert (doctor["code"], doctor["backend"], doctor["cgroup2_mount"], doctor["own_cgroup"]) == (
        0, "cgroup2", "/sys/fs/cgroup", "/sys/fs/cgroup")
    # Nothing in the container's view has a cgroup.kill to look at yet, and doctor writes nothing.
    assert doctor["managed_root"] == "/sys/fs/cgroup/cgturn" and doctor["cgroup_kill"] is None
    assert data["visible"] == ["cgturn"]  # only its own subtree: no host cgroup is in view
    assert data["ps"] == [["chat", "t-1", data["ps"][0][2]]] and data["daemon"] in data["ps"][0][2]
    assert data["daemon"] in data["killed"]
    assert wait_until(lambda: not alive(data["daemon"]))
    # seen from the host, the turns were below the container's cgroup
    assert os.path.isdir(os.path.join(ns, "cgturn"))
    ro_report = data["doctor_ro"]
    assert ro_report["backend"] == "registry" and ro_report["writable"] is False
    assert any("read-only" in p for p in ro_report["problems"]), ro_report["problems"]


def test_unit_file_verifies(tmp_path):
    """systemd-analyze verify, with the example's program paths pointed at programs that exist here."""
    analyze = need("systemd-analyze")
    text = open(os.path.join(CONTRIB, "cgturn.service")).read()
    assert re.search(r"^Delegate=yes$", text, re.M) and re.search(r"^DelegateSubgroup=supervisor$", text, re.M)
    for program in ("/usr/local/bin/cgturn", "/usr/local/lib/cgturn/enter-leaf", "/usr/local/bin/my-gateway"):
        text = text.replace(program, "/bin/true")
    unit = tmp_path / "cgturn.service"
    unit.write_text(text)
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    version = int(re.search(r"\d+", subprocess.run([analyze, "--version"], capture_output=True,
                                                    text=True).stdout).group())
    complaints = [line for line in out.stderr.splitlines() if line.strip()]
    if version < 254:  # DelegateSubgroup= is newer: older systemd warns and ignores it (enter-leaf covers)
        complaints = [c for c in complaints if "DelegateSubgroup" not in c]
    assert complaints == [], out.stderr
