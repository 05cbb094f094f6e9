"""Faults through the whole store: the context that issued the I/O gets our typed error, every
other context goes on unharmed, and nothing leaks (fds, threads, buffers, extents, pinned pages).

Injected faults come from a :class:`FaultyTarget` around the direct file, limited to the
victim's own run; a real ENOSPC comes from a tiny tmpfs (as root).
"""

from __future__ import annotations

import errno
import random
import time
from pathlib import Path

import anyio
import pytest
import torch

from dualblade.actors import Reply
from dualblade.actors.binder import Book, GetBook
from dualblade.bench.process_stats import live_threads, memory_sample, open_fds
from dualblade.io_engine import IOFailedError, Target
from dualblade.store import KVContext, KVStore, LayerLostError, open_store
from dualblade.testing import FaultKind, FaultPolicy, FaultyTarget

from .conftest import MakeConfig, MountTmpfs, random_kv

pytestmark = pytest.mark.anyio

ROWS = 32


async def _region(ctx: KVContext) -> tuple[int, int]:
    lba_map = await ctx.direct_map()
    size = lba_map.lba_size
    return lba_map.region.first_lba * size, lba_map.region.end * size


async def _bystander(ctx: KVContext, seed: int, rounds: int) -> None:
    """Writes, appends and reads its own layers; any error or wrong byte fails the test."""
    data = {layer: random_kv(ctx.store.config, ROWS, seed=seed + layer) for layer in range(4)}
    for layer, kv in data.items():
        await ctx.write(layer, *kv)
    for step in range(rounds):
        layer = step % 4
        k_row, v_row = random_kv(ctx.store.config, 1, seed=seed * 100 + step)
        if ctx.length(layer) < ctx.max_len:
            await ctx.append(layer, k_row[0], v_row[0])
            data[layer] = (torch.cat([data[layer][0], k_row]), torch.cat([data[layer][1], v_row]))
        k, v = await ctx.read(layer)
        assert torch.equal(k, data[layer][0])
        assert torch.equal(v, data[layer][1])


async def _victim(ctx: KVContext, rounds: int, seen: dict[str, int]) -> None:
    """Random writes and reads; each succeeds with exact bytes or fails with our error."""
    rng = random.Random(5)
    expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(rounds):
        layer = rng.randrange(4)
        try:
            if layer not in expected or rng.random() < 0.5:
                kv = random_kv(ctx.store.config, ROWS, seed=1000 + step)
                expected.pop(layer, None)
                await ctx.write(layer, *kv)
                expected[layer] = kv
            else:
                k, v = await ctx.read(layer)
                assert torch.equal(k, expected[layer][0])
                assert torch.equal(v, expected[layer][1])
                seen["verified"] += 1
        except IOFailedError as error:
            seen[errno.errorcode.get(error.errno or 0, "other")] += 1
            if layer not in expected:  # a failed write: the layer refuses until rewritten
                with pytest.raises(LayerLostError):
                    await ctx.read(layer)


@pytest.mark.parametrize("policy", ["direct", "dual"])
async def test_faults_hurt_only_the_context_that_issued_them(
    make_config: MakeConfig, policy: str
) -> None:
    config = make_config(policy, prompt_len=ROWS, max_new_tokens=8)
    fds, threads = open_fds(), live_threads()
    pinned = memory_sample().pinned_bytes
    faulty: list[FaultyTarget] = []

    def wrap(target: Target) -> Target:
        policy = FaultPolicy(0.3, seed=11, kinds=(FaultKind.EIO, FaultKind.ENOSPC, FaultKind.SHORT))
        faulty.append(FaultyTarget(target, policy))
        return faulty[0]

    seen = {"EIO": 0, "ENOSPC": 0, "verified": 0}
    async with open_store(config, device="cpu", wrap_direct=wrap) as store:
        async with store.context() as victim:
            faulty[0].limit_to(*await _region(victim))
            async with anyio.create_task_group() as tg:
                tg.start_soon(_victim, victim, 40, seen)
                for seed in (1, 2, 3):
                    tg.start_soon(_bystander_context, store, seed)
        reply: Reply[Book] = Reply()
        book = await store.runtime.binder.ask(GetBook(reply), reply)
        assert book.extents == {}
        assert book.files == {}
        buffers = store.runtime.buffers
    assert seen["EIO"] + seen["ENOSPC"] > 0
    assert set(seen) == {"EIO", "ENOSPC", "verified"}  # no other errno
    assert seen["verified"] > 0
    assert any(f.kind is FaultKind.SHORT for f in faulty[0].injected)
    for buffer in buffers:
        assert buffer.inflight == 0
        assert buffer.closed
    assert open_fds() == fds
    assert live_threads() == threads
    deadline = time.monotonic() + 2  # the kernel unpins a closed ring's buffers a moment later
    while memory_sample().pinned_bytes > pinned and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    assert memory_sample().pinned_bytes <= pinned


async def _bystander_context(store: KVStore, seed: int) -> None:
    async with store.context() as ctx:
        await _bystander(ctx, seed, 12)


async def test_failed_append_leaves_the_layer_as_it_was(make_config: MakeConfig) -> None:
    config = make_config("direct", prompt_len=ROWS, max_new_tokens=4)
    faulty: list[FaultyTarget] = []

    def wrap(target: Target) -> Target:
        faulty.append(FaultyTarget(target, FaultPolicy(1.0, kinds=(FaultKind.EIO,))))
        faulty[0].policy.enabled = False
        return faulty[0]

    async with (
        open_store(config, device="cpu", wrap_direct=wrap) as store,
        store.context() as ctx,
    ):
        k, v = random_kv(config, ROWS, seed=1)
        await ctx.write(0, k, v)
        faulty[0].policy.enabled = True
        k_row, v_row = random_kv(config, 1, seed=2)
        with pytest.raises(IOFailedError, match="EIO"):
            await ctx.append(0, k_row[0], v_row[0])
        with pytest.raises(IOFailedError, match="EIO"):
            await ctx.read(0)
        faulty[0].policy.enabled = False
        assert ctx.length(0) == ROWS
        got_k, got_v = await ctx.read(0)
        assert torch.equal(got_k, k)
        assert torch.equal(got_v, v)
        # The append can be retried and lands whole.
        assert await ctx.append(0, k_row[0], v_row[0]) == ROWS + 1
        got_k, _ = await ctx.read(0)
        assert torch.equal(got_k, torch.cat([k, k_row]))


@pytest.fixture
def tiny_tmpfs(mount_tmpfs: MountTmpfs) -> Path:
    """A 1 MiB tmpfs (root only), unmounted afterwards."""
    return mount_tmpfs("1m")


@pytest.mark.root
async def test_a_full_file_system_gives_enospc_to_the_writer_only(
    make_config: MakeConfig, tiny_tmpfs: Path
) -> None:
    """Page-cache files on a full 1 MiB tmpfs: the write that finds no room fails with ENOSPC
    (our IOFailedError); the context that wrote before keeps its bytes."""
    config = make_config(
        "page-cache",
        "aligned",  # 4 KiB rows: 64 rows of K and V are 512 KiB per layer
        prompt_len=64,
        max_new_tokens=0,
        storage={
            "page_cache_dir": str(tiny_tmpfs),
            "direct": {"path": str(tiny_tmpfs.parent / "direct.kv")},
        },
    )
    failures: list[IOFailedError] = []
    async with open_store(config, device="cpu") as store, store.context() as first:
        k, v = random_kv(config, 64, seed=1)
        await first.write(0, k, v)
        async with store.context() as hog:
            for layer in range(4):
                try:
                    await hog.write(layer, *random_kv(config, 64, seed=10 + layer))
                except IOFailedError as error:
                    failures.append(error)
                    with pytest.raises(LayerLostError):
                        await hog.read(layer)
        got_k, got_v = await first.read(0)
        assert torch.equal(got_k, k)
        assert torch.equal(got_v, v)
    assert failures
    assert {error.errno for error in failures} == {errno.ENOSPC}
