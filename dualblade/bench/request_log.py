"""Our own submission log: every io_uring chunk with its submit and completion time.

The ring calls an observer for each completed chunk (``IOEngine.observe_chunks``); a
:class:`RequestLog` keeps those records and turns them into the sweep's request-level metrics:

- latency percentiles per operation (completion − submission, the time the kernel and the device
  held the chunk);
- LBA sequentiality: the share of requests that start where an earlier request of the same
  stream ended. A *stream* is one target and one direction; as several copy threads interleave on
  the same target, a request counts as sequential when it starts where any of the last
  ``window`` requests of its stream ended (``window`` = the number of copy threads);
- latency by queue-depth bin: the queue depth a request met (requests already in flight when it
  was submitted, counted from the log itself) against its latency.

Only ring traffic is logged: the baseline's mmap page faults never pass through it.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChunkRecord:
    """One completed chunk."""

    target: str
    op: str
    offset: int
    length: int
    submitted: float
    completed: float

    @property
    def latency(self) -> float:
        return self.completed - self.submitted


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of already sorted values, linear between neighbours."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class RequestLog:
    """Collects chunk records from the ring thread; analysis happens after the run."""

    def __init__(self) -> None:
        self._records: list[ChunkRecord] = []
        self._lock = threading.Lock()
        self.enabled = True

    def __call__(
        self,
        target: str,
        op: str,
        offset: int,
        length: int,
        submitted: float,
        completed: float,
        result: int,
    ) -> None:
        if not self.enabled or result < 0:
            return
        record = ChunkRecord(target, op, offset, length, submitted, completed)
        with self._lock:
            self._records.append(record)

    def records(
        self, since: float = float("-inf"), until: float = float("inf")
    ) -> list[ChunkRecord]:
        """Records submitted in ``[since, until)``, in submission order."""
        with self._lock:
            chosen = [r for r in self._records if since <= r.submitted < until]
        chosen.sort(key=lambda r: r.submitted)
        return chosen


def latency_percentiles(records: list[ChunkRecord]) -> dict[str, dict[str, float | int]]:
    """p50/p90/p99/max latency in microseconds per operation."""
    by_op: dict[str, list[float]] = {}
    for record in records:
        by_op.setdefault(record.op, []).append(record.latency)
    out: dict[str, dict[str, float | int]] = {}
    for op, values in sorted(by_op.items()):
        values.sort()
        out[op] = {
            "count": len(values),
            "p50_us": round(percentile(values, 0.50) * 1e6, 1),
            "p90_us": round(percentile(values, 0.90) * 1e6, 1),
            "p99_us": round(percentile(values, 0.99) * 1e6, 1),
            "max_us": round(values[-1] * 1e6, 1),
        }
    return out


def sequentiality(records: list[ChunkRecord], window: int) -> float | None:
    """Share of requests (after each stream's first) that start where one of the last
    ``window`` requests of the same (target, op) stream ended; None without any."""
    ends: dict[tuple[str, str], deque[int]] = {}
    sequential = counted = 0
    for record in records:
        stream = (record.target, record.op)
        recent = ends.get(stream)
        if recent is None:
            recent = ends[stream] = deque(maxlen=max(1, window))
        else:
            counted += 1
            if record.offset in recent:
                sequential += 1
        recent.append(record.offset + record.length)
    return sequential / counted if counted else None


def queue_depth_bins(
    records: list[ChunkRecord], edges: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
) -> list[dict[str, Any]]:
    """Median and p99 latency of requests grouped by the queue depth they met on submission
    (1 = alone in flight). Bins are ``[edge_i, edge_{i+1})``; the last is open."""
    if not records:
        return []
    completions = sorted(r.completed for r in records)
    depths: list[int] = []
    for index, record in enumerate(records):
        # Submitted before it (records are in submission order) and not yet completed.
        done_before = bisect.bisect_right(completions, record.submitted)
        depths.append(index - done_before + 1)
    out = []
    for i, low in enumerate(edges):
        high = edges[i + 1] if i + 1 < len(edges) else None
        chosen = sorted(
            r.latency
            for r, depth in zip(records, depths, strict=True)
            if depth >= low and (high is None or depth < high)
        )
        if chosen:
            out.append(
                {
                    "queue_depth": f"{low}-{high - 1}" if high else f"{low}+",
                    "count": len(chosen),
                    "p50_us": round(percentile(chosen, 0.5) * 1e6, 1),
                    "p99_us": round(percentile(chosen, 0.99) * 1e6, 1),
                }
            )
    return out
