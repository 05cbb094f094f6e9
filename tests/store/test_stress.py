"""Randomized stress: many contexts, random reads, appends and cancellations, every byte checked.

Eight contexts work concurrently for a short while under each policy; a third of the reads and a
fifth of the appends are cancelled at a random moment. Afterwards every read must have returned
exactly what its context wrote (a cancelled append either landed whole or not at all), nothing
may be left in flight, and the store must have released every context.
"""

from __future__ import annotations

import random
import time

import anyio
import pytest
import torch

from dualblade.actors import Reply
from dualblade.actors.binder import Book, GetBook
from dualblade.store import KVContext, KVStore, open_store

from .conftest import POLICIES, MakeConfig

pytestmark = pytest.mark.anyio

SECONDS = 1.5


async def _worker(store: KVStore, seed: int, deadline: float, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    while time.monotonic() < deadline:
        async with store.context() as ctx:
            await _session(ctx, rng, generator, counts)


async def _session(
    ctx: KVContext, rng: random.Random, generator: torch.Generator, counts: dict[str, int]
) -> None:
    def rows(n: int) -> torch.Tensor:
        return torch.randn((n, ctx.batch, ctx.width), generator=generator).to(ctx.dtype)

    prompt = 8
    expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(ctx.num_layers):
        expected[layer] = (rows(prompt), rows(prompt))
        await ctx.write(layer, *expected[layer])
    for _ in range(rng.randint(2, 12)):
        layer = rng.randrange(ctx.num_layers)
        if rng.random() < 0.3:
            with anyio.move_on_after(rng.random() * 0.003) as scope:
                await ctx.read(layer)
            counts["cancelled"] += scope.cancelled_caught
        k, v = await ctx.read(layer)
        want_k, want_v = expected[layer]
        counts["reads"] += 1
        counts["mismatches"] += not (torch.equal(k, want_k) and torch.equal(v, want_v))
        if ctx.length(layer) >= ctx.max_len:
            continue
        k_row, v_row = rows(1), rows(1)
        before = ctx.length(layer)
        with anyio.move_on_after(rng.random() * 0.002 if rng.random() < 0.2 else 10) as scope:
            await ctx.append(layer, k_row, v_row)
        counts["cancelled"] += scope.cancelled_caught
        if ctx.length(layer) == before + 1:  # landed (a cancelled append may not have)
            expected[layer] = (torch.cat([want_k, k_row]), torch.cat([want_v, v_row]))


@pytest.mark.parametrize("policy", POLICIES)
async def test_concurrent_contexts_with_cancellations_never_corrupt(
    make_config: MakeConfig, policy: str
) -> None:
    config = make_config(policy, prompt_len=8, max_new_tokens=24)
    counts = {"reads": 0, "mismatches": 0, "cancelled": 0}
    async with open_store(config, device="cpu") as store:
        deadline = time.monotonic() + SECONDS
        async with anyio.create_task_group() as tg:
            for seed in range(8):
                tg.start_soon(_worker, store, seed, deadline, counts)
        reply: Reply[Book] = Reply()
        book = await store.runtime.binder.ask(GetBook(reply), reply)
        assert book.extents == {}
        assert book.files == {}
        assert store.open_contexts == 0
        buffers = store.runtime.buffers
    assert counts["reads"] > 50
    assert counts["cancelled"] > 5
    assert counts["mismatches"] == 0
    assert all(buffer.closed for buffer in buffers)
