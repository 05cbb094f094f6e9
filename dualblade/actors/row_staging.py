"""Room for appended rows at the end of a CUDA copy thread's pinned buffer, beside its images.

Why: with CUDA a copy thread runs two transfers at once, each in a KPU image of its pinned
buffer, and the store's pool leases no more than that. A decode step's appends (one row of each
layer's K and V: 64 a step for OPT-6.7B) took those leases and images like any transfer, for a
GPU copy out of a few hundred KiB and a write. On the H100 at 11 GiB, where every layer is read
from the page cache, an append held its lease 10 ms (median; 25 ms at most), a quarter of all
the leases a step had, and the step's reads, which need all eight of four copy threads at once
(four layers of K and V in flight), waited for them. So rows are staged in a room of their own:
an append takes no lease and no image, only one of a few small regions after the images.

A region keeps a row's place within a page (its offset modulo a page), so a direct write from
it is aligned exactly as it would have been from the row's place in the image.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

from dualblade.actors.copy_messages import CopyMessage, Store

#: Stores this small (an appended row; a layer of a few rows too) take no storage slot: holding
#: one, an append waited in the engine behind a direct read that the next read waited for. With
#: room for rows they take no transfer lease either (see the module).
SLOTLESS_STORE_BYTES = 1 << 20
#: A region's alignment: a row keeps its offset within one.
_PAGE = 4096
#: Rows a copy thread stages at once; more wait for a region (a step's appends are spread over
#: the copy threads, about two in flight on all of them together in the H100's trace).
ROW_REGIONS = 2
ROW_REGION_BYTES = SLOTLESS_STORE_BYTES + _PAGE
#: Bytes a copy thread's buffer keeps for rows after its images (CUDA only: on the host a store
#: never waits for an image, loads land in the caller's memory).
ROW_STAGING_BYTES = ROW_REGIONS * ROW_REGION_BYTES


def stages_rows(message: CopyMessage) -> bool:
    """Whether ``message`` is a store small enough for a row region."""
    return isinstance(message, Store) and message.span.nbytes <= SLOTLESS_STORE_BYTES


class RowStaging:
    """The row regions of one buffer, from ``base`` (a page boundary) on.

    Raises:
        ValueError: ``base`` is not a page boundary.
    """

    def __init__(self, base: int, regions: int = ROW_REGIONS) -> None:
        if base % _PAGE:
            raise ValueError(f"row regions must start on a page boundary, not at {base}")
        self._free = [base + i * ROW_REGION_BYTES for i in range(regions)]
        self._room = anyio.Semaphore(regions)

    @contextlib.asynccontextmanager
    async def shift_for(self, message: CopyMessage) -> AsyncIterator[int]:
        """Hold a region for ``message`` (waiting for one); yields the shift that moves the
        message's bytes there (for :func:`in_image`)."""
        assert stages_rows(message), f"{message.span.label} is no row to stage"
        async with self._room:
            region = self._free.pop()
            try:
                offset = message.span.buffer_offset
                yield region + offset % _PAGE - offset
            finally:
                self._free.append(region)

    async def run(
        self, message: CopyMessage, transfer: Callable[[CopyMessage, int], Awaitable[None]]
    ) -> None:
        """``transfer(message, shift)`` in a region held for it (the copy thread's transfer,
        moved by ``shift`` into its buffer)."""
        async with self.shift_for(message) as shift:
            await transfer(message, shift)
