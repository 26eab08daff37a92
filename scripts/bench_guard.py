#!/usr/bin/env python3
"""The pressure guard's reaction time: trigger crossing -> turn frozen, beside the trigger's own window.

Each round starts a hog turn (cores + 1 busy loops) beside a stand-in gateway (one busy loop) in a
cgroup this script created and the guard watches. The bench arms its own trigger, with the same
settings, on the same pressure file: the kernel wakes it at the crossing (its own fd, independent of
the guard's). Reaction = the guard's `freeze` audit record (written once the turn is frozen) minus that
crossing; "hog start -> frozen" adds the time the stall took to build up. Medians over --rounds.

Everything lives in `<cgroup2 mount>/cgturn-bench-<random>` (+ `-gw`), removed at the end, on errors
and on Ctrl-C/SIGTERM; every busy loop ends by itself after 60 s. Run as root:

    python3 scripts/bench_guard.py [--rounds 5] [--trigger 'some 100000 2000000']
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchlib import destroy  # noqa: E402

from cgturn import PressureGuard, TurnManager, audit, discover_host  # noqa: E402
from cgturn.testing import guard_pressing  # noqa: E402

BUSY = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
HOGS = (os.cpu_count() or 2) + 1


class Trigger:
    """A PSI trigger armed with the standard library alone, the bench's floor (Linux 5.2+,
    Documentation/accounting/psi.rst: write "some|full <stall us> <window us>" to an open pressure
    file; the kernel then raises POLLPRI on that fd when the stall crosses the threshold)."""

    def __init__(self, path: str, trigger: str):
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        os.write(self.fd, trigger.encode() + b"\0")
        self.poller = select.poll()
        self.poller.register(self.fd, select.POLLPRI)

    def wait(self, timeout: float) -> bool:
        """True when the kernel signalled a crossing within `timeout` seconds."""
        return any(events & select.POLLPRI for _, events in self.poller.poll(timeout * 1000))

    def close(self) -> None:
        os.close(self.fd)


def window_us(trigger: str) -> int:
    """The window of a trigger string ("some 100000 2000000" -> 2000000)."""
    return int(trigger.split()[2])


def freeze_time(state_dir: str, turn: str) -> float | None:
    """Wall time of the guard's freeze record for `turn`, or None yet."""
    for rec in audit.read_records(state_dir):
        if rec.get("action") == "freeze" and rec.get("turn") == turn and rec.get("reason") == "guard":
            return rec["time"]
    return None


def one_round(mgr, gw: str, trigger: str, state_dir: str, n: int, window_s: float) -> tuple[float, float]:
    """(crossing -> frozen, hog start -> frozen) in ms for one hog turn."""
    crossed: list[float] = []
    observer = Trigger(os.path.join(gw, "cpu.pressure"), trigger)

    def watch():
        if observer.wait(30):
            crossed.append(time.time())

    t = threading.Thread(target=watch)
    t.start()
    start = time.time()
    turn = mgr.begin_turn("bench", f"hog{n}")
    for _ in range(HOGS):
        turn.spawn([sys.executable, "-c", BUSY])
    deadline = time.monotonic() + 30
    while (frozen := freeze_time(state_dir, f"hog{n}")) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    t.join()
    observer.close()
    turn.abandon("bench-done", grace=0)
    if frozen is None or not crossed:
        raise RuntimeError(f"round {n}: no freeze within 30 s (crossed: {bool(crossed)})")
    # Let the pressure fall and the guard report quiet before the next round.
    deadline = time.monotonic() + 30
    while guard_pressing(mgr) and time.monotonic() < deadline:
        time.sleep(0.05)
    # The kernel signals a trigger at most once per window: a round started within a window of the
    # guard's last event would measure that rate limit, not the guard.
    time.sleep(window_s + 0.5)
    return (frozen - crossed[0]) * 1000, (frozen - start) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trigger", default="some 100000 2000000")
    args = ap.parse_args()
    host = discover_host()
    if not host.cgroup2_mount:
        print("cgroup v2 is not mounted here", file=sys.stderr)
        return 1
    tag = uuid.uuid4().hex[:8]
    root = os.path.join(host.cgroup2_mount, f"cgturn-bench-{tag}")
    gw = root + "-gw"
    state_dir = tempfile.mkdtemp(prefix="cgturn-bench-guard-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.mkdir(gw)
    gateway = None
    try:
        import subprocess
        gateway = subprocess.Popen([sys.executable, "-c", BUSY])
        with open(os.path.join(gw, "cgroup.procs"), "w") as f:
            f.write(str(gateway.pid))
        window_s = window_us(args.trigger) / 1e6
        guard = PressureGuard(resource="cpu", trigger=args.trigger, watch=gw, thaw_after=0.5, abandon_after=600)
        with TurnManager(root=root, backend="cgroup2", state_dir=state_dir, guard=guard) as mgr:
            rows = [one_round(mgr, gw, args.trigger, state_dir, n, window_s) for n in range(args.rounds)]
    finally:
        if gateway is not None:
            gateway.kill()
            gateway.wait()
        destroy(root)
        destroy(gw)
    window = window_us(args.trigger) / 1000
    reaction = statistics.median(r[0] for r in rows)
    total = statistics.median(r[1] for r in rows)
    print(f"\n## Pressure guard reaction (median of {args.rounds}; trigger '{args.trigger}'; "
          f"{os.cpu_count()} cores, {HOGS} busy loops)\n")
    print("| what | ms | / window |")
    print("|---|---:|---:|")
    print(f"| trigger window | {window:.0f} | 1.00x |")
    print(f"| crossing -> turn frozen | {reaction:.1f} | {reaction / window:.3f}x |")
    print(f"| hog start -> turn frozen | {total:.0f} | {total / window:.2f}x |")
    print("\nrounds (crossing->frozen, start->frozen ms): "
          + ", ".join(f"({a:.1f}, {b:.0f})" for a, b in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
