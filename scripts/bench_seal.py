#!/usr/bin/env python3
"""What a seal costs: a sealed whole turn (begin_turn(seal=True), spawn /bin/true, wait, complete)
beside a plain one, on each way a sealed spawn can start, alternating rounds in one run, printed as
medians with the exec chain each pays, the ratio sealed / plain per path and the load average:

- clone3, native sandbox: the extension's child builds the sandbox itself (the default here);
- clone3, bubblewrap: the same clone, then bwrap exec'd (where the native sandbox cannot be built);
- shim: the gated /bin/sh shim, then bwrap (where the extension is not built).

Then the floor, outside any turn, one spawn of /bin/true each way: wall time and the CPU time it costs
(this process plus its children, from getrusage: far less sensitive to the load than wall time).

Everything lives in one managed root `<own cgroup2>/cgturn-bench-<random>`, removed at the end, on
errors and on SIGTERM. The sealed spawns run in a temporary working directory (their writable path).
Run as root:

    python3 scripts/bench_seal.py [--rounds 5] [--turns 30]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchlib import bench_root, destroy  # noqa: E402

from cgturn import TurnManager, testing  # noqa: E402
from cgturn.backends import seal  # noqa: E402
from cgturn.kernel import spawn as kspawn  # noqa: E402

NATIVE, BWRAP_CHAIN = "clone3, native sandbox", "clone3, bubblewrap"
CASES = {  # name: (spawn path, native sandbox allowed, exec chain of the sealed spawn)
    NATIVE: (testing.CLONE3, True, "clone3 → PID 1 (the child: mounts, then execs cgturn-init) → target"),
    BWRAP_CHAIN: (testing.CLONE3, False, "clone3 → bwrap (→ its init) → target"),
    "shim": (testing.SHIM, False, "shim sh → bwrap (→ its init) → target"),
}


@contextlib.contextmanager
def native_sandbox(allowed: bool) -> Iterator[None]:
    """Sealed spawns use the extension's sandbox only if `allowed` (else bubblewrap) in the block."""
    saved = seal.native_works
    if not allowed:
        seal.native_works = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        seal.native_works = saved  # type: ignore[assignment]


def whole_turns_ms(mgr: TurnManager, sealed: bool, n: int, cwd: str) -> float:
    """Median ms of begin_turn + spawn(/bin/true) + wait + complete, n turns."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        turn = mgr.begin_turn("bench-seal", seal=sealed)
        code = turn.spawn(["/bin/true"], cwd=cwd).wait()
        turn.complete()
        times.append((time.perf_counter() - t0) * 1000)
        if code != 0:
            raise RuntimeError(f"/bin/true exited {code} (sealed={sealed})")
    return statistics.median(times)


def floor(start: Callable[[], int], n: int) -> tuple[float, float]:
    """(median wall ms, mean CPU ms of this process and its children) of start(), n times."""
    times = []
    before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    for _ in range(n):
        t0 = time.perf_counter()
        if start() != 0:
            raise RuntimeError("a floor spawn failed")
        times.append((time.perf_counter() - t0) * 1000)
    after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before))
    return statistics.median(times), cpu * 1000 / n


def floors(work: str) -> dict[str, Callable[[], int]]:
    """The floor spawns: /bin/true bare, in the native sandbox, under bubblewrap (the seal's command)."""
    spec, _ = seal.native(None, work, None)

    def bwrap() -> int:
        fd = seal.filter_fd()  # bwrap reads the filter from it: one per spawn, as a sealed spawn makes
        try:
            argv = [*seal.command([work], work, None, fd), "/bin/true"]
            return subprocess.run(argv, pass_fds=(fd,), cwd=work).returncode
        finally:
            os.close(fd)

    out = {"/bin/true (the extension's clone, no sandbox)":
           lambda: kspawn.CgroupPopen(["/bin/true"], cgroup=-1, cwd=work).wait()}
    if seal.native_works():
        out["/bin/true in the native sandbox"] = \
            lambda: kspawn.CgroupPopen(["/bin/true"], cgroup=-1, seal=spec, cwd=work).wait()
    out["bwrap (the seal's command) /bin/true"] = bwrap
    return out


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    root = bench_root()
    if root is None:
        return 2
    cases = {name: case for name, case in CASES.items() if testing.spawn_path_unavailable(case[0]) is None
             and (case[1] is False or seal.native_works())}
    results: dict[tuple[str, bool], list[float]] = {(name, s): [] for name in cases for s in (False, True)}
    floor_runs: dict[str, list[tuple[float, float]]] = {}
    loads = [load()]
    mgr = None
    try:
        with tempfile.TemporaryDirectory() as state, tempfile.TemporaryDirectory() as work:
            mgr = TurnManager(root=root, backend="cgroup2", state_dir=state)
            starts = floors(work)
            for _ in range(args.rounds):  # alternating: the machine's noise hits every case alike
                for name, (path, allowed, _chain) in cases.items():
                    with testing.forced_spawn_path(path), native_sandbox(allowed):
                        for sealed in (False, True):
                            results[(name, sealed)].append(whole_turns_ms(mgr, sealed, args.turns, work))
                for name, start in starts.items():
                    floor_runs.setdefault(name, []).append(floor(start, args.turns))
                loads.append(load())
            mgr.end_task("bench-seal")
    finally:
        destroy(root, *([mgr] if mgr else []))
        if mgr:
            mgr.close()
    print(f"\n## A sealed whole turn (begin, spawn /bin/true, wait, complete; median of {args.rounds} round "
          f"medians of {args.turns} turns)\n")
    print(f"load average (1, 5, 15 min) before and after each round: {' | '.join(loads)}\n")
    print("| sealed spawn | plain turn | sealed turn | sealed / plain | exec chain (sealed) |\n|---|---|---|---|---|")
    for name, (_path, _allowed, chain) in cases.items():
        plain, sealed = (statistics.median(results[(name, s)]) for s in (False, True))
        print(f"| {name} | {plain:.2f} ms | {sealed:.2f} ms | {sealed / plain:.2f}x | {chain} |")
    print("\n## The floor: one spawn of /bin/true outside any turn (wall: median of round medians; CPU: "
          "mean, this process and its children)\n")
    print("| spawn | wall | CPU |\n|---|---|---|")
    for name, runs in floor_runs.items():
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        print(f"| {name} | {wall:.2f} ms | {cpu:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
