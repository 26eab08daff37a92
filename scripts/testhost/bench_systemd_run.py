#!/usr/bin/env python3
"""In the test host: the anchor's path (`systemd-run --scope`) against `Turn.spawn` / `Turn.abandon`.

    python3 scripts/testhost/bench_systemd_run.py [--rounds N]     (run by run.py --bench, in the guest)

The gateway cgturn is modelled on runs each local worker with `systemd-run --user --scope`. Both
paths here start the same small tree (sh + two sleeps; "running" = the tree printed `ready`) and stop
it until it is gone (the spawned sh reaped, the unit or turn cgroup empty):
  start:      systemd-run --scope CMD             vs  begin_turn + Turn.spawn(CMD)
  stop/TERM:  systemctl stop UNIT.scope (SIGTERM) vs  Turn.abandon(grace=2) (SIGTERM; all exit on it)
  stop/KILL:  same, scope with KillSignal=SIGKILL vs  Turn.abandon(grace=0) (cgroup.kill)
As root against the system manager, and as an unprivileged user against that user's manager (in a
delegated user service, started with `loginctl enable-linger`) when one can be had. Rounds alternate
the order of the two paths. Under software emulation absolute times mean little: read the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

TREE = "sleep 600 & sleep 600 & echo ready; wait"
USER = "cgtest"


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def scope_round(user: bool, kill: bool) -> tuple[float, float]:
    name = f"cgturn-bench-{uuid.uuid4().hex[:8]}"
    mode = ["--user"] if user else []
    props = ["-p", "KillSignal=SIGKILL"] if kill else []
    t0 = time.perf_counter()
    p = subprocess.Popen(["systemd-run", *mode, "--scope", "--quiet", "--collect", f"--unit={name}", *props,
                          "--", "sh", "-c", TREE], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    start = _ms(t0)
    t0 = time.perf_counter()
    subprocess.run(["systemctl", *mode, "stop", f"{name}.scope"], check=True)
    p.wait(timeout=60)
    stop = _ms(t0)
    p.stdout.close()
    return start, stop


def turn_round(mgr, kill: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    turn = mgr.begin_turn("bench", uuid.uuid4().hex[:8])
    p = turn.spawn(["sh", "-c", TREE], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    start = _ms(t0)
    t0 = time.perf_counter()
    res = turn.abandon("bench", grace=0 if kill else 2.0)
    p.wait(timeout=60)
    stop = _ms(t0)
    assert len(res.killed) == 3, res
    p.stdout.close()
    return start, stop


def measure(rounds: int, user: bool, root: str, state_dir: str) -> dict:
    from cgturn import TurnManager

    mgr = TurnManager(root=root, backend="cgroup2", state_dir=state_dir)
    data: dict[str, list[float]] = {k: [] for k in ("scope_start", "scope_term", "scope_kill",
                                                    "turn_start", "turn_term", "turn_kill")}
    try:
        for i in range(rounds):
            kill = bool(i % 2)
            first_scope = random.random() < 0.5
            for which in (("scope", "turn") if first_scope else ("turn", "scope")):
                start, stop = scope_round(user, kill) if which == "scope" else turn_round(mgr, kill)
                data[f"{which}_start"].append(start)
                data[f"{which}_{'kill' if kill else 'term'}"].append(stop)
    finally:
        mgr.end_task("bench")
        mgr.close()
    return {k: statistics.median(v) for k, v in data.items() if v}


def user_manager_ready(uid: int) -> bool:
    """Start the test user's systemd manager (linger) and wait for its bus; False when none comes up."""
    if subprocess.run(["loginctl", "enable-linger", USER], capture_output=True).returncode != 0:
        return False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(f"/run/user/{uid}/bus"):
            state = subprocess.run(["systemctl", "is-active", f"user@{uid}.service"], capture_output=True,
                                   text=True).stdout.strip()
            if state == "active":
                return True
        time.sleep(0.2)
    return False


def user_half(rounds: int) -> dict | None:
    """Run the measurement as the test user, in a delegated service of that user's own manager."""
    uid = pwd.getpwnam(USER).pw_uid
    if not user_manager_ready(uid):
        print("no user manager could be started: --user --scope not measured", file=sys.stderr)
        return None
    env = [f"XDG_RUNTIME_DIR=/run/user/{uid}", f"DBUS_SESSION_BUS_ADDRESS=unix:path=/run/user/{uid}/bus"]
    res = subprocess.run(["runuser", "-u", USER, "--", "env", *env, "systemd-run", "--user", "--wait", "--pipe",
                          "--quiet", "--collect", "-p", "Delegate=yes", "-p", "DelegateSubgroup=supervisor",
                          f"--setenv=PYTHONPATH={os.environ.get('PYTHONPATH', '')}", "--",
                          sys.executable, os.path.abspath(__file__), "--rounds", str(rounds), "--as-user-service"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=1800)
    if res.returncode != 0:
        print(f"user half failed ({res.returncode}): {res.stderr.strip()}", file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def own_cgroup() -> str:
    with open("/proc/self/cgroup") as f:
        rel = next(line[3:].strip() for line in f if line.startswith("0::"))
    return "/sys/fs/cgroup" + (os.path.dirname(rel) if rel.endswith("/supervisor") else rel)


def table(title: str, m: dict) -> str:
    rows = [("start to running", m["scope_start"], m["turn_start"]),
            ("stop to gone, SIGTERM", m["scope_term"], m["turn_term"]),
            ("stop to gone, SIGKILL", m["scope_kill"], m["turn_kill"])]
    out = [f"### {title}", "", "| | systemd-run --scope | cgturn | systemd-run / cgturn |", "|---|---|---|---|"]
    out += [f"| {name} | {a:.1f} ms | {b:.1f} ms | {a / b:.2f}x |" for name, a, b in rows]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="rounds per path (half SIGTERM, half SIGKILL)")
    p.add_argument("--as-user-service", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_user_service:  # inside the user's delegated service: measure, print JSON
        with tempfile.TemporaryDirectory() as state:
            print(json.dumps(measure(args.rounds, True, own_cgroup() + "/turns", state)))
        return 0
    with tempfile.TemporaryDirectory() as state:
        system = measure(args.rounds, False, f"/sys/fs/cgroup/cgturn-bench-{uuid.uuid4().hex[:8]}", state)
    print(table(f"root, system manager ({args.rounds} rounds, medians)", system))
    user = user_half(args.rounds)
    if user:
        print()
        print(table(f"user {USER}, its own manager: --user --scope vs a delegated user service "
                    f"({args.rounds} rounds, medians)", user))
    return 0


if __name__ == "__main__":
    sys.exit(main())
