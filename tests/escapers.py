"""Real escapers: programs that leave their parent's process tree, as daemons do.

Each escaper is started inside a turn with `start(turn, workdir)` and returns the pid of the process
that escaped (read from a pid file it writes), after the launcher has exited. `cleanup(workdir)` undoes
anything that lives outside the process tree's reach (a tmux server socket).
"""
from __future__ import annotations

import os
import sys
import textwrap

from conftest import wait_until

PY = sys.executable

DOUBLE_FORK = textwrap.dedent("""
    import os, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(sys.argv[1], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(300)
        os._exit(0)
    os.wait()
""")


def _pidfile(workdir: str, name: str) -> str:
    return os.path.join(workdir, f"{name}.pid")


def _read_pid(path: str, timeout: float = 10.0) -> int:
    def ready():
        try:
            with open(path) as f:
                return f.read().strip().isdigit()
        except FileNotFoundError:
            return False
    if not wait_until(ready, timeout):
        raise AssertionError(f"escaper never wrote {path}")
    with open(path) as f:
        return int(f.read().strip())


def double_fork(turn, workdir):
    pf = _pidfile(workdir, "double_fork")
    turn.spawn([PY, "-c", DOUBLE_FORK, pf]).wait()
    return _read_pid(pf)


def setsid_f(turn, workdir):
    pf = _pidfile(workdir, "setsid_f")
    turn.spawn(["setsid", "-f", "sh", "-c", f'echo $$ > {pf}; exec sleep 300']).wait()
    return _read_pid(pf)


def nohup_disown(turn, workdir):
    pf = _pidfile(workdir, "nohup")
    script = f'nohup sh -c "echo \\$\\$ > {pf}; exec sleep 300" >/dev/null 2>&1 & disown; exit 0'
    turn.spawn(["bash", "-c", script]).wait()
    return _read_pid(pf)


def tmux_server(turn, workdir):
    sock = os.path.join(workdir, "tmux.sock")
    turn.spawn(["tmux", "-S", sock, "new-session", "-d", "sleep 300"]).wait()
    pf = _pidfile(workdir, "tmux")
    # The server's pid, as tmux reports it; asking it runs a client, which is harmless.
    out = os.popen(f"tmux -S {sock} display-message -p '#{{pid}}'").read().strip()
    with open(pf, "w") as f:
        f.write(out)
    return _read_pid(pf)


def ssh_agent(turn, workdir):
    pf = _pidfile(workdir, "ssh_agent")
    sock = os.path.join(workdir, "agent.sock")
    p = turn.spawn(["ssh-agent", "-s", "-a", sock], stdout=__import__("subprocess").PIPE, text=True)
    out, _ = p.communicate(timeout=10)
    pid = next(part.split("=")[1] for part in out.replace(";", "\n").split() if part.startswith("SSH_AGENT_PID="))
    with open(pf, "w") as f:
        f.write(pid)
    return _read_pid(pf)


def start_stop_daemon(turn, workdir):
    pf = _pidfile(workdir, "ssd")
    turn.spawn(["start-stop-daemon", "--start", "--background", "--make-pidfile", "--pidfile", pf,
                "--exec", "/bin/sleep", "--", "300"]).wait()
    return _read_pid(pf)


ESCAPERS = {
    "double_fork": double_fork,
    "setsid_f": setsid_f,
    "nohup_disown": nohup_disown,
    "tmux": tmux_server,
    "ssh_agent": ssh_agent,
    "start_stop_daemon": start_stop_daemon,
}


def cleanup(workdir: str) -> None:
    """Stop the tmux server of `workdir`'s socket if one is still up (only ours: its own socket)."""
    sock = os.path.join(workdir, "tmux.sock")
    if os.path.exists(sock):
        os.system(f"tmux -S {sock} kill-server >/dev/null 2>&1")
