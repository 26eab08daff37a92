#!/usr/bin/env python3
"""How accurate `cgturn run --report` is: the same workloads under benchexec's `runexec` and under
`cgturn run --report`, alternating in one run, printed as one table.

Workloads (each the same argv under both):
- alloc: a Python process that allocates and touches 150 MiB, under a 400 MB memory limit (both tools
  then give the turn / run a memory cgroup): peak memory and CPU time;
- burn: a Python process that burns 1 s of its own CPU time and exits: CPU time;
- cpu-limit: a Python process that burns until killed, under `--cpu-time 1 --grace 0` against runexec's
  `--timelimit 1`: CPU time at the kill and the reason each tool gives.
The workloads also print their own `getrusage` (peak RSS, user + system time) as a third opinion.

runexec needs cgroups: on a hybrid host (v1 controllers) it runs with `--no-container` (its container
mode needs an overlay filesystem) inside a parent cgroup this bench makes in every v1 hierarchy below
its own v1 cgroup (`cgturn-bench-report-*`), into which only runexec's wrapper process moves itself.
That and cgturn's managed root `<own cgroup2>/cgturn-bench-*` are removed at the end, on errors and
on Ctrl-C/SIGTERM. benchexec is not a dependency of cgturn: install it into a virtualenv and pass its
runexec. Run as root:

    python3 -m venv /tmp/bx && /tmp/bx/bin/pip install benchexec
    python3 scripts/bench_report.py --runexec /tmp/bx/bin/runexec [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchlib import _remove_tree as remove_tree, bench_root, destroy  # noqa: E402

from cgturn import TurnManager  # noqa: E402

MiB = 2 ** 20
PY = sys.executable
RUSAGE = ("import json, resource, sys\nr = resource.getrusage(resource.RUSAGE_SELF)\n"
          "print(json.dumps({'rss': r.ru_maxrss * 1024, 'cpu': r.ru_utime + r.ru_stime}), file=sys.stderr)\n")
WORKLOADS = {
    "alloc": "data = b'\\1' * (150 * 2 ** 20)\n" + RUSAGE,
    "burn": "import time\nwhile time.process_time() < 1.0: pass\n" + RUSAGE,
    "cpu-limit": "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n",
}
V1_SKIP = ("name=systemd", "devices", "net_cls", "net_prio", "perf_event", "hugetlb", "rdma", "misc")


def v1_parents() -> dict[str, str]:
    """Fresh `cgturn-bench-report-*` directories below this process's own cgroup of each v1 hierarchy
    runexec uses, made here (cpuset gets its parent's cpus and mems, or it could hold no process)."""
    name = f"cgturn-bench-report-{uuid.uuid4().hex[:8]}"
    made: dict[str, str] = {}
    with open("/proc/self/cgroup", encoding="ascii") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in lines:
        if not controllers or controllers in V1_SKIP:
            continue
        mount = os.path.join("/sys/fs/cgroup", controllers)
        if not os.path.isdir(mount):
            mount = os.path.join("/sys/fs/cgroup", controllers.split(",")[0])
        if not os.path.isdir(mount):
            continue
        parent = os.path.join(mount, path.lstrip("/"))
        target = os.path.join(parent, name)
        os.mkdir(target)
        made[controllers] = target
        if "cpuset" in controllers.split(","):
            for file in ("cpuset.cpus", "cpuset.mems"):
                with open(os.path.join(parent, file)) as src, open(os.path.join(target, file), "w") as dst:
                    dst.write(src.read())
    return made


def remove_v1_parents(parents: dict[str, str]) -> None:
    """Remove the parents (runexec removed its own cgroups below them; the wrapper has exited)."""
    for path in parents.values():
        remove_tree(path)  # a v1 directory has no cgroup.kill: only its rmdir retries apply


def run_runexec(runexec: str, parents: dict[str, str], workload: str, out_dir: str) -> dict:
    """One runexec run of `workload`, its wrapper moved into the bench's v1 parents first."""
    joins = "; ".join(f"echo $$ > {os.path.join(p, 'cgroup.procs')}" for p in parents.values())
    limit = ["--timelimit", "1"] if workload == "cpu-limit" else []
    log = os.path.join(out_dir, "runexec.log")
    argv = ["sh", "-c", f'{joins}; exec "$@"', "sh", runexec, "--no-container", "--memlimit", "400MB",
            *limit, "--output", log, "--", PY, "-c", WORKLOADS[workload]]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    values = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    if "cputime" not in values:
        raise RuntimeError(f"runexec failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    with open(log, encoding="utf-8", errors="replace") as f:
        own = _own_figures(f.read())
    return {"cpu": float(values["cputime"].rstrip("s")), "peak": int(values["memory"].rstrip("B")),
            "wall": float(values["walltime"].rstrip("s")), "ended": values.get("terminationreason", "exited"),
            "own": own}


def run_cgturn(root: str, state_dir: str, workload: str) -> dict:
    """One `cgturn run --report -` of `workload`."""
    limit = ["--cpu-time", "1", "--grace", "0"] if workload == "cpu-limit" else []
    argv = [PY, "-m", "cgturn", "--root", root, "--state-dir", state_dir, "run", "--memory", "400M", *limit,
            "--report", "-", "--", PY, "-c", WORKLOADS[workload]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.join(HERE, ".."),
                                                                   os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    report = json.loads(out.stdout.splitlines()[-1])
    return {"cpu": report["cpu_seconds"], "peak": report["memory_peak_bytes"], "wall": report["wall_seconds"],
            "ended": report["ended"], "own": _own_figures(out.stderr)}


def _own_figures(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runexec", default=shutil.which("runexec"), help="benchexec's runexec (default: on PATH)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not args.runexec:
        print("needs benchexec's runexec: pip install benchexec (into a virtualenv), then --runexec PATH",
              file=sys.stderr)
        return 1
    version = subprocess.run([args.runexec, "--version"], capture_output=True, text=True).stdout.strip()
    base = bench_root()
    if base is None:
        return 1
    figures: dict[tuple[str, str], list[dict]] = {}
    parents: dict[str, str] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as state:
        os.mkdir(base)
        root = os.path.join(base, "main")
        mgr = TurnManager(root=root, backend="cgroup2", state_dir=state, sentinel=False)
        try:
            layout = mgr.limits_report()["layout"]
            parents = v1_parents()
            for i in range(args.rounds):
                for workload in WORKLOADS:
                    tools = [("cgturn", lambda w=workload: run_cgturn(root, state, w)),
                             ("runexec", lambda w=workload: run_runexec(args.runexec, parents, w, state))]
                    for tool, measure in (tools if i % 2 == 0 else tools[::-1]):
                        figures.setdefault((workload, tool), []).append(measure())
                print(f"  round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        except KeyboardInterrupt:
            print("interrupted: cleaning up", file=sys.stderr)
            return 130
        finally:
            try:
                destroy(base, mgr)
                mgr.close()
            finally:
                remove_v1_parents(parents)
    print(f"cgturn run --report against {version} on {os.uname().release}, {os.cpu_count()} CPUs, layout {layout}, "
          f"load {os.getloadavg()[0]:.1f}, medians of {args.rounds} rounds, total {time.monotonic() - started:.0f} s\n")
    print("| workload | figure | cgturn --report | runexec | cgturn / runexec | the process's own getrusage |")
    print("|---|---|---:|---:|---:|---:|")
    for workload in WORKLOADS:
        ours, theirs = figures[(workload, "cgturn")], figures[(workload, "runexec")]
        rows = [("CPU seconds", "cpu", lambda v: f"{v:.3f}", "cpu", lambda v: f"{v:.3f}")]
        if workload == "alloc":
            rows.append(("peak memory MiB", "peak", lambda v: f"{v / MiB:.1f}", "rss",
                         lambda v: f"{v / MiB:.1f} (RSS)"))
        for label, key, fmt, own_key, own_fmt in rows:
            a = statistics.median(r[key] for r in ours if r[key] is not None)
            b = statistics.median(r[key] for r in theirs)
            owns = [r["own"][own_key] for r in ours + theirs if r["own"]]
            own = own_fmt(statistics.median(owns)) if owns else "- (killed)"
            print(f"| {workload} | {label} | {fmt(a)} | {fmt(b)} | {a / b:.3f} | {own} |")
        if workload == "cpu-limit":
            print(f"| {workload} | how it ended | {', '.join(sorted({r['ended'] for r in ours}))} | "
                  f"{', '.join(sorted({r['ended'] for r in theirs}))} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
