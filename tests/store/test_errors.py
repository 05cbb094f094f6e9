"""Bad input gets a KVShapeError that says what was expected; a closed context refuses work."""

from __future__ import annotations

import pytest
import torch

from dualblade.errors import DualbladeError
from dualblade.store import ContextClosedError, KVShapeError, open_store

from .conftest import random_kv

pytestmark = pytest.mark.anyio


@pytest.fixture
async def ctx(make_config):
    config = make_config("dual", prompt_len=16, max_new_tokens=2)  # batch 3, width 64, bf16
    async with open_store(config, device="cpu") as store, store.context() as context:
        yield context


async def test_wrong_dtype(ctx):
    k, v = random_kv(ctx.store.config, 16, seed=0)
    with pytest.raises(
        KVShapeError, match=r"k has dtype torch.float32; this store holds torch.bfloat16"
    ):
        await ctx.write(0, k.float(), v)
    with pytest.raises(KVShapeError, match=r"v has dtype torch\.float16"):
        await ctx.write(0, k, v.half())


@pytest.mark.parametrize(
    "shape", [(16, 4, 64), (16, 3, 32), (16, 3, 2, 16), (16, 192), (3, 64), (16, 3, 64, 1)]
)
async def test_wrong_batch_or_width(ctx, shape):
    good, _ = random_kv(ctx.store.config, 16, seed=0)
    bad = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(KVShapeError) as info:
        await ctx.write(1, bad, good)
    message = str(info.value)
    assert f"k has shape {list(shape)}" in message
    assert "expected [rows, 3, 64] (or [rows, 3, 2, 32])" in message
    assert isinstance(info.value, DualbladeError)
    assert isinstance(info.value, ValueError)


async def test_k_and_v_rows_must_match(ctx):
    k, _ = random_kv(ctx.store.config, 16, seed=0)
    _, v = random_kv(ctx.store.config, 15, seed=0)
    with pytest.raises(KVShapeError, match="v has 15 rows; expected 16"):
        await ctx.write(0, k, v)


@pytest.mark.parametrize("layer", [-1, 4, 100, 1.0, "0"])
async def test_layer_out_of_range(ctx, layer):
    k, v = random_kv(ctx.store.config, 16, seed=0)
    with pytest.raises(KVShapeError, match=r"layer must be in 0\.\.3, got"):
        await ctx.write(layer, k, v)
    with pytest.raises(KVShapeError, match=r"layer must be in 0\.\.3"):
        await ctx.read(layer)
    with pytest.raises(KVShapeError, match=r"layer must be in 0\.\.3"):
        await ctx.append(layer, k[:1], v[:1])
    with pytest.raises(KVShapeError, match=r"layer must be in 0\.\.3"):
        ctx.length(layer)


async def test_reading_rows_never_written(ctx):
    with pytest.raises(KVShapeError, match=r"rows \[0, 0\) of layer 2 were never written"):
        await ctx.read(2)
    k, v = random_kv(ctx.store.config, 16, seed=0)
    await ctx.write(2, k, v)
    for rows in [(0, 17), (16, 17), (5, 5), (-1, 3), (8, 4)]:
        with pytest.raises(KVShapeError, match=r"it holds rows \[0, 16\)"):
            await ctx.read(2, rows)
    got, _ = await ctx.read(2, (15, 16))  # the store is fine after refusals
    assert torch.equal(got, k[15:16])


async def test_prefill_longer_than_max_len(ctx):
    k, v = random_kv(ctx.store.config, 19, seed=0)
    with pytest.raises(KVShapeError, match=r"write of 19 rows; a context holds 1\.\.18 rows"):
        await ctx.write(0, k, v)


async def test_append_past_max_len(ctx):
    k, v = random_kv(ctx.store.config, 18, seed=0)
    await ctx.write(3, k[:16], v[:16])
    assert await ctx.append(3, k[16:17], v[16:17]) == 17
    assert await ctx.append(3, k[17], v[17]) == 18
    with pytest.raises(KVShapeError, match="layer 3 already holds 18 rows"):
        await ctx.append(3, k[17:18], v[17:18])
    with pytest.raises(KVShapeError, match="k_row has 2 rows; expected 1"):
        await ctx.append(0, k[:2], v[:2])
    got_k, got_v = await ctx.read(3)
    assert torch.equal(got_k, k)
    assert torch.equal(got_v, v)


async def test_not_a_tensor(ctx):
    _, v = random_kv(ctx.store.config, 16, seed=0)
    with pytest.raises(KVShapeError, match=r"k must be a torch\.Tensor, got list"):
        await ctx.write(0, [[1.0]], v)


async def test_use_after_close(make_config):
    config = make_config("direct")
    k, v = random_kv(config, 16, seed=0)
    async with open_store(config, device="cpu") as store:
        async with store.context() as ctx:
            await ctx.write(0, k, v)
        for call in (
            lambda: ctx.write(0, k, v),
            lambda: ctx.append(0, k[:1], v[:1]),
            lambda: ctx.read(0),
        ):
            with pytest.raises(ContextClosedError, match=f"context {ctx.id} is closed"):
                await call()
        with pytest.raises(ContextClosedError):
            ctx.length(0)
        await ctx.close()  # closing twice is harmless
