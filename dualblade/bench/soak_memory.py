"""The soak's memory watch: samples all along, per-window readings, and memory once settled.

Growth of resident memory is judged between the end of the first window (allocations at steady
state, after warm-up) and the end of the last, so that a slow leak shows while start-up does not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from dualblade.bench.process_stats import MemorySample, memory_sample

#: Called after each sample with the seconds since the start and the sample.
OnSample = Callable[[float, MemorySample], None]


@dataclass
class MemorySampler:
    """Memory samples ``(seconds since start, sample)``."""

    start: float
    samples: list[tuple[float, MemorySample]] = field(default_factory=list)

    def take(self) -> MemorySample:
        sample = memory_sample()
        self.samples.append((time.monotonic() - self.start, sample))
        return sample

    async def run(self, every: float, on_sample: OnSample | None = None) -> None:
        """Take a sample every ``every`` seconds until cancelled."""
        while True:
            await anyio.sleep(every)
            sample = self.take()
            if on_sample is not None:
                on_sample(self.samples[-1][0], sample)

    def windows(self, seconds: float, slack: float) -> tuple[float, list[dict[str, Any]]]:
        """Per-minute windows (halves of runs under two minutes): last and peak readings.

        A window's reading is its last sample, taken up to ``slack`` seconds after its end (the
        sampler's tick): the first window's is the state after warm-up, at the end of minute 1.
        """
        width = 60.0 if seconds >= 120 else seconds / 2
        count = max(1, math.ceil(seconds / width - 1e-9))
        out = []
        for index in range(count):
            low, high = index * width + slack, (index + 1) * width + slack
            inside = [s for t, s in self.samples if low < t <= high]
            inside = inside or [s for t, s in self.samples if t <= high][-1:]
            if not inside:
                continue
            out.append(
                {
                    "window": index + 1,
                    "end_s": round(high - slack, 1),
                    "rss_bytes": inside[-1].rss_bytes,
                    "rss_peak_bytes": max(s.rss_bytes for s in inside),
                    "locked_bytes": inside[-1].locked_bytes,
                    "pinned_bytes": inside[-1].pinned_bytes,
                }
            )
        return width, out


async def settled_memory(pinned_before: int, patience: float = 2.0) -> MemorySample:
    """Memory once the kernel has unpinned the ring's buffers (its exit work runs later)."""
    deadline = time.monotonic() + patience
    sample = memory_sample()
    while sample.pinned_bytes > pinned_before and time.monotonic() < deadline:
        await anyio.sleep(0.05)
        sample = memory_sample()
    return sample
