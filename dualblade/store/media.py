"""From the plan's medium to the span that moves it: the one table.

The plan names each layer's :class:`~dualblade.pipeline.Medium`; a context asks this table for
the storage span of a KPU's rows and hands it to a copy thread. A new path is a new medium and a
new row here, not a branch where bytes move (vLLM's offload worker keys its transfer handlers by
medium the same way).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from dualblade.actors import DirectSpan, MmapSpan, PageCacheSpan, PathCounters, StorageSpan
from dualblade.io_engine import IOEngine, PageCacheFile, Target
from dualblade.pipeline import KpuId, LbaMap, Medium, RowRange, TensorLayout, plan_slice


class ContextStorage(Protocol):
    """What a context offers the span makers: its layouts and its claimed storage."""

    @property
    def engine(self) -> IOEngine: ...
    @property
    def direct_target(self) -> Target: ...
    @property
    def counters(self) -> PathCounters: ...
    @property
    def direct_layout(self) -> TensorLayout: ...
    @property
    def file_layout(self) -> TensorLayout: ...
    async def layer_direct_map(self, layer: int) -> LbaMap: ...
    async def file(self, kpu: KpuId) -> PageCacheFile: ...


@dataclass(frozen=True)
class PlacedSpan:
    """A KPU's rows on their medium: the span that moves them and the layout they have there."""

    span: StorageSpan
    layout: TensorLayout


SpanMaker = Callable[[ContextStorage, KpuId, RowRange], Awaitable[PlacedSpan]]


def _label(kpu: KpuId, rows: RowRange) -> str:
    return f"{kpu} rows {rows.start}-{rows.stop}"


async def _direct(storage: ContextStorage, kpu: KpuId, rows: RowRange) -> PlacedSpan:
    layout = storage.direct_layout
    lba_map = await storage.layer_direct_map(kpu.layer)
    # One chunk: the span needs only where the slice starts and how long it is; the engine cuts
    # it into the target's commands (Algorithm 2's chunking at max_chunk happens there).
    plan = plan_slice(lba_map.lookup(kpu), layout, rows, layout.image_bytes)
    first_offset, _, _ = plan.file_ranges()[0]
    span = DirectSpan(
        storage.engine,
        storage.direct_target,
        first_offset,
        plan.buffer_bytes,
        plan.image_offset,
        _label(kpu, rows),
        storage.counters,
    )
    return PlacedSpan(span, layout)


def _through_page_cache(*, drop_after_use: bool) -> SpanMaker:
    async def make(storage: ContextStorage, kpu: KpuId, rows: RowRange) -> PlacedSpan:
        layout = storage.file_layout
        file = await storage.file(kpu)
        offset = rows.start * layout.row_stride
        nbytes = len(rows) * layout.row_stride
        span = PageCacheSpan(
            storage.engine,
            file,
            offset,
            nbytes,
            offset,
            _label(kpu, rows),
            storage.counters,
            evict=drop_after_use,
        )
        return PlacedSpan(span, layout)

    return make


async def _mmap(storage: ContextStorage, kpu: KpuId, rows: RowRange) -> PlacedSpan:
    layout = storage.file_layout
    file = await storage.file(kpu)
    offset = rows.start * layout.row_stride
    nbytes = len(rows) * layout.row_stride
    span = MmapSpan(file, offset, nbytes, offset, _label(kpu, rows), storage.counters)
    return PlacedSpan(span, layout)


SPAN_MAKERS: dict[Medium, SpanMaker] = {
    Medium.DIRECT: _direct,
    Medium.PAGE_CACHE: _through_page_cache(drop_after_use=False),
    Medium.PAGE_CACHE_DROPPED: _through_page_cache(drop_after_use=True),
    Medium.MMAP: _mmap,
}


class SpanCache:
    """The last span made for each KPU of a context, handed out again while the KPU's medium,
    rows and storage stay the same.

    Why: every transfer asks for its KPU's span, and making one (an LBA map lookup,
    Algorithm 2's slice plan, a label) took about a seventh of the event loop's time in
    LMCache loads of 1 MiB objects, whose K and V are read again and again with the same rows.
    One entry per KPU: a decode step asks for new rows each time and simply makes its span.
    The context's storage forgets a layer's entries when it gives that layer's storage back
    (a move), so a span never outlives the blocks or the file it names.
    """

    def __init__(self) -> None:
        self._last: dict[KpuId, tuple[Medium, RowRange, PlacedSpan]] = {}

    async def placed(
        self, storage: ContextStorage, medium: Medium, kpu: KpuId, rows: RowRange
    ) -> PlacedSpan:
        """The KPU's rows on ``medium``: a copy of the kept span (callers may set fields on
        theirs, such as a page-cache span's ``missing``), else a new one, kept."""
        last = self._last.get(kpu)
        if last is not None and last[0] is medium and last[1] == rows:
            placed = last[2]
            return PlacedSpan(placed.span.at(placed.span.buffer_offset), placed.layout)
        placed = await SPAN_MAKERS[medium](storage, kpu, rows)
        self._last[kpu] = (medium, rows, placed)
        return PlacedSpan(placed.span.at(placed.span.buffer_offset), placed.layout)

    def forget(self, layer: int, *, direct: bool) -> None:
        """Forget ``layer``'s spans on the direct target (``direct``), or in page-cache files."""
        for kpu, (medium, _, _) in list(self._last.items()):
            if kpu.layer == layer and (medium is Medium.DIRECT) == direct:
                del self._last[kpu]

    def forget_all(self) -> None:
        self._last.clear()
