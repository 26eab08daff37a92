"""A sealed turn's limits on pure cgroup v2 with `nsdelegate` (the test host): the limit-lifting attack
of issue 21 (a user namespace, then cgroup hierarchies mounted at the turn's own cgroup) against v2
`memory.max` and `pids.max`, which the development machine cannot test (its limits are v1), on the
chain a root caller takes on Linux 6.12: clone3 into the turn with the C extension's own sandbox
(scripts/testhost/run.py copies the host's build in: the guest has no compiler). Without that build
the test fails, not skips: it would prove bubblewrap's chain only. tests/test_seal_attacks.py, in the
same stage, runs every attack on all three chains here.

The managed root is `<unit>/turns` of a delegated transient service, as in test_testhost_limits.py.
The one mount call the attack makes runs only after the test checked that the attacker's mount
namespace is not PID 1's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cgturn import Limits, testing
from conftest import wait_until
from hostlib import GUEST_STATE, systemd_host  # noqa: F401 - the fixture
from test_seal_attacks import ATTACK
from test_testhost_limits import FORKER, MiB, read, turn_dir, unit_manager  # noqa: F401 - the fixture

pytestmark = [pytest.mark.testhost, pytest.mark.usefixtures("systemd_host"), GUEST_STATE]

# Opens each path for writing (no O_TRUNC, nothing written: the open is the check) and prints the errno
# names as JSON. Where the host's cgroup2 mount is writable (an unsealed root turn) the turn's own
# limit files open, and `echo max >` them lifts the limits: the seal's read-only mount is what stops it.
OPEN_FOR_WRITING = ("import errno, json, os, sys\nout = {}\n"
                    "for path in sys.argv[1:]:\n"
                    "    try:\n        os.close(os.open(path, os.O_WRONLY)); out[path] = 'ok'\n"
                    "    except OSError as err:\n        out[path] = errno.errorcode[err.errno]\n"
                    "print(json.dumps(out))\n")


def attacker_pid(turn) -> int:
    """The host pid of the sealed attacker (the sandbox's init, and bubblewrap where it builds the
    sandbox, are members of the turn too)."""
    found: list[int] = []

    def look() -> bool:
        for pid in turn.pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[0].decode() == sys.executable:
                        found.append(pid)
                        return True
            except OSError:
                continue
        return False

    assert wait_until(look, timeout=60)
    return found[0]


def test_a_sealed_root_process_cannot_lift_v2_memory_max_or_pids_max(unit_manager, tmp_path):
    mgr = unit_manager
    assert testing.spawn_path_unavailable(testing.CLONE3) is None, (
        "no cgturn._spawn in the guest: build it on the host (pip install -e . or python3 setup.py "
        "build_ext --inplace); scripts/testhost/run.py copies it in")
    assert testing.native_seal_works()
    turn = mgr.begin_turn("seal", "t1", seal=True, limits=Limits(memory_max=64 * MiB, pids_max=64))
    cg = turn_dir(mgr, turn)
    assert (read(cg, "memory.max"), read(cg, "pids.max")) == (str(64 * MiB), "64")
    proc = turn.spawn([sys.executable, "-c", ATTACK, "limits"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      text=True, cwd=str(tmp_path))
    mgr.test_procs.append(proc)
    attacker = attacker_pid(turn)
    # the extension's sandbox: its init (not bubblewrap) is what Popen holds. Waited for, as
    # tests/test_seal_native.py does: the kernel releases the vfork caller just before it gives the
    # exec'ing init its new memory (fs/exec.c exec_mmap), and until then /proc/PID/cmdline reads the
    # caller's; a CI run under emulation once read it after spawn() had returned (cgturn/_spawn.c)
    assert wait_until(lambda: open(f"/proc/{proc.pid}/cmdline", "rb").read() == b"cgturn-init\0")
    assert os.readlink(f"/proc/{attacker}/ns/mnt") != os.readlink("/proc/1/ns/mnt")  # before any mount call
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"userns": "EPERM"}
    assert (read(cg, "memory.max"), read(cg, "pids.max")) == (str(64 * MiB), "64")
    # nor through the host's cgroup2 mount, which the sandbox keeps (read-only) at the same path
    limit_files = [f"{cg}/memory.max", f"{cg}/pids.max"]
    direct = turn.spawn([sys.executable, "-c", OPEN_FOR_WRITING, *limit_files], stdout=subprocess.PIPE, text=True,
                        cwd=str(tmp_path))
    mgr.test_procs.append(direct)
    assert json.loads(direct.communicate(timeout=120)[0]) == {path: "EROFS" for path in limit_files}
    # and the limits hold: 256 MiB in the sealed turn is an OOM kill (the whole turn, v2's default)...
    hog = turn.spawn([sys.executable, "-c", "b = [b'x' * (1 << 20) for _ in range(256)]; print('allocated')"],
                     stdout=subprocess.PIPE, text=True, cwd=str(tmp_path))
    mgr.test_procs.append(hog)
    out = hog.communicate(timeout=180)[0]
    assert "allocated" not in out and hog.returncode in (-9, 137)
    assert turn.usage().oom_kills >= 1
    # ...and of 80 forks in the same (now empty) turn, those past pids.max 64 fail with EAGAIN
    forker = turn.spawn([sys.executable, "-c", FORKER, "80"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        text=True, cwd=str(tmp_path))
    mgr.test_procs.append(forker)
    result = json.loads(forker.stdout.readline())
    assert result["failed"] > 0 and result["forked"] + result["failed"] == 80
    assert result["forked"] < 64 and int(read(cg, "pids.current")) <= 64   # the init and the forker count too
    assert turn.usage().pids_max_hits >= result["failed"]
    turn.abandon("test", grace=0)
