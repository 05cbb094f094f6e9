"""A whole layer read from storage straight into the caller's host memory, on the caller's task.

Why a path beside the copy threads: on the host (no GPU) a copy thread adds nothing to a read
that can land where the caller wants it — storage writes the bytes itself, there is no DMA to
overlap — but each read through it costs two actor messages, a pool lease, range locks, a task
group and their cancel scopes on the event loop. For a caller that moves many small layers
(LMCache's 1 MiB objects, each a context of one layer) that Python, not the disk, set the rate:
about 1 ms of event-loop time per object. Here a read is the spans' own ``read_into`` on the
caller's memory: the same residency counting, write-back check, layer lock (so a write or a
live move of the layer is never read half-done) and path counters as a read through a copy
thread, and none of the hops.

What it leaves to :meth:`KVContext.read`: a store on a GPU (the pinned buffer is the DMA's
source), padded rows, a span that would overrun its half of the memory, and memory the target
cannot take at that address. :func:`read_layer_straight` then returns False and reads nothing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dualblade.actors import DirectSpan, PageCacheSpan, check_write_back, count_residency
from dualblade.io_engine import AlignedBuffer, IOFailedError
from dualblade.pipeline import RowRange, TensorKind
from dualblade.store.tensor_shape import requested_rows

if TYPE_CHECKING:
    from dualblade.store.context import KVContext


def _alignment(span: Any) -> int:
    """What the span's storage asks of a buffer address (O_DIRECT: the target's alignment)."""
    storage = span.target if isinstance(span, DirectSpan) else span.file
    return int(storage.alignment)


async def read_layer_straight(
    ctx: KVContext, layer: int, memory: AlignedBuffer, offsets: tuple[int, int]
) -> bool:
    """Read all written rows of ``layer``'s K into ``memory`` at ``offsets[0]`` and its V at
    ``offsets[1]``, each as ``[rows, batch, width]`` with no gaps; True once they landed.

    False (nothing read): the store runs on a GPU, the rows are padded on their medium, a half
    would not fit in ``memory``, or an address is not aligned as the storage needs; read with
    :meth:`KVContext.read` then.

    Raises:
        ContextClosedError, KVShapeError: a closed context, a layer out of range or never
            written.
        LayerLostError: an earlier write of the layer failed or was cancelled.
        IOFailedError: the read failed (the caller's memory holds partial bytes).
    """
    if ctx._runtime.device.type != "cpu":
        return False
    ctx._check_layer(layer)
    async with ctx._layer_locks[layer]:
        ctx._check_intact(layer)
        rows = RowRange(*requested_rows(None, ctx.length(layer), layer))
        spans = []
        kinds: tuple[TensorKind, TensorKind] = ("K", "V")
        for kind, offset in zip(kinds, offsets, strict=True):
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
                return False
            spans.append(span.at(offset))
        for span in spans:
            count_residency(span)
            try:
                await check_write_back(span)
            except IOFailedError:
                ctx._lost.add(layer)  # the file's bytes on disk are older than those written
                raise
        k, v = spans
        if (
            isinstance(k, DirectSpan)
            and isinstance(v, DirectSpan)
            and k.file_offset + k.nbytes == v.file_offset
            and k.buffer_offset + k.nbytes == v.buffer_offset
        ):
            # K's and V's blocks follow each other, as they do in a one-layer run: one request.
            await replace(k, nbytes=k.nbytes + v.nbytes, label=f"{k.label} + V").read_into(memory)
        else:
            for span in spans:
                if isinstance(span, PageCacheSpan) and span.missing == 0:
                    span.read_resident_into(memory)  # a memory copy: no ring round trip
                else:
                    await span.read_into(memory)
    return True
