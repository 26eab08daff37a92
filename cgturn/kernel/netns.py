"""Network namespaces without helper processes or bind mounts: made and entered by a short-lived thread.

A network namespace belongs to a thread, not to the whole process (unshare(2) and setns(2) with
CLONE_NEWNET are allowed in a multi-threaded process), so a thread of our own can make one, bring its
loopback up and open `/proc/thread-self/ns/net`; once the thread ends, that fd is the namespace's
only anchor: nothing under /run/netns (pyroute2.netns and `ip netns` bind-mount one there), and no
holder process. Closing the fd, once no process is left in it, frees the namespace.

Loopback is brought up with one ioctl (SIOCSIFFLAGS, netdevice(7)) rather than netlink: a new
namespace has exactly one interface, `lo`, down; pyroute2's import alone costs more than the rest.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading

from . import libc

SIOCGIFFLAGS = 0x8913  # linux/sockios.h
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def in_thread(fn, *args):
    """Run fn(*args) in a fresh thread and return its result (or raise its exception): what the
    thread does to its namespaces dies with it."""
    box: list = [None, None]

    def run():
        try:
            box[0] = fn(*args)
        except BaseException as err:  # handed to the caller
            box[1] = err

    thread = threading.Thread(target=run, name="cgturn-netns", daemon=True)
    thread.start()
    thread.join()
    if box[1] is not None:
        raise box[1]
    return box[0]


def _new_loopback_only() -> int:
    libc.unshare(libc.CLONE_NEWNET)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # made in the new namespace
        req = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def new_loopback_only() -> int:
    """A new network namespace with only `lo`, up; returns an O_CLOEXEC fd that holds it.

    Raises OSError (EPERM without CAP_SYS_ADMIN, EINVAL/ENOSPC when the kernel refuses).
    """
    return in_thread(_new_loopback_only)


def _entered(fd: int, fn, args):
    libc.setns(fd, libc.CLONE_NEWNET)
    return fn(*args)


def run_inside(fd: int, fn, *args):
    """fn(*args) in a thread that entered the network namespace `fd` (sockets it makes live there).
    Raises OSError when setns is refused."""
    return in_thread(_entered, fd, fn, args)


def same_as_ours(fd: int) -> bool:
    """True when `fd` refers to this thread's own network namespace."""
    mine, theirs = os.stat("/proc/thread-self/ns/net"), os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def open_of(pid: int) -> int:
    """An O_CLOEXEC fd of the network namespace of process `pid`. Raises OSError (gone, or not ours
    to look at)."""
    return os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
