"""Looking at many things a little at a time: round-robin sweeps with a time budget per step and a
duty cycle, so that a loop that must stay responsive (the sentinel's) can look at thousands of turns
without a step that blocks it or a share of the CPU that grows with their number."""
from __future__ import annotations

import time
from typing import Any, Callable


class SweepRounds:
    """Rounds over a snapshot of items, a few at each step.

    Each step looks at items of the current round (a new round takes a fresh snapshot) until `step`
    seconds are spent; the next step is due after `interval` seconds, or later, so that the looks
    use at most `duty` of a core: a handful of items are all looked at every `interval`, ten thousand
    in a round of minutes.

    Args:
        interval: the shortest time between two steps (seconds).
        step: the time budget of one step (seconds); at least one item is looked at per step.
        duty: the largest fraction of a core the steps may use.
    """

    def __init__(self, interval: float, step: float, duty: float) -> None:
        self.interval, self.step_budget, self.duty = interval, step, duty
        self.next_at = time.monotonic() + interval
        self._queue: list[Any] = []

    def due(self, now: float) -> bool:
        """True when the next step is due at monotonic time `now`."""
        return now >= self.next_at

    def step(self, snapshot: Callable[[], list[Any]], look: Callable[[Any], None]) -> int:
        """Look at the next items of the round (`look(item)`), starting a round from `snapshot()`.

        Returns:
            How many items were looked at.
        """
        started = time.perf_counter()
        if not self._queue:
            self._queue = snapshot()
            self._queue.reverse()  # popped from the end: the snapshot's order
        looked = 0
        while self._queue and (looked == 0 or time.perf_counter() - started < self.step_budget):
            look(self._queue.pop())
            looked += 1
        spent = time.perf_counter() - started
        self.next_at = time.monotonic() + max(self.interval, spent / self.duty)
        return looked
