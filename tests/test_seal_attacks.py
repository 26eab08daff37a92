"""Issue 21's red team as tests: a root process in a sealed turn tries every way out the attack found,
and every row of docs/security.md that says "enforced" names one of these (or a test_isolation.py test).

Each attack reports what the kernel answered (an errno name, or "ok" when it worked); the test then
checks the host side too (the outside cgroup is empty, the limit still holds, the stand-in lives).
Safety (the host is shared): the only cgroups written are the turn's own and ones this test made in
its own managed root; host settings are written back with the value just read, never trigger files;
reboot, kexec, modules and time are probed with invalid arguments; the one mount call runs only in a
process whose mount namespace the test has checked differs from PID 1's.
"""
from __future__ import annotations

import json
import os
import signal
import shutil
import socket
import subprocess

import pytest

from conftest import PY, cli, force_spawn_path, turn_dir, wait_until
from cgturn import Limits
from cgturn.kernel.cgroupfs import Cgroup

# Runs in the sealed turn: `mode` picks the attack; prints one JSON object and, unless told to exit,
# stays alive (sleeping) so the test can check abandon still reaches it.
ATTACK = r'''
import ctypes, errno, json, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
def check(rc):
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return rc
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as err:
        out[name] = errno.errorcode.get(err.errno, str(err.errno))
def write_back(path):
    with open(path) as f:
        value = f.read()
    fd = os.open(path, os.O_WRONLY)   # no O_TRUNC: the open is the check; the value is the one just read
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
mode, args = sys.argv[1], sys.argv[2:]

if mode == "setfsuid":   # attack 1: another user's /proc/PID/root to the host's read-write cgroup mount
    nobody_pid, outside = args
    libc.setfsuid(65534); libc.setfsgid(65534)
    out["fsuid"] = int(open("/proc/self/status").read().split("Uid:")[1].split()[3])
    def escape():
        fd = os.open(f"/proc/{nobody_pid}/root{outside}", os.O_RDONLY | os.O_DIRECTORY)
        libc.setfsuid(0); libc.setfsgid(0)
        procs = os.open("cgroup.procs", os.O_WRONLY, dir_fd=fd)
        os.write(procs, str(os.getpid()).encode())
    attempt("escape", escape)
    libc.setfsuid(0); libc.setfsgid(0)

elif mode == "limits":   # attack 2: a user namespace, then cgroup hierarchies mounted at its own cgroups
    sys.stdin.readline()   # the test has checked our mount namespace is not PID 1's
    CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWCGROUP, MS_REC, MS_PRIVATE = 0x10000000, 0x20000, 0x02000000, 16384, 1 << 18
    def enter():
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWCGROUP))
        for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None))
    attempt("userns", enter)
    if out["userns"] == "ok":
        for fstype, options, files in (("cgroup", b"memory", {"memory.limit_in_bytes": "-1"}),
                                       ("cgroup", b"pids", {"pids.max": "max"}),
                                       ("cgroup2", None, {"memory.max": "max", "pids.max": "max"})):
            where = os.path.abspath(f"cgturn-attack-{fstype}-{(options or b'').decode()}")   # in its cwd
            os.makedirs(where, exist_ok=True)
            def lift():
                check(libc.mount(fstype.encode(), where.encode(), fstype.encode(), 0, options))
                for name, value in files.items():
                    if os.path.exists(os.path.join(where, name)):
                        with open(os.path.join(where, name), "w") as f:
                            f.write(value)
            attempt(f"mount {fstype} {(options or b'').decode()}".strip(), lift)

elif mode == "host":     # attack 3: host settings, and the capabilities a root process keeps
    for path in args:
        attempt(path, lambda: write_back(path))
    attempt("reboot", lambda: check(libc.syscall(169, 0xdeadbeef, 0, 0, 0)))        # bad magic
    attempt("kexec_load", lambda: check(libc.syscall(246, 0, 0, 0, 0x0000ff00)))     # bad flags
    attempt("finit_module", lambda: check(libc.syscall(313, -1, b"", 0)))            # bad fd
    timex = ctypes.create_string_buffer(256)                                          # struct timex
    ctypes.c_uint.from_buffer(timex, 0).value = 0x4000                                # ADJ_TICK
    ctypes.c_long.from_buffer(timex, 88).value = 1                                    # an invalid tick
    attempt("adjtimex", lambda: check(libc.adjtimex(timex)))
    attempt("mknod", lambda: os.mknod("cgturn-null", 0o600 | 0o020000, os.makedev(1, 3)))
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
    out.update({k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs", "Seccomp")})

elif mode == "others":   # attack 4: processes outside the turn, and another sealed turn's
    gateway, other = (int(a) for a in args)
    attempt("kill gateway", lambda: os.kill(gateway, signal.SIGKILL))
    attempt("signal 0 gateway", lambda: os.kill(gateway, 0))
    buf = ctypes.create_string_buffer(8)
    class iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    local, remote = iovec(ctypes.cast(buf, ctypes.c_void_p), 8), iovec(0x400000, 8)
    attempt("process_vm_readv", lambda: check(libc.process_vm_readv(other, ctypes.byref(local), 1,
                                                                      ctypes.byref(remote), 1, 0)))
    attempt("ptrace attach", lambda: check(libc.ptrace(16, gateway, None, None)))   # PTRACE_ATTACH
    attempt("other's root", lambda: os.listdir(f"/proc/{other}/root"))
    out["pid"] = os.getpid()
    out["visible"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())

elif mode == "namespaces":   # what caps do not cover: new user namespaces, clone3, keyrings, the terminal
    CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
    attempt("unshare user", lambda: check(libc.unshare(CLONE_NEWUSER)))
    def clone_user():
        pid = check(libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0))
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    attempt("clone user", clone_user)
    attempt("clone3", lambda: check(libc.syscall(435, 0, 0)))
    attempt("keyctl", lambda: check(libc.syscall(250, 0, 0, 0, 0, 0)))              # KEYCTL_GET_KEYRING_ID
    attempt("TIOCSTI", lambda: check(libc.ioctl(0, 0x5412, b"x")))
    attempt("mount", lambda: check(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)))

elif mode == "files":    # the filesystem: what root later runs, the host's /tmp, the paths given
    hidden, *paths = args
    for path in paths:   # O_WRONLY without O_TRUNC: nothing is changed even where the open works
        attempt(path, lambda: os.close(os.open(path, os.O_WRONLY)))
    attempt("host /tmp", lambda: os.stat(hidden))
    attempt("own /tmp", lambda: open(f"/tmp/cgturn-own-{hidden.rsplit('-', 1)[-1]}", "w").close())
    attempt("cwd", lambda: open("made", "w").close())

print(json.dumps(out), flush=True)
if "--exit" not in sys.argv:
    time.sleep(300)
'''


def attack(turn, mode: str, *args: str, cwd, stdin=None, **kwargs) -> tuple[subprocess.Popen, dict]:
    """Spawn ATTACK in `turn` and return the process with its report (it stays alive)."""
    proc = turn.spawn([PY, "-c", ATTACK, mode, *args], stdout=subprocess.PIPE, stdin=stdin, text=True,
                      cwd=str(cwd), **kwargs)
    line = proc.stdout.readline()
    assert line, f"the attack {mode!r} printed nothing"
    return proc, json.loads(line)


def finish(turn, proc) -> list[int]:
    """Abandon the turn (grace 0) and return what the kill hit."""
    result = turn.abandon("test", grace=0)
    proc.wait(timeout=10)
    proc.stdout.close()
    return result.killed


def sandboxed_target(turn, program: str = PY, timeout: float = 10.0) -> int:
    """The host pid of the target of a sealed spawn, once it runs `program` inside the sandbox's PID
    namespace. Not the sandbox's init, a member of the turn too and PID 1 there (bubblewrap, or a copy
    of the caller, whose cmdline is the caller's); nor, before that namespace exists, the child cloned
    into the turn or the shim, which also carry the caller's cmdline and are in the host's namespaces
    until they exec bubblewrap (a window a slow machine holds open)."""
    found: list[int] = []

    def look() -> bool:
        for pid in turn.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv0 = f.read().split(b"\0")[0].decode()
                nspids = ns_pids(pid)
            except OSError:
                continue
            if argv0 == program and len(nspids) > 1 and nspids[-1] != 1:
                found.append(pid)
                return True
        return False

    assert wait_until(look, timeout=timeout)
    return found[0]


def ns_pids(pid: int) -> list[int]:
    """A process's pids, outermost PID namespace first (/proc/PID/status NSpid)."""
    with open(f"/proc/{pid}/status") as f:
        return [int(v) for line in f if line.startswith("NSpid:") for v in line.split()[1:]]


@pytest.fixture(autouse=True, params=["clone3", "clone3-bwrap", "shim"])
def spawn_path(request, monkeypatch):
    """Every attack on every way a sealed spawn starts: cloned into the turn with the extension's own
    sandbox, cloned and then bubblewrap (where that sandbox cannot be built), or the gated shim and
    bubblewrap."""
    from cgturn.backends import seal

    force_spawn_path(monkeypatch, request.param.split("-")[0])
    if request.param == "clone3" and not seal.native_works():   # else it would run clone3-bwrap's chain again
        pytest.skip("the extension's sandbox cannot be built here (it needs root and Linux 5.12+)")
    if request.param == "clone3-bwrap":
        monkeypatch.setattr(seal, "native_works", lambda: False)
    return request.param


@pytest.fixture
def nobody():
    """A process running as nobody, started by the test, outside any turn (killed at teardown)."""
    proc = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", "sleep", "300"],
                            stdin=subprocess.DEVNULL)
    assert wait_until(lambda: os.stat(f"/proc/{proc.pid}").st_uid != 0)
    yield proc
    proc.kill()
    proc.wait()


# --- attack 1: out of its cgroup through another user's /proc/PID/root ----------------------------

def test_setfsuid_into_a_nobody_process_root_reaches_no_other_cgroup(cgroup2_manager, nobody, tmp_path):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("attack-1", seal=True)
    outside = os.path.join(mgr.backend.root.path, "outside")   # the "outside" target: made by this test
    os.mkdir(outside)
    proc, report = attack(turn, "setfsuid", str(nobody.pid), outside, cwd=tmp_path)
    assert report["fsuid"] == 0          # setfsuid needs CAP_SETUID, which a sealed process lacks
    assert report["escape"] == "ENOENT"  # and its /proc shows no process outside its own PID namespace
    assert Cgroup(outside).procs() == []
    target = sandboxed_target(turn)
    assert target in finish(turn, proc)  # abandon still kills the attacker


# --- attack 2: its own limits lifted from a user namespace ----------------------------------------

def kernel_limits(mgr, turn) -> dict[str, str]:
    """The turn's memory and pids limits as the kernel holds them (v1 directories on a hybrid host)."""
    rec = turn.record
    if rec.v1_dirs:
        dirs = mgr.backend.layout.v1_dirs(rec.task_key, rec.turn_key)
        files = {"memory": os.path.join(dirs["memory"], "memory.limit_in_bytes"),
                 "pids": os.path.join(dirs["pids"], "pids.max")}
    else:
        here = turn_dir(mgr, turn)
        files = {"memory": os.path.join(here, "memory.max"), "pids": os.path.join(here, "pids.max")}
    return {name: open(path).read().strip() for name, path in files.items()}


def test_a_user_namespace_cannot_lift_the_turn_s_limits(cgroup2_manager, tmp_path):
    mgr = cgroup2_manager
    turn = mgr.begin_turn("attack-2", seal=True, limits=Limits(memory_max=64 << 20, pids_max=64))
    before = kernel_limits(mgr, turn)
    assert before == {"memory": str(64 << 20), "pids": "64"}
    proc = turn.spawn([PY, "-c", ATTACK, "limits"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                      cwd=str(tmp_path))
    attacker = sandboxed_target(turn)
    # Safety before any mount call: the attacker is in a mount namespace of its own, neither PID 1's
    # (where its link is readable: not always, here) nor this test's.
    try:
        hosts = {os.readlink("/proc/1/ns/mnt"), os.readlink("/proc/self/ns/mnt")}
    except PermissionError:
        hosts = {os.readlink("/proc/self/ns/mnt")}
    assert os.readlink(f"/proc/{attacker}/ns/mnt") not in hosts
    proc.stdin.write("go\n")
    proc.stdin.flush()
    report = json.loads(proc.stdout.readline())
    assert report == {"userns": "EPERM"}
    assert kernel_limits(mgr, turn) == before
    assert attacker in finish(turn, proc)


# --- attack 3: host settings, and what a root process keeps ---------------------------------------

HOST_SETTINGS = ["/proc/sys/kernel/core_pattern", "/proc/sys/vm/swappiness",
                 "/sys/kernel/mm/transparent_hugepage/khugepaged/pages_to_scan"]


def test_host_settings_are_read_only_and_the_kernel_s_own_doors_are_shut(cgroup2_manager, tmp_path):
    turn = cgroup2_manager.begin_turn("attack-3", seal=True)
    settings = [p for p in HOST_SETTINGS if os.path.exists(p)]
    before = {p: open(p).read() for p in settings}
    proc, report = attack(turn, "host", *settings, cwd=tmp_path)
    assert {p: report.pop(p) for p in settings} == {p: "EROFS" for p in settings}
    assert {p: open(p).read() for p in settings} == before
    # capability or no, the filter refuses them first: EPERM, where a root process with the
    # capability gets EINVAL/EBADF and a kernel without the feature ENOSYS
    assert {k: report.pop(k) for k in ("reboot", "kexec_load", "finit_module")} == {
        "reboot": "EPERM", "kexec_load": "EPERM", "finit_module": "EPERM"}
    assert report.pop("adjtimex") == "EPERM"      # CAP_SYS_TIME: EINVAL (the tick) with it
    assert report.pop("mknod") == "EPERM"         # CAP_MKNOD
    kept = sum(1 << n for n in (0, 1, 3, 4, 10))  # CHOWN, DAC_OVERRIDE, FOWNER, FSETID, NET_BIND_SERVICE
    assert report == {"CapInh": f"{kept:016x}", "CapPrm": f"{kept:016x}", "CapEff": f"{kept:016x}",
                      "CapAmb": f"{kept:016x}", "NoNewPrivs": "1", "Seccomp": "2"}
    from cgturn.backends import seal

    assert seal.KEPT_CAPS == ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_NET_BIND_SERVICE")
    finish(turn, proc)


# --- attack 4: other processes ---------------------------------------------------------------------

def test_processes_outside_and_other_sealed_turns_are_out_of_sight(cgroup2_manager, bystanders, tmp_path):
    mgr = cgroup2_manager
    gateway = bystanders()                        # a stand-in gateway: root, outside every turn
    other_turn = mgr.begin_turn("attack-4", "other", seal=True)
    other = other_turn.spawn(["sleep", "300"], cwd=str(tmp_path))
    other_pid = sandboxed_target(other_turn, shutil.which("sleep"))
    turn = mgr.begin_turn("attack-4", "attacker", seal=True)
    proc, report = attack(turn, "others", str(gateway.pid), str(other_pid), cwd=tmp_path)
    assert gateway.poll() is None and other.poll() is None
    assert {k: report[k] for k in ("kill gateway", "signal 0 gateway", "process_vm_readv", "ptrace attach",
                                   "other's root")} == {
        "kill gateway": "ESRCH", "signal 0 gateway": "ESRCH", "process_vm_readv": "ESRCH",
        "ptrace attach": "ESRCH", "other's root": "ENOENT"}
    assert report["pid"] == 2                     # bubblewrap's init is 1; the target is 2
    assert report["visible"] == [1, 2]            # its /proc shows its own spawn only
    finish(turn, proc)
    other_turn.abandon("test", grace=0)
    other.wait(timeout=10)


# --- what capabilities do not cover ----------------------------------------------------------------

def test_no_new_user_namespace_no_clone3_no_keyring_no_terminal_injection(cgroup2_manager, tmp_path):
    turn = cgroup2_manager.begin_turn("filter", seal=True)
    proc, report = attack(turn, "namespaces", cwd=tmp_path, stdin=subprocess.PIPE)
    assert report == {"unshare user": "EPERM", "clone user": "EPERM", "clone3": "ENOSYS", "keyctl": "EPERM",
                      "TIOCSTI": "EPERM", "mount": "EPERM"}
    finish(turn, proc)
    proc.stdin.close()


# --- attack 5: network="none" with a seal ----------------------------------------------------------

def test_a_sealed_turn_without_network_reaches_no_host_socket(cgroup2_manager, tmp_path):
    listeners, paths = [], []
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    listeners.append(tcp)
    for where in ("/tmp", "/run"):               # host services' sockets live there (dbus, docker, X11)
        path = os.path.join(where, f"cgturn-test-{os.getpid()}-{tmp_path.name}.sock")
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(path)
        unix.listen()
        listeners.append(unix)
        paths.append(path)
    script = ("import socket, sys, json, errno\nout = {}\n"
              "for target in sys.argv[1:]:\n"
              "    fam = socket.AF_UNIX if target[0] in '/@' else socket.AF_INET\n"
              "    addr = ('\\0' + target[1:] if target[0] == '@' else target) if fam == socket.AF_UNIX \\\n"
              "        else ('127.0.0.1', int(target))\n"
              "    try:\n        socket.socket(fam).connect(addr); out[target] = 'ok'\n"
              "    except OSError as err:\n        out[target] = errno.errorcode[err.errno]\n"
              "print(json.dumps(out))\n")
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0cgturn-test-{os.getpid()}-{tmp_path.name}")
    abstract.listen()
    listeners.append(abstract)
    try:
        turn = cgroup2_manager.begin_turn("net", seal=True, network="none")
        port = str(tcp.getsockname()[1])
        out = turn.spawn([PY, "-c", script, port, *paths, "@" + abstract.getsockname()[1:].decode()],
                         stdout=subprocess.PIPE, text=True, cwd=str(tmp_path)).communicate(timeout=30)[0]
        assert json.loads(out) == {port: "ECONNREFUSED", paths[0]: "ENOENT", paths[1]: "ENOENT",
                                   "@" + abstract.getsockname()[1:].decode(): "ECONNREFUSED"}
        # and it cannot go back to the host's network: setns needs CAP_SYS_ADMIN (an fd to it, handed over)
        host_net = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            rejoin = turn.spawn(["nsenter", f"--net=/proc/self/fd/{host_net}", "true"], pass_fds=(host_net,),
                                cwd=str(tmp_path), stderr=subprocess.PIPE, text=True)
            err = rejoin.communicate(timeout=30)[1]
        finally:
            os.close(host_net)
        assert rejoin.returncode != 0 and "Operation not permitted" in err
        turn.complete()
    finally:
        for s in listeners:
            s.close()
        for path in paths:
            os.unlink(path)


# --- the filesystem --------------------------------------------------------------------------------

def _unwritable(path: str) -> str:
    """What a sealed process's write to a host file gives: EROFS, or ENOENT under its private dirs."""
    return "ENOENT" if path.startswith(("/tmp/", "/run/")) else "EROFS"


def test_what_root_later_runs_is_read_only_and_only_the_named_paths_are_writable(cgroup2_manager, tmp_path):
    import cgturn

    hidden = tmp_path.parent / f"cgturn-hidden-{tmp_path.name}"   # on the host's /tmp (pytest's base)
    hidden.touch()
    given = tmp_path / "given"
    given.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    # (a program running anywhere gives ETXTBSY before EROFS: the helpers and libraries that are not)
    ran_as_root = [shutil.which("setpriv"), shutil.which("unshare"), shutil.which("nsenter"), os.__file__,
                   cgturn.__file__, "/etc/passwd"]
    try:
        turn = cgroup2_manager.begin_turn("files", seal=True)
        # default: the working directory is writable
        proc, report = attack(turn, "files", str(hidden), *ran_as_root, cwd=work)
        # EROFS, or ENOENT where the file lives under /tmp or /run (a checkout in /tmp, as CI's may be):
        # the sealed process's own private /tmp and /run hide it, so it cannot be rewritten either.
        assert {p: report[p] for p in ran_as_root} == {p: _unwritable(p) for p in ran_as_root}
        assert (report["cwd"], (work / "made").exists()) == ("ok", True)
        assert (report["host /tmp"], report["own /tmp"]) == ("ENOENT", "ok")
        own = f"/tmp/cgturn-own-{str(hidden).rsplit('-', 1)[-1]}"
        leaked = os.path.exists(own)
        if leaked:
            os.unlink(own)
        assert not leaked
        # writable= names the paths instead: the working directory is then read-only
        out = turn.spawn(["sh", "-c", "touch given/a && echo given; touch here 2>/dev/null || echo read-only"],
                         cwd=str(tmp_path), writable=[str(given)], stdout=subprocess.PIPE,
                         text=True).communicate(timeout=30)[0]
        assert out.split() == ["given", "read-only"]
        assert (given / "a").exists() and not (tmp_path / "here").exists()
        for bad in ("/", "/proc/sys", "/sys/fs/cgroup", "/dev/sda", str(tmp_path / "missing")):
            with pytest.raises(ValueError, match="writable="):
                turn.spawn(["true"], writable=[bad])
        turn.abandon("test", grace=0)
        proc.wait(timeout=10)
        proc.stdout.close()
        plain = cgroup2_manager.begin_turn("files-plain")
        with pytest.raises(ValueError, match="sealed"):
            plain.spawn(["true"], writable=[str(given)])
        plain.complete()
    finally:
        hidden.unlink()


# --- the turn's own promises, sealed ---------------------------------------------------------------

TRAP = ("import signal, sys, time\n"
        "def stop(*_):\n    open('stopped', 'w').write('SIGTERM'); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop)\nprint('ready', flush=True)\ntime.sleep(300)\n")


def test_abandon_s_sigterm_reaches_the_sealed_target_and_ps_shows_host_pids(cgroup2_manager, cgroup2_root,
                                                                            state_dir, tmp_path):
    turn = cgroup2_manager.begin_turn("lifecycle", seal=True)
    proc = turn.spawn([PY, "-c", TRAP], stdout=subprocess.PIPE, text=True, cwd=str(tmp_path))
    assert proc.stdout.readline().strip() == "ready"
    target = sandboxed_target(turn)
    assert ns_pids(target) == [target, 2]                    # PID 2 of its own namespace (bubblewrap's init is 1)
    assert proc.pid in turn.pids() and target != proc.pid    # Popen.pid is bubblewrap, in the turn
    rows = json.loads(cli(cgroup2_root, state_dir, "ps", "--json").stdout)
    row = [r for r in rows if r["turn"] == turn.record.turn_id][0]
    assert target in row["pids"] and proc.pid in row["pids"] and row["sealed"] is True
    result = turn.abandon("test", grace=20)
    assert (tmp_path / "stopped").read_text() == "SIGTERM"     # its handler ran within the grace
    assert target in result.killed and "SIGTERM" in result.signals
    assert proc.wait(timeout=10) in (-signal.SIGTERM, 3)      # bubblewrap: SIGTERM, or the target's status
    proc.stdout.close()


FORKS = ("import os, time\n"
         "print(open('/proc/self/status').read())\n"
         "print(open('/proc/net/dev').read())\n"
         "kids, refused = [], 0\n"
         "for _ in range(10):\n"
         "    try:\n        pid = os.fork()\n"
         "    except BlockingIOError:\n        refused += 1\n        continue\n"
         "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
         "    kids.append(pid)\n"
         "print('refused', refused, flush=True)\n")


def test_a_sealed_turn_combines_limits_a_user_and_no_network(cgroup2_manager, tmp_path):
    turn = cgroup2_manager.begin_turn("combined", seal=True, network="none", limits=Limits(pids_max=8))
    os.chmod(tmp_path, 0o777)
    out = turn.spawn(["/usr/bin/python3", "-c", FORKS], stdout=subprocess.PIPE, text=True, user="nobody",
                     cwd=str(tmp_path))
    text = ""
    for line in out.stdout:
        text += line
        if line.startswith("refused"):
            break
    status = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    assert status["Uid"].split() == ["65534"] * 4
    assert (status["CapEff"].strip(), status["NoNewPrivs"].strip()) == ("0" * 16, "1")
    assert [name.strip() for name in status if name.strip() in ("lo", "eth0", "ens3")] == ["lo"]
    assert int(text.split("refused")[1]) > 0   # pids.max 8 holds: bubblewrap, its init and python count too
    turn.abandon("test", grace=0)
    out.wait(timeout=10)
    out.stdout.close()


def test_a_sealed_user_target_can_write_its_private_tmp(cgroup2_manager):
    """The private /tmp is sticky and everyone's, as a host's own: a `user=` target can use it (a
    root-only 0755 tmpfs made every program that writes a temporary file fail there)."""
    turn = cgroup2_manager.begin_turn("tmp", seal=True)
    proc = turn.spawn(["/bin/sh", "-c", "echo hi > /tmp/cgturn-probe && cat /tmp/cgturn-probe && stat -c %a /tmp"],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, user="nobody", cwd="/")
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out.split()) == (0, ["hi", "1777"]), out
    turn.complete()


def test_cli_run_seal_writable_and_its_bad_input(cgroup2_root, state_dir, tmp_path):
    given = tmp_path / "given"
    given.mkdir()
    out = cli(cgroup2_root, state_dir, "run", "--seal", "--writable", str(given), "--", "sh", "-c",
              f"touch {given}/a && echo given; touch ./b 2>/dev/null || echo read-only")
    assert (out.returncode, out.stdout.split()) == (0, ["given", "read-only"]), out.stderr
    assert (given / "a").exists() and not os.path.exists("b")   # the working directory (the test's)
    for argv in (["--seal", "--writable", "/"], ["--writable", str(given)]):
        bad = cli(cgroup2_root, state_dir, "run", "--task", "never", *argv, "--", "touch", str(tmp_path / "c"))
        assert bad.returncode == 2 and "writable" in bad.stderr, bad.stderr
    assert not (tmp_path / "c").exists() and not os.path.exists(os.path.join(cgroup2_root, "never"))
