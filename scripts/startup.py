#!/usr/bin/env python3
"""Start-up cost of the console script: `cgturn run -- true`, `cgturn ps --json` and `cgturn doctor`
against the bare interpreter start (`python -c pass`, site included, as the user's environment has
it), side by side in one run.

Measure a PLAIN install (a virtual environment with `pip install .`, not `-e`: the editable finder
alone costs tens of milliseconds at every start):

    python3 -m venv /tmp/v && /tmp/v/bin/pip install .
    sudo python3 scripts/startup.py --venv /tmp/v [--venv /tmp/v-old ...] [-n 15]

Each `--venv` is measured with its own interpreter and console script; the commands of all of them
run in alternation, round after round, so every row sees the machine in the same state, and each
row is printed as the bare start + its cost and as a ratio to it. CPU time (user + system of the
child) is printed beside wall time: on a busy machine wall time includes waiting for a core. The
target (issue "Performance II"): `cgturn run -- true` within the bare start + 50 ms. Everything
happens in a managed root of its own (`cgturn-startup-<random>`, removed at the end); `ps` and
`doctor` create nothing.

`--turns N` first starts N running turns in that root (one `sleep` each, across 10 tasks, begun by
this process with this checkout's cgturn and no sentinel), so `cgturn ps --json` lists N turns (and
`run` begins its turn beside them); it prints `TurnManager.turns()` in this process beside, the
in-process figure the command's costs above the interpreter start are over. Target (issue
"Performance II"): `cgturn ps --json` of 1,000 turns within 150 ms wall.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchlib import destroy  # noqa: E402

import cgturn  # noqa: E402

TARGET_MS = 50.0
PS_TARGET_MS = 150.0  # `cgturn ps --json` of 1,000 turns, wall
COMMANDS = {"cgturn run -- true": ["run", "--", "true"], "cgturn ps --json": ["ps", "--json"],
            "cgturn doctor": ["doctor"]}


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, CPU ms of the child and its children: user + system)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} exited {proc.returncode}")
    return (time.perf_counter() - started) * 1000, (usage.ru_utime + usage.ru_stime) * 1000


def rows_for(venv: str) -> dict[str, list[str]]:
    """The commands to time for one virtual environment: its bare interpreter and its console script."""
    python, script = os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "cgturn")
    for path in (python, script):
        if not os.path.exists(path):
            raise SystemExit(f"no {path}: make the environment with `python3 -m venv {venv}` and "
                             f"`{venv}/bin/pip install .` first")
    # From /: `python -c` puts the working directory first on sys.path, and a source tree there wins.
    where = subprocess.run([python, "-c", "import cgturn; print(cgturn.__file__)"], env=clean_env(), cwd="/",
                           stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    if not where.startswith(os.path.realpath(venv)) and not where.startswith(venv):
        raise SystemExit(f"{venv} imports cgturn from {where}: not a plain install in the environment")
    out = {"python -c pass": [python, "-c", "pass"]}
    out.update({name: [script, *args] for name, args in COMMANDS.items()})
    return out


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without PYTHONPATH (it would put a source tree before the install)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env.update(extra)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", action="append", required=True,
                        help="a virtual environment with cgturn installed plainly (repeat to compare)")
    parser.add_argument("-n", type=int, default=15, help="rounds (default 15)")
    parser.add_argument("--turns", type=int, default=0, help="running turns for ps to list (default 0)")
    args = parser.parse_args()
    host = cgturn.discover_host()
    if host.cgroup2_mount is None:
        raise SystemExit("needs a cgroup2 mount")
    root = os.path.join(host.cgroup2_mount, f"cgturn-startup-{uuid.uuid4().hex[:8]}")
    plan = {venv: rows_for(venv) for venv in args.venv}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    in_process: list[float] = []
    load_before = os.getloadavg()[0]
    mgr = None
    try:
        with tempfile.TemporaryDirectory() as state:
            env = clean_env(CGTURN_ROOT=root, CGTURN_STATE_DIR=state)
            if args.turns:
                mgr = cgturn.TurnManager(root=root, backend="cgroup2", state_dir=state, sentinel=False)
                for i in range(args.turns):
                    mgr.begin_turn(f"startup-{i % 10}", f"t{i}").spawn(["sleep", "3600"])
            for commands in plan.values():  # warm the page cache for every row alike
                for argv in commands.values():
                    timed(argv, env)
            for _ in range(args.n):
                for venv, commands in plan.items():
                    for name, argv in commands.items():
                        samples.setdefault((venv, name), []).append(timed(argv, env))
                if mgr is not None:
                    started = time.perf_counter()
                    mgr.turns(detail=True)  # what `ps` lists: usage, pressure, frozen
                    in_process.append((time.perf_counter() - started) * 1000)
    finally:
        destroy(root, *([mgr] if mgr is not None else []))
    print(f"cgturn start-up on {os.uname().release}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"{args.n} rounds, {args.turns} running turns, load {load_before:.1f} before / "
          f"{os.getloadavg()[0]:.1f} after\n")
    print("| install | command | wall, median (ms) | CPU, median (ms) | wall - bare | CPU - bare | wall / bare |")
    print("|---|---|---:|---:|---:|---:|---:|")
    verdicts = []
    for venv, commands in plan.items():
        bare_wall = statistics.median(w for w, _ in samples[(venv, "python -c pass")])
        bare_cpu = statistics.median(c for _, c in samples[(venv, "python -c pass")])
        for name in commands:
            wall = statistics.median(w for w, _ in samples[(venv, name)])
            cpu = statistics.median(c for _, c in samples[(venv, name)])
            print(f"| {venv} | `{name}` | {wall:.1f} | {cpu:.1f} | +{wall - bare_wall:.1f} | +{cpu - bare_cpu:.1f} "
                  f"| {wall / bare_wall:.2f}x |")
            if name == "cgturn run -- true":
                verdicts.append(f"- {venv}: `cgturn run -- true` = bare start + {wall - bare_wall:.1f} ms wall, "
                                f"+ {cpu - bare_cpu:.1f} ms CPU (target + {TARGET_MS:.0f} ms: "
                                f"{'met' if wall - bare_wall <= TARGET_MS else 'NOT met'})")
            if name == "cgturn ps --json" and args.turns:
                verdicts.append(f"- {venv}: `cgturn ps --json` of {args.turns} turns = {wall:.1f} ms wall "
                                f"(target {PS_TARGET_MS:.0f} ms for 1,000: "
                                f"{'met' if wall <= PS_TARGET_MS else 'NOT met'})")
    if in_process:
        print(f"| (this process) | `TurnManager.turns(detail=True)` of {args.turns} turns | "
              f"{statistics.median(in_process):.1f} | | | | |")
    print()
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
