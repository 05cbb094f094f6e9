"""A first-fit allocator of contiguous block runs inside a region (the binder's free list).

Each request context gets one contiguous run for all of its direct KPUs, so the LBA map's
"contiguous" invariant holds within a context and contexts never share a block. Freed runs are
merged with their neighbours so a long-running store does not fragment.
"""

from __future__ import annotations

import bisect

from dualblade.errors import DualbladeError


class ExtentExhaustedError(DualbladeError):
    """No contiguous run of the asked size is free in the configured extent."""


class ExtentAllocator:
    """Free runs of ``[first, first + n_blocks)``; with ``growable`` the region may extend.

    Args:
        first: the first block of the region.
        n_blocks: its size in blocks (ignored when ``growable``: it starts empty and grows).
        growable: a file target, whose region grows on demand.
    """

    def __init__(self, first: int, n_blocks: int, *, growable: bool = False) -> None:
        if first < 0 or n_blocks < 0:
            raise ValueError(f"bad region: first {first}, {n_blocks} blocks")
        self.first = first
        self.end = first + (0 if growable else n_blocks)
        self.growable = growable
        self._free: list[tuple[int, int]] = [] if growable or n_blocks == 0 else [(first, n_blocks)]
        self._used: dict[int, int] = {}

    def allocate(self, n_blocks: int) -> int:
        """The start of a free run of ``n_blocks``.

        Raises:
            ExtentExhaustedError: no run is large enough (and the region cannot grow).
        """
        if n_blocks <= 0:
            raise ValueError(f"allocate a positive number of blocks, not {n_blocks}")
        for i, (start, length) in enumerate(self._free):
            if length >= n_blocks:
                if length == n_blocks:
                    del self._free[i]
                else:
                    self._free[i] = (start + n_blocks, length - n_blocks)
                self._used[start] = n_blocks
                return start
        if self.growable:
            start = self.end
            if self._free and self._free[-1][0] + self._free[-1][1] == self.end:
                start, _ = self._free.pop()  # extend the trailing free run
            self.end = start + n_blocks
            self._used[start] = n_blocks
            return start
        largest = max((length for _, length in self._free), default=0)
        raise ExtentExhaustedError(
            f"no free run of {n_blocks} blocks in the extent [{self.first}, {self.end}); the "
            f"largest free run has {largest} blocks and {len(self._used)} contexts hold the rest. "
            "Enlarge the extent, or close contexts before opening new ones"
        )

    def free(self, start: int) -> int:
        """Return the run that starts at ``start``; returns its size in blocks.

        Raises:
            KeyError: no run starts there.
        """
        length = self._used.pop(start)
        index = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(index, (start, length))
        # Merge with the following and the preceding run.
        if index + 1 < len(self._free):
            nxt_start, nxt_len = self._free[index + 1]
            if start + length == nxt_start:
                self._free[index] = (start, length + nxt_len)
                del self._free[index + 1]
        if index > 0:
            prev_start, prev_len = self._free[index - 1]
            cur_start, cur_len = self._free[index]
            if prev_start + prev_len == cur_start:
                self._free[index - 1] = (prev_start, prev_len + cur_len)
                del self._free[index]
        if self.growable and self._free[-1][0] + self._free[-1][1] == self.end:
            # A growable region ends at its last run in use: a run given back at the end (or a
            # claim that found no room to grow the file) must not make the next claim grow it.
            self.end = self._free.pop()[0]
        return length

    @property
    def used(self) -> dict[int, int]:
        """Allocated runs: start -> blocks."""
        return dict(self._used)

    @property
    def free_runs(self) -> list[tuple[int, int]]:
        """Free runs, sorted: (start, blocks)."""
        return list(self._free)
