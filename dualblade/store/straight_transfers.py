"""A whole layer moved between storage and the caller's host memory on the caller's task.

Why a path beside the copy threads: on the host (no GPU) a copy thread adds nothing to a
transfer whose memory storage can use itself — there is no DMA to overlap — but each transfer
through it costs two actor messages, a pool lease, range locks, a task group and their cancel
scopes on the event loop. For a caller that moves many small layers (LMCache's 1 MiB objects,
each a context of one layer) that Python, not the disk, set the rate: about 1 ms of event-loop
time per object. Here a transfer is the spans' own ``read_into`` / ``write_from`` on the
caller's memory: the same layer lock (a write or a live move of the layer is never seen
half-done), lost-layer rules, residency counting, write-back check and path counters as a
transfer through a copy thread, and none of the hops.

What it leaves to :meth:`KVContext.read` and :meth:`KVContext.write`: a store on a GPU (the
pinned buffer is the DMA's source), padded rows, a span that would overrun its half of the
memory, and memory the target cannot take at that address. The functions then return False
and move nothing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dualblade.actors import (
    DirectSpan,
    PageCacheSpan,
    check_write_back,
    count_residency,
    fast_sync,
)
from dualblade.io_engine import AlignedBuffer, IOFailedError
from dualblade.pipeline import RowRange, TensorKind
from dualblade.store.errors import KVShapeError
from dualblade.store.tensor_shape import requested_rows

if TYPE_CHECKING:
    from dualblade.store.context import KVContext

_KINDS: tuple[TensorKind, TensorKind] = ("K", "V")


def _alignment(span: Any) -> int:
    """What the span's storage asks of a buffer address (O_DIRECT: the target's alignment)."""
    storage = span.target if isinstance(span, DirectSpan) else span.file
    return int(storage.alignment)


async def _spans_at(
    ctx: KVContext, layer: int, rows: RowRange, memory: AlignedBuffer, offsets: tuple[int, int]
) -> list[Any] | None:
    """K's and V's spans of ``rows``, moved to ``offsets`` of ``memory``; None where the
    memory cannot take them as they are (padded rows, an overrun, an unaligned address)."""
    spans = []
    for kind, offset in zip(_KINDS, offsets, strict=True):
        span, view = await ctx._placed(layer, kind, rows)
        exact = len(rows) * view.row_bytes
        if (
            view.row_stride != view.row_bytes
            or span.buffer_offset != 0
            or span.nbytes != exact
            or offset < 0
            or offset + exact > memory.size
            or (memory.address + offset) % _alignment(span)
        ):
            return None
        spans.append(span.at(offset))
    return spans


def _traced(ctx: KVContext, what: str, layer: int, spans: list[Any]) -> Any:
    """A slice on the trace's ``straight`` track, as a copy thread records its transfers (the
    I/O chunks are on the engine's track either way)."""
    nbytes = sum(span.nbytes for span in spans)
    paths = "+".join(sorted({span.path for span in spans}))
    return ctx._runtime.tracer.span(
        "straight", f"{what} ctx {ctx.id} layer {layer}", bytes=nbytes, path=paths
    )


def _as_one(spans: list[Any]) -> Any | None:
    """K and V as one direct span where their blocks and their memory both follow each other,
    as they do in a one-layer run: one request instead of two."""
    k, v = spans
    if (
        isinstance(k, DirectSpan)
        and isinstance(v, DirectSpan)
        and k.file_offset + k.nbytes == v.file_offset
        and k.buffer_offset + k.nbytes == v.buffer_offset
    ):
        return replace(k, nbytes=k.nbytes + v.nbytes, label=f"{k.label} + V")
    return None


async def read_layer_straight(
    ctx: KVContext, layer: int, memory: AlignedBuffer, offsets: tuple[int, int]
) -> bool:
    """Read all written rows of ``layer``'s K into ``memory`` at ``offsets[0]`` and its V at
    ``offsets[1]``, each as ``[rows, batch, width]`` with no gaps; True once they landed.

    A page-cache span is first copied on the spot from what the page cache holds (a ``preadv``
    that never waits for the disk, GIL released): a trip through the ring and back costs more
    than the copy, and the copy itself says what was resident, so no ``mincore`` is asked. What
    was not resident is looked up, checked for a failed write-back and read through the ring.

    False (nothing read): see the module docstring; read with :meth:`KVContext.read` then.

    Raises:
        ContextClosedError, KVShapeError: a closed context, a layer out of range or never
            written.
        LayerLostError: an earlier write of the layer failed or was cancelled.
        IOFailedError: the read failed (the caller's memory holds partial bytes).
    """
    if ctx._runtime.device.type != "cpu":
        return False
    ctx._check_layer(layer)
    async with fast_sync.holding(ctx._layer_locks[layer]):
        ctx._check_intact(layer)
        rows = RowRange(*requested_rows(None, ctx.length(layer), layer))
        spans = await _spans_at(ctx, layer, rows, memory, offsets)
        if spans is None:
            return False
        one = _as_one(spans)
        with _traced(ctx, "load", layer, spans):
            for span in [one] if one is not None else spans:
                await _read_span(ctx, layer, memory, span)
    return True


async def _read_span(ctx: KVContext, layer: int, memory: AlignedBuffer, span: Any) -> None:
    """Read one span into ``memory``: a page-cache span's resident prefix by a copy on the
    spot (its bytes are the span's hits), the rest — and every other span — through the
    ring, after the residency count and write-back check that a copy thread makes."""
    if isinstance(span, PageCacheSpan):
        got = span.read_cached_into(memory)
        span.counters.add_lookup(got, got)  # resident when read: hits
        if got == span.nbytes:
            return
        span = span.piece(span.buffer_offset + got, span.nbytes - got)
    count_residency(span)
    try:
        await check_write_back(span)
    except IOFailedError:
        ctx._lost.add(layer)  # the file's bytes on disk are older than those written
        raise
    await span.read_into(memory)


async def write_layer_straight(
    ctx: KVContext, layer: int, memory: AlignedBuffer, offsets: tuple[int, int], rows: int
) -> bool:
    """Write rows ``[0, rows)`` of ``layer`` (a prefill) from ``memory``: K at ``offsets[0]``,
    V at ``offsets[1]``, each ``[rows, batch, width]`` with no gaps; True once written.

    As :meth:`KVContext.write`: a write that fails or is cancelled part-way loses the layer
    until a later write succeeds. False (nothing written, the layer as it was): see the module
    docstring; write with :meth:`KVContext.write` then.

    Raises:
        ContextClosedError, KVShapeError: a closed context, a layer out of range, ``rows``
            outside ``1..max_len``.
        IOFailedError: the write failed (the layer is lost).
    """
    if ctx._runtime.device.type != "cpu":
        return False
    ctx._check_layer(layer)
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 < rows <= ctx.max_len:
        raise KVShapeError(f"write of {rows!r} rows; a context holds 1..{ctx.max_len} rows")
    try:
        # Waiting for the layer's lock (a move) counts as part of the write, as in write().
        async with fast_sync.holding(ctx._layer_locks[layer]):
            spans = await _spans_at(ctx, layer, RowRange(0, rows), memory, offsets)
            if spans is None:
                return False
            one = _as_one(spans)
            with _traced(ctx, "store", layer, spans):
                for span in [one] if one is not None else spans:
                    await span.write_from(memory)
            ctx._lost.discard(layer)
            ctx._lengths[layer] = rows
    except BaseException:
        ctx._lost.add(layer)  # some rows may hold new bytes and some old ones
        raise
    return True
