"""Read buffers: direct reads land in the caller's memory on the host, every byte right."""

from __future__ import annotations

import pytest
import torch

from dualblade.store import ReadBuffers, open_store

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
