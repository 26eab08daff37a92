"""Who a spawned process runs as: `user=`, `group=`, `extra_groups=` resolved against the user and group
databases, before any process or cgroup exists (an unknown name is bad input, not a failed spawn)."""
from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    """Who the target runs as: ids, and its supplementary groups (None: the user's from the group
    database, as login's initgroups(3))."""

    uid: int
    gid: int
    groups: tuple[int, ...] | None

    def setpriv_args(self) -> list[str]:
        """setpriv(1) options that switch to this identity (real, effective and saved ids)."""
        args = [f"--reuid={self.uid}", f"--regid={self.gid}"]
        if self.groups is None:
            args.append("--init-groups")
        elif self.groups:
            args.append("--groups=" + ",".join(map(str, self.groups)))
        else:
            args.append("--clear-groups")
        return args


def resolve_identity(user=None, group=None, extra_groups=None) -> Identity | None:
    """The identity Turn.spawn's `user=`, `group=`, `extra_groups=` ask for; None when none is given.

    Unlike Popen, what is not given is not inherited from the (usually root) caller: `user` alone
    gives the user's primary group and its groups from the group database; `group` alone keeps the
    caller's uid and clears supplementary groups; `extra_groups` sets them exactly.

    Raises:
        ValueError: an unknown user or group name, a negative id, or a numeric uid with no passwd
            entry and no `group` (its primary group is unknown).
    """
    if user is None and group is None and extra_groups is None:
        return None
    entry = _passwd(user) if user is not None else None
    uid = os.getuid() if user is None else (entry.pw_uid if entry else _id(user, "user"))
    if group is not None:
        gid = _group(group)
    elif entry is not None:
        gid = entry.pw_gid
    elif user is not None:
        raise ValueError(f"user {user!r} has no passwd entry: give group= as well")
    else:
        gid = os.getgid()
    if extra_groups is not None:
        if isinstance(extra_groups, (str, bytes, int)):
            raise ValueError("extra_groups must be a list of group names or ids")
        groups = tuple(_group(g) for g in extra_groups)
    elif entry is not None:
        groups = None  # --init-groups needs the passwd entry: there is one
    else:
        groups = ()
    return Identity(uid, gid, groups)


def _id(value, kind: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"unknown {kind} {value!r}")
    return value


def _passwd(user) -> "pwd.struct_passwd | None":
    """The passwd entry of a user name or uid; None for a uid without one."""
    if isinstance(user, str):
        try:
            return pwd.getpwnam(user)
        except KeyError:
            if not user.isdigit():
                raise ValueError(f"unknown user {user!r}") from None
            user = int(user)
    try:
        return pwd.getpwuid(_id(user, "user"))
    except KeyError:
        return None


def _group(group) -> int:
    if isinstance(group, str):
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            if not group.isdigit():
                raise ValueError(f"unknown group {group!r}") from None
            return int(group)
    return _id(group, "group")
