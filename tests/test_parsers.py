"""Parsers of kernel files: table-driven, from text, no kernel needed."""
import pytest

from cgturn.kernel import parsers


@pytest.mark.parametrize("text, expected", [
    ("populated 1\nfrozen 0\n", {"populated": 1, "frozen": 0}),
    ("populated 0\n", {"populated": 0}),
    ("", {}),
    ("garbage\npopulated x\nfrozen 1\n", {"frozen": 1}),
])
def test_parse_cgroup_events(text, expected):
    assert parsers.parse_cgroup_events(text) == expected


def test_parse_cpu_stat():
    text = "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 0\n"
    assert parsers.parse_cpu_stat(text)["usage_usec"] == 1500


@pytest.mark.parametrize("text, expected", [("1\n22\n333\n", [1, 22, 333]), ("", []), ("\n", [])])
def test_parse_cgroup_procs(text, expected):
    assert parsers.parse_cgroup_procs(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("0::/\n", "/"),
    ("12:memory:/x\n0::/a/b\n", "/a/b"),
    ("4:memory:/only-v1\n", None),
    ("0::/gone (deleted)\n", "/gone (deleted)"),
])
def test_parse_proc_cgroup(text, expected):
    assert parsers.parse_proc_cgroup(text) == expected


def test_parse_mountinfo_cgroup_points_lists_every_cgroup_filesystem():
    text = (
        "47 46 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "48 47 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        "50 47 0:31 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n"
        "51 47 0:32 / /sys/fs/cgroup/unified rw shared:9 - cgroup2 cgroup2 rw\n"
        "52 23 0:32 /sub /mnt/with\\040space rw - cgroup2 cgroup2 rw\n"
        "53 23 0:5 / /proc rw - proc proc rw\n"
        "malformed line\n"
    )
    assert parsers.parse_mountinfo_cgroup_points(text) == [
        "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/mnt/with space"]


def test_parse_mountinfo_cgroup2():
    text = (
        "24 1 0:22 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw\n"
        "30 24 0:26 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw\n"
        "31 24 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
        "40 1 0:30 /sub /mnt/with\\040space rw - cgroup2 none rw\n"
    )
    assert parsers.parse_mountinfo_cgroup2(text) == [("/sys/fs/cgroup/unified", "/"), ("/mnt/with space", "/sub")]


@pytest.mark.parametrize("comm", ["sleep", "a b", "x) (y", "))"])
def test_parse_proc_stat_handles_hostile_command_names(comm):
    fields = ["S", "42"] + ["0"] * 17 + ["123456"] + ["0"] * 10
    text = f"1234 ({comm}) " + " ".join(fields) + "\n"
    assert parsers.parse_proc_stat(text) == ("S", 42, 123456)


def test_parse_environ():
    data = b"A=1\0B=x=y\0EMPTY=\0junk\0\xff=\xfe\0"
    env = parsers.parse_environ(data)
    assert env["A"] == "1" and env["B"] == "x=y" and env["EMPTY"] == ""
    assert "junk" not in env
