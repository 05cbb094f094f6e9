"""Without CUDA the page-cache and mmap paths move bytes straight between file and tensor, and
``read(out=...)`` fills the caller's buffers."""

from __future__ import annotations

import pytest
import torch

from dualblade.pipeline.slicing import RowRange
from dualblade.store import KVContext, KVShapeError, open_store

from .conftest import MakeConfig, random_kv

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("policy", ["page-cache", "baseline", "cache-policy"])
async def test_host_transfers_skip_the_pinned_buffer_and_keep_every_byte(
    make_config: MakeConfig, policy: str
) -> None:
    config = make_config(policy, "odd-gqa", prompt_len=300, max_new_tokens=2)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        expected = {}
        for layer in range(4):
            k, v = random_kv(config, 300, seed=layer)
            await ctx.write(layer, k, v)
            row_k, row_v = random_kv(config, 1, seed=100 + layer)
            await ctx.append(layer, row_k, row_v)
            expected[layer] = (torch.cat([k, row_k]), torch.cat([v, row_v]))
        for layer, (k, v) in expected.items():
            got_k, got_v = await ctx.read(layer)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
        load = await ctx._load_message(
            0, "K", RowRange(0, 301), torch.empty_like(expected[0][0]), None
        )
        (stats,) = await ctx._transfer_all([load])
        metrics = store.metrics()
    # The storage side wrote straight into the destination: no staging in the pinned buffer,
    # no host copy out of it.
    assert stats.io_buffer_address == stats.dma_host_address
    assert metrics["co_dma"]["cpu_fallback_copies"] == 0


@pytest.mark.parametrize("policy", ["dual", "direct", "page-cache", "baseline"])
async def test_read_into_caller_buffers(make_config: MakeConfig, policy: str) -> None:
    config = make_config(policy, "aligned", prompt_len=40, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 40, seed=7)
        for layer in range(4):
            await ctx.write(layer, k, v)
        shape = (44, config.workload.batch, config.shape().kv_width)
        out = (torch.zeros(shape, dtype=k.dtype), torch.zeros(shape, dtype=k.dtype))
        for layer in range(4):
            got_k, got_v = await ctx.read(layer, out=out)
            assert got_k.data_ptr() == out[0].data_ptr()
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
        part_k, _ = await ctx.read(1, (10, 20), out=out)
        assert torch.equal(part_k, k[10:20])
        await _refuses(ctx, (out[0][:39], out[1]), "contiguous")
        await _refuses(ctx, (out[0].float(), out[1]), "float16")
        await _refuses(ctx, (out[0],), "pair")
        await _refuses(ctx, (out[0], "v"), "tensor")


async def _refuses(ctx: KVContext, out: object, word: str) -> None:
    with pytest.raises(KVShapeError, match=word):
        await ctx.read(0, out=out)  # type: ignore[arg-type]
