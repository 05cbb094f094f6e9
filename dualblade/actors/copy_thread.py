"""Copy-thread actors: each owns one pinned, KPU-sized buffer and moves KPUs through it.

A load is storage -> pinned buffer (through the I/O engine's ring) -> device (through the
GPU-DMA actor); a store is the reverse. On the direct path the pinned buffer is both the
O_DIRECT/NVMe DMA buffer and the GPU copy's source or destination (Co-DMA): a KV byte crosses
host memory once. The buffer mirrors the KPU's padded image on storage, so a slice of rows
``[a, b)`` sits at ``a × row_stride`` in both places.

How bytes reach storage is not the copy thread's business: the runtime hands it a
:class:`StorageSpan` (direct extent, page-cache file, memory map ...) that fills or drains the
buffer. Storage transfers (all but an appended row's) hold one slot of the shared
:class:`~dualblade.actors.strategy_probe.OverlapGate`, which is how the overlap strategy acts.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, cast

import anyio
import torch
from anyio.abc import TaskGroup, TaskStatus

from dualblade.actors import pinned_images, row_staging, transfer_pieces
from dualblade.actors._base import Actor, ActorStoppedError, Reply
from dualblade.actors._ranges import RangeLocks
from dualblade.actors.buffer_views import BufferViews
from dualblade.actors.chained_load import ChainedLoad
from dualblade.actors.copy_messages import (
    ChainableSpan,
    CopyMessage,
    Load,
    RowView,
    StorageSpan,
    Store,
    TransferStats,
    in_image,
    split_pieces,
)
from dualblade.actors.gpu_dma import Copy, GpuDmaActor
from dualblade.actors.host_paths import host_tensor_for, landing_for
from dualblade.actors.strategy_probe import OverlapGate
from dualblade.errors import DualbladeError, plain_errors
from dualblade.io_engine import AlignedBuffer, StorageSlots
from dualblade.telemetry import NULL_TRACER, Tracer

#: Transfers a copy thread runs at once: on the host most never touch its buffer (loads land in
#: the caller's memory), so four; with CUDA one per image of the buffer, two at most.
HOST_TRANSFERS, CUDA_TRANSFERS = 4, 2


class CopyThreadActor(Actor[CopyMessage]):
    """One copy thread.

    Args:
        index: its number (names its trace track).
        buffer: its pinned buffer, one KPU's padded image (registered with the ring, page-locked
            for CUDA by the runtime).
        dma: the GPU-DMA actor.
        gate: the overlap gate shared by all copy threads.
        images: KPU images the buffer holds. With two, the thread reads the next KPU into one
            while the GPU copies the last one out of the other; with one, a KPU's read waits
            for the previous KPU's DMA to leave the buffer.
        rows_aside: the buffer ends in ``ROW_STAGING_BYTES`` of room for appended rows, after
            its images: small stores run there beside the transfers (:mod:`.row_staging`).
    """

    def __init__(
        self,
        index: int,
        buffer: AlignedBuffer,
        dma: GpuDmaActor,
        gate: OverlapGate,
        *,
        images: int = 1,
        rows_aside: bool = False,
        tracer: Tracer = NULL_TRACER,
    ) -> None:
        if images not in (1, 2):  # before the actor's mailbox exists
            raise ValueError(f"a copy thread's buffer holds 1 or 2 KPU images, not {images}")
        super().__init__(f"copy-thread-{index}", tracer=tracer)
        self.index = index
        self.buffer = buffer
        self._view_tensor = BufferViews(buffer)  # cleared on stop: its views pin the buffer
        self.dma = dma
        self.gate = gate
        self.bytes_loaded = 0
        self.direct_transfers = 0
        self.co_dma_transfers = 0
        self.bytes_stored = 0
        self._ranges = RangeLocks()
        staging = row_staging.ROW_STAGING_BYTES if rows_aside else 0
        self.image_bytes = (buffer.size - staging) // images
        self.image_windows = pinned_images.image_windows(buffer, images, self.image_bytes)
        #: the room for rows, where small stores run without a lease (None: none)
        self.rows = row_staging.RowStaging(images * self.image_bytes) if rows_aside else None
        self.piece_bytes = transfer_pieces.piece_bytes_for(
            cuda=dma.cuda, image_bytes=self.image_bytes
        )
        #: Each transfer has an image to itself with CUDA (read and copy chained there) or two
        #: images: one image runs one transfer at a time, the other threads keep storage busy.
        self._own_images = dma.cuda or images > 1
        #: Transfers at once, the tail of one over the head of the next (one-image CUDA: one).
        self.max_transfers = min(CUDA_TRANSFERS, images) if self._own_images else HOST_TRANSFERS
        self._slots = anyio.Semaphore(self.max_transfers)
        self._free_images = list(range(images))
        self._chained: set[ChainedLoad] = set()  # CUDA loads in flight with no task
        self._chained_idle: anyio.Event | None = None
        self._task_group: TaskGroup | None = None

    async def on_stop(self) -> None:
        # Chained loads still read into or copy out of the buffer: stop their reads, and wait
        # for them (and their copies) to settle before the owner may free it.
        for load in list(self._chained):
            if load.cancel is not None:
                load.cancel()
        while self._chained:
            self._chained_idle = anyio.Event()
            await self._chained_idle.wait()
        self._view_tensor.clear()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            await super().run(task_status=task_status)

    def _check(self, span: StorageSpan, view: RowView) -> None:
        assert span.buffer_offset == view.offset, "span and view must start at the same row"
        assert span.nbytes == view.rows * view.row_stride, "span and view must cover the same rows"
        assert view.offset + span.nbytes <= self.image_bytes, f"{span.label} overruns the buffer"

    async def handle(self, message: CopyMessage) -> None:
        """Start the transfer and return: the next message may begin while this one ends."""
        self._check(message.span, message.view)
        assert self._task_group is not None
        if self.rows is not None and self.takes_aside(message):  # rows: for mypy
            self._task_group.start_soon(self.rows.run, message, self._answered)
            return
        await self._slots.acquire()
        image = self._free_images.pop() if self._own_images else 0
        try:
            if self._own_images and self._start_chained(message, image):
                return
        except BaseException:
            self._release(image)
            raise
        self._task_group.start_soon(self._transfer, message, image)

    def _release(self, image: int) -> None:
        if self._own_images:
            self._free_images.append(image)
        self._slots.release()

    def takes_aside(self, message: CopyMessage) -> bool:
        """Whether ``message`` runs in the room for rows, with no lease (the pool asks too)."""
        return self.rows is not None and row_staging.stages_rows(message)

    async def _transfer(self, message: CopyMessage, image: int) -> None:
        try:
            await self._answered(message, self.image_windows[image].offset)
        finally:
            self._release(image)

    async def _answered(self, message: CopyMessage, image_base: int) -> None:
        """Run the transfer; a failure is told to whoever asked for it."""
        try:
            await self._run_transfer(message, image_base)
        except DualbladeError as error:  # a failed I/O belongs to the context that asked
            message.reply.fail(error)
        except BaseException as error:
            # Cancelled (the store is stopping) or a bug: answer anyway, a requester may be
            # waiting for the transfer to settle before it releases the storage.
            message.reply.fail(ActorStoppedError(f"{self.name} stopped: {error!r}"))
            raise

    async def _run_transfer(self, message: CopyMessage, image_base: int) -> None:
        span = message.span
        start = time.perf_counter()
        with self.tracer.span(
            self.name,
            f"{'load' if isinstance(message, Load) else 'store'} {span.label}",
            bytes=span.nbytes,
            path=span.path,
        ):
            landing = landing_for(message, cuda=self.dma.cuda)
            if landing is not None:
                assert isinstance(message, Load)
                host: torch.Tensor | None = message.destination
                storage_done = await self._land(*landing)
            elif (host := host_tensor_for(message, cuda=self.dma.cuda)) is not None:
                storage_done = await self._host_transfer(message, host)
            else:  # through the pinned buffer, in this transfer's image of it
                message = in_image(message, image_base)
                if isinstance(message, Load):
                    storage_done = await self._load(message)
                else:
                    storage_done = await self._store(message)
            if isinstance(message, Load):
                self.bytes_loaded += span.nbytes
            else:
                self.bytes_stored += span.nbytes
        message.reply.set(self._stats(message, start, storage_done, host))

    def _stats(
        self, placed: CopyMessage, start: float, storage_done: float, host: torch.Tensor | None
    ) -> TransferStats:
        """What a transfer that just ended did; ``placed``: in its image of the buffer."""
        end = time.perf_counter()
        span = placed.span
        if host is not None:  # storage moved the caller's own bytes; no DMA side
            io_address = dma_address = host.data_ptr()
        else:
            io_address = self.buffer.address + span.buffer_offset
            dma_address = self.buffer.address + placed.view.offset
        if span.path == "direct":
            # Co-DMA evidence: storage DMA and the device copy used the same host bytes.
            self.direct_transfers += 1
            self.co_dma_transfers += io_address == dma_address
        return TransferStats(
            span.nbytes,
            storage_done - start,
            end - storage_done,
            span.path,
            io_address,
            dma_address,
        )

    def _start_chained(self, message: CopyMessage, image: int) -> bool:
        """Start a CUDA load of one piece as a :class:`ChainedLoad` (no task: the read and the
        copy chained on the engine's thread), or say that it cannot be one."""
        if not isinstance(message, Load) or not self.dma.cuda:
            return False
        placed = in_image(message, self.image_windows[image].offset)
        assert isinstance(placed, Load)
        pieces = split_pieces(placed.span, placed.view, self.piece_bytes)
        span, view, _ = pieces[0]
        if len(pieces) > 1 or not hasattr(span, "read_then"):
            return False
        load = ChainedLoad(message, placed, image, self._chained_ended)
        copy = Copy(self._view_tensor(view), message.destination, "h2d", span.label, load)
        load.launch = self.dma.chain(copy)
        if load.launch is None:
            return False
        self._chained.add(load)
        slots = self.gate.limiter_for(span.path)
        try:
            load.cancel = cast(ChainableSpan, span).read_then(self.buffer, slots, load.read_ended)
        except BaseException as error:  # refused at once: told on the loop, as a failed read
            load.read_ended(error.with_traceback(None))
        return True

    def _chained_ended(self, load: ChainedLoad, error: BaseException | None) -> None:
        """On the loop: a chained load's copy is done, or its read or copy failed."""
        self._chained.discard(load)
        self._release(load.image)
        reply = load.message.reply
        if error is None:
            self.bytes_loaded += load.placed.span.nbytes
            reply.set(self._stats(load.placed, load.start, load.read_end, None))
        elif isinstance(error, DualbladeError):  # a failed I/O belongs to the context that asked
            reply.fail(error)
        else:
            reply.fail(ActorStoppedError(f"{self.name}: the load failed: {error!r}"))
        if not self._chained and self._chained_idle is not None:
            self._chained_idle.set()

    async def _land(self, span: StorageSpan, memory: AlignedBuffer) -> float:
        """Storage -> the caller's aligned memory, holding a storage slot of the overlap gate.

        Taken on the loop, not handed on in the engine as CUDA loads' are: on this 2-core
        machine the serving preset's dual at 768 MiB ran at 28.7-29.2 tokens/s with slots
        handed on in the engine, 31.8-34.2 with these (docs/pipeline-profile.md)."""
        async with self.gate.limiter_for(span.path):
            with self.tracer.span(self.name, f"land {span.label}", bytes=span.nbytes):
                await span.read_into(memory)
        return time.perf_counter()

    async def _host_transfer(self, message: CopyMessage, host: torch.Tensor) -> float:
        """Storage <-> the caller's host tensor, holding a storage slot of the overlap gate."""
        span: Any = message.span
        async with self.gate.limiter_for(span.path):
            with self.tracer.span(self.name, f"host {span.label}", bytes=span.nbytes):
                if isinstance(message, Load):
                    await span.read_to_host(host)
                else:
                    await span.write_from_host(host)
        return time.perf_counter()

    async def _load(self, message: Load) -> float:
        """Storage -> pinned -> device, piece by piece: a piece's DMA overlaps later reads.
        Returns when the last read finished."""
        pieces = split_pieces(message.span, message.view, self.piece_bytes)
        limiter = self.gate.limiter_for(message.span.path)
        if len(pieces) == 1 and self._own_images:
            # CUDA's common case: one piece, in an image of this transfer's own (its room is
            # never waited for), so its read waits for the storage slot in the engine, where
            # the read before it hands the slot on from the ring thread (StorageSlots).
            sub_span, sub_view, _ = pieces[0]  # all rows: the destination itself, not a slice
            region = (sub_span.buffer_offset, sub_span.buffer_offset + sub_span.nbytes)
            await self._ranges.acquire(*region)
            try:
                with self.tracer.span(self.name, f"read {sub_span.label}", bytes=sub_span.nbytes):
                    await sub_span.read_into(self.buffer, limiter)
                storage_done = time.perf_counter()
                await self._dma(
                    self._view_tensor(sub_view), message.destination, "h2d", sub_span.label
                )
            finally:
                self._ranges.release(*region)
            return storage_done
        return await self._load_pieces(message, pieces, limiter)

    async def _load_pieces(
        self,
        message: Load,
        pieces: list[tuple[StorageSpan, RowView, slice]],
        limiter: StorageSlots,
    ) -> float:
        """:meth:`_load` holding one storage slot from the first piece's read to the last's
        (Overlap-Cross: one thread reads at a time while DMAs trail). The slot is taken before
        the buffer's room, as stores take them, or the two could wait for each other forever."""
        await limiter.acquire()
        reads_left = len(pieces)
        storage_done = time.perf_counter()

        def read_finished() -> None:
            nonlocal reads_left, storage_done
            reads_left -= 1
            if reads_left == 0:
                limiter.release()
                storage_done = time.perf_counter()

        async def piece(sub_span: StorageSpan, sub_view: RowView, rows: slice) -> None:
            region = (sub_span.buffer_offset, sub_span.buffer_offset + sub_span.nbytes)
            try:
                await self._ranges.acquire(*region)
            except BaseException:
                read_finished()
                raise
            try:
                try:
                    with self.tracer.span(
                        self.name, f"read {sub_span.label}", bytes=sub_span.nbytes
                    ):
                        await sub_span.read_into(self.buffer)
                finally:
                    read_finished()
                await self._dma(
                    self._view_tensor(sub_view), message.destination[rows], "h2d", sub_span.label
                )
            finally:
                self._ranges.release(*region)

        try:
            with plain_errors():  # a piece's DualbladeError must reach _transfer as itself
                async with anyio.create_task_group() as tg:
                    for sub_span, sub_view, rows in pieces:
                        tg.start_soon(piece, sub_span, sub_view, rows)
        finally:
            if reads_left > 0:  # a piece never started: do not leak the storage slot
                limiter.release()
        return storage_done

    async def _store(self, message: Store) -> float:
        """Device -> pinned -> storage, piece by piece: a piece's write overlaps later DMAs."""
        small = message.span.nbytes <= row_staging.SLOTLESS_STORE_BYTES
        slot = contextlib.nullcontext() if small else self.gate.limiter_for(message.span.path)
        with plain_errors():
            async with slot, anyio.create_task_group() as tg:
                for sub_span, sub_view, rows in split_pieces(
                    message.span, message.view, self.piece_bytes
                ):
                    region = (sub_span.buffer_offset, sub_span.buffer_offset + sub_span.nbytes)
                    await self._ranges.acquire(*region)
                    try:
                        await self._dma(
                            message.source[rows],
                            self._view_tensor(sub_view),
                            "d2h",
                            sub_span.label,
                        )
                    except BaseException:
                        self._ranges.release(*region)
                        raise
                    tg.start_soon(self._write_piece, sub_span, region)
        return time.perf_counter()

    async def _write_piece(self, sub_span: StorageSpan, region: tuple[int, int]) -> None:
        try:
            with self.tracer.span(self.name, f"write {sub_span.label}", bytes=sub_span.nbytes):
                await sub_span.write_from(self.buffer)
        finally:
            self._ranges.release(*region)

    async def _dma(
        self, source: torch.Tensor, destination: torch.Tensor, direction: str, label: str
    ) -> None:
        reply: Reply[int] = Reply()
        await self.dma.ask(Copy(source, destination, direction, label, reply), reply)
