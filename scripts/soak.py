"""A soak a gateway would live through: a bounded run of gateway-shaped turns, with the gateway's
resources printed at the start and the end.

    python3 scripts/soak.py [--turns 10000] [--max-seconds 540] [--json]

As root on a host with a writable cgroup v2 (its own managed root `cgturn-bench-<random>`, removed at
the end). Each cycle of 20 turns mixes what a gateway does: plain turns (spawn /bin/true, complete),
turns with limits (memory, pids), sealed turns, `network="none"` turns, keyed spawns, pause/resume of a
running turn then an abandon, supervised turns that complete, completed turns that keep a survivor
on a lease (ended a batch at a time), and abandons (grace 0); every 10th cycle a supervised turn is
abandoned by its deadline, every 25th a running turn is stopped from outside (`cgturn stop` in a
subprocess). It stops by itself after `--turns` turns or `--max-seconds`, whichever comes first, and
says how many turns ran.

Figures, taken after WARM_UP_CYCLES cycles with every kind (imports, the sentinel, the watchdog
thread, pools), half-way and after the last turn:
this process's open fds, RSS, threads, the live cgroups under the managed root, the root's
`nr_dying_descendants` (cgroup.stat: removed cgroups the kernel still holds) and the audit log's
size (its rotated generations included). Targets (issue 22): fds, threads and live cgroups back to
their start; RSS growth < 5 MB per 10,000 turns; dying descendants bounded. Not a test: run by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib  # noqa: E402

from cgturn import Limits, LimitsUnavailable, Supervisor, TurnManager, audit  # noqa: E402

CYCLE = 20
WARM_UP_CYCLES = 5
LEASE_BATCH = 20          # lease turns ended together by end_task
RSS_TARGET_KB_PER_10K = 5 * 1024


def status_field(name: str) -> int:
    """A figure of /proc/self/status (VmRSS in kB, Threads)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {name} in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1   # less the fd listdir itself holds


def live_cgroups(root: str) -> int:
    return sum(len(dirs) for _, dirs, _ in os.walk(root))


def dying(root: str) -> int:
    with open(os.path.join(root, "cgroup.stat")) as f:
        stat = dict(line.split() for line in f)
    return int(stat["nr_dying_descendants"])


def audit_bytes(state_dir: str) -> int:
    path = audit.audit_path(state_dir)
    names = [path] + [audit.rotated_path(path, g) for g in range(1, audit.KEEP + 1)]
    return sum(os.path.getsize(n) for n in names if os.path.exists(n))


def figures(root: str, state_dir: str) -> dict[str, int]:
    return {"open fds": open_fds(), "RSS (kB)": status_field("VmRSS"), "threads": status_field("Threads"),
            "live cgroups": live_cgroups(root), "nr_dying_descendants": dying(root),
            "audit log (bytes)": audit_bytes(state_dir)}


class Soak:
    """The workload: one `cycle()` runs CYCLE turns of the mix; `turns` counts them."""

    def __init__(self, mgr: TurnManager, root: str, state_dir: str, limits_ok: bool):
        self.mgr, self.root, self.state_dir, self.limits_ok = mgr, root, state_dir, limits_ok
        self.turns = 0
        self.cycles = 0
        self.leased = 0
        self.kinds: dict[str, int] = {}

    def _count(self, kind: str) -> None:
        self.turns += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def plain(self, **options) -> None:
        turn = self.mgr.begin_turn("soak-plain", **options)
        turn.spawn(["/bin/true"]).wait()
        turn.complete()

    def limited(self) -> None:
        if not self.limits_ok:
            return self.plain()
        self.plain(limits=Limits(memory_max=256 << 20, pids_max=64))

    def keyed(self) -> None:
        turn = self.mgr.begin_turn("soak-keys")
        turn.spawn(["/bin/true"], key="the-one").wait()
        turn.complete()

    def paused(self) -> None:
        turn = self.mgr.begin_turn("soak-pause")
        proc = turn.spawn(["sleep", "300"])
        turn.freeze()
        turn.thaw()
        turn.abandon("soak", grace=0)
        proc.wait()

    def supervised(self) -> None:
        turn = self.mgr.begin_turn("soak-supervised")
        Supervisor(turn, timeout=30, grace=0).run_blocking(lambda: turn.spawn(["/bin/true"]).wait())

    def deadline(self) -> None:
        turn = self.mgr.begin_turn("soak-deadline")
        proc = turn.spawn(["sleep", "300"])
        outcome = Supervisor(turn, deadline=0.05, grace=0).run_blocking(proc.wait)
        proc.wait()
        if outcome.reason != "deadline":
            raise RuntimeError(f"a deadline turn ended as {outcome!r}")

    def leased_turn(self) -> None:
        turn = self.mgr.begin_turn("soak-lease")
        turn.spawn(["sh", "-c", "sleep 300 & exit 0"]).wait()
        turn.complete(keep_for=600)
        self.leased += 1
        if self.leased % LEASE_BATCH == 0:
            self.mgr.end_task("soak-lease", grace=0)

    def abandoned(self) -> None:
        turn = self.mgr.begin_turn("soak-abandon")
        proc = turn.spawn(["sh", "-c", "sleep 300 & sleep 300"])
        turn.abandon("soak", grace=0)
        proc.wait()

    def stopped_outside(self) -> None:
        turn = self.mgr.begin_turn("soak-stop")
        proc = turn.spawn(["sleep", "300"])
        out = subprocess.run([sys.executable, "-m", "cgturn", "stop", "--backend", "cgroup2", "--root", self.root,
                              "--state-dir", self.state_dir, "soak-stop", turn.turn_id, "--grace", "0"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"cgturn stop: exit {out.returncode}: {out.stderr.strip()}")
        proc.wait()
        turn.abandon("soak", grace=0)   # the owner learns it ended (idempotent)

    def cycle(self, every_kind: bool = False) -> None:
        """One cycle of the mix; `every_kind`: with the deadline and outside-stop turns whatever the
        cycle's number (the warm-up)."""
        mix = ([("plain", self.plain)] * 10 + [("limits", self.limited)] * 2
               + [("seal", lambda: self.plain(seal=True)), ("network none", lambda: self.plain(network="none"))]
               + [("keys", self.keyed)] * 2
               + [("pause/resume", self.paused), ("supervised", self.supervised), ("lease", self.leased_turn),
                  ("abandon", self.abandoned)])
        if every_kind or self.cycles % 10 == 9:
            mix[0] = ("deadline", self.deadline)
        if every_kind or self.cycles % 25 == 24:
            mix[1] = ("outside stop", self.stopped_outside)
        assert len(mix) == CYCLE
        for kind, run in mix:
            run()
            self._count(kind)
        self.cycles += 1

    def finish(self) -> None:
        """End what a batch of leases left, so the end figures see no turn the workload still holds."""
        self.mgr.end_task("soak-lease", grace=0)
        for task in ("soak-plain", "soak-keys", "soak-supervised"):
            self.mgr.end_task(task, grace=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--max-seconds", type=float, default=540.0)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object too")
    args = parser.parse_args()
    root = benchlib.bench_root()
    if root is None:
        return 1
    state_dir = tempfile.mkdtemp(prefix="cgturn-soak-")
    mgr = TurnManager(root=root, backend="cgroup2", state_dir=state_dir)
    try:
        try:
            mgr.begin_turn("soak-probe", limits=Limits(pids_max=64)).abandon("probe", grace=0)
            limits_ok = True
        except LimitsUnavailable as err:
            print(f"limits unavailable here ({err}): limit turns run plain", file=sys.stderr)
            limits_ok = False
        soak = Soak(mgr, root, state_dir, limits_ok)
        for _ in range(WARM_UP_CYCLES):   # imports, the sentinel, the watchdog thread, pools, caches
            soak.cycle(every_kind=True)
        soak.finish()
        start = figures(root, state_dir)
        warm_turns, t0 = soak.turns, time.monotonic()
        middle = None
        while soak.turns - warm_turns < args.turns and time.monotonic() - t0 < args.max_seconds:
            soak.cycle()
            if middle is None and soak.turns - warm_turns >= args.turns // 2:
                middle = figures(root, state_dir)   # after half: tells a warm-up step from a slope
        soak.finish()
        elapsed = time.monotonic() - t0
        end = figures(root, state_dir)
    finally:
        benchlib.destroy(root, mgr)
        mgr.close()
    turns = soak.turns - warm_turns
    print(f"{turns} turns in {elapsed:.0f} s ({turns / elapsed:.0f} turns/s) after {warm_turns} warm-up turns")
    print("kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(soak.kinds.items())))
    middle = middle or end
    print(f"{'':24} {'start':>12} {'half-way':>12} {'end':>12}")
    for name in start:
        print(f"{name:24} {start[name]:>12} {middle[name]:>12} {end[name]:>12}")
    rss_growth = (end["RSS (kB)"] - start["RSS (kB)"]) * 10_000 / max(turns, 1)
    missed = [name for name in ("open fds", "threads", "live cgroups") if end[name] != start[name]]
    if rss_growth >= RSS_TARGET_KB_PER_10K:
        missed.append(f"RSS (+{rss_growth:.0f} kB per 10,000 turns)")
    print("targets: " + ("all met" if not missed else "missed: " + ", ".join(missed)))
    if args.json:
        print(json.dumps({"turns": turns, "seconds": elapsed, "start": start, "half-way": middle, "end": end, "kinds": soak.kinds}))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
