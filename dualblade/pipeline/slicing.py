"""Algorithm 2: a row slice of a KPU becomes ``(slba, nlb, buffer_offset, nbytes)`` chunks.

A copy thread asks for rows ``[a, b)`` of one K or V tensor — the prefix ``[0, t)`` that decode
re-reads, the single row ``t`` it appends, or any range. The extent's ``lba_start`` comes from the
LBA map; the row-major byte offset ``a × row_stride`` gives ``slba* = lba_start + a ×
blocks_per_row`` and ``req_bytes = (b - a) × row_stride``; the request is then cut into chunks of
at most ``max_transfer`` bytes (the controller's MDTS or the config's ``max_chunk``, a multiple of
the LBA size) that the copy thread submits with at most QD in flight.

Because rows are padded to whole blocks (:mod:`.layout`), a slice always covers exactly its own
rows' blocks: a chunk never reaches into the row before ``a`` or the row at ``b``.

``buffer_offset`` is relative to the start of the buffer that holds the slice's padded image
(``(b - a) × row_stride`` bytes); ``SlicePlan.image_offset`` says where that image begins inside
the KPU's whole padded image, for callers whose pinned buffer holds the entire tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualblade.pipeline.errors import PlanError
from dualblade.pipeline.layout import TensorLayout
from dualblade.pipeline.lba_map import KpuExtent
from dualblade.pipeline.sizes import BlockCount, ByteCount, Lba


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of a ``[seq, batch, width]`` tensor."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise PlanError(f"rows [{self.start}, {self.stop}) are not a range")

    @classmethod
    def prefix(cls, t: int) -> RowRange:
        """Rows ``[0, t)``: what one decode step re-reads."""
        return cls(0, t)

    @classmethod
    def row(cls, t: int) -> RowRange:
        """Row ``t`` alone: what one decode step appends."""
        return cls(t, t + 1)

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Chunk:
    """One device command's worth of a slice."""

    slba: Lba
    nlb: BlockCount
    buffer_offset: ByteCount
    nbytes: ByteCount

    def file_offset(self, lba_size: int) -> ByteCount:
        """The ``pread``/``pwrite`` offset of this chunk on a file or block target."""
        return ByteCount(self.slba * lba_size)


@dataclass(frozen=True)
class SlicePlan:
    """The chunks of one slice and the facts a copy thread needs around them."""

    extent: KpuExtent
    rows: RowRange
    row_bytes: ByteCount
    row_stride: ByteCount
    chunks: tuple[Chunk, ...]

    @property
    def buffer_bytes(self) -> ByteCount:
        """Bytes of the padded slice image the buffer must hold."""
        return ByteCount(len(self.rows) * self.row_stride)

    @property
    def payload_bytes(self) -> ByteCount:
        """Bytes of tensor data in the slice (without row padding)."""
        return ByteCount(len(self.rows) * self.row_bytes)

    @property
    def image_offset(self) -> ByteCount:
        """Where the slice begins inside the KPU's whole padded image."""
        return ByteCount(self.rows.start * self.row_stride)

    def file_ranges(self) -> tuple[tuple[ByteCount, ByteCount, ByteCount], ...]:
        """``(file_offset, nbytes, buffer_offset)`` per chunk: the same plan for a DirectFile."""
        lba_size = self.extent.lba_size
        return tuple((c.file_offset(lba_size), c.nbytes, c.buffer_offset) for c in self.chunks)


def plan_slice(
    extent: KpuExtent, layout: TensorLayout, rows: RowRange, max_transfer: int
) -> SlicePlan:
    """Algorithm 2 for one KPU: the device chunks of rows ``[a, b)``.

    Args:
        extent: the KPU's extent from the LBA map.
        layout: the KPU's row layout (its padded image must be exactly the extent).
        rows: the rows to move; an empty range gives no chunks.
        max_transfer: the largest command in bytes, a positive multiple of the LBA size.

    Raises:
        PlanError: the rows run past the tensor, ``max_transfer`` is not a positive multiple of
            the LBA size, or the layout does not match the extent.
    """
    lba_size = extent.lba_size
    if layout.lba_size != lba_size or layout.n_blocks != extent.n_blocks:
        raise PlanError(
            f"{extent.kpu}: the layout ({layout.n_blocks} blocks of {layout.lba_size} B) does not "
            f"match the extent ({extent.n_blocks} blocks of {lba_size} B)"
        )
    if max_transfer < lba_size or max_transfer % lba_size:
        raise PlanError(
            f"max transfer {max_transfer} B must be a positive multiple of the LBA size "
            f"{lba_size} B"
        )
    if rows.stop > layout.rows:
        raise PlanError(
            f"{extent.kpu}: rows [{rows.start}, {rows.stop}) run past the tensor's "
            f"{layout.rows} rows"
        )
    first = extent.lba_start + rows.start * layout.blocks_per_row
    total = len(rows) * layout.blocks_per_row
    per_chunk = max_transfer // lba_size
    chunks = tuple(
        Chunk(
            slba=Lba(first + done),
            nlb=BlockCount(min(per_chunk, total - done)),
            buffer_offset=ByteCount(done * lba_size),
            nbytes=ByteCount(min(per_chunk, total - done) * lba_size),
        )
        for done in range(0, total, per_chunk)
    )
    return SlicePlan(extent, rows, layout.row_bytes, layout.row_stride, chunks)
