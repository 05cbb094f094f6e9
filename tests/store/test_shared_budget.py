"""One page-cache budget for all of a store's contexts, and live re-planning (issue 14).

Every test checks bytes: what a context reads is what it wrote, whatever moved in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from dualblade.pipeline import Medium, PipelineConfig, page_cache_order
from dualblade.store import FirstComeShares, KVContext, KVStore, open_store
from dualblade.testing import FaultKind, FaultLog, FaultPolicy, FaultyTarget

from .conftest import MakeConfig, random_kv

pytestmark = pytest.mark.anyio

LAYERS = 4
PROMPT = 52  # + 12 new rows: 64 rows of 4 KiB = a 256 KiB KPU, a 512 KiB layer
#: Room for more decode steps than the re-planner's PAYBACK_ROWS, so written layers promote.
NEW = 12
LAYER_BYTES = 512 << 10


#: The layer a context demotes first when its share drops from all four layers to three: the
#: last of its page-cache order (layers are spread over the model: see page_cache_order).
LAST_IN_ORDER = page_cache_order(4)[-1]


def _config(make_config: MakeConfig, policy: str = "dual", layers_in_budget: int = 4) -> Any:
    budget = f"{layers_in_budget * LAYER_BYTES}B"
    return make_config(
        policy,
        "aligned",
        prompt_len=PROMPT,
        max_new_tokens=NEW,
        memory={"page_cache_budget": budget, "knob_x": budget},
    )


class Requests:
    """Contexts and what each wrote, checked on every read."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.expected: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    async def prefill(self, ctx: KVContext, seed: int, rows: int = PROMPT) -> None:
        for layer in range(LAYERS):
            kv = random_kv(self.config, rows, seed=seed * 100 + layer)
            await ctx.write(layer, *kv)
            self.expected[ctx.id, layer] = kv

    async def decode_step(self, ctx: KVContext, seed: int) -> None:
        for layer in range(LAYERS):
            await self.check(ctx, layer)
            row = random_kv(self.config, 1, seed=seed * 100 + layer)
            await ctx.append(layer, *row)
            k, v = self.expected[ctx.id, layer]
            self.expected[ctx.id, layer] = (torch.cat([k, row[0]]), torch.cat([v, row[1]]))

    async def check(self, ctx: KVContext, layer: int) -> None:
        k, v = await ctx.read(layer)
        want_k, want_v = self.expected[ctx.id, layer]
        assert torch.equal(k, want_k), f"context {ctx.id} layer {layer}: K differs"
        assert torch.equal(v, want_v), f"context {ctx.id} layer {layer}: V differs"


def _resident_bytes(contexts: list[KVContext]) -> int:
    return sum(f.resident_bytes(0, f.size) for c in contexts for f in c.page_cache_files())


@contextlib.asynccontextmanager
async def _watch_ledger(
    store: KVStore, contexts: list[KVContext], budget: int
) -> AsyncIterator[list[int]]:
    """Sample the ledger and the contexts' cached pages (mincore) every millisecond; both
    must stay within ``budget`` at every sample. Yields the samples of placed bytes."""
    samples: list[int] = []

    async def sample() -> None:
        while True:
            placed = store.stats().ledger.placed_bytes
            samples.append(placed)
            assert placed <= budget, f"the ledger holds {placed} B of a {budget} B budget"
            resident = _resident_bytes(contexts)
            assert resident <= budget, f"{resident} B cached of a {budget} B budget"
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample)
        yield samples
        tg.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def all_resident(
    config: PipelineConfig, requests: Requests, seed: int
) -> AsyncIterator[tuple[KVStore, KVContext]]:
    """A store with one context whose prefill (``seed``) placed and left every layer resident."""
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        await store.replanned()
        await requests.prefill(ctx, seed)
        assert ctx.resident_layers == LAYERS
        yield store, ctx


async def test_concurrent_dual_contexts_share_one_budget(make_config: MakeConfig) -> None:
    """Four contexts under a budget of four layers: one layer each, never more in total."""
    config = _config(make_config)
    budget = 4 * LAYER_BYTES
    requests = Requests(config)
    async with open_store(config, device="cpu") as store, contextlib.AsyncExitStack() as stack:
        contexts = [await stack.enter_async_context(store.context()) for _ in range(4)]
        await store.replanned()
        ledger = store.stats().ledger
        assert ledger.budget_bytes == budget
        assert sorted(ledger.shares.values()) == [LAYER_BYTES] * 4  # equal contexts, equal shares
        assert [c.media.count(Medium.PAGE_CACHE) for c in contexts] == [1] * 4
        async with _watch_ledger(store, contexts, budget) as samples:
            async with anyio.create_task_group() as tg:
                for n, ctx in enumerate(contexts):
                    tg.start_soon(requests.prefill, ctx, n)
            for step in range(3):
                async with anyio.create_task_group() as tg:
                    for n, ctx in enumerate(contexts):
                        tg.start_soon(requests.decode_step, ctx, 1000 + 10 * step + n)
        assert samples
        assert max(samples) <= budget
        written = store.stats().write_bytes
        assert 0 < written["page-cache"] <= budget
        assert written["direct"] > 0


async def test_contexts_that_come_and_go_keep_the_budget_and_their_bytes(
    make_config: MakeConfig,
) -> None:
    """Arrivals and departures re-share the budget (moves happen) while others decode."""
    config = _config(make_config)
    budget = 4 * LAYER_BYTES
    requests = Requests(config)
    live: list[KVContext] = []
    async with open_store(config, device="cpu") as store:

        async def request(n: int, delay: float, steps: int) -> None:
            await anyio.sleep(delay)
            async with store.context() as ctx:
                live.append(ctx)
                await requests.prefill(ctx, n)
                for step in range(steps):
                    await requests.decode_step(ctx, 1000 + 10 * n + step)
                    await anyio.sleep(0.2)  # longer than the re-planner settles
                for layer in range(LAYERS):
                    await requests.check(ctx, layer)
                live.remove(ctx)

        async with _watch_ledger(store, live, budget), anyio.create_task_group() as tg:
            tg.start_soon(request, 0, 0.0, 4)  # alone at first: it takes every layer
            tg.start_soon(request, 1, 0.25, 4)
            tg.start_soon(request, 2, 0.5, 4)
            tg.start_soon(request, 3, 0.75, 4)
        stats = store.stats()
        assert stats.ledger.demotions > 0
        assert stats.ledger.promotions > 0
        assert stats.ledger.failed_moves == 0
        assert stats.ledger.placed_bytes == 0
        assert stats.ledger.shares == {}
        assert stats.extents_held == 0
        assert stats.files_held == 0


@pytest.mark.parametrize("policy", ["dual", "cache-policy"])
async def test_a_shrinking_then_growing_budget_demotes_then_promotes(
    make_config: MakeConfig, policy: str
) -> None:
    config = _config(make_config, policy)
    requests = Requests(config)
    async with open_store(config, device="cpu") as store, contextlib.AsyncExitStack() as stack:
        contexts = [await stack.enter_async_context(store.context()) for _ in range(2)]
        await store.replanned()
        for n, ctx in enumerate(contexts):
            await requests.prefill(ctx, n)
        assert [c.resident_layers for c in contexts] == [2, 2]

        stop = anyio.Event()
        steps = 0

        async def decode(ctx: KVContext, n: int) -> None:
            nonlocal steps
            while not stop.is_set() and ctx.length(0) < PROMPT + 4:
                await requests.decode_step(ctx, 5000 + 100 * n + steps)
                steps += 1
                await anyio.sleep(0.01)

        moves = store.stats().ledger
        async with anyio.create_task_group() as tg:
            for n, ctx in enumerate(contexts):
                tg.start_soon(decode, ctx, n)
            store.set_page_cache_budget(2 * LAYER_BYTES)  # squeezed: one layer each
            await store.replanned()
            assert [c.resident_layers for c in contexts] == [1, 1]
            assert store.stats().ledger.placed_bytes <= 2 * LAYER_BYTES
            assert store.stats().ledger.demotions == moves.demotions + 2
            outside = Medium.DIRECT if policy == "dual" else Medium.PAGE_CACHE_DROPPED
            assert all(c.media == (Medium.PAGE_CACHE, outside, outside, outside) for c in contexts)
            if policy == "dual":  # the demoted layers' files are unlinked with their pages
                assert all(len(c.page_cache_files()) == 2 for c in contexts)
            store.set_page_cache_budget(None)  # the squeeze is over
            await store.replanned()
            assert [c.resident_layers for c in contexts] == [2, 2]
            assert store.stats().ledger.promotions == moves.promotions + 2
            stop.set()
        for ctx in contexts:
            for layer in range(LAYERS):
                await requests.check(ctx, layer)


async def test_a_cut_during_a_prefill_gives_back_the_layers_not_written_yet(
    make_config: MakeConfig,
) -> None:
    """Moving a layer that holds no rows copies nothing: a budget cut that comes while a
    context is still writing its prompt takes the page-cache layers it has not written yet
    (the last of them in its order first), not the written ones, and reads no byte."""
    config = _config(make_config)
    requests = Requests(config)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        await store.replanned()
        assert ctx.media == (Medium.PAGE_CACHE,) * LAYERS
        for layer in (0, 1):  # half the prompt's layers written; layers 2 and 3 not yet
            kv = random_kv(config, PROMPT, seed=layer)
            await ctx.write(layer, *kv)
            requests.expected[ctx.id, layer] = kv
        read_before = dict(store.stats().read_bytes)
        store.set_page_cache_budget(2 * LAYER_BYTES)
        await store.replanned()
        assert ctx.media == (Medium.PAGE_CACHE,) * 2 + (Medium.DIRECT,) * 2
        assert store.stats().ledger.demotions == 2
        assert dict(store.stats().read_bytes) == read_before  # no layer was copied
        for layer in (2, 3):
            kv = random_kv(config, PROMPT, seed=layer)
            await ctx.write(layer, *kv)
            requests.expected[ctx.id, layer] = kv
        for layer in range(LAYERS):
            await requests.check(ctx, layer)


async def test_a_move_holds_up_only_its_own_layer(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a demotion waits for its direct run, the other layers read and append; a read
    of the moving layer waits for the move and then gets the same bytes."""
    from dualblade.store.context_storage import ContextHoldings

    config = _config(make_config)
    requests = Requests(config)
    claimed, release = anyio.Event(), anyio.Event()
    claim_run = ContextHoldings.direct_map

    async def held_claim(self: ContextHoldings, layer: int) -> Any:
        if layer == LAST_IN_ORDER:
            claimed.set()
            await release.wait()
        return await claim_run(self, layer)

    monkeypatch.setattr(ContextHoldings, "direct_map", held_claim)
    async with all_resident(config, requests, 1) as (store, ctx):
        store.set_page_cache_budget(3 * LAYER_BYTES)  # LAST_IN_ORDER must go direct
        with anyio.fail_after(5):
            await claimed.wait()  # the move holds LAST_IN_ORDER
        with anyio.fail_after(5):
            for layer in set(range(LAYERS)) - {LAST_IN_ORDER}:
                await requests.check(ctx, layer)
            await ctx.append(0, *random_kv(config, 1, seed=7))
        read_done = anyio.Event()

        async def read_moving_layer() -> None:
            await requests.check(ctx, LAST_IN_ORDER)
            read_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_moving_layer)
            await anyio.sleep(0.05)
            assert not read_done.is_set()  # it waits for the move, not for a wrong byte
            release.set()
        await store.replanned()
        assert ctx.media[LAST_IN_ORDER] is Medium.DIRECT


async def test_a_failed_move_leaves_the_layer_where_it_was(make_config: MakeConfig) -> None:
    config = _config(make_config)
    requests = Requests(config)
    policy = FaultPolicy(1.0, kinds=(FaultKind.EIO,))
    policy.enabled = False

    def direct(target: Any) -> FaultyTarget:
        return FaultyTarget(target, policy, log=FaultLog())

    async with (
        open_store(config, device="cpu", wrap_direct=direct) as store,
        store.context() as ctx,
    ):
        await store.replanned()
        await requests.prefill(ctx, 2)
        policy.enabled = True
        store.set_page_cache_budget(3 * LAYER_BYTES)
        await store.replanned()
        policy.enabled = False
        ledger = store.stats().ledger
        assert ledger.failed_moves >= 1
        assert ledger.demotions == 0
        assert ctx.media[LAST_IN_ORDER] is Medium.PAGE_CACHE
        assert ledger.placed_bytes == 4 * LAYER_BYTES  # over budget until a move succeeds
        for layer in range(LAYERS):
            await requests.check(ctx, layer)
        store.set_page_cache_budget(3 * LAYER_BYTES)  # a new reading: it tries again
        await store.replanned()
        assert ctx.media[LAST_IN_ORDER] is Medium.DIRECT
        await requests.check(ctx, LAST_IN_ORDER)


async def test_first_come_shares_never_move_a_layer_for_a_newcomer(
    make_config: MakeConfig,
) -> None:
    config = _config(make_config)
    async with open_store(config, device="cpu", share_policy=FirstComeShares()) as store:
        async with store.context() as first, store.context() as second:
            await store.replanned()
            assert (first.resident_layers, second.resident_layers) == (4, 0)
        assert store.stats().ledger.demotions == 0


async def test_without_replanning_contexts_keep_their_admitted_share(
    make_config: MakeConfig,
) -> None:
    config = _config(make_config)
    async with open_store(config, device="cpu", replan=False) as store:
        async with store.context() as first:
            async with store.context() as second:
                store.set_page_cache_budget(0)
                await store.replanned()
                assert (first.resident_layers, second.resident_layers) == (4, 0)
            async with store.context() as third:  # admitted under the new cap: nothing
                assert third.resident_layers == 0
        assert store.stats().ledger.demotions == 0


@pytest.mark.parametrize("policy", ["dual", "direct", "page-cache", "cache-policy", "baseline"])
async def test_contexts_of_different_shapes_at_once(make_config: MakeConfig, policy: str) -> None:
    """Requests of different batch sizes and lengths on one store, concurrently, every policy."""
    config = _config(make_config, policy, layers_in_budget=3)
    shapes = [(4, 64), (2, 40), (1, 17), (3, 64)]
    async with open_store(config, device="cpu") as store:

        async def request(n: int, batch: int, max_len: int) -> None:
            async with store.context(batch=batch, max_len=max_len) as ctx:
                kvs = []
                for layer in range(LAYERS):
                    g = torch.Generator().manual_seed(100 * n + layer)
                    shape = (max_len - 1, batch, ctx.width)
                    k, v = (torch.randn(shape, generator=g).to(ctx.dtype) for _ in "KV")
                    await ctx.write(layer, k, v)
                    row = [torch.randn((1, batch, ctx.width), generator=g).to(ctx.dtype)] * 2
                    await ctx.append(layer, *row)
                    kvs.append((torch.cat([k, row[0]]), torch.cat([v, row[1]])))
                await anyio.sleep(0.01)  # all open at once
                for layer, (k, v) in enumerate(kvs):
                    got_k, got_v = await ctx.read(layer)
                    assert got_k.shape == (max_len, batch, ctx.width)
                    assert torch.equal(got_k, k)
                    assert torch.equal(got_v, v)

        async with anyio.create_task_group() as tg:
            for n, (batch, max_len) in enumerate(shapes):
                tg.start_soon(request, n, batch, max_len)
        stats = store.stats()
        if policy in ("dual", "cache-policy"):
            assert stats.ledger.placed_bytes == 0
        assert stats.extents_held == 0
        assert stats.files_held == 0


async def test_the_budgeters_readings_replan_live_contexts(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    """A new reading of the memory limit (cgroup v1 or v2 alike) moves live layers."""
    from dualblade.actors import Budget, Reply
    from dualblade.actors.budgeter import Refresh
    from dualblade.pipeline import fixed_budget, pin_bytes

    config = _config(make_config)
    requests = Requests(config)
    async with all_resident(config, requests, 3) as (store, ctx):
        squeezed = fixed_budget(
            LAYER_BYTES, pin_bytes=pin_bytes(config), copy_threads=config.copy_threads
        )
        store.runtime.budgeter.min_change = 1
        store.runtime.budgeter._read = lambda: Budget(LAYER_BYTES, None, detail=squeezed)
        reply: Reply[Budget] = Reply()
        await store.runtime.budgeter.ask(Refresh(reply), reply)
        await store.replanned()
        assert ctx.resident_layers == 1
        assert store.metrics()["ledger"]["budget_bytes"] == LAYER_BYTES
        assert "dualblade_ledger_demotions 3" in store.prometheus()
        for layer in range(LAYERS):
            await requests.check(ctx, layer)


async def test_a_higher_reading_promotes_only_once_it_has_held(make_config: MakeConfig) -> None:
    """Demotions follow a lower reading at once; promotions wait until a higher one has held
    for GROWTH_WINDOW_S, so a reading that comes and goes moves no layer in and out again."""
    from dualblade.actors import Budget, Reply
    from dualblade.actors.budgeter import Refresh
    from dualblade.pipeline import fixed_budget, pin_bytes
    from dualblade.store.budget_watermark import GROWTH_WINDOW_S

    config = _config(make_config)
    requests = Requests(config)

    async def reading(store: KVStore, layers: int) -> None:
        detail = fixed_budget(
            layers * LAYER_BYTES, pin_bytes=pin_bytes(config), copy_threads=config.copy_threads
        )
        store.runtime.budgeter._read = lambda: Budget(layers * LAYER_BYTES, None, detail=detail)
        reply: Reply[Budget] = Reply()
        await store.runtime.budgeter.ask(Refresh(reply), reply)

    async with open_store(config, device="cpu") as store, store.context() as ctx:
        store.runtime.budgeter.min_change = 1
        await store.replanned()
        await requests.prefill(ctx, 4)
        await reading(store, 1)
        await store.replanned()
        assert ctx.resident_layers == 1  # at once
        before = store.stats().ledger.promotions

        await reading(store, 4)  # a rise that does not hold
        await anyio.sleep(GROWTH_WINDOW_S / 4)
        assert ctx.resident_layers == 1
        await reading(store, 1)
        await anyio.sleep(GROWTH_WINDOW_S / 4)
        assert store.stats().ledger.promotions == before  # nothing moved in, nor out again

        await reading(store, 4)  # one that holds
        start = anyio.current_time()
        await store.replanned()
        assert ctx.resident_layers == 4
        assert store.stats().ledger.promotions == before + 3
        assert GROWTH_WINDOW_S / 2 < anyio.current_time() - start < GROWTH_WINDOW_S * 3
        for layer in range(LAYERS):
            await requests.check(ctx, layer)


async def test_each_reading_keeps_what_the_application_reserved_out_of_the_budget(
    make_config: MakeConfig,
) -> None:
    """``reserved_memory`` is asked at every reading: as the application touches what it
    reserved, the budget follows what is still untouched."""
    from dualblade.actors import Budget, Reply
    from dualblade.actors.budgeter import Refresh

    config = _config(make_config)
    reserved = [256 << 20]
    async with open_store(
        config, device="cpu", memory_limit=4 << 30, reserved_memory=lambda: reserved[0]
    ) as store:
        first = store.runtime.budgeter.current
        assert first is not None
        assert first.detail.reserved_bytes == 256 << 20
        reserved[0] = 64 << 20
        reply: Reply[Budget] = Reply()
        second = await store.runtime.budgeter.ask(Refresh(reply), reply)
        assert second.detail.reserved_bytes == 64 << 20
        assert second.page_cache_bytes - first.page_cache_bytes == 192 << 20


async def test_a_new_mix_of_contexts_probes_the_strategy_again(make_config: MakeConfig) -> None:
    config = _config(make_config)
    async with open_store(config, device="cpu") as store, store.context():
        for _ in range(3):  # warm-up, intra, cross: then it locks
            async with store.iteration():
                pass
        assert (await store.strategy()).locked
        async with store.context():  # two contexts now: other traffic
            assert not (await store.strategy()).locked
            for _ in range(3):
                async with store.iteration():
                    pass
            assert (await store.strategy()).locked
        assert not (await store.strategy()).locked  # back to one
        assert store.runtime.probe.reprobes == 2


async def test_a_write_cancelled_while_a_move_holds_its_layer_loses_the_layer(
    make_config: MakeConfig,
) -> None:
    """The contract of write: cancelled part-way, the layer is refused until written again,
    also when the cancel came while it waited for a move of its layer."""
    from dualblade.store import LayerLostError

    config = _config(make_config)
    requests = Requests(config)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        await requests.prefill(ctx, 4)
        held, done = anyio.Event(), anyio.Event()

        async def hold_layer_0() -> None:  # as a move of layer 0 does
            async with ctx._layer_locks[0]:
                held.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_layer_0)
            await held.wait()
            with anyio.move_on_after(0.05):
                await ctx.write(0, *random_kv(config, PROMPT, seed=9))
            done.set()
        with pytest.raises(LayerLostError):
            await ctx.read(0)
        await requests.check(ctx, 1)


async def test_a_failed_write_back_is_raised_before_stale_bytes_are_read(
    make_config: MakeConfig,
) -> None:
    """Write-back failed and the pages are gone: the read that would go to disk raises the
    write-back error, and the layer is refused from then on (issue 18)."""
    from dualblade.io_engine import IOFailedError
    from dualblade.store import LayerLostError
    from dualblade.testing import FaultyPageCacheFile

    policy = FaultPolicy(1.0, kinds=(FaultKind.EIO,), ops=("write-back",))
    policy.enabled = False
    log = FaultLog()
    config = _config(make_config, "page-cache")
    requests = Requests(config)

    def files(path: Path, size: int) -> FaultyPageCacheFile:
        return FaultyPageCacheFile(path, size, policy, log)

    async with (
        open_store(config, device="cpu", page_cache_file=files) as store,
        store.context() as ctx,
    ):
        await requests.prefill(ctx, 5)
        await requests.check(ctx, 0)  # resident: served from memory
        for file in ctx.page_cache_files():
            if file.name.endswith("L0.K"):
                file.flush()
                file.advise_dontneed()  # its pages are gone: a read goes to disk
        policy.enabled = True  # and the kernel has a write-back error to report
        with pytest.raises(IOFailedError) as error:
            await ctx.read(0)
        assert error.value.op == "write-back"
        policy.enabled = False
        with pytest.raises(LayerLostError):
            await ctx.read(0)
        await requests.check(ctx, 1)  # the other layers are served


async def test_a_written_layer_is_promoted_only_while_its_context_can_repay_the_move(
    make_config: MakeConfig,
) -> None:
    """A promotion of a written layer is a disk read now and a write-back soon: a context
    with fewer than PAYBACK_ROWS steps to come keeps what it has when the budget grows, and
    one that still has them gets its layers back."""
    from dualblade.store.replanner import PAYBACK_ROWS

    config = _config(make_config)
    requests = Requests(config)
    async with (
        open_store(config, device="cpu") as store,
        store.context() as ending,
        store.context() as going_on,
    ):
        await store.replanned()
        await requests.prefill(ending, 1, rows=ending.max_len - PAYBACK_ROWS)
        await requests.prefill(going_on, 2, rows=going_on.max_len - PAYBACK_ROWS)
        store.set_page_cache_budget(2 * LAYER_BYTES)  # one layer each
        await store.replanned()
        assert [ending.resident_layers, going_on.resident_layers] == [1, 1]
        await requests.decode_step(ending, 700)  # one step fewer to come than would repay
        assert ending.max_len - ending.length(0) == PAYBACK_ROWS - 1
        assert going_on.max_len - going_on.length(0) == PAYBACK_ROWS
        store.set_page_cache_budget(None)
        await store.replanned()
        assert ending.resident_layers == 1  # the move would not pay: it stays
        assert going_on.resident_layers == 2  # its share back: it has the steps to repay it
        for ctx in (ending, going_on):
            for layer in range(LAYERS):
                await requests.check(ctx, layer)


async def test_a_budget_below_what_is_placed_cuts_a_newcomers_settling_short(
    make_config: MakeConfig,
) -> None:
    """A newcomer opens (the re-planner gathers arrivals for SETTLE_S) and the budget falls
    below what the first context placed: the demotions start at once, not after the wait,
    so the kernel is not left to evict the pages meanwhile."""
    from dualblade.store.replanner import SETTLE_S

    config = _config(make_config)
    requests = Requests(config)
    async with all_resident(config, requests, 1) as (store, first):
        async with store.context():
            start = anyio.current_time()
            store.set_page_cache_budget(LAYER_BYTES)  # three of first's four layers must go
            while store.stats().ledger.placed_bytes > LAYER_BYTES:
                await anyio.sleep(0.002)
            elapsed = anyio.current_time() - start
            assert elapsed < SETTLE_S, f"the demotions waited {elapsed:.3f} s for the settling"
        for layer in range(LAYERS):
            await requests.check(first, layer)
