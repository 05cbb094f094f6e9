"""The binder: one contiguous run per context, never past the extent, TRIM and unlink on release."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from dualblade.actors import BinderActor, ExtentExhaustedError, Reply
from dualblade.actors.binder import Book, ClaimExtent, ClaimFile, GetBook, ReleaseContext, Released
from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine, PageCacheFile, TargetError

pytestmark = pytest.mark.anyio

LBA = 4096
EXTENT_BLOCKS = 64


@pytest.fixture
def engine():
    with IOEngine(queue_depth=8) as eng:
        yield eng


@pytest.fixture
def target(tmp_path):
    with DirectFile(tmp_path / "direct.kv", (8 + EXTENT_BLOCKS) * LBA) as direct:
        yield direct


class Client:
    def __init__(self, binder: BinderActor) -> None:
        self.binder = binder

    async def claim(self, context: int, n_blocks: int) -> int:
        reply: Reply[int] = Reply()
        return await self.binder.ask(ClaimExtent(context, n_blocks, reply), reply)

    async def file(self, context: int, name: str, size: int) -> PageCacheFile:
        reply: Reply[PageCacheFile] = Reply()
        return await self.binder.ask(ClaimFile(context, name, size, reply), reply)

    async def release(self, context: int) -> Released:
        reply: Reply[Released] = Reply()
        return await self.binder.ask(ReleaseContext(context, reply), reply)

    async def book(self) -> Book:
        reply: Reply[Book] = Reply()
        return await self.binder.ask(GetBook(reply), reply)


@pytest.fixture
async def client(engine, target, tmp_path) -> AsyncIterator[Client]:
    binder = BinderActor(engine, target, 8, EXTENT_BLOCKS, tmp_path / "pc")
    async with anyio.create_task_group() as tg:
        await tg.start(binder.run)
        yield Client(binder)
        binder.close()


async def test_claim_is_idempotent_per_context(client):
    first = await client.claim(1, 16)
    assert first == 8  # the extent's first LBA
    assert await client.claim(1, 16) == first
    assert await client.claim(1, 4) == first  # a context has one run, whatever it asks later
    assert (await client.book()).extents == {1: (8, 16)}


async def test_contexts_get_disjoint_runs_inside_the_extent(client):
    sizes = {1: 10, 2: 7, 3: 20, 4: 1, 5: 26}  # 64 blocks: exactly full
    starts = {c: await client.claim(c, n) for c, n in sizes.items()}
    book = await client.book()
    assert book.region == (8, 8 + EXTENT_BLOCKS)
    runs = sorted((start, start + sizes[c]) for c, start in starts.items())
    for (_, end), (start, _) in itertools.pairwise(runs):
        assert end <= start
    assert runs[0][0] >= 8
    assert runs[-1][1] <= 8 + EXTENT_BLOCKS
    assert book.extents == {c: (starts[c], n) for c, n in sizes.items()}


async def test_exhausted_extent_fails_only_that_claim(client):
    await client.claim(1, 60)
    with pytest.raises(ExtentExhaustedError, match="no free run of 5 blocks"):
        await client.claim(2, 5)
    assert await client.claim(3, 4) == 68  # the binder goes on
    await client.release(1)
    assert await client.claim(2, 5) == 8


async def test_refuses_an_extent_past_the_target_end(engine, target, tmp_path):
    limit = target.size // LBA
    with pytest.raises(TargetError, match=rf"runs past the end of .*direct.kv \({limit} blocks"):
        BinderActor(engine, target, 8, limit - 7, tmp_path / "pc")
    # Exactly up to the end is fine.
    binder = BinderActor(engine, target, 8, limit - 8, tmp_path / "pc")
    async with anyio.create_task_group() as tg:
        await tg.start(binder.run)
        assert await Client(binder).claim(1, limit - 8) == 8
        binder.close()


async def test_release_trims_the_run(client, engine, target):
    start = await client.claim(1, 32)
    size = 32 * LBA
    with AlignedBuffer(size) as buffer:
        buffer.view[:] = b"\xab" * size
        await engine.pwrite(target, buffer, size, start * LBA)
        allocated = os.fstat(target.fd).st_blocks
        released = await client.release(1)
        assert released == Released(trimmed_blocks=32, files=0)
        assert client.binder.trimmed_blocks == 32
        # The file system really gave the blocks back (st_blocks counts 512-byte units).
        assert os.fstat(target.fd).st_blocks <= allocated - size // 512
        await engine.pread(target, buffer, size, start * LBA)
        assert bytes(buffer.view) == bytes(size)  # a punched hole reads as zeros
    assert (await client.book()).extents == {}
    assert await client.release(1) == Released(0, 0)  # releasing twice is harmless


async def test_release_only_touches_that_context(client, engine, target):
    a = await client.claim(1, 8)
    b = await client.claim(2, 8)
    with AlignedBuffer(8 * LBA) as buffer:
        buffer.view[:] = b"\x5a" * (8 * LBA)
        for start in (a, b):
            await engine.pwrite(target, buffer, 8 * LBA, start * LBA)
        await client.release(1)
        await engine.pread(target, buffer, 8 * LBA, b * LBA)
        assert bytes(buffer.view) == b"\x5a" * (8 * LBA)
    assert (await client.book()).extents == {2: (b, 8)}


async def test_files_are_created_once_and_removed_on_release(client, tmp_path):
    k = await client.file(1, "L0.K", 10_000)
    assert await client.file(1, "L0.K", 10_000) is k
    v = await client.file(1, "L0.V", 10_000)
    other = await client.file(2, "L0.K", 10_000)
    assert Path(k.name).parent != Path(other.name).parent  # one folder per context
    for f in (k, v, other):
        assert Path(f.name).is_file()
        assert Path(f.name).is_relative_to(tmp_path / "pc")
        assert f.size >= 10_000
    assert (await client.book()).files == {1: ["L0.K", "L0.V"], 2: ["L0.K"]}
    assert await client.release(1) == Released(trimmed_blocks=0, files=2)
    assert not Path(k.name).exists()
    assert not Path(k.name).parent.exists()
    assert Path(other.name).is_file()
    assert (await client.book()).files == {2: ["L0.K"]}


async def test_stop_releases_everything_left(engine, target, tmp_path):
    binder = BinderActor(engine, target, 8, EXTENT_BLOCKS, tmp_path / "pc")
    async with anyio.create_task_group() as tg:
        await tg.start(binder.run)
        c = Client(binder)
        await c.claim(1, 4)
        await c.claim(2, 4)
        f = await c.file(2, "L3.V", 4096)
        binder.close()
    assert binder.trimmed_blocks == 8
    assert not Path(f.name).exists()
    assert not (tmp_path / "pc").exists()  # the emptied page-cache folder is removed too
    assert binder.allocator.used == {}


async def test_growable_file_target_grows(engine, tmp_path):
    with DirectFile(tmp_path / "grow.kv", 0) as target:
        binder = BinderActor(engine, target, 2, None, tmp_path / "pc")
        async with anyio.create_task_group() as tg:
            await tg.start(binder.run)
            c = Client(binder)
            assert await c.claim(1, 10) == 2
            assert target.size >= 12 * LBA
            assert await c.claim(2, 5) == 12
            assert target.size >= 17 * LBA
            assert os.fstat(target.fd).st_size >= 17 * LBA
            binder.close()


async def test_a_claim_the_disk_has_no_room_for_keeps_no_run(engine, tmp_path, monkeypatch):
    """ENOSPC while growing a file target fails that claim alone; its run is given back."""
    with DirectFile(tmp_path / "grow.kv", 0) as growing:
        real_grow = growing.grow_to
        full = True

        def grow_to(size: int) -> None:
            if full:
                raise TargetError(f"cannot grow {growing.name} to {size} bytes: No space left")
            real_grow(size)

        monkeypatch.setattr(growing, "grow_to", grow_to)
        binder = BinderActor(engine, growing, 0, None, tmp_path / "pc")
        async with anyio.create_task_group() as tg:
            await tg.start(binder.run)
            client = Client(binder)
            for context in (1, 2):
                with pytest.raises(TargetError, match="No space left"):
                    await client.claim(context, 100)
            book = await client.book()
            assert book.extents == {}
            assert binder.allocator.free_runs in ([], [(0, 100)])  # nothing held
            full = False  # room again: the next context is served, from the first block
            assert await client.claim(3, 100) == 0
            assert (await client.book()).extents == {3: (0, 100)}
            await client.release(3)
            binder.close()
