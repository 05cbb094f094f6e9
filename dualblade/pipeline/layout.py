"""How one KPU lies on a direct target: rows of ``batch × kv_heads × head_dim`` elements, each
padded to a whole number of logical blocks.

A KV tensor is ``[seq, batch, kv_heads * head_dim]`` row-major, and decode appends one *row* per
step. The direct path can only transfer whole logical blocks, so a row that is not a multiple of
the LBA size (OPT-13B at batch 1: 10 KiB rows on 4 KiB blocks) would make an append share a block
with the next row — a read-modify-write that races with the neighbour's own write. Instead the row
*stride* is rounded up to the LBA size: each row owns its blocks, appends never touch another
row's bytes, and the price is reported as ``padding_overhead``. Where the row is already a
multiple (every OPT model at even batch sizes), the stride equals the row and nothing is wasted.

The pinned buffer holds the same padded image, so the NVMe DMA and the GPU DMA share one buffer
(Co-DMA); the GPU side copies ``row_bytes`` out of every ``row_stride``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualblade.pipeline.errors import PlanError
from dualblade.pipeline.shapes import ModelShape
from dualblade.pipeline.sizes import BlockCount, ByteCount, round_up


@dataclass(frozen=True)
class TensorLayout:
    """Rows, their logical size and padded stride, on a target of ``lba_size``-byte blocks."""

    rows: int
    row_bytes: ByteCount
    lba_size: ByteCount

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.row_bytes <= 0:
            raise PlanError(f"a KV tensor needs rows and bytes per row (got {self})")
        if self.lba_size <= 0 or self.lba_size & (self.lba_size - 1):
            raise PlanError(f"lba_size must be a power of two (got {self.lba_size})")

    @classmethod
    def for_shape(cls, shape: ModelShape, batch: int, max_len: int, lba_size: int) -> TensorLayout:
        """The layout of every K (and V) tensor of ``shape`` for a batch and maximum length."""
        return cls(max_len, shape.row_bytes(batch), ByteCount(lba_size))

    @property
    def row_stride(self) -> ByteCount:
        """Bytes from one row's start to the next: ``row_bytes`` rounded up to the LBA size."""
        return ByteCount(round_up(self.row_bytes, self.lba_size))

    @property
    def blocks_per_row(self) -> BlockCount:
        """Logical blocks one row owns."""
        return BlockCount(self.row_stride // self.lba_size)

    @property
    def padding_per_row(self) -> ByteCount:
        """Bytes of padding after each row (0 when the row is a multiple of the LBA size)."""
        return ByteCount(self.row_stride - self.row_bytes)

    @property
    def padding_overhead(self) -> float:
        """Padding as a fraction of the payload: 0.2 means 20 % more device space and I/O."""
        return self.padding_per_row / self.row_bytes

    @property
    def payload_bytes(self) -> ByteCount:
        """Bytes of tensor data: ``rows * row_bytes``."""
        return ByteCount(self.rows * self.row_bytes)

    @property
    def image_bytes(self) -> ByteCount:
        """Bytes of the padded image on the device and in the pinned buffer."""
        return ByteCount(self.rows * self.row_stride)

    @property
    def n_blocks(self) -> BlockCount:
        """Logical blocks of the whole padded tensor: its extent's size."""
        return BlockCount(self.rows * self.blocks_per_row)
