"""Many contexts at once: their data and their storage never mix; closing releases storage."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import anyio
import pytest
import torch

from dualblade.actors import ExtentExhaustedError, Reply
from dualblade.actors.binder import Book, GetBook
from dualblade.store import open_store

from .conftest import random_kv

pytestmark = pytest.mark.anyio

CONTEXTS = 8


async def book_of(store) -> Book:
    reply: Reply[Book] = Reply()
    return await store.runtime.binder.ask(GetBook(reply), reply)


@pytest.mark.parametrize("policy", ["dual", "direct", "page-cache"])
async def test_concurrent_contexts_never_mix(make_config, policy):
    config = make_config(policy, prompt_len=16, max_new_tokens=2)
    layers = config.shape().num_layers
    written = anyio.Event()
    checked = anyio.Event()
    ready = 0
    results: dict[int, bool] = {}

    async with open_store(config, device="cpu") as store:

        async def request(n: int) -> None:
            nonlocal ready
            async with store.context() as ctx:
                mine = {}
                for layer in range(layers):
                    mine[layer] = random_kv(config, 16, seed=1000 * n + layer)
                    await ctx.write(layer, *mine[layer])
                    row = random_kv(config, 1, seed=1000 * n + 100 + layer)
                    await ctx.append(layer, *row)
                    mine[layer] = tuple(
                        torch.cat([a, b]) for a, b in zip(mine[layer], row, strict=True)
                    )
                ready += 1
                if ready == CONTEXTS:
                    written.set()
                await checked.wait()  # all contexts are open and written while we read
                ok = True
                for layer in reversed(range(layers)):
                    k, v = await ctx.read(layer)
                    ok &= torch.equal(k, mine[layer][0]) and torch.equal(v, mine[layer][1])
                results[n] = ok

        async with anyio.create_task_group() as tg:
            for n in range(CONTEXTS):
                tg.start_soon(request, n)
            with anyio.fail_after(30):
                await written.wait()
            assert store.open_contexts == CONTEXTS
            book = await book_of(store)
            # Holdings are the contexts' shared runs plus runs and files of single layers;
            # whoever holds them, no two runs overlap and all stay in the extent.
            runs = sorted((first, first + n) for first, n in book.extents.values())
            for (_, end), (start, _) in itertools.pairwise(runs):
                assert end <= start, f"direct runs overlap: {runs}"
            if runs:
                first_lba, end_lba = book.region
                assert runs[0][0] >= first_lba
                assert runs[-1][1] <= end_lba
            if policy == "page-cache":
                assert book.extents == {}
                assert sum(len(f) for f in book.files.values()) == CONTEXTS * 2 * layers
            if policy == "direct":
                assert len(book.extents) == CONTEXTS
                assert book.files == {}
            checked.set()
        assert results == dict.fromkeys(range(CONTEXTS), True)
        assert store.open_contexts == 0
        after = await book_of(store)
        assert (after.extents, after.files) == ({}, {})


async def test_closing_a_context_releases_its_storage(make_config, tmp_path):
    config = make_config("dual")
    direct_path = Path(config.storage.direct.path)
    async with open_store(config, device="cpu") as store:
        assert store.metrics()["trimmed_blocks"] == 0
        async with store.context() as ctx:
            for layer in range(4):
                await ctx.write(layer, *random_kv(config, 16, seed=layer))
            book = await book_of(store)
            ((first, blocks),) = book.extents.values()
            files = [name for names in book.files.values() for name in names]
            assert sorted(files) == ["L0.K", "L0.V", "L2.K", "L2.V"]  # 2 of 4 layers, spread
            allocated = os.stat(direct_path).st_blocks
            folders = list((tmp_path / "pc").rglob("context-*"))
            assert len(folders) == 1
        # Closed: the run is trimmed (its file blocks deallocated), the files are gone.
        assert store.metrics()["trimmed_blocks"] == blocks
        assert os.stat(direct_path).st_blocks <= allocated - blocks * 4096 // 512
        after = await book_of(store)
        assert (after.extents, after.files) == ({}, {})
        assert not folders[0].exists()
        with open(direct_path, "rb") as raw:
            raw.seek(first * 4096)
            assert raw.read(blocks * 4096) == bytes(blocks * 4096)
        # A new context can reuse the space and reads back its own data.
        async with store.context() as again:
            k, v = random_kv(config, 16, seed=99)
            await again.write(3, k, v)
            got_k, got_v = await again.read(3)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
    assert not (tmp_path / "pc").exists() or not any((tmp_path / "pc").rglob("*.K"))


async def test_full_extent_fails_only_the_context_that_does_not_fit(make_config):
    probe = make_config("direct")
    from dualblade.pipeline.planner import tensor_layout

    per_context = 8 * tensor_layout(probe).image_bytes  # 4 layers × K, V
    config = make_config("direct", direct={"extent_size": 2 * per_context})
    async with open_store(config, device="cpu") as store:
        async with store.context() as a, store.context() as b:
            ka, va = random_kv(config, 16, seed=1)
            await a.write(0, ka, va)
            await b.write(0, *random_kv(config, 16, seed=2))
            async with store.context() as c:
                with pytest.raises(ExtentExhaustedError, match="no free run"):
                    await c.write(0, *random_kv(config, 16, seed=3))
            got_k, _ = await a.read(0)
            assert torch.equal(got_k, ka)
        async with store.context() as d:  # space came back when a and b closed
            await d.write(1, *random_kv(config, 16, seed=4))
