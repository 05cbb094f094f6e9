"""Where a load can land in the caller's own memory, never touching a copy thread's buffer.

A decoder's read buffers (``ctx.read_buffers()``) are aligned memory laid out like a KPU's image,
so on the host an O_DIRECT or page-cache read can fill them straight from storage. Such a load
needs no room in a copy thread's pinned buffer: the copy thread and the copy-thread pool take it
at once, and only the overlap gate's storage slots bound it.
"""

from __future__ import annotations

from dualblade.actors.copy_messages import CopyMessage, Load, StorageSpan
from dualblade.io_engine import AlignedBuffer


def landing_of(message: CopyMessage, *, cuda: bool) -> tuple[StorageSpan, AlignedBuffer] | None:
    """The span moved into the caller's aligned memory, if a load can land there directly.

    Only without CUDA (with a GPU the pinned buffer is the DMA's source: Co-DMA), only for
    unpadded rows (the caller's tensor has no gaps between rows), and only where the
    destination sits in the landing memory exactly where the span puts its rows.
    """
    if cuda or not isinstance(message, Load) or message.landing is None:
        return None
    landing, view, span = message.landing, message.view, message.span
    start = landing.offset + span.buffer_offset
    if (
        view.row_stride != view.row_bytes
        or not message.destination.is_contiguous()
        or message.destination.data_ptr() != landing.buffer.address + start
        or start + span.nbytes > landing.buffer.size
    ):
        return None
    return span.at(start), landing.buffer


def lands_directly(message: CopyMessage, *, cuda: bool) -> bool:
    """Whether a load lands in the caller's memory, never touching a copy thread's buffer.

    Such a transfer needs no room in the buffer: a copy thread takes it at once, however many
    it already runs, and the copy-thread pool gives it no lease. What bounds it is the overlap
    gate's storage slots. (Bounding it by buffer room too cost a decode walk its read-ahead: a
    direct layer's reads that waited for the gate held the pool's leases, and the page-cache
    layer behind them could not start until the disk was done: 1.30x its floor against 1.13x.)
    """
    return landing_of(message, cuda=cuda) is not None
