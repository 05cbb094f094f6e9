"""Byte-range locks over one buffer: two transfers may share a buffer if they touch other bytes.

A copy thread overlaps the tail of one transfer (the DMA of its last pieces) with the head of the
next (the storage reads of its first pieces) inside its single pinned buffer; each piece holds the
range of the buffer it uses from the moment its data starts to arrive until its data has left.
"""

from __future__ import annotations

import anyio


class RangeLocks:
    """Exclusive locks on half-open byte ranges; a range waits for every overlapping holder."""

    def __init__(self) -> None:
        self._held: list[tuple[int, int, anyio.Event]] = []

    async def acquire(self, start: int, end: int) -> None:
        """Wait until ``[start, end)`` overlaps no held range, then hold it."""
        while True:
            blocker = next((e for s, t, e in self._held if s < end and start < t), None)
            if blocker is None:
                self._held.append((start, end, anyio.Event()))
                return
            await blocker.wait()

    def release(self, start: int, end: int) -> None:
        """Release a held range and wake its waiters."""
        for index, (s, t, event) in enumerate(self._held):
            if (s, t) == (start, end):
                del self._held[index]
                event.set()
                return
        raise RuntimeError(f"range [{start}, {end}) is not held")

    @property
    def held(self) -> list[tuple[int, int]]:
        return [(s, t) for s, t, _ in self._held]
