#!/usr/bin/env python3
"""Where cgturn's part of a small abandon goes: the abandon with one of its steps left out, beside
the kernel floor and the abandon as it is.

    python3 scripts/bench_abandon_parts.py [--size 10] [--rounds 300]   # as root; ~20 s

A diagnostic, not a mode of the library: each variant patches, in this process only, one step of
the kill path into doing nothing (the audit append, the listings' stamp), into returning the figures
of the turn before (the usage read), or into changing the record without its lock and its write (the
mark; the record is still read). Every round runs the floor and every variant once, in a fresh
random order, on trees at rest (benchlib.wait_settled); medians. What a step costs is the abandon as
it is minus the abandon without it, measured in the same rounds.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchlib import bench_root, cgturn_abandon, destroy, floor_abandon, ms  # noqa: E402

from cgturn import TurnManager, audit  # noqa: E402

VARIANTS = {
    "cgturn": set(),
    "without the audit append": {"audit"},
    "without the usage read": {"usage"},
    "without the listings' stamp": {"stamp"},
    "without the locked mark (the record is still read)": {"mark"},
    "without all four": {"audit", "usage", "stamp", "mark"},
}
_LEFT_OUT: set[str] = set()


def _patch(backend: type) -> None:
    """Make each step skippable by name while _LEFT_OUT holds it. `backend`: the manager's backend
    class, reached through the manager (a script talks to the library's faces, not its backends)."""
    record_kill, turn_usage = audit.record_kill, backend.turn_usage
    pay_stamp, transition = backend._pay_stamp, backend.transition
    last_usage = []

    def usage(self, rec):
        if "usage" in _LEFT_OUT and last_usage:
            return last_usage[-1]
        last_usage[:] = [turn_usage(self, rec)]
        return last_usage[-1]

    def mark(self, task_key, turn_key, allowed, to_state, updates, when=None, stamp_later=False):
        if "mark" not in _LEFT_OUT:
            return transition(self, task_key, turn_key, allowed, to_state, updates, when=when, stamp_later=stamp_later)
        rec = self.meta.load(self.turn_cgroup(task_key, turn_key))
        return rec.advance(allowed, to_state, updates), rec

    audit.record_kill = lambda *a, **kw: None if "audit" in _LEFT_OUT else record_kill(*a, **kw)
    backend.turn_usage = usage
    backend._pay_stamp = lambda self, cg: None if "stamp" in _LEFT_OUT else pay_stamp(self, cg)
    backend.transition = mark


def abandon(mgr: TurnManager, n: int, left_out: set[str]) -> float:
    """benchlib.cgturn_abandon with the steps `left_out` skipped (the begin, spawn and wait for rest
    before the abandon run none of them)."""
    _LEFT_OUT.update(left_out)
    try:
        return cgturn_abandon(mgr, n)
    finally:
        _LEFT_OUT.clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=10, help="processes in each abandoned tree")
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    base = bench_root()
    if base is None:
        return 1
    got: dict[str, list[float]] = {"kernel floor": [], **{name: [] for name in VARIANTS}}
    started, load = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as state:
        try:
            os.mkdir(base)
            os.mkdir(os.path.join(base, "floor"))
            with TurnManager(root=os.path.join(base, "main"), backend="cgroup2", state_dir=state) as mgr:
                _patch(type(mgr.backend))
                for _ in range(args.rounds):
                    for name in random.sample(list(got), len(got)):
                        got[name].append(floor_abandon(os.path.join(base, "floor"), args.size) if name == "kernel floor"
                                         else abandon(mgr, args.size, VARIANTS[name]))
        except KeyboardInterrupt:
            print("interrupted: cleaning up", file=sys.stderr)
            return 130
        finally:
            destroy(base)
    medians = {name: statistics.median(values) for name, values in got.items()}
    floor, whole = medians["kernel floor"], medians["cgturn"]
    print(f"cgturn abandon parts on {os.uname().release}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"{args.size} processes, {args.rounds} rounds, total {time.monotonic() - started:.0f} s, "
          f"load {load:.1f} before / {os.getloadavg()[0]:.1f} after\n")
    print(f"| abandon of {args.size} | ms | against the floor | against cgturn as it is |")
    print("|---|---:|---:|---:|")
    for name, value in medians.items():
        against_floor = "" if name == "kernel floor" else f"{ms(value - floor):+.3f}"
        against_whole = "" if name in ("kernel floor", "cgturn") else f"{ms(value - whole):+.3f}"
        print(f"| {name} | {ms(value):.3f} | {against_floor} | {against_whole} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
