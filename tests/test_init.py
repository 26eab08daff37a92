"""`cgturn init`: a container's PID 1 that gives its cgroup namespace's controllers to cgturn.

Every test runs `cgturn init` only inside namespaces below a cgroup the test made: a PID namespace
(`unshare --pid --fork --mount-proc`, so init is PID 1), a private mount namespace with cgroup2
mounted afresh on /sys/fs/cgroup, and a cgroup namespace whose root is the test's `T/ns` — the
shape a container runtime gives (its cgroup namespace root has `cgroup.kill`, which the host's root
has not). The host's /proc/1/cgroup is checked unchanged after each. The refusals are checked for
what they leave: nothing moved, no leaf made.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import PY, REPO, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and cgroup moves need root")

# Runs as CMD under `cgturn init`: what it sees, a turn with a double-forked daemon, an orphan that
# must be reaped by PID 1, then exit 7 (init must pass the status through).
SCENARIO = r"""
import json, os, subprocess, sys, time
def v2(pid):
    return [line for line in open(f"/proc/{pid}/cgroup").read().splitlines() if line.startswith("0::")][0]
out = {"pid": os.getpid(), "cgroup": v2("self"),
       "root_env": os.environ.get("CGTURN_ROOT"),
       "root_procs": open("/sys/fs/cgroup/cgroup.procs").read().split(),
       "leaf_procs": open("/sys/fs/cgroup/init/cgroup.procs").read().split(),
       "given": open("/sys/fs/cgroup/cgroup.controllers").read().split(),
       "enabled": open("/sys/fs/cgroup/cgroup.subtree_control").read().split(),
       "root_delegates": open("/sys/fs/cgroup/cgturn/cgroup.subtree_control").read().split()}
# An orphan: a child forks a grandchild and exits; the grandchild is reparented to PID 1 and exits.
hold_r, hold_w = os.pipe()     # the grandchild lives until this closes
report_r, report_w = os.pipe() # the child says the grandchild's pid here
child = os.fork()
if child == 0:
    grandchild = os.fork()
    if grandchild == 0:
        os.close(hold_w)
        os.read(hold_r, 1)
        os._exit(0)
    os.write(report_w, str(grandchild).encode() + b"\n")
    os._exit(0)
os.waitpid(child, 0)
os.close(report_w)
orphan = int(os.read(report_r, 32).split()[0])
os.close(hold_w)           # the orphan exits now, a zombie until PID 1 reaps it
deadline = time.monotonic() + 30
while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
    time.sleep(0.01)
out["orphan_reaped"] = not os.path.exists(f"/proc/{orphan}")
from cgturn import TurnManager
with TurnManager(state_dir=sys.argv[1]) as mgr:
    out["backend"] = mgr.backend.name
    turn = mgr.begin_turn("chat", "t-1")
    p = turn.spawn(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], stdout=subprocess.PIPE, text=True)
    out["daemon"] = int(p.stdout.readline())
    p.wait()
    out["turn_cgroup"] = v2(out["daemon"])
    out["killed"] = turn.abandon("test", grace=0).killed
    deadline = time.monotonic() + 30  # killed, then a zombie until PID 1 (init) reaps it
    while os.path.exists(f"/proc/{out['daemon']}") and time.monotonic() < deadline:
        time.sleep(0.01)
    out["daemon_gone"] = not os.path.exists(f"/proc/{out['daemon']}")
print(json.dumps(out), flush=True)
sys.exit(7)
"""

# Waits for SIGTERM with the default action, after saying it is ready.
WAIT_FOR_TERM = "import os, sys; print('ready', flush=True); sys.stdin.read()"


@pytest.fixture
def test_cgroup(cgroup2_root):
    """`T` (made, with the controllers its parent delegates enabled for its children), `T/ns` (the
    container's cgroup) and `T/outside` (where the waiting unshare process sits)."""
    os.mkdir(cgroup2_root)
    for name in ("ns", "outside"):
        os.mkdir(os.path.join(cgroup2_root, name))
    given = open(os.path.join(cgroup2_root, "cgroup.controllers")).read().split()
    if given:
        with open(os.path.join(cgroup2_root, "cgroup.subtree_control"), "w") as f:
            f.write(" ".join(f"+{c}" for c in given))
    return cgroup2_root


@pytest.fixture
def host_pid1():
    """The mount namespaces a mount must not happen in (PID 1's where readable, and this test's), as
    one string for the shell's check; PID 1's cgroup is checked unchanged after the test."""
    before = open("/proc/1/cgroup").read()
    try:
        pid1 = os.readlink("/proc/1/ns/mnt")
    except PermissionError:  # unreadable here: the test's own namespace, which PID 1's contains, must differ
        pid1 = "-"
    yield f"{pid1} {os.readlink('/proc/self/ns/mnt')}"
    assert open("/proc/1/cgroup").read() == before


def _container_argv(t: str, host_mnt: str, cmd: list[str], *, mount_opts: str = "",
                    cgroupns: str | None = "ns", init_args: tuple[str, ...] = (), bare: bool = False) -> list[str]:
    """argv that runs `cgturn init ... -- CMD` as PID 1 of a new PID namespace, in a private mount
    namespace with cgroup2 mounted afresh, in a cgroup namespace rooted at `T/<cgroupns>` (None: no
    cgroup namespace and no move, the caller's own cgroup). The waiting unshare sits in `T/outside`.
    `bare`: CMD itself is PID 1, without `cgturn init`."""
    mount_cgroup = (f'case " {host_mnt} " in *" $(readlink /proc/self/ns/mnt) "*) exit 99;; esac; '
                    f"mount -t tmpfs none /sys/fs/cgroup && mount -t cgroup2 {mount_opts} none /sys/fs/cgroup && "
                    'exec "$@"')
    init = cmd if bare else [PY, "-m", "cgturn", "init", *init_args, "--", *cmd]
    inner = ["sh", "-c", mount_cgroup, "mount-cgroup", *init]
    if cgroupns is not None:
        # PID 1 moves itself into the container's cgroup, then makes the cgroup namespace there.
        pid1 = f'echo $$ > "{os.path.join(t, cgroupns)}/cgroup.procs" && exec unshare --cgroup "$@"'
        inner = ["sh", "-c", pid1, "enter", *inner]
    outside = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    return ["sh", "-c", outside, os.path.join(t, "outside"),
            "unshare", "--pid", "--fork", "--mount-proc", "--propagation", "private", *inner]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": REPO}
    for name in ("CGTURN_ROOT", "CGTURN_CGROUP2_MOUNT", "CGTURN_BACKEND"):
        env.pop(name, None)
    return env


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env())


def _procs(path: str) -> list[str]:
    return open(os.path.join(path, "cgroup.procs")).read().split()


def test_init_moves_the_root_into_a_leaf_enables_controllers_and_runs_cmd(test_cgroup, host_pid1, tmp_path):
    out = _run(_container_argv(test_cgroup, host_pid1, [PY, "-c", SCENARIO, str(tmp_path)], init_args=("-v",)))
    assert out.returncode == 7, out.stderr   # CMD's status is init's
    data = json.loads(out.stdout)
    assert data["cgroup"] == "0::/init"
    assert data["root_procs"] == [] and "1" in data["leaf_procs"]
    assert data["root_env"] == "/sys/fs/cgroup/cgturn"
    assert data["enabled"] == data["given"]                    # every controller the container was given
    assert data["root_delegates"] == data["given"]             # and the managed root hands them to turns
    assert data["orphan_reaped"] is True
    assert data["backend"] == "cgroup2"
    assert data["turn_cgroup"].startswith("0::/cgturn/")
    assert data["daemon"] in data["killed"] and data["daemon_gone"]
    assert "moved 1 process(es) into /sys/fs/cgroup/init" in out.stderr
    # seen from the host: everything happened below the test's cgroup
    assert os.path.isdir(os.path.join(test_cgroup, "ns", "init"))
    assert os.path.isdir(os.path.join(test_cgroup, "ns", "cgturn"))


def test_init_forwards_sigterm_and_exits_with_the_signal_status(test_cgroup, host_pid1):
    argv = _container_argv(test_cgroup, host_pid1, [PY, "-c", WAIT_FOR_TERM])
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        # the unshare process's one child is the namespace's PID 1: cgturn init
        init = int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0])
        assert b"init" in open(f"/proc/{init}/cmdline", "rb").read().split(b"\0")
        os.kill(init, signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_init_exit_codes_for_a_missing_and_a_signalled_command(test_cgroup, host_pid1):
    out = _run(_container_argv(test_cgroup, host_pid1, ["/nonexistent/cmd"]))
    assert out.returncode == 127 and "cannot run /nonexistent/cmd" in out.stderr, (out.returncode, out.stderr)
    # A fresh container cgroup: the first run's init enabled controllers in T/ns, after which no process
    # may join T/ns itself (the no-internal-processes rule: EBUSY), as for any runtime's late arrival.
    os.mkdir(os.path.join(test_cgroup, "ns2"))
    killed = _run(_container_argv(test_cgroup, host_pid1, ["sh", "-c", "kill -KILL $$"], cgroupns="ns2"))
    assert killed.returncode == 128 + signal.SIGKILL, (killed.returncode, killed.stderr)


def test_init_refuses_when_not_pid_1(test_cgroup, host_pid1):
    """PID 1 is a shell; `cgturn init` is its child: exit 2, one line, the namespace root untouched."""
    out = _run(_container_argv(test_cgroup, host_pid1, ["sh", "-c", f'{PY} -m cgturn init -- true; echo "status $?"'],
                               bare=True))
    assert "status 2" in out.stdout, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not PID 1" in lines[0]
    assert not os.path.exists(os.path.join(test_cgroup, "ns", "init"))
    assert not os.path.exists(os.path.join(test_cgroup, "ns", "cgturn"))


def test_init_refuses_a_root_shared_with_another_pid_namespace(test_cgroup, host_pid1):
    """A process outside init's PID namespace in the namespace root (it reads as 0): refused, and that
    process is still where it was."""
    ns = os.path.join(test_cgroup, "ns")
    bystander = subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec sleep 300', ns])
    try:
        assert wait_until(lambda: str(bystander.pid) in _procs(ns))
        out = _run(_container_argv(test_cgroup, host_pid1, ["true"]))
        assert out.returncode == 2
        assert "outside this PID namespace" in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert str(bystander.pid) in _procs(ns) and not os.path.exists(os.path.join(ns, "init"))
    finally:
        bystander.kill()
        bystander.wait()


def test_init_refuses_a_read_only_cgroupfs(test_cgroup, host_pid1):
    out = _run(_container_argv(test_cgroup, host_pid1, ["true"], mount_opts="-o ro"))
    assert out.returncode == 2 and "read-only" in out.stderr
    assert not os.path.exists(os.path.join(test_cgroup, "ns", "init"))


def test_init_plain_if_refused_runs_cmd_without_the_cgroup_step(test_cgroup, host_pid1):
    out = _run(_container_argv(test_cgroup, host_pid1, ["sh", "-c", "exit 5"], mount_opts="-o ro",
                               init_args=("--plain-if-refused",)))
    assert out.returncode == 5 and "no cgroup step" in out.stderr
    assert not os.path.exists(os.path.join(test_cgroup, "ns", "init"))


def test_init_refuses_the_hosts_root_cgroup(test_cgroup, host_pid1):
    """No cgroup namespace of its own: the cgroup2 mount shows the host's root, which has no
    cgroup.kill. Mounted read-only as well, so not even a broken check could move anything."""
    own = open("/proc/self/cgroup").read()
    if "0::/\n" not in own + "\n":
        pytest.skip("needs a test process in the host's root cgroup (this host's layout), not " + own.strip())
    mount = os.path.dirname(test_cgroup)
    leaf_before = os.path.exists(os.path.join(mount, "init"))
    root_before = len(_procs(mount))
    argv = _container_argv(test_cgroup, host_pid1, ["true"], mount_opts="-o ro", cgroupns=None)
    argv[2] = 'exec "$@"'  # stays in the host's root: no move into T/outside
    out = _run(argv)
    assert out.returncode == 2 and "has no cgroup.kill" in out.stderr, out.stderr
    assert os.path.exists(os.path.join(mount, "init")) == leaf_before
    assert len(_procs(mount)) > 0 and root_before > 0


def test_doctor_at_a_namespace_root_says_what_init_would_enable(test_cgroup, host_pid1):
    """Without init, a process at the namespace root gets cgroup2 turns without limits, and doctor says
    what `cgturn init` would enable (here: whatever T/ns was given)."""
    out = _run(_container_argv(test_cgroup, host_pid1, [PY, "-m", "cgturn", "doctor", "--json"], bare=True))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    given = open(os.path.join(test_cgroup, "ns", "cgroup.controllers")).read().split()
    assert data["backend"] == "cgroup2" and data["own_cgroup"] == "/sys/fs/cgroup"
    if given:
        assert data["container_init"] == {"would_enable": given}
        assert any("cgturn init" in p for p in data["problems"]), data["problems"]
    else:
        assert data["container_init"] is None  # nothing given to the container: nothing to enable
    assert not os.path.exists(os.path.join(test_cgroup, "ns", "init"))
