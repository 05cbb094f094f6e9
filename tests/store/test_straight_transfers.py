"""Straight transfers: a whole layer between storage and the caller's host memory, no copy
thread: byte-exact on every policy, counted per path, declined where memory cannot take it."""

from __future__ import annotations

import pytest
import torch

from dualblade.io_engine import (
    AlignedBuffer,
    BorrowedBuffer,
    IOFailedError,
    PageCacheFile,
    Target,
)
from dualblade.store import (
    KVShapeError,
    LayerLostError,
    open_store,
    read_layer_straight,
    write_layer_straight,
)
from dualblade.telemetry import Tracer
from dualblade.testing import FaultKind, FaultPolicy, FaultyTarget

from .conftest import MakeConfig, prefill_and_append, random_kv

pytestmark = pytest.mark.anyio


def views(memory: AlignedBuffer, like: torch.Tensor, offset: int) -> torch.Tensor:
    count = like.numel()
    return memory.tensor(like.dtype, count=count, offset=offset).view(like.shape)


@pytest.mark.parametrize("policy", ["dual", "direct", "page-cache", "cache-policy", "baseline"])
async def test_every_policy_reads_every_byte_straight(make_config: MakeConfig, policy: str):
    config = make_config(policy, "aligned", prompt_len=40, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        expected = await prefill_and_append(ctx, config)
        half = expected[0][0].numel() * expected[0][0].element_size()
        before = store.stats()
        with AlignedBuffer(2 * half) as memory:
            for layer, (k, v) in expected.items():
                memory.view[:] = b"\xee" * memory.size
                assert await read_layer_straight(ctx, layer, memory, (0, half))
                got_k, got_v = views(memory, k, 0), views(memory, v, half)
                assert torch.equal(got_k, k)
                assert torch.equal(got_v, v)
                del got_k, got_v
        after = store.stats()
        # the spans counted every byte they read, per path, as reads through a copy thread do
        moved = sum(after.read_bytes.values()) - sum(before.read_bytes.values())
        assert moved == 4 * 2 * half
        # and no copy thread took part: no direct transfer, no host copy
        assert after.co_dma.direct_transfers == before.co_dma.direct_transfers
        assert after.co_dma.cpu_fallback_copies == before.co_dma.cpu_fallback_copies


async def test_resident_page_cache_reads_count_as_hits(make_config: MakeConfig):
    config = make_config("page-cache", "aligned", prompt_len=40, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 40, seed=7)
        await ctx.write(0, k, v)
        half = k.numel() * k.element_size()
        before = store.stats()
        with AlignedBuffer(2 * half) as memory:
            assert await read_layer_straight(ctx, 0, memory, (0, half))
            assert torch.equal(views(memory, k, 0), k)
            assert torch.equal(views(memory, v, half), v)
        after = store.stats()
        assert after.cache_lookup_bytes - before.cache_lookup_bytes == 2 * half
        assert after.cache_hit_bytes - before.cache_hit_bytes == 2 * half  # just written


async def test_memory_the_direct_target_cannot_take_is_declined(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=16, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=9)
        await ctx.write(0, k, v)
        half = k.numel() * k.element_size()
        with AlignedBuffer(2 * half + 4096) as memory:
            # one byte off the page: O_DIRECT refuses the address, so nothing is read
            unaligned = BorrowedBuffer(memory.tensor(count=2 * half, offset=1))
            assert not await read_layer_straight(ctx, 0, unaligned, (0, half))
            unaligned.close()
            # a V that would run past the memory's end
            assert not await read_layer_straight(ctx, 0, memory, (0, half + 4096 + 1))
            assert bytes(memory.view[:16]) == bytes(16)  # untouched: still the zeroed pages
        assert store.stats().read_bytes.get("direct", 0) == 0


async def test_padded_rows_are_left_to_read(make_config: MakeConfig):
    config = make_config("direct", "odd-gqa", prompt_len=16, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=4)
        await ctx.write(1, k, v)
        half = k.numel() * k.element_size()
        with AlignedBuffer(4 * half + 8192) as memory:
            assert not await read_layer_straight(ctx, 1, memory, (0, 2 * half + 4096))
            got_k, got_v = await ctx.read(1)  # the copy threads read what straight reads leave
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)


async def test_a_borrowed_tensor_takes_direct_reads(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=16, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=11)
        await ctx.write(2, k, v)
        half = k.numel() * k.element_size()
        with AlignedBuffer(2 * half) as owner:
            flat = owner.tensor()  # someone else's aligned memory, as LMCache's L1 is
            borrowed = BorrowedBuffer(flat)
            assert await read_layer_straight(ctx, 2, borrowed, (0, half))
            borrowed.close()
            assert torch.equal(flat[:half].view(k.dtype).view(k.shape), k)
            assert torch.equal(flat[half:].view(v.dtype).view(v.shape), v)
            del flat


async def test_a_layer_never_written_is_refused_as_read_refuses_it(make_config: MakeConfig):
    config = make_config("dual", "aligned", prompt_len=16, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        with AlignedBuffer(1 << 20) as memory:
            with pytest.raises(KVShapeError, match="never written"):
                await read_layer_straight(ctx, 1, memory, (0, 1 << 19))
            with pytest.raises(KVShapeError, match="layer must be in"):
                await read_layer_straight(ctx, 99, memory, (0, 1 << 19))


def _memory_holding(k: torch.Tensor, v: torch.Tensor) -> tuple[AlignedBuffer, int]:
    """Aligned memory with K's bytes, then V's; and V's offset."""
    half = k.numel() * k.element_size()
    memory = AlignedBuffer(2 * half)
    views(memory, k, 0).copy_(k)
    views(memory, v, half).copy_(v)
    return memory, half


@pytest.mark.parametrize("policy", ["dual", "direct", "page-cache", "cache-policy", "baseline"])
async def test_every_policy_writes_every_byte_straight(make_config: MakeConfig, policy: str):
    config = make_config(policy, "aligned", prompt_len=40, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        before = store.stats()
        expected = {}
        for layer in range(4):
            k, v = random_kv(config, 40, seed=layer)
            memory, half = _memory_holding(k, v)
            with memory:
                assert await write_layer_straight(ctx, layer, memory, (0, half), 40)
            expected[layer] = (k, v)
        after = store.stats()
        assert sum(after.write_bytes.values()) - sum(before.write_bytes.values()) == 4 * 2 * half
        assert after.co_dma == before.co_dma  # no copy thread took part
        for layer, (k, v) in expected.items():
            assert ctx.length(layer) == 40
            got_k, got_v = await ctx.read(layer)  # through the copy threads, as any reader
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
        # and a decode step appends after a straight prefill as after any other
        row_k, row_v = random_kv(config, 1, seed=99)
        assert await ctx.append(0, row_k, row_v) == 41
        got_k, _ = await ctx.read(0)
        assert torch.equal(got_k, torch.cat([expected[0][0], row_k]))


async def test_a_declined_write_leaves_the_layer_as_it_was(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=16, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=1)
        await ctx.write(0, k, v)
        new_k, new_v = random_kv(config, 16, seed=2)
        memory, half = _memory_holding(new_k, new_v)
        with memory:
            unaligned = BorrowedBuffer(memory.tensor(count=2 * half - 4096, offset=1))
            assert not await write_layer_straight(ctx, 0, unaligned, (0, half - 4096), 16)
            unaligned.close()
            with pytest.raises(KVShapeError, match="a context holds"):
                await write_layer_straight(ctx, 0, memory, (0, half), 0)
            for bad in (21, True, 2.0):  # past max_len (20), and rows that are not an int
                with pytest.raises(KVShapeError, match="a context holds"):
                    await write_layer_straight(ctx, 0, memory, (0, half), bad)
        got_k, got_v = await ctx.read(0)
        assert torch.equal(got_k, k)
        assert torch.equal(got_v, v)
        assert store.stats().write_bytes.get("direct", 0) == 2 * half  # the first write only


async def test_a_failed_straight_write_loses_the_layer_until_rewritten(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=16, max_new_tokens=4)
    faulty: list[FaultyTarget] = []

    def wrap(target: Target) -> Target:
        faulty.append(FaultyTarget(target, FaultPolicy(1.0, kinds=(FaultKind.EIO,))))
        return faulty[0]

    async with (
        open_store(config, device="cpu", wrap_direct=wrap) as store,
        store.context() as ctx,
    ):
        k, v = random_kv(config, 16, seed=3)
        memory, half = _memory_holding(k, v)
        with memory:
            with pytest.raises(IOFailedError, match="EIO"):
                await write_layer_straight(ctx, 0, memory, (0, half), 16)
            with pytest.raises(LayerLostError):
                await read_layer_straight(ctx, 0, memory, (0, half))
            faulty[0].policy.enabled = False
            assert await write_layer_straight(ctx, 0, memory, (0, half), 16)
        got_k, got_v = await ctx.read(0)
        assert torch.equal(got_k, k)
        assert torch.equal(got_v, v)


async def test_pages_evicted_after_the_lookup_are_read_from_the_disk(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
):
    """Pages the page cache no longer holds: the copy on the spot never waits for the disk
    (RWF_NOWAIT) and stops at the first missing page; the rest goes through the ring. Simulated
    by a cached read that returns the first 4 KiB only."""
    config = make_config("page-cache", "aligned", prompt_len=40, max_new_tokens=4)
    real = PageCacheFile.pread_cached
    calls: list[int] = []

    def first_page_only(self: PageCacheFile, view: memoryview, offset: int) -> int:
        calls.append(offset)
        if len(calls) % 2 == 0:
            return 0  # the next page was evicted
        with view[:4096] as page:
            return real(self, page, offset)

    monkeypatch.setattr(PageCacheFile, "pread_cached", first_page_only)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 40, seed=13)
        await ctx.write(0, k, v)
        half = k.numel() * k.element_size()
        before = store.stats().read_bytes.get("page-cache", 0)
        with AlignedBuffer(2 * half) as memory:
            assert await read_layer_straight(ctx, 0, memory, (0, half))
            assert torch.equal(views(memory, k, 0), k)
            assert torch.equal(views(memory, v, half), v)
        assert len(calls) == 4  # K and V: one page each, then a miss
        assert store.stats().read_bytes["page-cache"] - before == 2 * half  # each byte once


def test_a_cached_read_takes_only_what_the_page_cache_holds(tmp_path):
    with PageCacheFile(tmp_path / "f", 1 << 20) as file, AlignedBuffer(1 << 20) as memory:
        memory.view[:] = b"\x5a" * (1 << 20)
        assert file.pwrite_blocking(memory.view, 0) == 1 << 20
        # Written back first: a page the flusher has locked to start its write-back is not
        # read without waiting, so a read racing it stops short (seen once in CI).
        file.flush()
        assert file.pread_cached(memory.view, 0) == 1 << 20  # written and clean: all cached
        file.advise_dontneed()
        if file.resident_bytes(0, 1 << 20):
            pytest.skip("the kernel kept the pages after DONTNEED (a file system that pins them)")
        # RWF_NOWAIT starts readahead for the pages it misses, and a fast disk (or the host's
        # cache under a VM) can fill some before the read looks again (seen in CI: all of
        # them, once): so one try may return bytes, but what it returns is the file's, in
        # whole pages, and a read that waited for the disk would return all of it every time.
        returned = []
        for _ in range(20):
            file.advise_dontneed()
            memory.view[:] = b"\x00" * (1 << 20)
            got = file.pread_cached(memory.view, 0)
            assert got % 4096 == 0
            assert memory.view[:got] == b"\x5a" * got
            returned.append(got)
        assert min(returned) < 1 << 20, returned  # nothing waits for the disk


async def test_straight_transfers_are_on_the_trace(make_config: MakeConfig):
    config = make_config("dual", "aligned", prompt_len=16, max_new_tokens=4)
    tracer = Tracer()
    async with open_store(config, device="cpu", tracer=tracer) as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=21)
        memory, half = _memory_holding(k, v)
        with memory:
            for layer in (0, 1):  # one page-cache layer and one direct (dual, knob_x)
                assert await write_layer_straight(ctx, layer, memory, (0, half), 16)
                assert await read_layer_straight(ctx, layer, memory, (0, half))
    events = tracer.document()["traceEvents"]
    slices = [(e["name"], e["args"]) for e in events if e.get("ph") == "X"]
    straight = [(name, args) for name, args in slices if " layer " in name and "ctx" in name]
    assert {name.split()[0] for name, _ in straight} == {"store", "load"}
    assert {args["path"] for _, args in straight} == {"page-cache", "direct"}
    assert all(args["bytes"] == 2 * half for _, args in straight)
    assert "straight" in tracer.tracks()
