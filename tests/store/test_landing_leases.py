"""Loads that land in the caller's memory take no copy-thread lease (they use no buffer)."""

from __future__ import annotations

import anyio
import pytest
import torch

from dualblade.store import open_store

from .conftest import MakeConfig, random_kv

pytestmark = pytest.mark.anyio


async def test_a_landing_read_is_not_held_behind_buffer_leases(make_config: MakeConfig) -> None:
    """With every lease of the pool taken (as by transfers through the copy threads' buffers
    waiting for storage), a read into the store's read buffers still runs: it lands in them
    and needs no buffer room. A read into a plain tensor, which goes through a buffer, waits
    for a lease; both return the bytes written."""
    config = make_config("direct", "aligned", prompt_len=40, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 40, seed=3)
        await ctx.write(0, k, v)
        pool = store.runtime.pool
        held = await pool.acquire(pool.PER_THREAD * len(pool.threads))
        try:
            with ctx.read_buffers() as buffers:
                with anyio.fail_after(5):
                    got_k, got_v = await ctx.read(0, out=buffers)
                assert torch.equal(got_k, k)
                assert torch.equal(got_v, v)
                landed = got_k.data_ptr() == buffers.k.data_ptr()
                del got_k, got_v  # views of the buffers: they must go before the buffers close
            assert landed
            plain = (torch.empty_like(k), torch.empty_like(v))
            with anyio.move_on_after(0.3) as waited:
                await ctx.read(0, out=plain)
            assert waited.cancelled_caught, "a buffered read went past a full pool"
        finally:
            for index in held:
                pool.release(index)
        with anyio.fail_after(5):
            got_k, _ = await ctx.read(0, out=(torch.empty_like(k), torch.empty_like(v)))
        assert torch.equal(got_k, k)
