#!/usr/bin/env python3
"""What one message to the sentinel costs its sender, by how the receiver waits: for data (POLLIN:
every datagram wakes it) or for the channel's end only (POLLRDHUP, reading what came every 5 ms, as
cgturn.sentinel_server does once a wake-up has read messages). No cgturn code: a socketpair, a
forked receiver under SCHED_BATCH, and a sender that sends a `track`-sized datagram every ~70 us
(a small turn's pace), timing each send(2). Alternating rounds; medians.

    python3 scripts/bench_sentinel_send.py [--sends 20000] [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import sys
import time

WINDOW_MS = 5
MESSAGE = json.dumps({"v": 2, "op": "track", "key": ["task", "20261205T061207-1346-48e510"], "task": "task",
                      "turn": "20261205T061207-1346-48e510", "deadline": None, "inactivity": None, "grace": 0.0,
                      "last": 1234.5}).encode()


def receive(sock: socket.socket, wake_on_data: bool) -> None:
    """The receiver's loop until EOF: wait, then read everything waiting."""
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN if wake_on_data else select.POLLRDHUP)
    while True:
        poller.poll(-1 if wake_on_data else WINDOW_MS)
        while True:
            try:
                data = sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if not data:
                return


def voluntary_switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))


def one_round(wake_on_data: bool, sends: int) -> tuple[float, int]:
    """(median µs per send, the receiver's voluntary context switches)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        receive(theirs, wake_on_data)
        os._exit(0)
    theirs.close()
    ours.setblocking(False)
    time.sleep(0.05)
    before = voluntary_switches(pid)
    took = []
    for _ in range(sends):
        t0 = time.perf_counter_ns()
        while True:
            try:
                ours.send(MESSAGE)
                break
            except BlockingIOError:
                select.select([], [ours], [])
        took.append(time.perf_counter_ns() - t0)
        until = time.perf_counter_ns() + 70_000  # a small turn's own work between two messages
        while time.perf_counter_ns() < until:
            pass
    switches = voluntary_switches(pid) - before
    ours.close()
    os.waitpid(pid, 0)
    return statistics.median(took) / 1000, switches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sends", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    got: dict[str, list[tuple[float, int]]] = {"POLLIN": [], "POLLRDHUP, 5 ms": []}
    loads = [os.getloadavg()[0]]
    for i in range(args.rounds):
        for name in (list(got) if i % 2 == 0 else list(got)[::-1]):
            got[name].append(one_round(name == "POLLIN", args.sends))
            loads.append(os.getloadavg()[0])
    print(f"{args.sends} sends a round, {args.rounds} rounds alternating, 1-min load "
          f"{min(loads):.1f}-{max(loads):.1f}\n")
    print("| receiver waits with | median send (µs) | receiver wake-ups per send |")
    print("|---|---:|---:|")
    for name, rows in got.items():
        print(f"| {name} | {statistics.median(t for t, _ in rows):.2f} | "
              f"{statistics.median(s for _, s in rows) / args.sends:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
