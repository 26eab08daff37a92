"""The registry fallback, for real: run where cgroup v2 is hidden and report, as JSON, who died.

Run by tests/test_registry.py inside `unshare --mount` with a tmpfs over /sys/fs/cgroup, itself inside
a cgroup2 turn of the test (so anything this scenario fails to kill is still killed by the outer turn).

Usage: registry_scenario.py STATE_DIR TMPDIR
Prints one JSON object: backend, problems, escapers {name: {pids, members, dead}}, bystander_alive.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import escapers as esc  # noqa: E402
from cgturn import TurnManager, discover_host  # noqa: E402
from conftest import alive, wait_until  # noqa: E402 - the suite's helpers


def main(state_dir: str, tmpdir: str) -> int:
    bystander = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
    recipes = esc.recipes(tmpdir)
    report = {"escapers": {}}
    try:
        with TurnManager(backend="auto", state_dir=state_dir) as mgr:
            report["backend"] = mgr.backend.name
            report["problems"] = discover_host().problems
            turn = mgr.begin_turn("scenario", "t1")
            launched = {name: esc.launch(turn, r) for name, r in recipes.items()}
            members = set(turn.pids())
            result = turn.abandon("scenario", grace=0.2)
            for name, pids in launched.items():
                wait_until(lambda pids=pids: not any(alive(p) for p in pids), 3.0)
                report["escapers"][name] = {"pids": pids, "members": sorted(set(pids) & members),
                                            "dead": bool(pids) and not any(alive(p) for p in pids)}
            report["killed"] = result.killed
            report["bystander_alive"] = bystander.poll() is None
    finally:
        for r in recipes.values():
            esc.destroy(r)
        bystander.kill()
        bystander.wait()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
