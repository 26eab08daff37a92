"""One watchdog for all supervised turns: 2,000 concurrent supervised turns in one process keep
cgturn's own thread count flat, and every timeout fires while the event loop is blocked."""
import asyncio
import threading

from cgturn import Supervisor, watchdog

TURNS = 2000


def cgturn_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cgturn")]


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
