#!/usr/bin/env python3
"""Start-up cost of the console script: `cgturn ps --json` on an empty managed root against the bare
interpreter start (`python -c pass`, the same interpreter, no version-manager shim), side by side.

Runs each command N times in alternation and prints medians and the difference. The target (issue
"house in order"): the console script within the bare start + 50 ms. Uses a managed root that does
not exist (nothing is created: ps is read-only) and a throwaway state directory.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cgturn  # noqa: E402

TARGET_MS = 50.0


def console_script() -> str:
    """The `cgturn` entry point installed for this very interpreter (not a shim on PATH)."""
    path = os.path.join(sysconfig.get_path("scripts"), "cgturn")
    if not os.path.exists(path):
        raise SystemExit(f"no console script at {path}: pip install -e . first")
    return path


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, CPU ms of the child: user + system). CPU time is what survives a busy machine:
    wall time there includes waiting for a core."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} exited {proc.returncode}")
    return (time.perf_counter() - started) * 1000, (usage.ru_utime + usage.ru_stime) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=10, help="runs of each command (default 10)")
    args = parser.parse_args()
    # An installed package has its bytecode (pip compiles at install; PYTHONDONTWRITEBYTECODE stops
    # only the writing of new .pyc files, not their use): measure that, not the compiler.
    import compileall

    compileall.compile_dir(os.path.dirname(os.path.abspath(cgturn.__file__)), quiet=1)
    host = cgturn.discover_host()
    if host.cgroup2_mount is None:
        raise SystemExit("needs a cgroup2 mount")
    root = os.path.join(host.cgroup2_mount, f"cgturn-startup-{uuid.uuid4().hex[:8]}")
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "CGTURN_ROOT": root, "CGTURN_STATE_DIR": state}
        commands = {"python -c pass": [sys.executable, "-c", "pass"],
                    "cgturn ps --json": [console_script(), "ps", "--json"]}
        for argv in commands.values():  # warm the page cache for both alike
            timed(argv, env)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for _ in range(args.n):
            for name, argv in commands.items():
                samples[name].append(timed(argv, env))
        if os.path.exists(root):
            raise SystemExit(f"ps created {root}: it must be read-only")
    medians = {name: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
               for name, values in samples.items()}
    print(f"| command | wall, median of {args.n} (ms) | CPU, median (ms) |")
    print("|---|---|---|")
    for name, (wall, cpu) in medians.items():
        print(f"| `{name}` | {wall:.1f} | {cpu:.1f} |")
    (bare_wall, bare_cpu), (ps_wall, ps_cpu) = medians["python -c pass"], medians["cgturn ps --json"]
    for what, bare, ps in (("wall", bare_wall, ps_wall), ("CPU", bare_cpu, ps_cpu)):
        verdict = "met" if ps - bare <= TARGET_MS else "NOT met"
        print(f"{what}: cgturn ps --json costs the bare start + {ps - bare:.1f} ms ({ps / bare:.2f}x); "
              f"target + {TARGET_MS:.0f} ms: {verdict}")
    print(f"load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
