"""Pure parsers for kernel files, each named after the file it parses. They take text, never a path."""
from __future__ import annotations

import re


def parse_flat_keyed(text: str) -> dict[str, int]:
    """Parse a flat-keyed cgroup file (`key value` per line), e.g. cgroup.events or cpu.stat.

    Lines that do not have exactly two fields with an integer value are skipped.
    """
    out: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2:
            try:
                out[fields[0]] = int(fields[1])
            except ValueError:
                continue
    return out


def parse_cgroup_events(text: str) -> dict[str, int]:
    """cgroup.events: `populated 0|1` and `frozen 0|1`."""
    return parse_flat_keyed(text)


def parse_cpu_stat(text: str) -> dict[str, int]:
    """cpu.stat: `usage_usec`, `user_usec`, `system_usec`, ... (microseconds)."""
    return parse_flat_keyed(text)


def parse_cpu_usage_usec(text: str) -> int | None:
    """cpu.stat's `usage_usec` alone (its first line), without parsing the rest; None if absent."""
    if text.startswith("usage_usec "):
        value = text[11:text.find("\n")] if "\n" in text else text[11:]
        if value.isdigit():
            return int(value)
    return parse_cpu_stat(text).get("usage_usec")


def parse_cgroup_procs(text: str) -> list[int]:
    """cgroup.procs / cgroup.threads: one decimal id per line."""
    return [int(line) for line in text.split() if line.isdigit()]


def parse_controllers(text: str) -> list[str]:
    """cgroup.controllers / cgroup.subtree_control: space-separated controller names."""
    return text.split()


def parse_proc_cgroup(text: str) -> str | None:
    """/proc/PID/cgroup: the cgroup v2 path (the `0::<path>` line), or None when there is none.

    A path ending in ` (deleted)` or starting with `/..` (outside our cgroup namespace) is returned
    as-is; callers decide what it means.
    """
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def parse_mountinfo_cgroup2(text: str) -> list[tuple[str, str]]:
    """/proc/self/mountinfo: (mount point, root within the filesystem) of every cgroup2 mount.

    Format (proc(5)): `id parent major:minor root mountpoint options [optional...] - fstype source sopts`.
    Octal escapes (`\\040` for space) in paths are decoded.
    """
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        if right.split(" ", 1)[0] != "cgroup2":
            continue
        fields = left.split()
        if len(fields) >= 5:
            mounts.append((_unescape(fields[4]), _unescape(fields[3])))
    return mounts


def parse_mountinfo_cgroup_points(text: str) -> list[str]:
    """/proc/self/mountinfo: the mount point of every cgroup filesystem (cgroup2 and every v1
    hierarchy, named ones and sub-directory mounts included), in mount order."""
    points = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and right.split(" ", 1)[0] in ("cgroup", "cgroup2") and len(fields) >= 5:
            points.append(_unescape(fields[4]))
    return points


def _unescape(path: str) -> str:
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1:i + 4].isdigit() and len(path[i + 1:i + 4]) == 3:
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def parse_proc_stat(text: str) -> tuple[str, int, int]:
    """/proc/PID/stat: (state, ppid, starttime). starttime is field 22, clock ticks since boot.

    The command name (field 2) is in parentheses and may itself contain spaces and ')', so fields are
    counted from the last ')'.
    """
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    return rest[0], int(rest[1]), int(rest[19])


def parse_environ(data: bytes) -> dict[str, str]:
    """/proc/PID/environ: NUL-separated KEY=VALUE entries (bytes; undecodable bytes are replaced)."""
    env = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


_NOT_CONTROLLERS = frozenset({"rw", "ro", "clone_children", "noprefix", "xattr", "cpuset_v2_mode", "favordynmods"})


def parse_mountinfo_cgroup1(text: str) -> list[tuple[str, list[str]]]:
    """/proc/self/mountinfo: (mount point, controllers) of every cgroup v1 hierarchy mounted at its
    root. Named hierarchies (`name=systemd`) carry no controller and are left out, and so are mounts
    of a sub-directory of a hierarchy (a container's view), whose paths /proc/PID/cgroup does not give.
    """
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        parts = right.split()
        if len(parts) < 3 or parts[0] != "cgroup":
            continue
        fields = left.split()
        if len(fields) < 5 or fields[3] != "/":
            continue
        controllers = [opt for opt in parts[2].split(",") if opt not in _NOT_CONTROLLERS and "=" not in opt]
        if controllers:
            out.append((_unescape(fields[4]), controllers))
    return out


def parse_proc_cgroup_v1(text: str) -> dict[str, str]:
    """/proc/PID/cgroup: controller -> path for every v1 hierarchy line (`N:cpu,cpuacct:/path`)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not number.isdigit() or number == "0" or not controllers:
            continue
        for controller in controllers.split(","):
            if "=" not in controller:
                out[controller] = path
    return out


def parse_pressure(text: str) -> dict[str, dict[str, float]]:
    """cpu.pressure / memory.pressure / io.pressure (PSI, 4.20+): `some|full avg10=.. avg60=..
    avg300=.. total=..` per line -> {"some": {"avg10": 1.5, ..., "total": 123}, "full": {...}}.
    avg* are percentages as the kernel prints them; total is stall time in microseconds."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "some" or kind == "full":
            out[kind] = {key: int(value) if key == "total" else float(value)
                         for key, value in _PSI_PAIR.findall(rest) if key != "total" or value.isdigit()}
    return out


_PSI_PAIR = re.compile(r"(\w+)=(\d+(?:\.\d+)?)(?!\S)")  # key=number; another value is skipped
# Both lines as the kernel prints them (kernel/sched/psi.c, psi_show: "%s avg10=%lu.%02lu avg60=%lu.%02lu
# avg300=%lu.%02lu total=%llu\n"), numbers as _PSI_PAIR takes them: what parse_pressure would make of it.
_PSI_LINE = r" avg10=(\d+(?:\.\d+)?) avg60=(\d+(?:\.\d+)?) avg300=(\d+(?:\.\d+)?) total=(\d+)\n"
_PSI_FILE = re.compile("some" + _PSI_LINE + "full" + _PSI_LINE)


def parse_pressure_figures(text: str) -> dict[str, float | None] | None:
    """A PSI file as `ps` shows it: {some_avg10, full_avg10, some_total_usec, full_total_usec} from
    `parse_pressure` (a figure it lacks, or a `full` line it lacks, as None; cpu has none before
    5.13); None without a `some` line."""
    both = _PSI_FILE.fullmatch(text)
    if both is not None:  # the usual file (three per turn in `ps`): only the four figures converted
        return {"some_avg10": float(both[1]), "full_avg10": float(both[5]), "some_total_usec": int(both[4]),
                "full_total_usec": int(both[8])}
    parsed = parse_pressure(text)
    some, full = parsed.get("some"), parsed.get("full")
    if some is None:
        return None
    return {"some_avg10": some.get("avg10"), "full_avg10": None if full is None else full.get("avg10"),
            "some_total_usec": some.get("total"), "full_total_usec": None if full is None else full.get("total")}


def parse_io_stat_bytes(text: str) -> int:
    """io.stat (`MAJ:MIN rbytes=.. wbytes=.. rios=..` per device) -> rbytes + wbytes over all devices."""
    total = 0
    for line in text.splitlines():
        for item in line.split()[1:]:
            key, _, value = item.partition("=")
            if key in ("rbytes", "wbytes") and value.isdigit():
                total += int(value)
    return total
