"""The figures scripts/bench_many.py takes from other processes on the same live turns: `cgturn ps
--json` and `reap` wall times, `turns()` in a fresh process, a single abandon by a process holding no
turn (the control for one among N in the owner), and the side-by-side rounds against an earlier
source tree (`--base`), base and this checkout alternating so both see the same turns and load.

Imported by scripts/bench_many.py (scripts/ is on its sys.path).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ABANDONS = 20   # single-turn abandons timed in a fresh process (median), as bench_many does in its own


def _env(tree: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p))


def cli_wall(root: str, state: str, *args: str, tree: str = os.path.join(HERE, "..")) -> float:
    """Wall time of `python -m cgturn --root ROOT --state-dir STATE ARGS` run from the source `tree`
    (this checkout by default; must exit 0)."""
    env = _env(tree)
    argv = [sys.executable, "-m", "cgturn", "--root", root, "--state-dir", state, *args]
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=tree)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {out.returncode}: {out.stderr.strip()[-300:]}")
    return elapsed


TURNS_IN_PROCESS = """
import sys, time
from cgturn import TurnManager
mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2])
t0 = time.perf_counter(); cold = len(mgr.turns()); t1 = time.perf_counter(); warm = len(mgr.turns())
print(t1 - t0, time.perf_counter() - t1, cold, warm)
"""


def turns_elsewhere(root: str, state: str, tree: str) -> tuple[float, float]:
    """(first, second) `turns()` of a manager in a fresh process running the source `tree`: the first
    reads every record, the second reuses them (metadata.py's generation tokens)."""
    env = _env(tree)
    out = subprocess.run([sys.executable, "-c", TURNS_IN_PROCESS, root, state], capture_output=True, text=True,
                         timeout=600, env=env, cwd=tree, check=True)
    cold, warm, _, _ = out.stdout.split()
    return float(cold), float(warm)


def side_by_side(root: str, state: str, base: str, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """{figure: [(base, this checkout)...]}: `turns()` (first and second, in a fresh process), `ps --json`
    and `reap` run from the source tree `base` and from this checkout alternately on the same live turns
    (one round: base then this; the next: this then base), so both see the same tree and the same load."""
    here = os.path.join(HERE, "..")
    # Both trees byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (as on this host), a tree
    # never compiled pays the compilation of every module at each CLI start (seconds under load).
    for tree in (base, here):
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(tree, "cgturn")], check=True)
    out: dict[str, list[tuple[float, float]]] = {"turns_cold": [], "turns_warm": [], "ps": [], "reap": []}
    for i in range(rounds):
        order = (base, here) if i % 2 == 0 else (here, base)
        got: dict[str, dict[str, float]] = {}
        for tree in order:
            cold, warm = turns_elsewhere(root, state, tree)
            got[tree] = {"turns_cold": cold, "turns_warm": warm, "ps": cli_wall(root, state, "ps", "--json", tree=tree),
                         "reap": cli_wall(root, state, "reap", "--json", tree=tree)}
        for name in out:
            out[name].append((got[base][name], got[here][name]))
    return out


ABANDONS_ELSEWHERE = """
import statistics, subprocess, sys, time
from cgturn import TurnManager
mgr = TurnManager(root=sys.argv[1], backend="cgroup2", state_dir=sys.argv[2])
took = []
for i in range(int(sys.argv[4])):
    turn = mgr.begin_turn(sys.argv[3], f"e{i}")
    proc = turn.spawn(["sleep", "3600"])
    t0 = time.perf_counter()
    turn.abandon("bench", grace=0)
    took.append(time.perf_counter() - t0)
    proc.wait()
mgr.close()
print(statistics.median(took))
"""


def abandon_elsewhere(root: str, state: str, task: str) -> float:
    """Median abandon of one turn, as `abandon_one`, by a fresh process with no other turn of its own
    (a control: an abandon slower there too is the host's or the kernel's, not the owner's holding N)."""
    out = subprocess.run([sys.executable, "-c", ABANDONS_ELSEWHERE, root, state, task, str(ABANDONS)],
                         capture_output=True, text=True, timeout=600, check=True, cwd=os.path.join(HERE, ".."),
                         env=_env(os.path.join(HERE, "..")))
    return float(out.stdout.split()[-1])


def print_pairs(pairs: dict[str, list[tuple[float, float]]], base: str) -> None:
    """The side-by-side rounds: each figure from `base` and from this checkout, and their ratio."""
    print(f"\nSide by side on the same turns, alternating (base: {base}):\n")
    print("| figure | base | this checkout | this / base |")
    print("|---|---:|---:|---:|")
    names = {"turns_cold": "`turns()`, first call in a fresh process", "turns_warm": "`turns()`, second call",
             "ps": "`cgturn ps --json` (wall)", "reap": "`cgturn reap`, nothing to do (wall)"}
    for key, rounds in pairs.items():
        b, h = statistics.median(x for x, _ in rounds), statistics.median(y for _, y in rounds)
        print(f"| {names[key]} | {b:.2f} s | {h:.2f} s | {h / b:.2f}x |")
