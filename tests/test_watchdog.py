"""One watchdog for all supervised turns: 2,000 concurrent supervised turns in one process keep
cgturn's own thread count flat, and every timeout fires while the event loop is blocked."""
import asyncio
import threading

from cgturn import Supervisor, watchdog

TURNS = 2000


def cgturn_threads() -> list[str]:
    """cgturn's supervision threads: the watchdog and its kill pool. (Other cgturn threads live once
    per process, whatever the number of turns: the asyncio spawn's `cgturn-drain`, for one.)"""
    return [t.name for t in threading.enumerate() if t.name.startswith(("cgturn-watchdog", "cgturn-kill"))]


def test_two_thousand_supervised_turns_one_watchdog(cgroup2_manager):
    mgr = cgroup2_manager
    turns = [mgr.begin_turn("many", f"t{i}") for i in range(TURNS)]
    fired: list[str] = []
    all_fired = threading.Event()
    counted = threading.Lock()
    most_threads = [0]

    def on_interrupt(reason: str) -> None:  # the watchdog thread, while the loop is blocked below
        with counted:
            fired.append(reason)
            most_threads[0] = max(most_threads[0], len(cgturn_threads()))
            if len(fired) == TURNS:
                all_fired.set()

    async def main():
        never = asyncio.Event()
        sups = [Supervisor(t, timeout=0.3 + (i % 50) / 100, grace=0, on_interrupt=on_interrupt, use_sentinel=False)
                for i, t in enumerate(turns)]
        runs = [asyncio.ensure_future(s.run(never.wait)) for s in sups]
        await asyncio.sleep(0)  # every run() starts: its clocks run from here
        most_threads[0] = max(most_threads[0], len(cgturn_threads()))
        # Block the loop: only the watchdog thread can fire the timeouts now.
        assert all_fired.wait(120), f"{len(fired)} of {TURNS} timeouts fired while the loop was blocked"
        return await asyncio.gather(*runs)

    outcomes = asyncio.run(main())
    assert fired == ["timeout"] * TURNS
    assert [o.reason for o in outcomes] == ["timeout"] * TURNS and not any(o.external for o in outcomes)
    assert most_threads[0] <= 1 + watchdog.KILL_THREADS <= 3, cgturn_threads()
    assert mgr.turns("many") == []


class _Client:
    """A watchdog client that records its calls; `finished` as a supervisor reports it."""

    def __init__(self, finished: bool = False):
        self.finished = finished
        self.calls = 0
        self.called = threading.Event()

    def on_due(self, now: float):
        self.calls += 1
        self.called.set()
        return None


def test_finished_clients_leave_the_heap_without_a_call_or_a_wait():
    """Supervised turns that complete long before their timeouts leave entries behind; the thread
    drops them when they reach the head instead of waking for each at its due time."""
    import time

    from conftest import wait_until

    dog = watchdog.Watchdog()
    far = time.monotonic() + 600
    done = [_Client() for _ in range(20)]
    for client in done:
        dog.schedule(client, far)
    for client in done:
        client.finished = True
    probe = _Client()
    dog.schedule(probe, time.monotonic())  # the nearest: wakes the thread now
    assert probe.called.wait(10)
    assert wait_until(lambda: len(dog) == 0, timeout=10), f"{len(dog)} finished entries still wait for their due time"
    assert [c.calls for c in done] == [0] * 20 and probe.calls == 1
