"""The extension's own sandbox for a sealed spawn (cgturn/_spawn.c, backends/seal.py native()): what it
does differently from bubblewrap, which the red team (test_seal_attacks.py, every attack on this path
too) does not see: its PID 1 is the small static init, holding no copy of the caller and no
capability, in a process group of its own; the target's status comes through it; Popen.kill() ends
the whole namespace (the signals it forwards: test_seal_signals.py); a caller
that ignores SIGCHLD still gets the target's status; the seal's choice falls back to bubblewrap when
the sandbox cannot be built.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import force_spawn_path, wait_until
from test_seal_attacks import ns_pids, sandboxed_target

SLEEP = shutil.which("sleep")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def native(monkeypatch):
    """Sealed spawns take the clone3 path, and the extension's sandbox is usable here."""
    from cgturn.backends import seal

    force_spawn_path(monkeypatch, "clone3")
    if not seal.native_works():
        pytest.skip("the extension cannot build the sandbox here (not root, or Linux < 5.12)")


def status_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f)}


def test_pid_1_is_the_small_init_with_cap_kill_alone_and_no_copy_of_the_caller(cgroup2_manager, tmp_path):
    turn = cgroup2_manager.begin_turn("native", seal=True)
    proc = turn.spawn(["sleep", "300"], cwd=str(tmp_path))
    target = sandboxed_target(turn, SLEEP)
    assert wait_until(lambda: open(f"/proc/{proc.pid}/cmdline", "rb").read() == b"cgturn-init\0")
    init, sealed = status_of(proc.pid), status_of(target)
    assert ns_pids(proc.pid)[-1] == 1 and ns_pids(target)[-1] == 2 and proc.pid in turn.pids()
    kill = f"{1 << 5:016x}"  # CAP_KILL: to forward to a user= target (another uid)
    assert (init["CapEff"], init["CapPrm"], init["CapBnd"], init["NoNewPrivs"], init["Seccomp"]) == \
        (kill, kill, kill, "1", "2")
    # the target's bounding set is exactly its kept set: CAP_KILL, kept for the init, is not in it
    kept = f"{sum(1 << n for n in (0, 1, 3, 4, 10)):016x}"
    assert (sealed["CapBnd"], sealed["CapEff"]) == (kept, kept)
    # the caller's memory is not in it: a 616-byte static program maps a few pages
    assert int(init["VmRSS"].split()[0]) < 1024 < int(status_of(os.getpid())["VmRSS"].split()[0])
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)


def test_the_target_s_status_comes_through_the_init(cgroup2_manager, tmp_path):
    turn = cgroup2_manager.begin_turn("native", seal=True)
    assert turn.spawn(["sh", "-c", "exit 7"], cwd=str(tmp_path)).wait(timeout=10) == 7
    proc = turn.spawn(["sleep", "300"], cwd=str(tmp_path))
    os.kill(sandboxed_target(turn, SLEEP), signal.SIGKILL)   # by its host pid, as abandon does
    assert proc.wait(timeout=10) == 128 + signal.SIGKILL          # an init cannot die of the target's signal
    turn.complete()


def test_popen_kill_ends_the_whole_namespace(cgroup2_manager, tmp_path):
    turn = cgroup2_manager.begin_turn("native", seal=True)
    proc = turn.spawn(["sleep", "300"], cwd=str(tmp_path))
    target = sandboxed_target(turn, SLEEP)
    proc.kill()                   # SIGKILL cannot be blocked: the init ends, and the kernel kills PID 2 with it
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: not os.path.exists(f"/proc/{target}") or status_of(target)["State"].startswith("Z"))
    turn.complete()


def test_the_init_leads_a_process_group_of_its_own(cgroup2_manager, tmp_path):
    # so a signal to the caller's group (a terminal's Ctrl-C) reaches the target once, not again forwarded
    turn = cgroup2_manager.begin_turn("native", seal=True)
    proc = turn.spawn(["sleep", "300"], cwd=str(tmp_path))
    target = sandboxed_target(turn, SLEEP)
    assert wait_until(lambda: open(f"/proc/{proc.pid}/cmdline", "rb").read() == b"cgturn-init\0")
    assert wait_until(lambda: os.getpgid(proc.pid) == proc.pid)
    assert os.getpgid(target) == os.getpgrp() != proc.pid          # the target stays where the caller put it
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)


def test_a_caller_that_ignores_sigchld_still_gets_the_target_s_status(cgroup2_manager, tmp_path):
    # The init's SIGCHLD must not be ignored (the kernel would reap for it and it would wait for ever);
    # a caller's SIG_IGN survives the clone, so the sandbox's PID 1 resets it before the target exists.
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        turn = cgroup2_manager.begin_turn("native", seal=True)
        proc = turn.spawn(["sh", "-c", "exit 5"], cwd=str(tmp_path))
        gone = wait_until(lambda: not turn.pids(), timeout=20)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert gone                    # the init saw its target exit and exited (this caller reaps nothing)
    try:
        proc.wait(timeout=10)
    except ChildProcessError:      # SIG_IGN: the kernel reaped the init for this caller
        pass
    turn.complete()


def test_a_sealed_spawn_takes_bubblewrap_where_the_sandbox_cannot_be_built(cgroup2_manager, tmp_path, monkeypatch):
    from cgturn.backends import seal

    monkeypatch.setattr(seal, "native_works", lambda: False)
    turn = cgroup2_manager.begin_turn("fallback", seal=True)
    proc = turn.spawn(["sleep", "300"], cwd=str(tmp_path))
    sandboxed_target(turn, SLEEP)
    assert os.path.basename(open(f"/proc/{proc.pid}/cmdline", "rb").read().split(b"\0")[0]) == b"bwrap"
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)


def test_the_probe_says_no_for_a_caller_without_cap_sys_admin():
    # What native_works() relies on: the clone into new namespaces is refused (EPERM) for an
    # unprivileged caller, and the probe reports that instead of raising.
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from cgturn.backends import seal\nprint(seal.native_works())\n") % REPO
    out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
                          "/usr/bin/python3", "-c", code], capture_output=True, text=True, cwd="/",
                         env={"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1"})
    if "No module named" in out.stderr:
        pytest.skip("the checkout is not readable by nobody")
    assert out.stdout.strip() == "False", out.stderr



def test_a_refused_sealed_clone_turns_to_bubblewrap_and_leaves_clone3_on(cgroup2_manager, tmp_path, monkeypatch):
    # The kernel refusing the sandbox's clone (EPERM: the caller lost CAP_SYS_ADMIN after the probe, or
    # a seccomp filter came) is simulated at the extension's call: unsealed spawns must keep clone3.
    import errno

    from cgturn.backends import seal, spawn_paths
    from cgturn.kernel import spawn as kspawn

    real = kspawn._spawn.spawn

    def refuse_sealed(*args):
        if len(args) > 19 and args[19] is not None:
            raise OSError(errno.EPERM, "Operation not permitted")
        return real(*args)

    monkeypatch.setattr(kspawn._spawn, "spawn", refuse_sealed)
    monkeypatch.setattr(seal, "_refused", False, raising=False)
    turn = cgroup2_manager.begin_turn("refused", seal=True)
    proc = turn.spawn(["sleep", "300"], cwd=str(tmp_path))         # sealed by bubblewrap instead
    sandboxed_target(turn, SLEEP)
    assert os.path.basename(open(f"/proc/{proc.pid}/cmdline", "rb").read().split(b"\0")[0]) == b"bwrap"
    assert not seal.native_works() and spawn_paths.can_clone3
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)


def test_the_embedded_init_is_what_its_source_builds():
    # _spawn.c's SEAL_INIT_ELF must be scripts/seal_init/seal_init.c built as build.py builds it (no build
    # id, no .comment: the same source and gcc give the same bytes), or the source reviewed is not what runs
    if shutil.which("gcc") is None or shutil.which("strip") is None:
        pytest.skip("gcc and strip build the init (build.py)")
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "seal_init", "build.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
