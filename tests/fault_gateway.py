"""A gateway run by tests/test_faults.py in a child process, inside a private mount namespace, that
suffers a fault the test asked for on the state directory the test made, and reports what happened
as one JSON object on stdout.

    unshare --mount --propagation private python3 fault_gateway.py SCENARIO JSON-ARGS

Scenarios: `state-dir` (args: root, state_dir, backend `cgroup2`|`cgroup2-files`|`registry`, fault
`full`|`readonly`), `emfile` (root, state_dir). Never mounts anything unless this process's mount
namespace differs from PID 1's, and only on the state directory the test created (never /run/cgturn).
"""
from __future__ import annotations

import faulthandler
import json
import os
import resource
import subprocess
import sys
import time
import traceback

from cgturn import TurnManager, audit
from cgturn.backends.cgroup2 import Cgroup2Backend
from cgturn.host import discover_host
from cgturn.metrics import AuditTail

TMPFS_BYTES = 256 * 1024
READONLY_TMPFS_BYTES = 16 * 1024 * 1024
# Turn processes must not hold the test's pipe to this process (a survivor would keep it open).
QUIET = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
PAGE = os.sysconf("SC_PAGE_SIZE")


PARENT_NS_ENV = "CGTURN_FAULT_PARENT_MNTNS"


def refuse_shared_namespace(state_dir: str) -> None:
    """Exit unless this process's mount namespace is neither PID 1's nor the launching test's (PID 1's
    link may be unreadable here: then the test's, which it passes in PARENT_NS_ENV, must differ)."""
    mine = os.readlink("/proc/self/ns/mnt")
    try:
        pid1 = os.readlink("/proc/1/ns/mnt")
    except PermissionError:
        pid1 = None
    parent = os.environ.get(PARENT_NS_ENV)
    if mine in (pid1, parent) or (pid1 is None and not parent):
        raise SystemExit(f"refusing to mount: mount namespace {mine} is not private "
                         f"(PID 1: {pid1}, the test: {parent})")
    if os.path.realpath(state_dir).startswith("/run/cgturn") or not os.path.isabs(state_dir):
        raise SystemExit(f"refusing to mount over {state_dir!r}")


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def error_of(call) -> str | None:
    """None when `call()` worked, else its error as `Type: message` (what a user would read)."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the report says what it was
        return f"{type(err).__name__}: {err}"
    return None


def wait_pids(turn, n: int) -> list[int]:
    deadline = time.monotonic() + 20
    while len(turn.pids()) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"turn {turn.turn_id} never had {n} processes")
        time.sleep(0.005)
    return sorted(turn.pids())


def exited(proc: subprocess.Popen, timeout: float = 10.0) -> bool:
    """Whether `proc` (killed, if the kill happened) exits within `timeout` s; collected if so."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def make_manager(root: str, state_dir: str, backend: str) -> TurnManager:
    if backend == "cgroup2-files":   # turn records in <state_dir>/meta: the metadata fallback
        host = discover_host(root)
        assert host.cgroup2_mount is not None
        return TurnManager(backend=Cgroup2Backend(root, host.cgroup2_mount, state_dir, use_xattrs=False),
                           state_dir=state_dir, sentinel=False)
    return TurnManager(root=root, backend=backend, state_dir=state_dir, sentinel=False)


def cli_stop(root: str, state_dir: str, backend: str, task: str, turn: str) -> dict:
    name = "cgroup2" if backend.startswith("cgroup2") else "registry"
    env = dict(os.environ)
    if backend == "registry":
        env.pop("CGTURN_SCOPE", None)
    out = subprocess.run([sys.executable, "-m", "cgturn", "stop", "--backend", name, "--root", root,
                          "--state-dir", state_dir, "--grace", "0", task, turn],
                         capture_output=True, text=True, timeout=120, env=env)
    return {"rc": out.returncode, "stderr": out.stderr}


def pad_audit_to_page_end(state_dir: str) -> None:
    """Leave the audit log ending 60 bytes short of a page boundary, so the next record, written on a
    full tmpfs, is cut short (a short write into the last page's free bytes)."""
    path = audit.audit_path(state_dir)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    want = (PAGE - 60 - size % PAGE) % PAGE
    while want < 40:
        want += PAGE
    head = '{"action": "pad", "reason": "pad", "pad": "'
    with open(path, "a") as f:
        f.write(head + "x" * (want - len(head) - 3) + '"}\n')


def fill(path: str) -> None:
    chunk = b"\0" * 4096
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError:
                break
    # tmpfs may still take a partial page: fill that too, byte by byte is too slow, halve instead
    size = 2048
    with open(path, "ab", buffering=0) as f:
        while size:
            try:
                f.write(b"\0" * size)
            except OSError:
                size //= 2


def state_dir_scenario(root: str, state_dir: str, backend: str, fault: str) -> dict:
    refuse_shared_namespace(state_dir)
    # Small, so filling it is quick; a read-only one has room for the registry's WAL once it is lifted
    # (SQLite checkpoints it only at 1,000 pages: sqlite.org/wal.html).
    size = TMPFS_BYTES if fault == "full" else READONLY_TMPFS_BYTES
    mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "cgturn-fault", state_dir)
    report: dict = {"backend": backend, "fault": fault}
    mgr = make_manager(root, state_dir, backend)
    report["scope"] = getattr(mgr.backend, "scope", None)
    victim = mgr.begin_turn("fault", "victim")
    victim_proc = victim.spawn(["sh", "-c", "sleep 300 & exec sleep 300"], **QUIET)
    report["victim_pids"] = wait_pids(victim, 2)
    outside = mgr.begin_turn("fault", "outside")
    outside.spawn(["sh", "-c", "sleep 300 & exec sleep 300"], **QUIET)
    report["outside_pids"] = wait_pids(outside, 2)
    keep = mgr.begin_turn("fault", "keep")
    keep.spawn(["sh", "-c", "sleep 300 & exit 0"], **QUIET).wait()
    report["survivor_pids"] = wait_pids(keep, 1)
    keep.complete()
    if fault == "full":
        pad_audit_to_page_end(state_dir)
        fill(os.path.join(state_dir, "filler"))
    else:   # a read-only bind of it on itself: the open registry database does not make it busy
        mount("--bind", state_dir, state_dir)
        mount("-o", "remount,bind,ro", state_dir)
    # The faults: a kill by the owner, a turn begun, a kill from outside (which leaves a note).
    report["abandon_error"] = error_of(lambda: victim.abandon("fault", grace=0))
    report["victim_exited"] = exited(victim_proc)
    report["begin_error"] = error_of(lambda: mgr.begin_turn("fault", "during").spawn(["/bin/true"], **QUIET).wait())
    report["stop"] = cli_stop(root, state_dir, backend, "fault", "outside")
    report["during_turns"] = sorted(info.turn for info in mgr.turns("fault"))
    # Lifted: the next operations work.
    if fault == "full":
        os.unlink(os.path.join(state_dir, "filler"))
    else:
        subprocess.run(["umount", state_dir], check=True, capture_output=True)
    after = mgr.begin_turn("fault", "after")
    after_proc = after.spawn(["sh", "-c", "sleep 300 & exec sleep 300"], **QUIET)
    report["after_pids"] = wait_pids(after, 2)
    report["after_abandon"] = after.abandon("after-lift", grace=0).killed
    after_proc.wait(timeout=30)
    report["audit_reasons"] = [r["reason"] for r in audit.read_records(state_dir) if r["reason"] != "pad"]
    tail = AuditTail(state_dir)
    tail.update()
    report["audit_kills"], report["audit_malformed"] = tail.kills, tail.malformed
    report["turns_after"] = sorted((info.turn, info.state) for info in mgr.turns("fault"))
    if backend == "registry":   # what the stop could not record, a stop after the lift does
        report["restop"] = cli_stop(root, state_dir, backend, "fault", "outside")
        report["turns_after_restop"] = sorted((info.turn, info.state) for info in mgr.turns("fault"))
    mgr.close()
    return report


def emfile_scenario(root: str, state_dir: str) -> dict:
    report: dict = {}
    mgr = TurnManager(root=root, backend="cgroup2", state_dir=state_dir, sentinel=False)
    victim = mgr.begin_turn("fault", "victim")
    victim_proc = victim.spawn(["sh", "-c", "sleep 300 & exec sleep 300"], **QUIET)
    report["victim_pids"] = wait_pids(victim, 2)
    keep = mgr.begin_turn("fault", "keep")
    keep.spawn(["sh", "-c", "sleep 300 & exit 0"], **QUIET).wait()
    report["survivor_pids"] = wait_pids(keep, 1)
    keep.complete()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    hogs = []
    try:
        while True:
            hogs.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as err:
        report["exhausted"] = err.strerror
    report["begin_error"] = error_of(lambda: mgr.begin_turn("fault", "during").spawn(["/bin/true"], **QUIET).wait())
    report["abandon_error"] = error_of(lambda: victim.abandon("fault", grace=0))
    for fd in hogs:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    report["turns_lifted"] = sorted((info.turn, info.state, len(info.pids)) for info in mgr.turns("fault"))
    report["second_abandon_error"] = error_of(lambda: victim.abandon("fault", grace=0, force=True))
    report["recover_error"] = error_of(mgr.recover)
    victim_proc.wait(timeout=30)
    after = mgr.begin_turn("fault", "after")
    after_proc = after.spawn(["sh", "-c", "sleep 300 & exec sleep 300"], **QUIET)
    report["after_pids"] = wait_pids(after, 2)
    report["after_abandon"] = after.abandon("after-lift", grace=0).killed
    after_proc.wait(timeout=30)
    report["turns_after"] = sorted((info.turn, info.state) for info in mgr.turns("fault"))
    mgr.close()
    return report


def main() -> int:
    faulthandler.dump_traceback_later(240, exit=True)   # a hang shows where it hangs
    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    try:
        report = {"state-dir": state_dir_scenario, "emfile": emfile_scenario}[scenario](**args)
    except BaseException:  # noqa: BLE001 - the test shows it
        print(json.dumps({"crash": traceback.format_exc()}))
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
