"""A budget change re-plans new contexts and restarts the strategy probe; open ones keep theirs."""

from __future__ import annotations

import pytest
import torch

from dualblade.actors import Budget, Reply
from dualblade.actors.budgeter import Refresh
from dualblade.bench.kv_workload import run_kv_workload
from dualblade.pipeline import fixed_budget, pin_bytes
from dualblade.store import open_store

from .conftest import random_kv

pytestmark = pytest.mark.anyio


async def test_budget_change_replans_and_reprobes(make_config):
    config = make_config("dual", prompt_len=16, max_new_tokens=4)
    async with open_store(config, device="cpu") as store:
        await run_kv_workload(store)  # probes steps 2 and 3, then locks
        assert (await store.strategy()).locked
        before = store.plan.placement
        assert before.page_cache == (0, 2)  # 2 of 4 layers, spread (page_cache_order)
        async with store.context() as old:
            k, v = random_kv(config, 16, seed=1)
            await old.write(3, k, v)  # layer 3 is direct under the old plan
            # The machine now has room for every layer (a change over min_change).
            budget = fixed_budget(
                100 << 20, pin_bytes=pin_bytes(config), copy_threads=config.copy_threads
            )
            store.runtime.budgeter._read = lambda: Budget(100 << 20, None, detail=budget)
            reply: Reply[Budget] = Reply()
            assert (await store.runtime.budgeter.ask(Refresh(reply), reply)).page_cache_bytes == (
                100 << 20
            )
            assert store.plan.placement.page_cache == (0, 1, 2, 3)
            assert store.plan.placement.direct == ()
            state = await store.strategy()
            assert not state.locked  # the placement changed: probe again
            # The open context keeps the plan it started with, and its data.
            assert old.plan.placement == before
            got_k, got_v = await old.read(3)
            assert torch.equal(got_k, k)
            assert torch.equal(got_v, v)
        async with store.context() as new:
            assert new.plan.placement.page_cache == (0, 1, 2, 3)
        result = await run_kv_workload(store)
        assert result.strategies[1:3] == ["intra", "cross"]  # the new probe ran
        assert (await store.strategy()).locked
        assert store.runtime.budgeter.changes == 1
