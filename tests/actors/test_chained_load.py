"""A copy thread's CUDA load with its copy chained to the read (``GpuDmaActor.chain``), end to
end on a real ring and file, with the GPU-DMA actor on a fake driver whose copies move host
bytes (``fake_cuda``): the bytes arrive, the load is Co-DMA, a failed read fails that load only,
and a load cancelled mid-read lets go of nothing before the read and its copy have ended."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import pytest
import torch

from dualblade.actors import (
    CopyThreadActor,
    GpuDmaActor,
    Load,
    OverlapGate,
    Reply,
    RowView,
    Store,
    TransferStats,
)
from dualblade.actors.spans import DirectSpan, PageCacheSpan, PathCounters
from dualblade.io_engine import (
    AlignedBuffer,
    DirectFile,
    IOEngine,
    IOFailedError,
    PageCacheFile,
    Target,
)
from dualblade.testing import FaultKind, FaultPolicy, FaultyTarget

from .fake_cuda import FakeLibrary, fake_cuda_dma

pytestmark = pytest.mark.anyio

ROWS, BATCH, WIDTH = 16, 2, 1024  # 4 KiB rows of float16, unpadded: the copy is contiguous
ROW_BYTES = BATCH * WIDTH * 2


@dataclass
class Rig:
    thread: CopyThreadActor
    dma: GpuDmaActor
    held: FakeLibrary
    engine: IOEngine
    target: DirectFile
    buffer: AlignedBuffer
    scope: anyio.CancelScope  # the actors' task group's

    async def move(
        self, kind: str, tensor: torch.Tensor, target: Target | None = None
    ) -> TransferStats:
        view = RowView(0, ROWS, ROW_BYTES, ROW_BYTES, tensor.dtype, tuple(tensor.shape))
        span = DirectSpan(
            self.engine, target or self.target, 0, ROWS * ROW_BYTES, 0, "L0.K", PathCounters()
        )
        reply: Reply[TransferStats] = Reply()
        message = (
            Load(span, view, tensor, reply) if kind == "load" else Store(tensor, view, span, reply)
        )
        return await self.thread.ask(message, reply)


@contextlib.asynccontextmanager
async def make_rig(tmp_path, images: int = 2) -> AsyncIterator[Rig]:
    with (
        IOEngine(queue_depth=8, max_chunk=16 << 10) as engine,
        DirectFile(tmp_path / "direct.kv", ROWS * ROW_BYTES) as target,
        AlignedBuffer(images * ROWS * ROW_BYTES) as buffer,  # two KPU images, as on CUDA
    ):
        dma = GpuDmaActor(torch.device("cpu"))
        async with anyio.create_task_group() as tg:
            await tg.start(dma.run)
            held = fake_cuda_dma(dma)
            thread = CopyThreadActor(0, buffer, dma, OverlapGate(1), images=images)
            await tg.start(thread.run)
            try:
                yield Rig(thread, dma, held, engine, target, buffer, tg.cancel_scope)
            finally:  # the body runs in this task group: cancelling it ends the body too
                thread.close()
                dma.close()


def data(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((ROWS, BATCH, WIDTH), generator=generator).to(torch.float16)


async def test_a_chained_load_brings_every_byte_through_the_pinned_buffer(tmp_path):
    async with make_rig(tmp_path) as rig:
        source = data(1)
        await rig.move("store", source)  # through the mailbox: a d2h copy, then the write
        assert rig.dma.chained_copies == 0
        for round_ in range(3):
            destination = torch.empty_like(source)
            stats = await rig.move("load", destination)
            assert torch.equal(destination, source)
            assert rig.dma.chained_copies == round_ + 1
            # Co-DMA: the read's memory is the copy's source, inside the pinned buffer
            assert stats.io_buffer_address == stats.dma_host_address
            assert (
                rig.buffer.address <= stats.io_buffer_address < rig.buffer.address + rig.buffer.size
            )
        assert rig.thread.co_dma_transfers == rig.thread.direct_transfers == 4
        assert rig.buffer.inflight == 0


@pytest.mark.parametrize("images", [1, 2])
async def test_a_cuda_load_is_one_chained_piece_however_large(tmp_path, images):
    """A CUDA load is never cut, with one image or two: in 64 MiB pieces an OPT-6.7B K was three
    loop tasks, and the page-cache path reached 0.82-0.86 of its limit against 0.91-0.96 as one
    piece. Each transfer has an image of its own: one image runs one transfer at a time."""
    async with make_rig(tmp_path, images=images) as rig:
        assert rig.thread.piece_bytes == rig.thread.image_bytes
        assert rig.thread.max_transfers == images
        source = data(7)
        await rig.move("store", source)
        for round_ in range(3):
            destination = torch.empty_like(source)
            await rig.move("load", destination)
            assert torch.equal(destination, source)
            assert rig.dma.chained_copies == round_ + 1


async def test_one_image_takes_loads_asked_at_once_one_after_another(tmp_path):
    """A one-image CUDA thread asked for four loads at once runs them one at a time in its
    image, each chained: every destination gets every byte, and the image is free again."""
    async with make_rig(tmp_path, images=1) as rig:
        source = data(5)
        await rig.move("store", source)
        out = [torch.empty_like(source) for _ in range(4)]
        peak = 0

        async def load(destination: torch.Tensor) -> None:
            nonlocal peak
            peak = max(peak, rig.buffer.inflight)
            await rig.move("load", destination)
            peak = max(peak, rig.buffer.inflight)

        async with anyio.create_task_group() as tg:
            for destination in out:
                tg.start_soon(load, destination)
        assert all(torch.equal(destination, source) for destination in out)
        assert rig.dma.chained_copies == 4
        assert peak <= 1  # never two reads in the one image
        assert rig.thread._free_images == [0]
        assert rig.buffer.inflight == 0


async def test_a_failed_chained_read_fails_that_load_only(tmp_path):
    async with make_rig(tmp_path) as rig:
        source = data(2)
        await rig.move("store", source)
        faulty = FaultyTarget(rig.target, FaultPolicy(1.0, kinds=(FaultKind.EIO,)))
        with pytest.raises(IOFailedError) as caught:
            await rig.move("load", torch.empty_like(source), faulty)
        assert caught.value.errno == errno.EIO
        assert rig.dma.chained_copies == 0
        destination = torch.empty_like(source)
        await rig.move("load", destination)  # the thread goes on
        assert torch.equal(destination, source)


async def test_a_load_cancelled_mid_read_waits_for_its_read_and_copy(tmp_path):
    """Cancelling the actors (the store stopping) while a chained read is in flight: the
    transfer must settle, read and copy both, before the pinned buffer is let go."""
    async with make_rig(tmp_path) as rig:
        await rig.move("store", data(3))
        slow = FaultyTarget(rig.target, FaultPolicy(1.0, kinds=(FaultKind.SLOW,), slow_s=0.01))
        destination = torch.empty(ROWS, BATCH, WIDTH, dtype=torch.float16)
        async with anyio.create_task_group() as requesters:
            requesters.start_soon(rig.move, "load", destination, slow)
            await anyio.sleep(0.015)  # the read is in flight: 4 chunks of 10 ms each
            assert rig.buffer.inflight == 1
            rig.scope.cancel()  # cancels the copy thread's transfer
            requesters.cancel_scope.cancel()
    # the buffer was closed by make_rig without an alias or a read left on it
    assert rig.buffer.inflight == 0
    assert rig.dma._completions is not None
    assert rig.dma._completions.pending == 0


async def test_spans_read_then_count_their_bytes_and_report_accounting_errors(tmp_path):
    """Direct and page-cache spans end a chained read with the same accounting as
    ``read_into``; a page-cache span's drop-after-use advice that fails reaches ``then``."""
    payload = os.urandom(ROWS * ROW_BYTES)
    with (
        IOEngine(queue_depth=8) as engine,
        PageCacheFile(tmp_path / "pc.kv", len(payload)) as file,
        AlignedBuffer(len(payload)) as buffer,
    ):
        os.pwrite(file.fd, payload, 0)
        counters = PathCounters()
        span = PageCacheSpan(engine, file, 0, len(payload), 0, "L1.V", counters, evict=True)
        told: list[BaseException | None] = []
        ended = threading.Event()

        def then(error: BaseException | None) -> None:
            told.append(error)
            ended.set()

        span.read_then(buffer, None, then)
        await anyio.to_thread.run_sync(ended.wait, 5)
        assert told == [None]
        assert bytes(buffer.view) == payload
        assert counters.read_bytes == {"page-cache": len(payload)}

        def refuse(offset: int = 0, length: int = 0) -> None:
            raise OSError(errno.EBADF, "advice refused")

        file.advise_dontneed = refuse  # type: ignore[method-assign]
        told.clear()
        ended.clear()
        span.read_then(buffer, None, then)
        await anyio.to_thread.run_sync(ended.wait, 5)
        (error,) = told
        assert isinstance(error, OSError)
        assert error.errno == errno.EBADF
