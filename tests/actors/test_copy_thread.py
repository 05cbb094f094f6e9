"""Copy threads: Co-DMA on the direct path, pieces, failed I/O confined to its request."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from types import SimpleNamespace

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
    row_staging,
    transfer_pieces,
)
from dualblade.actors.spans import DirectSpan, PathCounters
from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine, IOFailedError, StorageSlots

pytestmark = pytest.mark.anyio

ROWS, BATCH, WIDTH = 24, 3, 64  # 384-byte rows (bfloat16), padded to 4096
ROW_BYTES = BATCH * WIDTH * 2
STRIDE = 4096


@dataclass
class Rig:
    thread: CopyThreadActor
    dma: GpuDmaActor
    engine: IOEngine
    target: DirectFile
    buffer: AlignedBuffer
    counters: PathCounters
    preads: list[tuple[int, int]]  # (host address, bytes) of every storage read

    def span(self, first_row: int, rows: int) -> DirectSpan:
        return DirectSpan(
            self.engine,
            self.target,
            first_row * STRIDE,
            rows * STRIDE,
            first_row * STRIDE,
            f"rows {first_row}-{first_row + rows}",
            self.counters,
        )

    async def move(self, kind: str, first_row: int, tensor: torch.Tensor) -> TransferStats:
        rows = tensor.shape[0]
        view = RowView(
            first_row * STRIDE, rows, ROW_BYTES, STRIDE, tensor.dtype, tuple(tensor.shape)
        )
        reply: Reply[TransferStats] = Reply()
        span = self.span(first_row, rows)
        message = (
            Load(span, view, tensor, reply) if kind == "load" else Store(tensor, view, span, reply)
        )
        return await self.thread.ask(message, reply)


@contextlib.asynccontextmanager
async def make_rig(tmp_path, images: int = 1, rows_aside: bool = False) -> AsyncIterator[Rig]:
    preads: list[tuple[int, int]] = []
    with (
        IOEngine(queue_depth=8, max_chunk=64 << 10) as engine,
        DirectFile(tmp_path / "direct.kv", ROWS * STRIDE) as target,
        AlignedBuffer(
            images * ROWS * STRIDE + (row_staging.ROW_STAGING_BYTES if rows_aside else 0)
        ) as buffer,
    ):
        real_pread = engine.pread

        async def spy_pread(tgt, buf, size, offset, *, buf_offset=0, slots=None):
            preads.append((buf.address + buf_offset, size))
            return await real_pread(tgt, buf, size, offset, buf_offset=buf_offset, slots=slots)

        engine.pread = spy_pread  # type: ignore[method-assign]
        dma = GpuDmaActor(torch.device("cpu"))
        thread = CopyThreadActor(
            0, buffer, dma, OverlapGate(1), images=images, rows_aside=rows_aside
        )
        async with anyio.create_task_group() as tg:
            await tg.start(dma.run)
            await tg.start(thread.run)
            yield Rig(thread, dma, engine, target, buffer, PathCounters(), preads)
            thread.close()
            dma.close()


@pytest.fixture
async def rig(tmp_path, monkeypatch) -> AsyncIterator[Rig]:
    monkeypatch.setattr(transfer_pieces, "PIECE_BYTES", 5 * STRIDE)  # 5-row pieces
    async with make_rig(tmp_path) as made:
        yield made


def data(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((rows, BATCH, WIDTH), generator=generator).to(torch.bfloat16)


async def test_direct_load_is_co_dma(rig):
    source = data(ROWS, 1)
    stats = await rig.move("store", 0, source)
    assert stats.io_buffer_address == stats.dma_host_address == rig.buffer.address
    destination = torch.empty_like(source)
    copies_before = rig.dma.host_copies
    rig.preads.clear()
    stats = await rig.move("load", 0, destination)
    assert torch.equal(destination, source)
    assert stats.path == "direct"
    assert stats.nbytes == ROWS * STRIDE
    # The storage DMA's buffer is the memory the device copy reads: one crossing of host memory.
    assert stats.io_buffer_address == stats.dma_host_address
    lo, hi = rig.buffer.address, rig.buffer.address + rig.buffer.size
    assert lo <= stats.io_buffer_address < hi
    # Every piece was read from storage straight into the pinned buffer, at the place the DMA
    # took it from (5-row pieces: 0, 5, 10, 15, 20).
    assert sorted(rig.preads) == [
        (lo + r * STRIDE, min(5, ROWS - r) * STRIDE) for r in range(0, ROWS, 5)
    ]
    # One host copy per piece on this CPU-only machine, nothing else touched the bytes.
    assert rig.dma.host_copies - copies_before == 5
    assert rig.thread.co_dma_transfers == rig.thread.direct_transfers == 2


async def test_slice_load_uses_the_rows_place_in_the_buffer(rig):
    source = data(ROWS, 2)
    await rig.move("store", 0, source)
    destination = torch.empty((9, BATCH, WIDTH), dtype=torch.bfloat16)
    copies_before = rig.dma.host_copies
    stats = await rig.move("load", 7, destination)
    assert torch.equal(destination, source[7:16])
    assert stats.io_buffer_address == stats.dma_host_address == rig.buffer.address + 7 * STRIDE
    assert rig.dma.host_copies - copies_before == 2  # rows 7-11 and 12-15


async def test_host_copies_count_every_piece(rig):
    pieces = 0
    for first, rows in [(0, ROWS), (3, 1), (10, 11), (23, 1)]:
        await rig.move("store", first, data(rows, first))
        await rig.move("load", first, torch.empty((rows, BATCH, WIDTH), dtype=torch.bfloat16))
        pieces += 2 * -(-rows // 5)
    assert rig.dma.host_copies == pieces
    assert rig.dma.bytes_h2d == rig.dma.bytes_d2h


async def test_overlapping_transfers_in_one_buffer_stay_exact(rig):
    """Two transfers at a time share the buffer under byte-range locks."""
    first, second = data(ROWS, 3), data(ROWS, 4)
    await rig.move("store", 0, first)
    out = [torch.empty_like(first) for _ in range(4)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.move, "load", 0, out[0])
        tg.start_soon(rig.move, "load", 0, out[1])
    assert torch.equal(out[0], first)
    assert torch.equal(out[1], first)
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.move, "store", 0, second)
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.move, "load", 0, out[2])
        tg.start_soon(rig.move, "load", 12, out[3][:12])
    assert torch.equal(out[2], second)
    assert torch.equal(out[3][:12], second[12:])


async def test_failed_storage_read_fails_only_that_request(rig):
    source = data(ROWS, 5)
    await rig.move("store", 0, source)

    @dataclass
    class FailingSpan:
        inner: DirectSpan
        label: str = "failing"
        path: str = "direct"

        @property
        def buffer_offset(self) -> int:
            return self.inner.buffer_offset

        @property
        def nbytes(self) -> int:
            return self.inner.nbytes

        def piece(self, buffer_offset: int, nbytes: int) -> FailingSpan:
            return replace(self, inner=self.inner.piece(buffer_offset, nbytes))

        async def read_into(self, buffer: AlignedBuffer, slots: StorageSlots | None = None) -> None:
            if self.inner.buffer_offset >= 10 * STRIDE:  # the third piece fails
                raise IOFailedError(self.inner.target.name, "read", 0, 4096, errno=errno.EIO)
            await self.inner.read_into(buffer, slots)

        async def write_from(self, buffer: AlignedBuffer) -> None:
            raise AssertionError("not used")

    view = RowView(0, ROWS, ROW_BYTES, STRIDE, torch.bfloat16, (ROWS, BATCH, WIDTH))
    reply: Reply[TransferStats] = Reply()
    destination = torch.empty_like(source)
    with pytest.raises(IOFailedError):
        await rig.thread.ask(Load(FailingSpan(rig.span(0, ROWS)), view, destination, reply), reply)
    # The copy thread is alive, its buffer's ranges and the storage slot were given back.
    assert rig.thread._ranges.held == []
    assert rig.thread.gate.limiter_for("direct").borrowed_tokens == 0
    again = torch.empty_like(source)
    await rig.move("load", 0, again)
    assert torch.equal(again, source)


async def test_two_images_let_two_transfers_use_the_buffer_at_once(tmp_path):
    """With two KPU images a thread's second transfer reads into the other one, not after the
    first has left the buffer; every byte still arrives where it belongs."""
    image = ROWS * STRIDE
    async with make_rig(tmp_path, images=2) as two:
        source = data(ROWS, 6)
        stored = await two.move("store", 0, source)
        out = [torch.empty_like(source) for _ in range(2)]
        loads: list[TransferStats] = []

        async def load(destination: torch.Tensor) -> None:
            loads.append(await two.move("load", 0, destination))

        async with anyio.create_task_group() as tg:
            for destination in out:
                tg.start_soon(load, destination)
        assert all(torch.equal(destination, source) for destination in out)
        bases = sorted(stats.io_buffer_address - two.buffer.address for stats in loads)
        assert bases == [0, image]  # one image each, at the same time
        assert all(stats.io_buffer_address == stats.dma_host_address for stats in loads)
        assert stored.io_buffer_address in (two.buffer.address, two.buffer.address + image)
        # A slice lands at its rows' place inside whichever image it got.
        part = torch.empty((9, BATCH, WIDTH), dtype=torch.bfloat16)
        stats = await two.move("load", 7, part)
        assert torch.equal(part, source[7:16])
        assert (stats.io_buffer_address - two.buffer.address) % image == 7 * STRIDE
        assert two.thread._ranges.held == []
        assert sorted(two.thread._free_images) == [0, 1]


async def test_a_load_in_its_own_image_waits_for_its_storage_slot_in_the_engine(tmp_path):
    """With two images a one-piece load queues for the gate's slot inside the engine (the ring
    thread hands it on) and holds it only while its read is in flight."""
    async with make_rig(tmp_path, images=2) as two:
        source = data(ROWS, 8)
        await two.move("store", 0, source)
        slots = two.thread.gate.limiter_for("direct")
        await slots.acquire()  # the only slot, held by the test
        destination = torch.zeros_like(source)
        reads = len(two.preads)
        async with anyio.create_task_group() as tg:
            tg.start_soon(two.move, "load", 0, destination)
            await anyio.wait_all_tasks_blocked()
            assert len(two.preads) == reads + 1  # handed to the engine before its slot ...
            assert slots.waiting == 1  # ... where it waits for it
            assert not destination.any()
            slots.release()
        assert torch.equal(destination, source)
        assert slots.borrowed_tokens == 0
        assert slots.waiting == 0


async def test_an_appended_row_runs_in_the_room_for_rows_while_both_images_are_taken(tmp_path):
    """With room for rows a one-row store waits for neither an image nor a transfer slot: both
    are held by loads waiting for the storage slot, and the row still lands, written from the
    room after the images at its row's offset within a page (the alignment it had in place)."""
    async with make_rig(tmp_path, images=2, rows_aside=True) as two:
        source = data(ROWS, 9)
        await two.move("store", 0, source)
        slots = two.thread.gate.limiter_for("direct")
        await slots.acquire()  # the only slot: both loads below wait for it in the engine
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(two.move, "load", 0, torch.empty_like(source))
            await anyio.wait_all_tasks_blocked()
            assert two.thread._free_images == []  # both images held
            row = data(1, 10)
            with anyio.fail_after(5):
                stats = await two.move("store", 5, row)
            placed = stats.io_buffer_address - two.buffer.address
            assert placed >= 2 * two.thread.image_bytes  # in the room, not an image
            assert placed % 4096 == (5 * STRIDE) % 4096
            assert stats.io_buffer_address == stats.dma_host_address
            slots.release()
        expected = source.clone()
        expected[5] = row[0]
        again = torch.empty_like(source)
        await two.move("load", 0, again)
        assert torch.equal(again, expected)
        assert sorted(two.thread._free_images) == [0, 1]


async def test_rows_beyond_the_rooms_regions_wait_for_one() -> None:
    staging = row_staging.RowStaging(8192, regions=1)
    row = Store(
        torch.empty(0),
        RowView(3 * STRIDE + 512, 1, 512, 512, torch.uint8, (512,)),
        SimpleNamespace(nbytes=512, buffer_offset=3 * STRIDE + 512, label="row"),  # type: ignore[arg-type]
        Reply(),
    )
    async with staging.shift_for(row) as shift:
        assert 3 * STRIDE + 512 + shift == 8192 + 512  # the region, at the row's page offset
        with anyio.move_on_after(0.05) as waited:
            async with staging.shift_for(row):
                pass
        assert waited.cancelled_caught  # the one region is held
    with anyio.fail_after(1):
        async with staging.shift_for(row) as again:
            assert again == shift
    with pytest.raises(ValueError, match="page boundary"):
        row_staging.RowStaging(100)


def test_a_buffer_holds_one_or_two_images():
    dma = GpuDmaActor(torch.device("cpu"))
    with AlignedBuffer(ROWS * STRIDE) as buffer, pytest.raises(ValueError, match="1 or 2"):
        CopyThreadActor(0, buffer, dma, OverlapGate(1), images=3)
    dma.close()


@pytest.mark.parametrize(("device", "images", "expected"), [("cpu", 1, 4), ("cuda", 2, 2)])
def test_transfers_at_once_follow_the_buffers_use(device: str, images: int, expected: int) -> None:
    # On the host most transfers never touch the buffer (four at once); with CUDA each transfer
    # in flight needs an image of its own (two). Constructing touches no GPU.
    with AlignedBuffer(images * ROWS * STRIDE) as buffer:
        dma = GpuDmaActor(torch.device(device))
        thread = CopyThreadActor(0, buffer, dma, OverlapGate(1), images=images)
        try:
            assert thread.max_transfers == expected
        finally:
            thread.close()
            dma.close()


async def test_an_appended_row_takes_no_storage_slot(rig, monkeypatch):
    # Every slot of the direct path is taken (a long read, say): a one-row store (an append)
    # still lands, a larger store waits for a slot. Holding one, an append's write sat in the
    # engine behind the read before it while the next read waited for the slot.
    monkeypatch.setattr(row_staging, "SLOTLESS_STORE_BYTES", STRIDE)
    slots = rig.thread.gate.limiter_for("direct")
    await slots.acquire()
    try:
        row = data(1, 7)
        with anyio.fail_after(5):
            await rig.move("store", 3, row)
        with anyio.move_on_after(0.2) as waited:
            await rig.move("store", 4, data(2, 8))
        assert waited.cancelled_caught
    finally:
        slots.release()
    back = torch.empty_like(row)
    await rig.move("load", 3, back)
    assert torch.equal(back, row)
