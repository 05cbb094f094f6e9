"""The budget that promotions plan against: the lowest budgeter reading of the last second.

The budgeter's readings move with the application's own memory (a prefill's tensors waiting for
their write, a step's read buffers), by about a layer at a time on the quick preset's shapes.
Following every reading both ways made the re-planner undo its own moves: at 1.69 GiB one layer
went to the page cache, back to the direct path and to the page cache again within 0.6 s of one
decode, each move a layer's read and write on the disk that the decode's reads were waiting for
(docs/bench.md). Demotions still follow every reading at once: a budget below the placed bytes
means the kernel is about to evict them. A promotion waits until the room it needs has been
there for :data:`GROWTH_WINDOW_S`: shrink at once, grow on what has held.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

#: How long a budgeter reading must have held before promotions may use it, in seconds (the
#: budgeter reads every 0.25 s).
GROWTH_WINDOW_S = 1.0


class LowWatermark:
    """The lowest of the readings seen in the last ``window_s`` seconds (the latest always
    counts, however old).

    Args:
        window_s: how long a reading counts.
        clock: monotonic seconds (a test passes its own).
    """

    def __init__(
        self, window_s: float = GROWTH_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._readings: deque[tuple[float, int]] = deque()

    def observe(self, value: int) -> None:
        """A new reading."""
        self._readings.append((self._clock(), value))
        self._expire()

    def reset(self, value: int) -> None:
        """Forget the history: ``value`` holds from now on (an operator's cap, not a reading)."""
        self._readings.clear()
        self._readings.append((float("-inf"), value))

    def low(self, default: int) -> int:
        """The lowest reading that still counts, or ``default`` before any."""
        self._expire()
        return min((value for _, value in self._readings), default=default)

    def rises_in(self) -> float | None:
        """Seconds until :meth:`low` rises with no new reading (when the last reading at the
        lowest value leaves the window), or None if it cannot: the latest is the lowest."""
        self._expire()
        if len(self._readings) < 2:
            return None
        lowest = min(value for _, value in self._readings)
        if self._readings[-1][1] == lowest:
            return None
        last_lowest = max(at for at, value in self._readings if value == lowest)
        return max(0.0, last_lowest + self.window_s - self._clock())

    def _expire(self) -> None:
        horizon = self._clock() - self.window_s
        while len(self._readings) > 1 and self._readings[0][0] <= horizon:
            self._readings.popleft()
