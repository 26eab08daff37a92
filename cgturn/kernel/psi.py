"""PSI (pressure stall information, 4.20+): read a pressure file, and arm a kernel trigger on one.

A trigger is `some|full <stall us> <window us>` written to an fd opened O_RDWR|O_NONBLOCK on
`<cgroup>/{cpu,memory,io}.pressure` or `/proc/pressure/{cpu,memory,io}`; the kernel then wakes
poll(POLLPRI) on that fd when the stall time within a moving window crosses the threshold (at most
once per window), and POLLERR when the cgroup is removed. Closing the fd disarms it. One trigger per
open file (a second write on the same fd: EBUSY). See the kernel's Documentation/accounting/psi.rst.

The kernel's rules (kernel/sched/psi.c, psi_trigger_create), checked here before anything is written so
bad input is a ValueError naming the rule instead of a bare EINVAL:
- the window is 500 ms to 10 s;
- the threshold is > 0 and at most the window;
- a writer without CAP_SYS_RESOURCE may only use windows that are multiples of 2 s (6.5+: such
  triggers ride on the 2 s averaging work instead of an RT poll thread).
/proc/pressure/* drops the last byte written (psi_write copies nbytes and NUL-terminates in place),
so the trigger is written with a trailing NUL, as the kernel's documentation does.
"""
from __future__ import annotations

import errno
import os
import re
import select
from dataclasses import dataclass

RESOURCES = ("memory", "cpu", "io")
KINDS = ("some", "full")
WINDOW_MIN_US = 500_000
WINDOW_MAX_US = 10_000_000
UNPRIVILEGED_WINDOW_STEP_US = 2_000_000   # 6.5+ (commit "sched/psi: Allow unprivileged polling of N*2s period")
UNPRIVILEGED_SINCE = (6, 5)
PROC_PRESSURE = "/proc/pressure"
CAP_SYS_RESOURCE = 24


@dataclass(frozen=True, slots=True)
class Trigger:
    """A parsed PSI trigger: `kind` "some"|"full", stall threshold and window in microseconds."""

    kind: str
    stall_us: int
    window_us: int

    def __str__(self) -> str:
        return f"{self.kind} {self.stall_us} {self.window_us}"


def parse_trigger(text: str) -> Trigger:
    """`some|full <stall us> <window us>` -> Trigger, checked against the kernel's privilege-free rules.

    Raises:
        ValueError: not three fields, an unknown kind, a number that is not a decimal integer, a
            window outside 500 ms-10 s, or a threshold of 0 or above the window (message names the rule).
    """
    if not isinstance(text, str):
        raise ValueError(f"PSI trigger must be a string, not {type(text).__name__}")
    fields = text.split()
    if len(fields) != 3:
        raise ValueError(f"PSI trigger {text!r}: expected 'some|full <stall us> <window us>'")
    kind, stall, window = fields
    if kind not in KINDS:
        raise ValueError(f"PSI trigger {text!r}: the kind must be 'some' or 'full', not {kind!r}")
    if not (stall.isdecimal() and window.isdecimal() and stall.isascii() and window.isascii()):
        raise ValueError(f"PSI trigger {text!r}: stall and window are whole microseconds")
    trig = Trigger(kind, int(stall), int(window))
    if not WINDOW_MIN_US <= trig.window_us <= WINDOW_MAX_US:
        raise ValueError(f"PSI trigger {text!r}: the kernel accepts windows of 500000-10000000 us "
                         f"(500 ms to 10 s), not {trig.window_us}")
    if not 0 < trig.stall_us <= trig.window_us:
        raise ValueError(f"PSI trigger {text!r}: the stall threshold must be > 0 and at most the window "
                         f"({trig.window_us} us), not {trig.stall_us}")
    return trig


def check_privilege(trig: Trigger, privileged: bool, kernel: tuple[int, int]) -> None:
    """Raise ValueError when a writer with this privilege (CAP_SYS_RESOURCE) may not arm `trig` on
    kernel `kernel` (major, minor). Before 6.5 the kernel let only privileged writers arm any trigger;
    from 6.5 others may arm windows that are multiples of 2 s."""
    if privileged:
        return
    if kernel < UNPRIVILEGED_SINCE:
        raise ValueError(f"PSI trigger '{trig}': arming a trigger needs CAP_SYS_RESOURCE before Linux 6.5 "
                         f"(this is {kernel[0]}.{kernel[1]})")
    if trig.window_us % UNPRIVILEGED_WINDOW_STEP_US:
        raise ValueError(f"PSI trigger '{trig}': without CAP_SYS_RESOURCE the kernel accepts only windows "
                         f"that are multiples of 2 s (2000000 us), not {trig.window_us}")


def parse_kernel_release(release: str) -> tuple[int, int]:
    """`6.18.44-foo` -> (6, 18); (0, 0) when it cannot be read."""
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def parse_cap_eff(status_text: str) -> int:
    """The CapEff mask of a /proc/PID/status text (0 when absent)."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def privileged() -> bool:
    """True if this process has CAP_SYS_RESOURCE in its effective set (what psi_write checks on the
    opener's credentials)."""
    try:
        with open("/proc/self/status") as f:
            return bool(parse_cap_eff(f.read()) >> CAP_SYS_RESOURCE & 1)
    except OSError:
        return False


def kernel_version() -> tuple[int, int]:
    return parse_kernel_release(os.uname().release)


def validate_trigger(text: str) -> Trigger:
    """parse_trigger, then the privilege rule for this process on this kernel. Raises ValueError."""
    trig = parse_trigger(text)
    check_privilege(trig, privileged(), kernel_version())
    return trig


def pressure_file(resource: str, cgroup_dir: str | None) -> str:
    """`<cgroup_dir>/<resource>.pressure`, or `/proc/pressure/<resource>` (the host) for None."""
    if resource not in RESOURCES:
        raise ValueError(f"unknown PSI resource {resource!r} (expected one of {', '.join(RESOURCES)})")
    if cgroup_dir is None:
        return f"{PROC_PRESSURE}/{resource}"
    return os.path.join(cgroup_dir, f"{resource}.pressure")


def stall_total(text: str, kind: str) -> int | None:
    """The `total=` stall microseconds of the `kind` line of a pressure file's text."""
    for line in text.splitlines():
        if line.startswith(kind + " "):
            _, sep, rest = line.rpartition("total=")
            if sep and rest.strip().isdigit():
                return int(rest.strip())
    return None


class ArmedTrigger:
    """One armed PSI trigger: an open fd the kernel wakes with POLLPRI. Also reads the same file's
    stall total into a preallocated buffer (no allocation for the read itself).

    Args:
        path: the pressure file.
        trigger: what to arm.

    Raises:
        FileNotFoundError: no such pressure file (no PSI here: CONFIG_PSI, `psi=0`, or no such cgroup).
        PermissionError: the file cannot be opened for writing.
        OSError: the kernel refused the trigger (EINVAL: see the rules above; EOPNOTSUPP: PSI disabled).
    """

    def __init__(self, path: str, trigger: Trigger):
        self.path = path
        self.trigger = trigger
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.write(self.fd, str(trigger).encode() + b"\0")
        except OSError:
            os.close(self.fd)
            raise
        self._poller = select.poll()
        self._poller.register(self.fd, select.POLLPRI)
        self._buf = bytearray(256)

    def wait(self, timeout: float | None) -> int:
        """Block until the kernel signals or `timeout` s pass. Returns the revents (0: timed out).
        POLLPRI: the threshold was crossed; POLLERR: the watched cgroup is gone."""
        for _fd, revents in self._poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
            return revents
        return 0

    def total_us(self) -> int | None:
        """The stall total of the trigger's kind (one pread into the preallocated buffer); None when
        the watched cgroup is gone."""
        try:
            n = os.preadv(self.fd, [self._buf], 0)
        except OSError as err:
            if err.errno in (errno.ENODEV, errno.ENOENT):
                return None
            raise
        return stall_total(self._buf[:n].decode("ascii", "replace"), self.trigger.kind)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "ArmedTrigger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
