"""Listening sockets with the cgroup each was created in, from one sock_diag netlink dump per
protocol and address family (linux/inet_diag.h), with the standard library only.

Why not pyroute2: importing it costs ~0.25 s here (its package imports every module it has), which
was the largest part of a `cgturn ps`, for four small dumps this module does in ~1 ms.

INET_DIAG_CGROUP_ID (5.7+, any caller; checked here as an unprivileged user) is the inode number of
the cgroup v2 directory the socket was created in. Older kernels omit it: `cgroup_id` is then None.
"""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_CGROUP_ID = 21

TCP_LISTEN = 10   # include/net/tcp_states.h
TCP_CLOSE = 7     # a bound, unconnected UDP socket reports this state
PROTOCOLS = (("tcp", socket.IPPROTO_TCP, 1 << TCP_LISTEN), ("udp", socket.IPPROTO_UDP, 1 << TCP_CLOSE))
FAMILIES = (socket.AF_INET, socket.AF_INET6)

_NLMSGHDR = struct.Struct("=IHHII")          # len, type, flags, seq, pid
_REQ_V2 = struct.Struct("=BBBxI48x")         # family, protocol, ext, pad, states, inet_diag_sockid (any)
_MSG_LEN = 72                                # sizeof(struct inet_diag_msg)
_RTATTR = struct.Struct("=HH")               # len, type


@dataclass(frozen=True)
class ListeningSocket:
    """One listening TCP socket or bound, unconnected UDP socket."""

    proto: str
    address: str
    port: int
    cgroup_id: int | None

    def to_json(self) -> dict:
        return {"proto": self.proto, "address": self.address, "port": self.port}


class DiagError(OSError):
    """The kernel refused or garbled a sock_diag dump."""


def listening_sockets() -> list[ListeningSocket]:
    """Every listening socket of this network namespace. Raises DiagError (an OSError)."""
    out: list[ListeningSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        for seq, (family, (proto, number, states)) in enumerate(
                ((f, p) for f in FAMILIES for p in PROTOCOLS), start=1):
            request = _REQ_V2.pack(family, number, 0, states)
            sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(request), SOCK_DIAG_BY_FAMILY,
                                     NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + request)
            out.extend(ListeningSocket(proto, *entry) for entry in _receive_dump(sock, seq))
    return out


def _receive_dump(sock: socket.socket, seq: int):
    """(address, port, cgroup id) of each message of the dump `seq`, until NLMSG_DONE."""
    while True:
        data = sock.recv(1 << 16)  # the kernel fills each dump datagram up to 32 KiB (netlink_dump)
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length, kind, _, msg_seq, _ = _NLMSGHDR.unpack_from(data, offset)
            if length < _NLMSGHDR.size or offset + length > len(data):
                raise DiagError(0, f"sock_diag: malformed message (length {length})")
            body = data[offset + _NLMSGHDR.size:offset + length]
            offset += (length + 3) & ~3
            if msg_seq != seq:
                continue
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                code = -struct.unpack_from("=i", body)[0]
                if code:
                    raise DiagError(code, f"sock_diag: {os.strerror(code)}")
                continue
            if kind == SOCK_DIAG_BY_FAMILY and len(body) >= _MSG_LEN:
                yield parse_inet_diag_msg(body)
        if not data:
            raise DiagError(0, "sock_diag: the dump ended without NLMSG_DONE")


def parse_inet_diag_msg(body: bytes) -> tuple[str, int, int | None]:
    """(source address, source port, INET_DIAG_CGROUP_ID or None) of one struct inet_diag_msg with
    its attributes."""
    family = body[0]
    port = int.from_bytes(body[4:6], "big")
    raw = body[8:12] if family == socket.AF_INET else body[8:24]
    address = socket.inet_ntop(family, raw)
    cgroup_id = None
    offset = _MSG_LEN
    while offset + _RTATTR.size <= len(body):
        length, kind = _RTATTR.unpack_from(body, offset)
        if length < _RTATTR.size:
            break
        if kind == INET_DIAG_CGROUP_ID and length >= _RTATTR.size + 8:
            cgroup_id = struct.unpack_from("=Q", body, offset + _RTATTR.size)[0]
        offset += (length + 3) & ~3
    return address, port, cgroup_id
