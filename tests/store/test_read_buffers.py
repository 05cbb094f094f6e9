"""Read buffers: direct reads land in the caller's memory on the host, every byte right."""

from __future__ import annotations

import pytest
import torch

from dualblade.store import KVShapeError, ReadBuffers, open_store

from .conftest import MakeConfig, prefill_and_append, random_kv

pytestmark = pytest.mark.anyio


def host_copies(store) -> int:
    return store.stats().co_dma.cpu_fallback_copies


@pytest.mark.parametrize("policy", ["dual", "direct", "page-cache", "baseline"])
async def test_reads_into_read_buffers_keep_every_byte(make_config: MakeConfig, policy: str):
    config = make_config(policy, "aligned", prompt_len=40, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        expected = await prefill_and_append(ctx, config)
        with ctx.read_buffers() as buffers:
            assert buffers.k.shape == (44, config.workload.batch, config.shape().kv_width)
            for layer, (k, v) in expected.items():
                got_k, got_v = await ctx.read(layer, out=buffers)
                assert got_k.data_ptr() == buffers.k.data_ptr()
                assert torch.equal(got_k, k)
                assert torch.equal(got_v, v)
                # rows that do not start at 0 take the staged path, still exact
                part_k, part_v = await ctx.read(layer, (3, 41), out=buffers)
                assert torch.equal(part_k, k[3:41])
                assert torch.equal(part_v, v[3:41])
                del got_k, got_v, part_k, part_v


async def test_direct_reads_land_without_a_host_copy(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=40, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 40, seed=3)
        await ctx.write(0, k, v)
        with ctx.read_buffers() as buffers:
            before = host_copies(store)
            got_k, got_v = await ctx.read(0, out=buffers)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
            assert host_copies(store) == before  # storage wrote the caller's memory itself
            del got_k, got_v
        plain = (torch.empty_like(k), torch.empty_like(v))
        await ctx.read(0, out=plain)
        assert torch.equal(plain[0], k)
        assert host_copies(store) > before  # plain tensors: staged, then copied out


async def test_padded_rows_read_exactly_through_read_buffers(make_config: MakeConfig):
    config = make_config("direct", "odd-gqa", prompt_len=16, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=4)
        await ctx.write(1, k, v)
        with ctx.read_buffers() as buffers:
            got_k, got_v = await ctx.read(1, out=buffers)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
            del got_k, got_v


async def test_closing_read_buffers_while_a_view_lives_is_refused(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=8, max_new_tokens=2)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 8, seed=5)
        await ctx.write(0, k, v)
        buffers = ctx.read_buffers()
        assert isinstance(buffers, ReadBuffers)
        view, _ = await ctx.read(0, out=buffers)
        with pytest.raises(BufferError, match="still aliases"):
            buffers.close()
        del view, _
        buffers.close()
        buffers.close()  # idempotent


async def test_reads_of_one_row_count_reuse_their_checked_views(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=8, max_new_tokens=2)
    async with (
        open_store(config, device="cpu") as store,
        store.context() as ctx,
        store.context(batch=1) as narrow,
    ):
        expected = {layer: random_kv(config, 8, seed=10 + layer) for layer in (0, 1)}
        for layer, (k, v) in expected.items():
            await ctx.write(layer, k, v)
        await narrow.write(0, expected[0][0][:, :1], expected[0][1][:, :1])
        with ctx.read_buffers() as buffers:
            first_k, first_v = await ctx.read(0, out=buffers)
            assert torch.equal(first_k, expected[0][0])
            again_k, again_v = await ctx.read(1, out=buffers)
            assert again_k is first_k  # made once for 8 rows
            assert again_v is first_v
            assert torch.equal(again_k, expected[1][0])
            assert torch.equal(again_v, expected[1][1])
            fewer_k, _ = await ctx.read(1, (0, 5), out=buffers)
            assert fewer_k is not first_k
            assert fewer_k.shape[0] == 5
            # the views were checked for ctx's shape: another shape is checked again
            with pytest.raises(KVShapeError, match=r"out k is .* \[>= 8, 1,") as refused:
                await narrow.read(0, out=buffers)
            del first_k, first_v, again_k, again_v, fewer_k, _, refused  # the traceback too


async def test_read_buffers_are_fixed_in_the_ring_until_closed(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=40, max_new_tokens=4)
    made_first = ReadBuffers(
        44, config.workload.batch, config.shape().kv_width, torch.float16, torch.device("cpu")
    )
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        engine = ctx.engine
        if engine.kind != "io_uring":
            pytest.skip(f"no io_uring ring here: {engine.fallback_reason}")
        probe = ReadBuffers(1, 1, 8, torch.float16, torch.device("cpu"))
        refusal = probe.landings[0] and engine.add_fixed_buffer(probe.landings[0].buffer)
        probe.close()
        if refusal:
            pytest.skip(f"read buffers stay unregistered here: {refusal}")
        k, v = random_kv(config, 40, seed=5)
        await ctx.write(0, k, v)
        buffers = ctx.read_buffers()
        memory = buffers.landings[0]
        assert memory is not None
        assert engine.is_registered(memory.buffer)
        got_k, got_v = await ctx.read(0, out=buffers)
        assert torch.equal(got_k, k)
        assert torch.equal(got_v, v)
        del got_k, got_v
        buffers.close()
        assert not engine.is_registered(memory.buffer)
        # made before the store (a bench does, so that the budget counts them): fixed on ask
        first = made_first.landings[0]
        assert first is not None
        assert not engine.is_registered(first.buffer)
        assert store.fix_read_buffers(made_first)
        assert engine.is_registered(first.buffer)
        got_k, got_v = await ctx.read(0, out=made_first)
        assert torch.equal(got_k, k)
        assert torch.equal(got_v, v)
        del got_k, got_v
    made_first.close()  # after the store: its ring took the table along


async def test_read_buffers_that_outlive_a_store_are_fixed_in_the_next(make_config: MakeConfig):
    config = make_config("direct", "aligned", prompt_len=40, max_new_tokens=4)
    kept = ReadBuffers(
        44, config.workload.batch, config.shape().kv_width, torch.float16, torch.device("cpu")
    )
    memory = kept.landings[0]
    assert memory is not None
    for seed in (6, 7):  # two stores, one after the other, reading into the same buffers
        async with open_store(config, device="cpu") as store, store.context() as ctx:
            engine = ctx.engine
            probe = ReadBuffers(1, 1, 8, torch.float16, torch.device("cpu"))
            refusal = probe.landings[0] and engine.add_fixed_buffer(probe.landings[0].buffer)
            probe.close()
            if engine.kind != "io_uring" or refusal:
                pytest.skip(f"read buffers stay unregistered here: {refusal or engine.kind}")
            assert store.fix_read_buffers(kept)  # the second store too: they move to its ring
            assert engine.is_registered(memory.buffer)
            k, v = random_kv(config, 40, seed=seed)
            await ctx.write(0, k, v)
            got_k, got_v = await ctx.read(0, out=kept)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
            del got_k, got_v
    kept.close()
