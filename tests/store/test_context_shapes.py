"""Contexts of their own shape on one store: different batches, lengths and dtypes at once."""

from __future__ import annotations

import anyio
import pytest
import torch

from dualblade.store import KVShapeError, open_store, torch_dtype

from .conftest import POLICIES, MakeConfig

pytestmark = pytest.mark.anyio


def kv_for(ctx, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = (rows, ctx.batch, ctx.width)
    return (
        torch.randn(size, generator=generator).to(ctx.dtype),
        torch.randn(size, generator=generator).to(ctx.dtype),
    )


@pytest.mark.parametrize("policy", POLICIES)
async def test_contexts_of_different_shapes_at_once_keep_every_byte(
    make_config: MakeConfig, policy: str
) -> None:
    config = make_config(policy, "odd-gqa", prompt_len=40, max_new_tokens=8)  # batch 3, 48 rows
    shapes = [(3, 48), (1, 20), (2, 33), (3, 9)]
    async with open_store(config, device="cpu") as store:

        async def request(index: int, batch: int, max_len: int) -> None:
            async with store.context(batch=batch, max_len=max_len) as ctx:
                assert (ctx.batch, ctx.max_len) == (batch, max_len)
                prompt = max_len - 2
                expected = {}
                for layer in range(ctx.num_layers):
                    k, v = kv_for(ctx, prompt, seed=100 * index + layer)
                    await ctx.write(layer, k, v)
                    row_k, row_v = kv_for(ctx, 1, seed=1000 * index + layer)
                    await ctx.append(layer, row_k, row_v)
                    expected[layer] = (torch.cat([k, row_k]), torch.cat([v, row_v]))
                await anyio.sleep(0)  # the others write meanwhile
                for layer, (k, v) in expected.items():
                    got_k, got_v = await ctx.read(layer)
                    assert torch.equal(got_k, k)
                    assert torch.equal(got_v, v)
                with pytest.raises(KVShapeError):
                    await ctx.write(0, *kv_for(ctx, max_len + 1, seed=0))  # past its own length

        async with anyio.create_task_group() as tg:
            for index, (batch, max_len) in enumerate(shapes):
                tg.start_soon(request, index, batch, max_len)
        assert store.stats().open_contexts == 0
        assert store.stats().extents_held == 0


async def test_a_context_of_another_dtype_within_the_buffers(make_config: MakeConfig) -> None:
    config = make_config("direct", "odd-gqa", prompt_len=40, max_new_tokens=8)  # bfloat16
    async with open_store(config, device="cpu") as store, store.context(dtype="float16") as ctx:
        assert ctx.dtype == torch_dtype("float16")
        k, v = kv_for(ctx, 48, seed=1)
        await ctx.write(2, k, v)
        got_k, _ = await ctx.read(2)
        assert torch.equal(got_k, k)


async def test_a_context_larger_than_the_store_is_refused(make_config: MakeConfig) -> None:
    config = make_config("dual", "aligned", prompt_len=16, max_new_tokens=4)  # batch 4, 20 rows
    async with open_store(config, device="cpu") as store:
        with pytest.raises(KVShapeError, match="open the store with the largest shape"):
            async with store.context(batch=8, max_len=20):
                pytest.fail("a context larger than the store must not open")
        with pytest.raises(KVShapeError, match="open the store with the largest shape"):
            async with store.context(dtype="float32"):
                pytest.fail("float32 KPUs are twice the store's float16 ones")
        for bad in ({"batch": 0}, {"max_len": -3}, {"batch": True}, {"dtype": "int8"}):
            with pytest.raises(KVShapeError):
                async with store.context(**bad):
                    pytest.fail(f"{bad} must be refused")
        assert store.stats().open_contexts == 0
