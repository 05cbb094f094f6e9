"""Every policy: prefill, appends and reads come back byte-exact, padded and GQA shapes too."""

from __future__ import annotations

import pytest
import torch

from dualblade.actors import transfer_pieces
from dualblade.store import open_store

from .conftest import POLICIES, SHAPES, random_kv

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("policy", POLICIES)
async def test_write_append_read_byte_exact(make_config, policy, shape):
    config = make_config(policy, shape, prompt_len=16, max_new_tokens=4)
    layers = config.shape().num_layers
    async with open_store(config, device="cpu") as store:
        if policy == "dual":
            assert store.plan.placement.page_cache
            assert store.plan.placement.direct
        async with store.context() as ctx:
            expected = {}
            for layer in range(layers):
                k, v = random_kv(config, 16, seed=layer)
                await ctx.write(layer, k, v)
                expected[layer] = (k, v)
            for step in range(4):
                for layer in range(layers):
                    k_row, v_row = random_kv(config, 1, seed=100 + 10 * step + layer)
                    if step % 2:  # a decode row may come as [batch, width]
                        k_row, v_row = k_row[0], v_row[0]
                    assert await ctx.append(layer, k_row, v_row) == 17 + step
                    k, v = expected[layer]
                    expected[layer] = (
                        torch.cat([k, k_row.reshape(1, *k.shape[1:])]),
                        torch.cat([v, v_row.reshape(1, *v.shape[1:])]),
                    )
            for layer in range(layers):
                want_k, want_v = expected[layer]
                assert ctx.length(layer) == 20
                k, v = await ctx.read(layer)
                assert k.dtype == want_k.dtype
                assert k.shape == (20, config.workload.batch, ctx.width)
                assert torch.equal(k, want_k)
                assert torch.equal(v, want_v)
                for start, stop in [(0, 1), (5, 17), (15, 16), (19, 20), (16, 20)]:
                    k, v = await ctx.read(layer, (start, stop))
                    assert torch.equal(k, want_k[start:stop]), (layer, start, stop)
                    assert torch.equal(v, want_v[start:stop]), (layer, start, stop)
        metrics = store.metrics()
    paths = set(metrics["read_bytes"]) | set(metrics["write_bytes"])
    expected_paths = {
        "dual": {"direct", "page-cache"},
        "direct": {"direct"},
        "page-cache": {"page-cache"},
        "cache-policy": {"page-cache"},
        "baseline": {"baseline"},
    }[policy]
    assert paths == expected_paths


@pytest.mark.parametrize("policy", POLICIES)
async def test_four_dimensional_tensors_are_accepted(make_config, policy):
    config = make_config(policy, "odd-gqa")
    shape = config.shape()
    assert shape.num_kv_heads < shape.num_heads  # GQA
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=1)
        heads = (16, 3, shape.num_kv_heads, shape.head_dim)
        await ctx.write(3, k.reshape(heads), v.reshape(heads))
        k_row, v_row = random_kv(config, 1, seed=2)
        await ctx.append(3, k_row.reshape(1, 3, *heads[2:]), v_row.reshape(1, 3, *heads[2:]))
        got_k, got_v = await ctx.read(3)
        assert torch.equal(got_k, torch.cat([k, k_row]))
        assert torch.equal(got_v, torch.cat([v, v_row]))


@pytest.mark.parametrize("policy", POLICIES)
async def test_transfers_cut_into_many_pieces_stay_exact(make_config, policy, monkeypatch):
    """Pieces of 3 padded rows: piece DMAs overlap later reads inside one buffer."""
    monkeypatch.setattr(transfer_pieces, "PIECE_BYTES", 3 * 4096)
    config = make_config(policy, "odd-gqa", prompt_len=40, max_new_tokens=3)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        written = {}
        for layer in range(4):
            written[layer] = random_kv(config, 40, seed=layer)
            await ctx.write(layer, *written[layer])
        for layer in range(4):
            k, v = await ctx.read(layer)
            assert torch.equal(k, written[layer][0])
            assert torch.equal(v, written[layer][1])
            k, v = await ctx.read(layer, (7, 33))
            assert torch.equal(k, written[layer][0][7:33])
        # Padding: rows of 384 bytes, each in its own 4 KiB block on the direct path.
        if "direct" in store.metrics()["read_bytes"]:
            assert store.plan.layout.row_stride == 4096
            assert store.plan.layout.padding_overhead == pytest.approx(4096 / 384 - 1)


async def test_store_direct_path_is_co_dma(make_config, monkeypatch):
    """Through the store: every direct transfer used one host buffer for the storage DMA and the
    device copy, and each piece was one CPU copy (this machine has no GPU)."""
    monkeypatch.setattr(transfer_pieces, "PIECE_BYTES", 4 * 4096)
    config = make_config("direct", "odd-gqa", prompt_len=16, max_new_tokens=1)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=7)
        await ctx.write(0, k, v)  # 2 stores of 4 pieces
        await ctx.append(0, k[:1], v[:1])  # 2 stores of 1 piece
        await ctx.read(0, (2, 17))  # 2 loads of 4 pieces (15 rows)
        co_dma = store.metrics()["co_dma"]
    assert co_dma["direct_transfers"] == 6
    assert co_dma["same_buffer"] == 6
    assert co_dma["cpu_fallback_copies"] == 2 * 4 + 2 * 1 + 2 * 4
    assert co_dma["staged_host_copies"] == 0
