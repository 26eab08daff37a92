"""The sentinel with many turns: a wake-up looks only at the clocks that can fire, and the sweep looks
at its turns a few at a time (cgturn.sweeps), yet every one of them in each round."""
from __future__ import annotations

import os
import socket

from cgturn import sentinel_protocol as protocol
from cgturn.processes import start_time
from cgturn.sentinel_server import Sentinel
from cgturn.sweeps import SweepRounds


def test_a_round_with_no_budget_looks_at_one_item_per_step_and_at_every_item():
    rounds = SweepRounds(interval=0.5, step=0.0, duty=1.0)
    items = list(range(5))
    seen: list[int] = []
    snapshots = []

    def snapshot():
        snapshots.append(1)
        return list(items)

    for _ in range(5):
        assert rounds.step(snapshot, seen.append) == 1
    assert seen == items and len(snapshots) == 1  # one round, in the snapshot's order
    rounds.step(snapshot, seen.append)
    assert len(snapshots) == 2 and seen[-1] == 0  # the next round starts from a fresh snapshot


def test_a_step_with_budget_looks_at_a_whole_small_round_and_waits_at_least_the_interval():
    rounds = SweepRounds(interval=0.5, step=60.0, duty=1.0)
    seen: list[int] = []
    before = rounds.next_at
    assert rounds.step(lambda: list(range(100)), seen.append) == 100
    assert seen == list(range(100)) and rounds.next_at >= before
    assert not rounds.due(rounds.next_at - 0.25) and rounds.due(rounds.next_at)


def test_only_turns_with_a_clock_are_looked_at_on_each_wake_up(cgroup2_manager):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    me = os.getpid()
    server = Sentinel(cgroup2_manager, theirs, me, start_time(me))
    turns = [cgroup2_manager.begin_turn("scale", f"t{i}") for i in range(3)]
    try:
        with ours:
            for i, turn in enumerate(turns):  # owner death only, except the last: an inactivity timeout
                ours.send(protocol.encode(protocol.track(turn.task_id, turn.turn_id, None, 60.0 if i == 2 else None,
                                                         0.0, turn.last_activity)))
            ours.send(protocol.encode(protocol.watch(turns[0].task_id, turns[0].turn_id, 5.0, False, 0.0)))
            server.drain()
            assert set(server.tracked) == {t.names for t in turns}
            assert server.timed == {turns[2].names} and set(server.watches) == {turns[0].names}
            ours.send(protocol.encode(protocol.untrack(*turns[2].names)))
            ours.send(protocol.encode(protocol.untrack(*turns[0].names)))
            server.drain()
            assert server.timed == set() and server.watches == {} and set(server.tracked) == {turns[1].names}
            # A turn that ended without telling the sentinel is forgotten by the sweep.
            turns[1].abandon("test", grace=0)
            server._sweep_item(("tracked", turns[1].names))
            assert server.tracked == {}
    finally:
        theirs.close()
        os.close(server.owner_pidfd)
        for turn in turns:
            turn.abandon("test-done", grace=0)
