"""Without CUDA the page-cache and mmap paths move bytes straight between file and tensor, and
``read(out=...)`` fills the caller's buffers."""

from __future__ import annotations

import pytest
import torch

from dualblade.models import LayerWalk
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


async def test_dual_reads_direct_layers_first_with_four_transfers_per_host_thread(
    make_config: MakeConfig,
) -> None:
    # Layers 1 and 3 are direct (conftest): a step with two buffers reads 0, then 1 and 3
    # ahead of 2, and every byte comes back as written while up to four transfers run on each
    # copy thread (landing reads never touch its buffer).
    config = make_config("dual", "aligned", prompt_len=40, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        assert store.runtime.pool.per_thread == 4
        assert [str(m) for m in ctx.media] == ["page-cache", "direct", "page-cache", "direct"]
        order = ctx.read_order(2)
        issued = order.start()
        for layer in range(4):
            following = order.used(layer)
            if following is not None:
                issued.append(following)
        assert [layer for layer, _ in issued] == [0, 1, 3, 2]
        written = {layer: random_kv(config, 40, seed=layer) for layer in range(4)}
        for layer, (k, v) in written.items():
            await ctx.write(layer, k, v)
        # the walk reads the next step's layer 0 in each step's tail: it must hold the new row
        walk = LayerWalk(ctx, [ctx.read_buffers() for _ in range(2)])
        for step in range(3):
            got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            rows = {layer: random_kv(config, 1, seed=100 * step + layer) for layer in range(4)}

            async def use(
                layer: int,
                k: torch.Tensor,
                v: torch.Tensor,
                got: dict[int, tuple[torch.Tensor, torch.Tensor]] = got,
                rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = rows,
            ) -> tuple[torch.Tensor, torch.Tensor]:
                got[layer] = (k.clone(), v.clone())
                return rows[layer]

            await walk.step(use, more=step < 2)
            assert walk.carried_layers == ([0] if step < 2 else [])
            for layer, (k, v) in written.items():
                assert torch.equal(got[layer][0], k)
                assert torch.equal(got[layer][1], v)
                row_k, row_v = rows[layer]
                written[layer] = (torch.cat([k, row_k]), torch.cat([v, row_v]))
