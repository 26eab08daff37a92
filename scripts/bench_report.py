#!/usr/bin/env python3
"""How accurate `cgturn run --report` is: the same workloads under benchexec's `runexec` and under
`cgturn run --report`, alternating in one run, printed as one table.

Workloads (each the same argv under both, `python3 -I -c ...`: isolated from PYTHONPATH, which differs
between the two, so that both interpreters start alike):
- alloc: a Python process that allocates and touches 150 MiB, under a 400 MB memory limit (both tools
  then give the turn / run a memory cgroup): peak memory and CPU time;
- burn: a Python process that burns 1 s of its own CPU time and exits: CPU time;
- cpu-limit: a Python process that burns until killed, under `--cpu-time 1 --grace 0` against runexec's
  `--timelimit 1`: CPU time at the kill and the reason each tool gives.
The workloads also print their own `getrusage` (peak RSS, user + system time) as a third opinion.

runexec runs with `--no-container` (its container mode needs an overlay filesystem the hybrid
development host does not offer) and needs a cgroup of its own. On a hybrid host (v1 controllers) that
is a parent this bench makes in every v1 hierarchy below its own v1 cgroup (`cgturn-bench-report-*`),
into which only runexec's wrapper process moves itself. On a pure cgroup v2 host it is what benchexec's
documentation asks for there: a transient systemd scope with `Delegate=yes` (`systemd-run --scope`,
unit `cgturn-bench-report-*.scope`, gone when runexec exits). cgturn's managed root is
`<parent>/cgturn-bench-*` (`--parent`, default this process's own cgroup2; its parent must delegate
the memory controller, as the cgroup2 root does under systemd). Everything is removed at the end, on
errors and on Ctrl-C/SIGTERM. benchexec is not a dependency of cgturn: install it into a virtualenv
and pass its runexec. Run as root:

    python3 -m venv /tmp/bx && /tmp/bx/bin/pip install benchexec
    python3 scripts/bench_report.py --runexec /tmp/bx/bin/runexec [--rounds 3]
    # in the pure-v2 test host (docs/testhost.md): scripts/testhost/run.py --bench-report WHEEL
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
from typing import Callable

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


def workload_argv(workload: str) -> list[str]:
    """The workload's argv. `-I`: the interpreter ignores PYTHON* variables, so the PYTHONPATH each tool
    inherits (cgturn's CLI needs the checkout on it) adds no path to search at the workload's imports."""
    return [PY, "-I", "-c", WORKLOADS[workload]]


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


def runexec_place(parents: dict[str, str]) -> list[str]:
    """The argv prefix that gives runexec a cgroup of its own: the bench's v1 parents on a hybrid host
    (its wrapper writes itself into them, then execs runexec), or, with no v1 hierarchy (pure v2), a
    fresh systemd scope with `Delegate=yes`, in which runexec finds itself alone and makes its cgroups."""
    if parents:
        joins = "; ".join(f"echo $$ > {os.path.join(p, 'cgroup.procs')}" for p in parents.values())
        return ["sh", "-c", f'{joins}; exec "$@"', "sh"]
    return ["systemd-run", "--scope", "--quiet", "--collect", f"--unit=cgturn-bench-report-{uuid.uuid4().hex[:8]}",
            "-p", "Delegate=yes", "--"]


def run_runexec(runexec: str, parents: dict[str, str], workload: str, out_dir: str) -> dict:
    """One runexec run of `workload`, in the cgroup runexec_place gives it."""
    limit = ["--timelimit", "1"] if workload == "cpu-limit" else []
    log = os.path.join(out_dir, "runexec.log")
    argv = [*runexec_place(parents), runexec, "--no-container", "--memlimit", "400MB",
            *limit, "--output", log, "--", *workload_argv(workload)]
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
            "--report", "-", "--", *workload_argv(workload)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.join(HERE, ".."),
                                                                   os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    report = json.loads(out.stdout.splitlines()[-1])
    if report["ended"] == "not-started":
        raise RuntimeError(f"cgturn run did not start the workload ({report['exit_status']}): {report['error']}")
    return {"cpu": report["cpu_seconds"], "peak": report["memory_peak_bytes"], "wall": report["wall_seconds"],
            "ended": report["ended"], "own": _own_figures(out.stderr)}


def _spread(values: list[float], fmt: Callable[[float], str]) -> str:
    """`median (min-max)` of the rounds' values, `-` when there are none (the workload was killed)."""
    if not values:
        return "- (killed)"
    if len(values) == 1:
        return str(fmt(values[0]))
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


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
    ap.add_argument("--parent", help="cgroup2 directory to make cgturn's managed root in (default: this "
                    "process's own cgroup; in the test host /sys/fs/cgroup, whose memory controller systemd "
                    "delegates, where a service's own cgroup holds the service and delegates nothing)")
    args = ap.parse_args()
    if not args.runexec:
        print("needs benchexec's runexec: pip install benchexec (into a virtualenv), then --runexec PATH",
              file=sys.stderr)
        return 1
    version = subprocess.run([args.runexec, "--version"], capture_output=True, text=True).stdout.strip()
    base = bench_root(args.parent)
    if base is None:
        return 1
    figures: dict[tuple[str, str], list[dict]] = {}
    parents: dict[str, str] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as state:
        # cgturn makes the managed root itself: a directory the bench made would be one whose
        # cgroup.subtree_control cgturn never writes, so on v2 its turns would get no memory controller.
        mgr = TurnManager(root=base, backend="cgroup2", state_dir=state, sentinel=False)
        try:
            limits = mgr.limits_report()
            layout = limits["layout"]
            if layout is None:
                raise RuntimeError(f"no memory limit for cgturn's turns here: {'; '.join(limits['problems'])}")
            parents = v1_parents()
            for i in range(args.rounds):
                for workload in WORKLOADS:
                    tools = [("cgturn", lambda w=workload: run_cgturn(base, state, w)),
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
    place = "v1 parents" if parents else "a systemd scope with Delegate=yes"
    print(f"cgturn run --report against {version} on {os.uname().release}, {os.cpu_count()} CPUs, layout {layout}, "
          f"runexec in {place}, load {os.getloadavg()[0]:.1f}, medians of {args.rounds} rounds, "
          f"total {time.monotonic() - started:.0f} s\n")
    print("Each cell: the median, and the range over the rounds. The last two columns: the workload's own "
          "getrusage (user + system time; peak RSS) under each tool. 'Beyond the workload's own': each run's "
          "figure minus the workload's own getrusage in that run (what the workload did after its last look, "
          "its exit, and anything else the tool counts).\n")
    print("| workload | figure | cgturn --report | runexec | cgturn / runexec | own, under cgturn | own, under runexec |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for workload in WORKLOADS:
        ours, theirs = figures[(workload, "cgturn")], figures[(workload, "runexec")]
        rows = [("CPU seconds", "cpu", lambda v: f"{v:.3f}", "cpu", lambda v: f"{v:.3f}")]
        if workload == "alloc":
            rows.append(("peak memory MiB", "peak", lambda v: f"{v / MiB:.1f}", "rss", lambda v: f"{v / MiB:.1f}"))
        for label, key, fmt, own_key, own_fmt in rows:
            a = [r[key] for r in ours if r[key] is not None]
            b = [r[key] for r in theirs]
            owns = [_spread([r["own"][own_key] for r in runs if r["own"]], own_fmt) for runs in (ours, theirs)]
            print(f"| {workload} | {label} | {_spread(a, fmt)} | {_spread(b, fmt)} | "
                  f"{statistics.median(a) / statistics.median(b):.3f} | {owns[0]} | {owns[1]} |")
        if workload != "cpu-limit":
            # Paired within each run, so it does not move with how long the workload itself took.
            beyond = [_spread([r["cpu"] - r["own"]["cpu"] for r in runs if r["own"]], lambda v: f"{v:.3f}")
                      for runs in (ours, theirs)]
            print(f"| {workload} | CPU seconds beyond the workload's own | {beyond[0]} | {beyond[1]} | | | |")
        if workload == "cpu-limit":
            print(f"| {workload} | how it ended | {', '.join(sorted({r['ended'] for r in ours}))} | "
                  f"{', '.join(sorted({r['ended'] for r in theirs}))} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
