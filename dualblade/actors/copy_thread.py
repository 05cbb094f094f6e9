"""Copy-thread actors: each owns one pinned, KPU-sized buffer and moves KPUs through it.

A load is storage -> pinned buffer (through the I/O engine's ring) -> device (through the
GPU-DMA actor); a store is the reverse. On the direct path the pinned buffer is both the
O_DIRECT/NVMe DMA buffer and the GPU copy's source or destination (Co-DMA): a KV byte crosses
host memory once. The buffer mirrors the KPU's padded image on storage, so a slice of rows
``[a, b)`` sits at ``a × row_stride`` in both places.

How bytes reach storage is not the copy thread's business: the runtime hands it a
:class:`StorageSpan` (direct extent, page-cache file, memory map ...) that fills or drains the
buffer. Storage transfers are done holding one slot of the shared
:class:`~dualblade.actors.strategy_probe.OverlapGate`, which is how the overlap strategy acts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from dualblade.actors._base import Actor, Reply
from dualblade.actors.gpu_dma import Copy, GpuDmaActor
from dualblade.actors.strategy_probe import OverlapGate
from dualblade.io_engine import AlignedBuffer
from dualblade.telemetry import NULL_TRACER, Tracer


class StorageSpan(Protocol):
    """Bytes ``[buffer_offset, buffer_offset + nbytes)`` of a copy thread's buffer on storage."""

    label: str
    path: str  # "direct", "page-cache" or "baseline", for accounting
    buffer_offset: int
    nbytes: int

    async def read_into(self, buffer: AlignedBuffer) -> None:
        """Fill the buffer's span from storage."""

    async def write_from(self, buffer: AlignedBuffer) -> None:
        """Write the buffer's span to storage."""


@dataclass(frozen=True)
class RowView:
    """Rows of a ``[rows, batch, width]`` tensor laid out in a buffer with a padded row stride."""

    offset: int  # byte offset of the first row in the buffer
    rows: int
    row_bytes: int
    row_stride: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # (rows, batch, width)

    def tensor(self, buffer: AlignedBuffer) -> torch.Tensor:
        """A tensor aliasing the rows in ``buffer`` (no copy; strided when rows are padded)."""
        raw = buffer.tensor(torch.uint8, count=self.rows * self.row_stride, offset=self.offset)
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
class Load:
    """Storage -> pinned -> ``destination``."""

    span: StorageSpan
    view: RowView
    destination: torch.Tensor
    reply: Reply[TransferStats]


@dataclass(frozen=True)
class Store:
    """``source`` -> pinned -> storage."""

    source: torch.Tensor
    view: RowView
    span: StorageSpan
    reply: Reply[TransferStats]


CopyMessage = Load | Store


class CopyThreadActor(Actor[CopyMessage]):
    """One copy thread.

    Args:
        index: its number (names its trace track).
        buffer: its pinned buffer, one KPU's padded image (registered with the ring, page-locked
            for CUDA by the runtime).
        dma: the GPU-DMA actor.
        gate: the overlap gate shared by all copy threads.
    """

    def __init__(
        self,
        index: int,
        buffer: AlignedBuffer,
        dma: GpuDmaActor,
        gate: OverlapGate,
        *,
        tracer: Tracer = NULL_TRACER,
    ) -> None:
        super().__init__(f"copy-thread-{index}", tracer=tracer)
        self.index = index
        self.buffer = buffer
        self.dma = dma
        self.gate = gate
        self.bytes_loaded = 0
        self.bytes_stored = 0

    def _check(self, span: StorageSpan, view: RowView) -> None:
        end = max(span.buffer_offset + span.nbytes, view.offset + view.rows * view.row_stride)
        assert end <= self.buffer.size, f"{span.label} overruns copy thread {self.index}'s buffer"

    async def handle(self, message: CopyMessage) -> None:
        self._check(message.span, message.view)
        pinned = message.view.tensor(self.buffer)
        if isinstance(message, Load):
            start = time.perf_counter()
            async with self.gate.limiter:
                with self.tracer.span(
                    self.name,
                    f"read {message.span.label}",
                    bytes=message.span.nbytes,
                    path=message.span.path,
                ):
                    await message.span.read_into(self.buffer)
            mid = time.perf_counter()
            await self._dma(pinned, message.destination, "h2d", message.span.label)
            end = time.perf_counter()
            self.bytes_loaded += message.span.nbytes
        else:
            start = time.perf_counter()
            await self._dma(message.source, pinned, "d2h", message.span.label)
            mid = time.perf_counter()
            async with self.gate.limiter:
                with self.tracer.span(
                    self.name,
                    f"write {message.span.label}",
                    bytes=message.span.nbytes,
                    path=message.span.path,
                ):
                    await message.span.write_from(self.buffer)
            end = time.perf_counter()
            self.bytes_stored += message.span.nbytes
        storage_s, dma_s = (
            (mid - start, end - mid) if isinstance(message, Load) else (end - mid, mid - start)
        )
        message.reply.set(
            TransferStats(
                nbytes=message.span.nbytes,
                storage_s=storage_s,
                dma_s=dma_s,
                path=message.span.path,
                io_buffer_address=self.buffer.address + message.span.buffer_offset,
                dma_host_address=pinned.data_ptr(),
            )
        )

    async def _dma(
        self, source: torch.Tensor, destination: torch.Tensor, direction: str, label: str
    ) -> None:
        reply: Reply[int] = Reply()
        await self.dma.ask(Copy(source, destination, direction, label, reply), reply)
