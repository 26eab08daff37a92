"""A sealed turn's signals (issue 21): the target is PID 2 of its own PID namespace, and what is sent
to the turn or to its Popen must reach it as it would reach an unsealed process, once.

- abandon with a grace: the target gets exactly one SIGTERM and stops within the grace (no SIGKILL),
  on every chain (the extension's sandbox, whose init forwards what it is sent, is skipped by the
  abandon's SIGTERM stage; bubblewrap's init ignores it);
- the extension's sandbox: Popen.terminate(), send_signal() and os.killpg(p.pid) reach the target
  through cgturn-init, wait() returns the target's status (128+N when a signal N killed it), and
  kill() ends the whole namespace, grandchildren too;
- a terminal's Ctrl-C (a signal to the caller's process group) reaches the target once, not a
  second time through the init; a sealed process's signal to its init comes back to it, and goes
  nowhere else; a user= target (another uid) is reached too: the init keeps CAP_KILL alone;
- bubblewrap: terminate() reaches its outer process only, which dies of it, and the target stays in
  the turn until the turn is abandoned (docs/security.md says so).

The target counts what it gets: each signal the kernel delivers is appended by name to a file in its
writable working directory, and it takes a moment to stop after its first SIGTERM, as a program that
shuts down gracefully does: a second copy within it would be seen (many programs take it as "force
quit"). Two copies sent at the same instant merge in the kernel (a standard signal is pending once),
so where the test cannot make them apart (a group signal) the init's own process group is checked
too (test_seal_native.py).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest

from conftest import PY, cgturn_popen, force_spawn_path, wait_until
from test_seal_attacks import ns_pids, sandboxed_target

SLEEP = shutil.which("sleep")

# Ready (handlers installed) once it prints. Each signal the kernel delivers is one byte on Python's
# wakeup fd (written by its C-level handler at every delivery, where the Python-level handler runs once
# for copies that land together), appended to `signals` by name. After its first SIGTERM it keeps
# running for a moment, then exits 3. `child` also starts a grandchild (sleep) and prints its pid.
COUNTER = r'''
import os, select, signal, subprocess, sys, time
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(sig, lambda *_: None)
kid = subprocess.Popen(["sleep", "300"]) if "child" in sys.argv else None
print("ready", kid.pid if kid else "", flush=True)
stop_at = None
while stop_at is None or time.monotonic() < stop_at:
    wait = None if stop_at is None else max(0.0, stop_at - time.monotonic())
    if not select.select([r], [], [], wait)[0]:
        continue
    got = os.read(r, 64)
    with open("signals", "a") as f:
        f.writelines(signal.Signals(b).name + "\n" for b in got)
    if signal.SIGTERM in got and stop_at is None:
        stop_at = time.monotonic() + 1.0   # the graceful stop: a second SIGTERM would land in here
sys.exit(3)
'''

def use_chain(monkeypatch, name: str) -> None:
    """Make sealed spawns take chain `name` (as test_seal_attacks.py): "clone3", the extension's sandbox;
    "clone3-bwrap", bubblewrap on the clone3 path; "shim", the shim and bubblewrap."""
    from cgturn.backends import seal

    force_spawn_path(monkeypatch, name.split("-")[0])
    if name == "clone3-bwrap":
        monkeypatch.setattr(seal, "native_works", lambda: False)
    elif name == "clone3" and not seal.native_works():
        pytest.skip("the extension cannot build the sandbox here (not root, or Linux < 5.12)")


@pytest.fixture(params=["clone3", "clone3-bwrap", "shim"])
def chain(request, monkeypatch):
    """Each way a sealed spawn starts."""
    use_chain(monkeypatch, request.param)
    return request.param


@pytest.fixture
def native(monkeypatch):
    """The extension's sandbox, whose init is cgturn-init."""
    use_chain(monkeypatch, "clone3")


@pytest.fixture(params=["clone3-bwrap", "shim"])
def bubblewrap(request, monkeypatch):
    """The chains that exec bubblewrap."""
    use_chain(monkeypatch, request.param)


def start(turn, cwd, *args: str, **kwargs) -> tuple[subprocess.Popen, str]:
    """Spawn COUNTER in `turn`; returns it once its handlers are installed, with the rest of its line."""
    proc = turn.spawn([PY, "-c", COUNTER, *args], stdout=subprocess.PIPE, text=True, cwd=str(cwd), **kwargs)
    words = proc.stdout.readline().split()
    assert words[:1] == ["ready"], "the target did not start"
    return proc, " ".join(words[1:])


def got(cwd) -> list[str]:
    """The signals the target's handler saw, in order."""
    try:
        return (cwd / "signals").read_text().split()
    except FileNotFoundError:
        return []


def finish(turn, proc) -> None:
    """Abandon what is left (grace 0) and reap the Popen."""
    turn.abandon("test", grace=0)
    proc.wait(timeout=10)
    if proc.stdout:
        proc.stdout.close()


def test_abandon_gives_the_target_one_sigterm_and_it_stops_within_the_grace(cgroup2_manager, tmp_path, chain,
                                                                            monkeypatch):
    from cgturn.backends.cgroup2_killer import CgroupKiller

    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc, _ = start(turn, tmp_path)
    init = [pid for pid in turn.pids() if ns_pids(pid)[-1] == 1]
    target = sandboxed_target(turn)
    assert len(init) == 1                               # the sandbox's init is a member, beside its target
    signalled: list[int] = []                           # what the killer sends to, each still sent
    send = CgroupKiller._signal_if_inside
    monkeypatch.setattr(CgroupKiller, "_signal_if_inside",
                        lambda self, cg, pid, sig: signalled.append(pid) or send(self, cg, pid, sig))
    result = turn.abandon("test", grace=30)
    assert target in signalled and init[0] not in signalled   # two copies sent together can merge: see both
    assert got(tmp_path) == ["SIGTERM"]                 # once: not a second copy through the init
    assert result.signals == ["SIGTERM"]                # it stopped within the grace: no SIGKILL
    assert init[0] in result.killed                     # reached (through its target) and gone
    status = proc.wait(timeout=10)
    assert status == (3 if chain == "clone3" else -signal.SIGTERM)   # bubblewrap's outer dies of its SIGTERM
    proc.stdout.close()


def test_terminate_reaches_the_target_and_wait_returns_its_status(cgroup2_manager, tmp_path, native):
    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc, _ = start(turn, tmp_path)
    try:
        proc.terminate()
        assert proc.wait(timeout=30) == 3               # the target's own exit code, through the init
        assert got(tmp_path) == ["SIGTERM"]
    finally:
        finish(turn, proc)


def test_send_signal_reaches_the_target_s_handler(cgroup2_manager, tmp_path, native):
    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc, _ = start(turn, tmp_path)
    try:
        proc.send_signal(signal.SIGUSR1)
        assert wait_until(lambda: got(tmp_path) == ["SIGUSR1"], timeout=30)
        os.kill(proc.pid, signal.SIGHUP)                # by Popen.pid from anywhere, as send_signal
        assert wait_until(lambda: got(tmp_path) == ["SIGUSR1", "SIGHUP"], timeout=30)
        assert proc.poll() is None                      # handled: the target runs on
    finally:
        finish(turn, proc)


def test_killpg_of_popen_pid_reaches_the_target_once(cgroup2_manager, tmp_path, native):
    # start_new_session: the target leads its own session; the init leads a group of its own, Popen.pid,
    # so the usual os.killpg(p.pid, sig) of a new-session child reaches the target (once, forwarded).
    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc, _ = start(turn, tmp_path, start_new_session=True)
    try:
        os.killpg(proc.pid, signal.SIGUSR1)
        assert wait_until(lambda: got(tmp_path) == ["SIGUSR1"], timeout=30)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 3 and got(tmp_path) == ["SIGUSR1", "SIGTERM"]
    finally:
        finish(turn, proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_target_killed_by_the_signal_gives_128_plus_n(cgroup2_manager, tmp_path, native, sig):
    # sleep keeps every default action: the forwarded signal kills it, and the init, which cannot die of
    # its child's signal, exits 128+N (as bubblewrap's and a shell's status say it), not -N
    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc = turn.spawn([SLEEP, "300"], cwd=str(tmp_path))
    sandboxed_target(turn, SLEEP)
    try:
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
    finally:
        finish(turn, proc)


def test_kill_ends_the_whole_namespace_grandchildren_too(cgroup2_manager, tmp_path, native):
    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc, kid = start(turn, tmp_path, "child")
    assert kid == "3"                                   # the grandchild, PID 3 of the namespace
    assert wait_until(lambda: len(turn.pids()) == 3)    # init, target, grandchild
    proc.kill()                                         # SIGKILL ends the init; the kernel kills the rest
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: turn.pids() == [], timeout=30)
    assert got(tmp_path) == []                          # nothing was forwarded: SIGKILL cannot be taken
    proc.stdout.close()
    turn.complete()


def test_a_terminal_s_ctrl_c_reaches_the_target_once(cgroup2_root, state_dir, tmp_path):
    # `cgturn run --seal` leads a process group, as a shell's job does: a terminal's Ctrl-C is a SIGINT to
    # that whole group. The target gets it directly; the init, in a group of its own, does not forward a
    # second copy. `run` then abandons the turn (one SIGTERM) and exits 130. (`run` takes the extension's
    # sandbox where it can be built; bubblewrap's init ignores the SIGINT.)
    run = cgturn_popen(cgroup2_root, state_dir, "run", "--seal", "--grace", "30", "--", PY, "-c", COUNTER,
                       cwd=str(tmp_path), start_new_session=True)
    try:
        assert run.stdout.readline().split()[:1] == ["ready"]
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=60) == 130
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        run.stdout.close()
    # once each (the order is the kernel's and run's: a loaded host has shown SIGTERM's copy first)
    assert sorted(got(tmp_path)) == ["SIGINT", "SIGTERM"]


def test_bubblewrap_s_terminate_reaches_its_outer_process_only(cgroup2_manager, tmp_path, bubblewrap):
    # What docs/security.md states for bubblewrap's chain: Popen.pid is bwrap's outer process, which has
    # no handler and forwards nothing; it dies of the signal, and the target runs on in the turn.
    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc, _ = start(turn, tmp_path)
    target = sandboxed_target(turn)
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert target in turn.pids() and got(tmp_path) == []
    result = turn.abandon("test", grace=30)             # the way to stop it: one SIGTERM, by host pid
    assert got(tmp_path) == ["SIGTERM"] and result.signals == ["SIGTERM"]
    proc.stdout.close()


def test_the_namespace_s_init_is_told_by_its_nspid(cgroup2_manager, tmp_path, native):
    from cgturn.kernel import pidns

    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc = turn.spawn([SLEEP, "300"], cwd=str(tmp_path))
    target = sandboxed_target(turn, SLEEP)
    try:
        assert pidns.is_namespace_init(proc.pid)                          # NSpid: <host pid> 1
        assert not pidns.is_namespace_init(target)                        # NSpid: <host pid> 2
        assert not pidns.is_namespace_init(os.getpid()) and not pidns.is_namespace_init(1)   # one entry
        assert not pidns.is_namespace_init(2 ** 22 + 1)                   # no such process (above pid_max)
    finally:
        finish(turn, proc)


def test_terminate_of_a_user_target_reaches_it(  # the init keeps CAP_KILL for this (docs/security.md)
        cgroup2_manager, tmp_path, native):
    tmp_path.chmod(0o777)
    turn = cgroup2_manager.begin_turn("signals", seal=True)
    proc = turn.spawn([SLEEP, "300"], user="nobody", cwd=str(tmp_path))
    sandboxed_target(turn, SLEEP)
    try:
        proc.terminate()
        assert proc.wait(timeout=3) == 128 + signal.SIGTERM
    finally:
        finish(turn, proc)


# Sends SIGUSR1 to its namespace's PID 1 (cgturn-init) and prints what comes back to it.
REFLECT = r'''
import os, select, signal
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
signal.signal(signal.SIGUSR1, lambda *_: None)
os.kill(1, signal.SIGUSR1)
print(signal.Signals(os.read(r, 1)[0]).name if select.select([r], [], [], 30)[0] else "nothing", flush=True)
'''


def test_a_sealed_process_s_signal_to_its_init_comes_back_to_itself_only(cgroup2_manager, tmp_path, native):
    # the init forwards to PID 2 of its own namespace and nowhere else: not to another spawn of the turn
    # (another sandbox), not to the caller
    turn = cgroup2_manager.begin_turn("signals", seal=True)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other, _ = start(turn, other_dir)
    caller_got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda sig, _: caller_got.append(sig))
    try:
        out = turn.spawn([PY, "-c", REFLECT], stdout=subprocess.PIPE, text=True, cwd=str(tmp_path))
        assert out.communicate(timeout=60)[0].strip() == "SIGUSR1"
        assert got(other_dir) == [] and caller_got == []
    finally:
        signal.signal(signal.SIGUSR1, previous)
        finish(turn, other)
