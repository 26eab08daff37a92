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


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return (time.perf_counter() - started) * 1000


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
        samples: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.n):
            for name, argv in commands.items():
                samples[name].append(timed(argv, env))
        if os.path.exists(root):
            raise SystemExit(f"ps created {root}: it must be read-only")
    bare = statistics.median(samples["python -c pass"])
    ps = statistics.median(samples["cgturn ps --json"])
    print(f"| command | median of {args.n} (ms) |")
    print("|---|---|")
    for name, values in samples.items():
        print(f"| `{name}` | {statistics.median(values):.1f} |")
    verdict = "met" if ps - bare <= TARGET_MS else "NOT met"
    print(f"\ncgturn ps --json costs the bare start + {ps - bare:.1f} ms ({ps / bare:.2f}x); "
          f"target + {TARGET_MS:.0f} ms: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
