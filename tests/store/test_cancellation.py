"""Cancelling a read mid-flight leaves every other context's data and the store intact."""

from __future__ import annotations

import anyio
import pytest
import torch

from dualblade.store import open_store

from .conftest import random_kv

pytestmark = pytest.mark.anyio

DELAYS = [0.0, 0.0002, 0.0005, 0.001, 0.002, 0.004]


@pytest.mark.parametrize("policy", ["dual", "direct", "baseline"])
async def test_cancelled_reads_leave_the_store_intact(make_config, policy):
    # 1.5 MiB padded KPUs: a read takes long enough to be cut at each delay.
    config = make_config(policy, prompt_len=384, max_new_tokens=0)
    async with open_store(config, device="cpu") as store:
        async with store.context() as victim, store.context() as other:
            data = {}
            for layer in range(4):
                data["victim", layer] = random_kv(config, 384, seed=layer)
                data["other", layer] = random_kv(config, 384, seed=10 + layer)
                await victim.write(layer, *data["victim", layer])
                await other.write(layer, *data["other", layer])
            cut = 0
            for delay in DELAYS:
                with anyio.move_on_after(delay) as scope:
                    async with anyio.create_task_group() as tg:
                        for layer in range(4):
                            tg.start_soon(victim.read, layer)
                cut += scope.cancelled_caught
                # Meanwhile and afterwards, the other context reads exactly its own bytes.
                for layer in range(4):
                    k, v = await other.read(layer)
                    assert torch.equal(k, data["other", layer][0])
                    assert torch.equal(v, data["other", layer][1])
            assert cut >= 1  # at least the zero delay cancelled something in flight
            # The cancelled context itself still works.
            for layer in range(4):
                k, v = await victim.read(layer)
                assert torch.equal(k, data["victim", layer][0])
                assert torch.equal(v, data["victim", layer][1])
        async with store.context() as fresh:
            k, v = random_kv(config, 384, seed=99)
            await fresh.write(3, k, v)
            got, _ = await fresh.read(3, (100, 300))
            assert torch.equal(got, k[100:300])
        buffers = store.runtime.buffers
    # Closing waited for every in-flight transfer: no buffer was released under I/O.
    assert buffers
    for buffer in buffers:
        assert buffer.inflight == 0
        assert buffer.closed


async def test_cancelled_writes_do_not_corrupt_other_contexts(make_config):
    config = make_config("dual", prompt_len=384, max_new_tokens=0)
    async with (
        open_store(config, device="cpu") as store,
        store.context() as victim,
        store.context() as other,
    ):
        mine = [random_kv(config, 384, seed=20 + layer) for layer in range(4)]
        for layer in range(4):
            await other.write(layer, *mine[layer])
        for delay in DELAYS:
            with anyio.move_on_after(delay):
                for layer in range(4):
                    await victim.write(layer, *random_kv(config, 384, seed=layer))
        for layer in range(4):
            k, v = await other.read(layer)
            assert torch.equal(k, mine[layer][0])
            assert torch.equal(v, mine[layer][1])
    for buffer in store.runtime.buffers:
        assert buffer.inflight == 0


async def test_cancelling_the_whole_store_shuts_down_cleanly(make_config):
    config = make_config("direct", prompt_len=384, max_new_tokens=0)
    for delay in DELAYS[:4]:
        with anyio.move_on_after(delay):
            async with open_store(config, device="cpu") as store, store.context() as ctx:
                k, v = random_kv(config, 384, seed=1)
                await ctx.write(0, k, v)
                while True:
                    await ctx.read(0)
        # Reopening works: the target is free and nothing leaked.
        with anyio.fail_after(30):
            async with open_store(config, device="cpu") as again, again.context() as ctx:
                k, v = random_kv(config, 16, seed=2)
                await ctx.write(1, k, v)
                got, _ = await ctx.read(1)
                assert torch.equal(got, k)


async def test_failed_start_up_leaks_nothing(make_config, monkeypatch):
    """The budgeter (first actor) fails while starting: the error comes out as itself and no
    actor is left with an open mailbox (a ResourceWarning, an error under this suite)."""
    from dualblade.errors import DualbladeError
    from dualblade.store import runtime

    def refuse(*_args):
        raise DualbladeError("no memory information")

    monkeypatch.setattr(runtime, "_budget_reader", refuse)
    with pytest.raises(DualbladeError, match="no memory information"):
        async with open_store(make_config("dual"), device="cpu"):
            pytest.fail("the store must not open")
    import gc

    gc.collect()  # unclosed streams would warn here
