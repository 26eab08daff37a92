"""Escaper recipes shared by the tests (both backends, torture) and scripts/bench.py.

Each recipe is a command that leaves a long-lived process behind that is no longer a descendant of
the command (double fork, setsid, a daemonizing server). Every leftover carries a unique marker in
its command line, so a test finds exactly the processes it started and nothing else.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from cgturn.kernel import procfs

DOUBLE_FORK = ("import os, sys\n"
               "if os.fork(): os._exit(0)\n"
               "os.setsid()\n"
               "if os.fork(): os._exit(0)\n"
               "os.execvp('sleep', ['sleep', sys.argv[1]])\n")


@dataclass
class Escaper:
    name: str
    argv: list[str]
    marker: str          # substring of the leftover processes' command lines
    leftovers: int = 1   # how many marked processes the recipe leaves running
    cleanup: list[str] | None = None  # command that undoes it (tmux kill-server)
    log: str = "/dev/null"  # where the launcher's stderr goes
    status: int | None = None  # the launcher's exit status once launched
    # Program every leftover finally runs, when an intermediate image (the launcher, `env -i`) also
    # carries the marker: launch() waits for that exec, so membership is judged on the final process
    # (mid-exec, /proc/PID/environ reads empty for a moment). Without it, launch() waits until each
    # leftover shows an environment.
    final: str | None = None


def _duration() -> str:
    """A unique sleep duration (GNU sleep takes fractions): the marker of one leftover."""
    return f"300.{secrets.randbelow(10**8):08d}"


# Every recipe's name; `env_cleared` is the one the registry cannot catch (cgroup2 catches all).
NAMES = ("double_fork_setsid", "setsid_f", "nohup_disown", "tmux", "ssh_agent", "start_stop_daemon",
         "env_cleared")


def recipes(tmpdir: str) -> dict[str, Escaper]:
    """Every escaper, with fresh markers. `env_cleared` is the one the registry cannot catch."""
    out = {}
    d = _duration()
    out["double_fork_setsid"] = Escaper("double_fork_setsid", [sys.executable, "-c", DOUBLE_FORK, d], d,
                                        final="sleep")
    d = _duration()
    out["setsid_f"] = Escaper("setsid_f", ["setsid", "-f", "sleep", d], d, final="sleep")
    d = _duration()
    out["nohup_disown"] = Escaper("nohup_disown",
                                  ["bash", "-c", f"nohup sleep {d} >/dev/null 2>&1 & disown; exit 0"], d,
                                  final="sleep")
    sock = f"cgturn-test-{secrets.token_hex(5)}"
    d = _duration()
    out["tmux"] = Escaper("tmux", ["tmux", "-L", sock, "-f", "/dev/null", "new-session", "-d", "sleep", d], d,
                          leftovers=2, cleanup=["tmux", "-L", sock, "kill-server"])
    agent_sock = os.path.join(tmpdir, f"agent-{secrets.token_hex(5)}.sock")
    out["ssh_agent"] = Escaper("ssh_agent", ["ssh-agent", "-a", agent_sock], agent_sock)
    d = _duration()
    pidfile = os.path.join(tmpdir, f"ssd-{secrets.token_hex(5)}.pid")
    # --pidfile: without it start-stop-daemon matches *any* running /bin/sleep and refuses to start.
    out["start_stop_daemon"] = Escaper("start_stop_daemon",
                                       ["start-stop-daemon", "--start", "--background", "--make-pidfile",
                                        "--pidfile", pidfile, "--exec", "/bin/sleep", "--", d], d,
                                       final="sleep")
    d = _duration()
    out["env_cleared"] = Escaper("env_cleared", ["setsid", "-f", "env", "-i", "sleep", d], d, final="sleep")
    for name, recipe in out.items():
        recipe.log = os.path.join(tmpdir, f"launch-{name}-{secrets.token_hex(3)}.err")
    return out


def find_marked(marker: str) -> list[int]:
    """Live pids whose command line contains `marker` (never the caller or its ancestors)."""
    skip = procfs.protected_pids()
    out = []
    for pid in procfs.all_pids():
        if pid in skip or marker not in procfs.cmdline(pid):
            continue
        st = procfs.stat(pid)
        if st is not None and st.state not in ("Z", "X"):
            out.append(pid)
    return sorted(out)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def launch(turn, esc: Escaper, timeout: float = 10.0) -> list[int]:
    """Run the recipe in `turn`, wait for the launcher to exit and the leftovers to appear."""
    # stderr to a file, not a pipe: the leftovers inherit it and would hold a pipe open.
    with open(esc.log, "wb") as err:
        proc = turn.spawn(esc.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    esc.status = proc.wait(timeout=timeout)
    # One predicate for count and readiness: a leftover in the middle of its exec reads an empty
    # command line for a moment (the new mm has no arguments yet), so it drops out of find_marked, and
    # a separate "all of them are ready" would hold on the empty list.
    wait_for(lambda: _launched(esc), timeout)
    return find_marked(esc.marker)


def _launched(esc: Escaper) -> bool:
    pids = find_marked(esc.marker)
    if len(pids) < esc.leftovers:
        return False
    if esc.final is not None:
        return all(os.path.basename(procfs.cmdline(pid).split(" ")[0]) == esc.final for pid in pids)
    return all(procfs.environ(pid) for pid in pids)


def explain(esc: Escaper) -> str:
    """What the launcher said, for assertion messages."""
    try:
        with open(esc.log, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        text = ""
    return f"{esc.name}: launcher exit {esc.status}, stderr {text!r}"


def destroy(esc: Escaper) -> None:
    """Kill whatever the recipe left (only processes carrying its unique marker)."""
    if esc.cleanup:
        subprocess.run(esc.cleanup, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
    for _ in range(3):
        pids = find_marked(esc.marker)
        if not pids:
            return
        for pid in pids:
            procfs.signal_pid(pid, signal.SIGKILL, procfs.start_time(pid))
        wait_for(lambda: not find_marked(esc.marker), 2.0)
