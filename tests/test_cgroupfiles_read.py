"""`cgroupfiles.read_text` reads a cgroup file whole with one read(2) when the first is short, and
loops when it is not: what it returns is what a plain buffered read of the same file returns, for a
cgroup holding one process and for one whose cgroup.procs is longer than that first read's threshold
(and than a page). Real cgroups, real processes; every process is killed with its test cgroup.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from cgturn.kernel import cgroupfiles
from conftest import wait_until

SHIM = 'echo $$ > "$0" || exit 125; exec "$@"'


@pytest.fixture
def test_cgroup(cgroup2_root):
    """The test's own cgroup (conftest's cgroup2_root, made here; its teardown kills and removes it)."""
    os.mkdir(cgroup2_root)
    return cgroup2_root


def _procs(path: str) -> str:
    with open(os.path.join(path, "cgroup.procs"), encoding="ascii") as f:
        return f.read()


@pytest.mark.parametrize("count", [1, 1000])  # 1000 pids of 4+ digits: past a page of the kernel's buffer
def test_read_text_is_the_whole_file(test_cgroup, count):
    procs = os.path.join(test_cgroup, "cgroup.procs")
    tree = ["sleep", "120"] if count == 1 else \
        ["sh", "-c", f"i=1; while [ $i -lt {count} ]; do sleep 120 & i=$((i+1)); done; wait"]
    shim = subprocess.Popen(["/bin/sh", "-c", SHIM, procs, *tree])
    try:
        assert wait_until(lambda: len(_procs(test_cgroup).split()) == count, timeout=60)
        expected = _procs(test_cgroup)
        assert count == 1 or len(expected) > 4096
        assert cgroupfiles.read_text(procs) == expected
        dir_fd = os.open(test_cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert sorted(cgroupfiles.read_procs(".", dir_fd=dir_fd)) == sorted(map(int, expected.split()))
        finally:
            os.close(dir_fd)
        # Files printed by one show (their values move between two reads; their keys do not).
        for name in ("cgroup.stat", "cpu.stat", "cgroup.events"):
            with open(os.path.join(test_cgroup, name), encoding="ascii") as f:
                keys = [line.split()[0] for line in f.read().splitlines()]
            assert [line.split()[0] for line in cgroupfiles.read_text(os.path.join(test_cgroup, name)).splitlines()] == keys
    finally:
        with open(os.path.join(test_cgroup, "cgroup.kill"), "w") as f:
            f.write("1")
        shim.wait(timeout=60)


def test_an_xattr_read_says_none_where_nothing_is_set_and_the_value_where_it_is(test_cgroup):
    """`Cgroup.get_xattr` (libc.getxattr underneath: no exception made for an absent value,
    what most reads of a task's or the root's limits find) against os.getxattr on the same directory."""
    from cgturn.kernel.cgroupfs import Cgroup

    cg = Cgroup(test_cgroup)
    assert cg.get_xattr("user.cgturn.test") is None  # ENODATA
    assert Cgroup(os.path.join(test_cgroup, "gone")).get_xattr("user.cgturn.test") is None  # ENOENT
    for value in (b"small", b"x" * (cgroupfiles.XATTR_READ_SIZE + 1)):  # one read; ERANGE, then os's
        os.setxattr(test_cgroup, "user.cgturn.test", value)
        assert cg.get_xattr("user.cgturn.test") == value == os.getxattr(test_cgroup, "user.cgturn.test")
    with pytest.raises(OSError):  # any other errno still raises: a name the kernel refuses
        cg.get_xattr("nonamespace.cgturn")
