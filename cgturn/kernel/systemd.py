"""The systemd service manager of the caller's user, over D-Bus: a transient scope with Delegate=yes.

An unprivileged user logged in over SSH sits in `session-N.scope`, a cgroup owned by root: nothing
below it is theirs to create, and moving a process between two cgroups needs write access to their
common ancestor (cgroup-v2.rst, "Delegation Containment"). systemd offers the way out that container
tools take (what `systemd-run --user --scope -p Delegate=yes` does): ask the user's own manager for a
transient scope with `Delegate=yes` holding the caller (a scope needs a process when it is made, and
goes when it is empty). The user manager moves the caller, asking the system manager for help when
the move crosses a root-owned cgroup (systemd >= 238, `AttachProcessesToUnit`), and hands the scope's
subtree to the user: its `cgroup.subtree_control` and everything below are theirs to write
(systemd's docs/CGROUP_DELEGATION.md).

This module knows the bus and the manager's methods, nothing of turns. The D-Bus client is jeepney
(pure Python); it is imported only when a manager is really asked something, so commands that never
need one (a root caller, a writable cgroup) never load it. Errors are `CgroupUnavailable` with the
manager's own error name and text.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import CgroupUnavailable

SCOPE_UNIT = "cgturn.scope"       # the well-known unit: one per service manager, i.e. per user
OWNERS_LEAF = "owners"            # the scope's leaf that holds the processes that own turns
USER_SLICE = "app.slice"          # where a user manager keeps applications (systemd.special(7))
SYSTEM_SLICE = "system.slice"
# systemd marks a delegated cgroup with both xattrs (src/core/cgroup.c, cgroup_delegate_xattr_apply,
# systemd >= 251 for user.*): trusted.* only root can read, user.* anyone.
DELEGATE_XATTRS = ("user.delegate", "trusted.delegate")
SYSTEMD_RUNTIME = "/run/systemd/system"   # exists iff systemd is the init (sd_booted(3))
SYSTEM_BUS = "/run/dbus/system_bus_socket"
JOB_WAIT = 30.0                   # seconds for systemd to carry out the scope's start job

_BUS_NAME = "org.freedesktop.systemd1"
_PATH = "/org/freedesktop/systemd1"
_MANAGER = "org.freedesktop.systemd1.Manager"
_UNIT = "org.freedesktop.systemd1.Unit"
_SCOPE = "org.freedesktop.systemd1.Scope"
_NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"
_UNIT_EXISTS = "org.freedesktop.systemd1.UnitExists"


@dataclass(frozen=True)
class ManagerAddress:
    """Where the caller's service manager listens: `kind` "user" (its own manager) or "system"."""

    kind: str
    socket: str

    @property
    def slice(self) -> str:
        return USER_SLICE if self.kind == "user" else SYSTEM_SLICE


def systemd_booted() -> bool:
    """Whether systemd is this host's init, as sd_booted(3) decides it (its runtime directory)."""
    return os.path.isdir(SYSTEMD_RUNTIME)


def manager_address(uid: int, env: dict[str, str]) -> tuple[ManagerAddress | None, str]:
    """The caller's service manager, and why there is none when it is None.

    Root asks the system manager (on the system bus); any other user its own manager, on the user
    bus at `$XDG_RUNTIME_DIR/bus` (dbus-user-session), else `/run/user/UID/bus` (a job started
    outside a login session, such as cron, has no XDG_RUNTIME_DIR; the manager runs there only while
    the user is logged in or lingers). The socket must be the caller's own (or root's, for the
    system bus): another user's socket is never spoken to.

    Args:
        uid: the caller's effective uid.
        env: the caller's environment.

    Returns:
        (address or None, the reason when None).
    """
    if not systemd_booted():
        return None, "systemd is not the init here (no /run/systemd/system)"
    if uid == 0:
        candidates, owner = [SYSTEM_BUS], 0
    else:
        runtime = env.get("XDG_RUNTIME_DIR") or ""
        candidates = [os.path.join(runtime, "bus")] if runtime else []
        candidates.append(f"/run/user/{uid}/bus")
        owner = uid
    for path in dict.fromkeys(candidates):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if _is_socket(st.st_mode) and st.st_uid == owner:
            return ManagerAddress("system" if uid == 0 else "user", path), ""
    if uid == 0:
        return None, f"no system bus socket at {SYSTEM_BUS}"
    return None, (f"no systemd user manager is reachable for uid {uid} (no bus socket at "
                  f"{' or '.join(dict.fromkeys(candidates))}: not logged in, and no linger?)")


def _is_socket(mode: int) -> bool:
    import stat

    return stat.S_ISSOCK(mode)


def parse_delegate_mark(value: bytes | None) -> bool | None:
    """systemd's delegation xattr value: True ("1"), False (any other value), None (absent)."""
    if value is None:
        return None
    return value.strip(b"\0 \n") in (b"1", b"yes", b"true")


def delegation_mark(path: str) -> bool | None:
    """Whether systemd marked the cgroup at `path` as delegated (`user.delegate` or
    `trusted.delegate` = 1); None when neither can be read (absent, or trusted.* refused to a user)."""
    seen: bool | None = None
    for name in DELEGATE_XATTRS:
        try:
            mark = parse_delegate_mark(os.getxattr(path, name))
        except OSError:
            continue
        if mark:
            return True
        seen = False if mark is False else seen
    return seen


class Manager:
    """One connection to a systemd service manager (`close()` it). Raises CgroupUnavailable when
    jeepney is missing or the bus refuses the connection."""

    def __init__(self, address: ManagerAddress, timeout: float = 5.0):
        self.address = address
        self.timeout = timeout
        try:
            from jeepney import DBusAddress
            from jeepney.auth import AuthenticationError
            from jeepney.io.blocking import open_dbus_connection
        except ImportError as err:
            raise CgroupUnavailable("the D-Bus client jeepney is not installed (pip install jeepney; "
                                    "Debian: python3-jeepney): cannot ask systemd for a delegated scope") from err
        try:
            self._conn = open_dbus_connection(bus=f"unix:path={address.socket}", auth_timeout=timeout)
        except (OSError, TimeoutError, ValueError, AuthenticationError) as err:
            raise CgroupUnavailable(f"cannot connect to the systemd {address.kind} manager's bus at "
                                    f"{address.socket}: {err}") from err
        self._manager = DBusAddress(_PATH, bus_name=_BUS_NAME, interface=_MANAGER)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, signature: str | None = None, body: tuple = (), *, address=None):
        from jeepney import new_method_call
        from jeepney.wrappers import DBusErrorResponse, unwrap_msg

        msg = new_method_call(address or self._manager, method, signature, body)
        try:
            reply = self._conn.send_and_get_reply(msg, timeout=self.timeout)
            return unwrap_msg(reply)
        except DBusErrorResponse as err:
            raise ManagerError(err.name or "", " ".join(map(str, err.data)), method) from err
        except (OSError, TimeoutError) as err:
            raise CgroupUnavailable(f"systemd {self.address.kind} manager: {method} failed: {err}") from err

    def _property(self, path: str, interface: str, name: str) -> Any:
        from jeepney import DBusAddress

        target = DBusAddress(path, bus_name=_BUS_NAME, interface="org.freedesktop.DBus.Properties")
        (value,) = self._call("Get", "ss", (interface, name), address=target)
        return value[1]  # a variant: (signature, value)

    def control_group(self) -> str:
        """The manager's own cgroup, as it names it (`/` for the system manager)."""
        return self._property(_PATH, _MANAGER, "ControlGroup") or "/"

    def unit_control_group(self, unit: str) -> str | None:
        """The cgroup of a loaded, active unit; None when no such unit is loaded or it is not active
        (GetUnit loads nothing and starts nothing)."""
        try:
            (path,) = self._call("GetUnit", "s", (unit,))
        except ManagerError as err:
            if err.name == _NO_SUCH_UNIT:
                return None
            raise
        if self._property(path, _UNIT, "ActiveState") != "active":
            return None
        return self._property(path, _SCOPE, "ControlGroup") or None

    def start_delegated_scope(self, unit: str, pid: int, description: str) -> bool:
        """Make `unit` a transient scope with Delegate=yes holding `pid`, and wait for its start job.

        Returns:
            True when the scope was made; False when a unit of that name exists already.

        Raises:
            CgroupUnavailable: the manager refused, or the job did not finish within JOB_WAIT.
        """
        from jeepney import MatchRule, message_bus

        props = [("PIDs", ("au", [pid])), ("Delegate", ("b", True)), ("Slice", ("s", self.address.slice)),
                 ("Description", ("s", description)),
                 # a failed start leaves no unit behind to block the name (systemd >= 236)
                 ("CollectMode", ("s", "inactive-or-failed"))]
        rule = MatchRule(type="signal", interface=_MANAGER, member="JobRemoved", path=_PATH)
        self._call("AddMatch", "s", (rule.serialise(),), address=message_bus)
        self._call("Subscribe")  # signals go to subscribers and to the job's own client
        queue: deque = deque(maxlen=256)
        with self._conn.filter(rule, queue=queue):
            try:
                (job,) = self._call("StartTransientUnit", "ssa(sv)a(sa(sv))", (unit, "fail", props, []))
            except ManagerError as err:
                if err.name == _UNIT_EXISTS:
                    return False
                raise
            result = self._wait_job(job, queue)
        if result != "done":
            raise CgroupUnavailable(f"systemd {self.address.kind} manager: the start job of {unit} ended "
                                    f"with {result!r} (journalctl --user -u {unit})")
        return True

    def _wait_job(self, job: str, queue: deque) -> str:
        """The result of `job` from its JobRemoved signal (queued by the filter while we waited)."""
        deadline = time.monotonic() + JOB_WAIT
        while True:
            while queue:
                _id, path, _unit, result = queue.popleft().body
                if path == job:
                    return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise CgroupUnavailable(f"systemd {self.address.kind} manager: job {job} did not finish "
                                        f"within {JOB_WAIT:g} s")
            try:
                self._conn.recv_messages(timeout=left)
            except TimeoutError:
                continue

    def attach(self, unit: str, subcgroup: str, pid: int) -> None:
        """Move `pid` into `subcgroup` of the delegated `unit` (AttachProcessesToUnit, systemd >= 238;
        a subgroup only of a delegated unit)."""
        self._call("AttachProcessesToUnit", "ssau", (unit, subcgroup, [pid]))


class ManagerError(CgroupUnavailable):
    """A D-Bus error the manager answered with: `name` (e.g. org.freedesktop.systemd1.NoSuchUnit)."""

    def __init__(self, name: str, text: str, method: str):
        super().__init__(f"systemd manager: {method} failed: {name}: {text}")
        self.name = name
