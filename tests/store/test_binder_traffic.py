"""A context asks the binder once per KPU file and once for its extent, not on every transfer."""

from __future__ import annotations

import pytest
import torch

from dualblade.store import open_store

from .conftest import MakeConfig

pytestmark = pytest.mark.anyio


async def test_transfers_after_the_first_do_not_message_the_binder(make_config: MakeConfig) -> None:
    config = make_config("dual")
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        assert store.plan.placement.page_cache
        assert store.plan.placement.direct
        rows = torch.zeros((8, ctx.batch, ctx.width), dtype=ctx.dtype)
        for layer in range(ctx.num_layers):
            await ctx.write(layer, rows, rows)  # materializes files and the extent
        binder = store.runtime.binder
        before = binder.handled
        for layer in range(ctx.num_layers):
            await ctx.read(layer)
            await ctx.append(layer, rows[:1], rows[:1])
        assert binder.handled == before


async def test_cache_policy_evicts_only_beyond_its_budget(make_config: MakeConfig) -> None:
    config = make_config("cache-policy")
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        # The fixture's budget holds two of the four layers.
        assert ctx.resident_layers == 2
