"""What a copy thread is asked to move: the storage span protocol, row views and messages.

A :class:`Load` or :class:`Store` pairs the storage side (a :class:`StorageSpan`: direct extent,
page-cache file, memory map — see :mod:`.spans`) with the rows of the caller's tensor
(:class:`RowView`), and carries the :class:`~dualblade.actors.Reply` the requester awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from dualblade.actors._base import Reply
from dualblade.io_engine import AlignedBuffer, StorageSlots


class StorageSpan(Protocol):
    """Bytes ``[buffer_offset, buffer_offset + nbytes)`` of a copy thread's buffer on storage."""

    label: str
    path: str  # "direct", "page-cache" or "baseline", for accounting
    buffer_offset: int
    nbytes: int

    async def read_into(self, buffer: AlignedBuffer, slots: StorageSlots | None = None) -> None:
        """Fill the buffer's span from storage, holding one of ``slots`` (when given) exactly
        while the read is in flight."""

    async def write_from(self, buffer: AlignedBuffer) -> None:
        """Write the buffer's span to storage."""

    def piece(self, buffer_offset: int, nbytes: int) -> StorageSpan:
        """The sub-span of ``nbytes`` starting at ``buffer_offset`` (inside this span)."""

    def at(self, buffer_offset: int) -> StorageSpan:
        """The same bytes of storage, moved to ``buffer_offset`` of another buffer."""


class ChainableSpan(StorageSpan, Protocol):
    """A span whose read can end on the engine's thread (direct and page-cache spans)."""

    def read_then(
        self,
        buffer: AlignedBuffer,
        slots: StorageSlots | None,
        then: Callable[[BaseException | None], None],
    ) -> Callable[[], None]:
        """Start the read; ``then(error or None)`` on the engine's thread when it ends; returns
        a function that cancels it (see ``IOEngine.read_then``)."""


@dataclass(frozen=True)
class RowView:
    """Rows of a ``[rows, batch, width]`` tensor laid out in a buffer with a padded row stride."""

    offset: int  # byte offset of the first row in the buffer
    rows: int
    row_bytes: int
    row_stride: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # (rows, batch, width)

    def moved(self, shift: int) -> RowView:
        """The same rows ``shift`` bytes further into the buffer."""
        return RowView(
            self.offset + shift, self.rows, self.row_bytes, self.row_stride, self.dtype, self.shape
        )

    def tensor(self, buffer: AlignedBuffer | torch.Tensor) -> torch.Tensor:
        """A tensor aliasing the rows in ``buffer`` (no copy; strided when rows are padded).

        ``buffer`` may be the buffer's whole byte tensor, made once: slicing it costs a few
        microseconds, aliasing the buffer anew (``torch.frombuffer``) tens of them.
        """
        nbytes = self.rows * self.row_stride
        if isinstance(buffer, torch.Tensor):
            raw = buffer[self.offset : self.offset + nbytes]
        else:
            raw = buffer.tensor(torch.uint8, count=nbytes, offset=self.offset)
        rows = raw.view(self.rows, self.row_stride)[:, : self.row_bytes]
        return rows.view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class TransferStats:
    """What one load or store did, for metrics, traces and Co-DMA evidence."""

    nbytes: int
    storage_s: float
    dma_s: float
    path: str
    io_buffer_address: int  # the buffer storage DMA used
    dma_host_address: int  # the host side of the GPU copy


@dataclass(frozen=True)
class Landing:
    """Aligned host memory holding a KPU's image from ``offset`` on (rows ``[a, b)`` at
    ``offset + a × row_stride``): a caller's read buffer that storage can write into itself."""

    buffer: AlignedBuffer
    offset: int


@dataclass(frozen=True)
class Load:
    """Storage -> pinned -> ``destination``.

    ``landing``: where ``destination`` lies in aligned memory. On the host path storage then
    writes the rows there directly, and the bytes cross host memory once instead of twice (no
    pinned buffer, no copy out of it).
    """

    span: StorageSpan
    view: RowView
    destination: torch.Tensor
    reply: Reply[TransferStats]
    landing: Landing | None = None


@dataclass(frozen=True)
class Store:
    """``source`` -> pinned -> storage."""

    source: torch.Tensor
    view: RowView
    span: StorageSpan
    reply: Reply[TransferStats]


CopyMessage = Load | Store


def in_image(message: CopyMessage, base: int) -> CopyMessage:
    """``message`` moved ``base`` bytes into its copy thread's buffer (its second image)."""
    if base == 0:
        return message
    span = message.span.at(message.span.buffer_offset + base)
    view = message.view.moved(base)
    # built directly: ``dataclasses.replace`` costs a KPU several times more (see spans.py)
    if isinstance(message, Load):
        return Load(span, view, message.destination, message.reply, message.landing)
    return Store(message.source, view, span, message.reply)


def split_pieces(
    span: StorageSpan, view: RowView, piece_bytes: int
) -> list[tuple[StorageSpan, RowView, slice]]:
    """Row-aligned pieces of ``span`` and ``view`` of about ``piece_bytes``, in order, each with
    the rows of the caller's tensor it holds."""
    rows_per_piece = max(1, piece_bytes // view.row_stride)
    if rows_per_piece >= view.rows:  # one piece (with CUDA's pieces, every KPU): no copies
        return [(span, view, slice(0, view.rows))]
    out: list[tuple[StorageSpan, RowView, slice]] = []
    for first in range(0, view.rows, rows_per_piece):
        last = min(view.rows, first + rows_per_piece)
        offset = view.offset + first * view.row_stride
        nbytes = (last - first) * view.row_stride
        sub_view = RowView(
            offset,
            last - first,
            view.row_bytes,
            view.row_stride,
            view.dtype,
            (last - first, *view.shape[1:]),
        )
        out.append((span.piece(offset, nbytes), sub_view, slice(first, last)))
    return out
