"""The pressure guard on io, for real: the development machine has no v2 io controller (its cgroup2 has
only hugetlb), so io pressure and "the io-heaviest turn by io.stat" are proved here.

The managed root is `<unit>/turns` of a transient service with `Delegate=yes`,
`DelegateSubgroup=supervisor` and `IOAccounting=yes` (systemd enables io on the unit's ancestors, so
the unit's cgroup has it); the test, as the delegatee, enables `+io` for the unit's children, and for
the managed root's and the task's (cgturn enables only the controllers its limits use). Every cgroup
written is the unit's or below it; stopping the unit at teardown kills whatever a test left.

The io hog is bounded: `dd` rewrites one 64 MiB file on the guest's disk (/var/tmp: /tmp is a tmpfs
on Debian 13) with O_DIRECT and O_DSYNC, for at most HOG_SECONDS.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

from cgturn import PressureGuard, TurnManager
from conftest import audit_records, cgturn_argv, wait_until
from hostlib import systemctl, systemd_host, unit_cgroup, unit_name  # noqa: F401

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host")]
PROPS = ("Delegate=yes", "DelegateSubgroup=supervisor", "IOAccounting=yes")
HOG_SECONDS = 60
HOG = ("end=$(( $(date +%s) + {secs} ))\n"
       "while [ $(date +%s) -lt $end ]; do\n"
       "  dd if=/dev/zero of={file} bs=1M count=64 oflag=direct,dsync conv=notrunc status=none\n"
       "done\n")
# 5 % of a 2 s window (the test host's root has no CAP_SYS_RESOURCE either: see docs/guard.md).
TRIGGER = "some 100000 2000000"
DEADLINE = 90  # software emulation: everything is slow


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def cli(root: str, state_dir: str, *args: str) -> str:
    return subprocess.run(cgturn_argv(root, state_dir, *args), capture_output=True, text=True, timeout=120,
                          check=True).stdout


def enable_io(cgroup: str) -> None:
    with open(f"{cgroup}/cgroup.subtree_control", "w") as f:
        f.write("+io")


@pytest.fixture
def io_unit():
    """A delegated transient service with io accounting; yields its cgroup directory with `+io`
    enabled for its children. Stopped at teardown."""
    name = unit_name("cgturn-test-guard")
    subprocess.run(["systemd-run", "--quiet", "--collect", f"--unit={name}", *(f"--property={p}" for p in PROPS),
                    "--", "sleep", "infinity"], check=True, capture_output=True, timeout=120)
    try:
        unit = unit_cgroup(f"{name}.service")
        assert "io" in read(f"{unit}/cgroup.controllers").split(), read(f"{unit}/cgroup.controllers")
        enable_io(unit)
        yield unit
    finally:
        systemctl("stop", f"{name}.service", check=False)


@pytest.fixture
def scratch():
    path = f"/var/tmp/cgturn-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(path)
    yield path
    shutil.rmtree(path)


def test_io_guard_freezes_the_io_heavy_turn_then_thaws_it(io_unit, scratch, tmp_path):
    # thaw_after outlasts the two CLI runs below (seconds each under emulation): they see it frozen.
    guard = PressureGuard(resource="io", trigger=TRIGGER, watch="root", thaw_after=15.0, abandon_after=600)
    root, state_dir = f"{io_unit}/turns", str(tmp_path / "state")
    with TurnManager(root=root, backend="cgroup2", state_dir=state_dir, guard=guard) as mgr:
        enable_io(root)  # the guard's watch="root" created it
        quiet = mgr.begin_turn("t", "quiet")
        task = os.path.dirname(mgr.backend.cgroup_dir(quiet.record))
        enable_io(task)
        assert os.path.exists(f"{mgr.backend.cgroup_dir(quiet.record)}/io.stat")
        quiet.spawn(["sleep", str(HOG_SECONDS)])
        before = read(f"{root}/io.pressure")
        hog = mgr.begin_turn("t", "hog")
        hog.spawn(["sh", "-c", HOG.format(secs=HOG_SECONDS, file=f"{scratch}/hog.bin")])
        hog_dir = mgr.backend.cgroup_dir(hog.record)
        started = time.monotonic()
        frozen = wait_until(lambda: hog.record.frozen_by == "guard", timeout=DEADLINE)
        figures = {"seconds": round(time.monotonic() - started, 1), "root io.pressure before": before,
                   "root io.pressure": read(f"{root}/io.pressure"), "hog io.pressure": read(f"{hog_dir}/io.pressure"),
                   "hog io.stat": read(f"{hog_dir}/io.stat")}
        print("figures:", json.dumps(figures, indent=1))
        assert frozen, figures
        assert quiet.record.frozen_by is None
        state = json.loads(cli(root, state_dir, "doctor", "--json"))["guard"]
        assert (state["active"], state["resource"], state["file"]) == (True, "io", f"{root}/io.pressure")
        rows = {r["turn"]: r for r in json.loads(cli(root, state_dir, "ps", "--json"))}
        assert (rows["hog"]["frozen"], rows["quiet"]["frozen"]) == (True, False)
        assert rows["hog"]["pressure"]["io"]["some_total_usec"] > 0, rows["hog"]["pressure"]
        assert wait_until(lambda: any(r.get("action") == "thaw" and r["reason"] == "guard"
                                      for r in audit_records(state_dir, "hog")), timeout=DEADLINE)
        assert hog.record.state == "running"
        hog.abandon("test-done", grace=0)
        quiet.abandon("test-done", grace=0)
