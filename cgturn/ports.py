"""A listening socket of a turn, as `cgturn ps` shows it: plain data, no turns, no I/O.

A leaf of its own so that the kernel layer (cgturn.kernel.observe, which finds the sockets) can name it
without importing the turn vocabulary of `cgturn.model` (docs/design.md: the kernel knows no turns).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, order=True)
class Port:
    """A listening socket of a turn: a listening TCP socket or a bound, unconnected UDP socket.

    Ordered (proto, address, port), as `TurnInfo.ports` lists them.
    """

    proto: str  # "tcp" or "udp"
    address: str  # as the kernel reports it: "127.0.0.1", "::", "0.0.0.0"
    port: int

    def to_json(self) -> dict[str, Any]:
        """The element of `ports` in `cgturn ps --json`.

        Returns:
            `{"proto", "address", "port"}`.
        """
        return {"proto": self.proto, "address": self.address, "port": self.port}
