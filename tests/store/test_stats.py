"""stats(): the typed snapshot code above the store reads instead of the runtime."""

from __future__ import annotations

import dataclasses

import pytest

from dualblade.errors import ConfigError
from dualblade.io_engine import AlignedBuffer
from dualblade.store import StoreStats, open_store

from .conftest import random_kv

pytestmark = pytest.mark.anyio


async def test_stats_follow_a_context_from_open_to_close(make_config) -> None:
    config = make_config("dual")
    async with open_store(config, device="cpu") as store:
        before = store.stats()
        assert isinstance(before, StoreStats)
        with pytest.raises(dataclasses.FrozenInstanceError):
            before.open_contexts = 3  # type: ignore[misc]
        assert (before.open_contexts, before.extents_held, before.files_held) == (0, 0, 0)
        assert before.page_cache_placed_bytes == 0
        assert before.direct_target == str(config.storage.direct.path)
        assert before.buffers == config.copy_threads
        assert before.buffers_open == config.copy_threads
        async with store.context() as ctx:
            k, v = random_kv(config, 16, seed=1)
            for layer in range(ctx.num_layers):
                await ctx.write(layer, k, v)
            for layer in range(ctx.num_layers):
                await ctx.read(layer)
            during = store.stats()
            page_cache_layers = len(ctx.plan.placement.page_cache)
            assert during.open_contexts == 1
            assert during.extents_held == 1
            assert during.files_held == 2 * page_cache_layers
            assert during.page_cache_placed_bytes == 2 * page_cache_layers * (
                ctx.file_layout.image_bytes
            )
            assert during.page_cache_placed_bytes <= during.page_cache_budget_bytes
            assert during.read_bytes["direct"] > 0
            assert during.read_bytes["page-cache"] > 0
            assert during.io_chunks > before.io_chunks
        after_close = store.stats()
        assert (after_close.extents_held, after_close.files_held) == (0, 0)
        assert after_close.page_cache_placed_bytes == 0
        assert after_close.trimmed_blocks > 0
        assert store.metrics() == after_close.to_dict()
    closed = store.stats()  # still readable: the soak checks buffers after the store closed
    assert closed.buffers_open == 0
    assert closed.buffers_in_flight == 0


async def test_raw_direct_read_stays_inside_the_extent(make_config) -> None:
    config = make_config("direct")
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=2)
        await ctx.write(0, k, v)
        extent = next(iter(await ctx.direct_map()))
        with AlignedBuffer(extent.nbytes) as buffer:
            await store.raw_direct_read(buffer, extent.nbytes, extent.byte_offset)
            with pytest.raises(ConfigError, match="outside the store's direct extent"):
                await store.raw_direct_read(buffer, 4096, 0 if extent.byte_offset else -4096)


async def test_a_discovered_budget_counts_the_pinned_buffers_once(make_config) -> None:
    """The buffers exist before the budgeter's first reading: a discovered limit holds them in
    its in-use memory, so the plan does not reserve them again; a stated limit does."""
    discovered = make_config("direct", memory={"limit": "auto"})
    async with open_store(discovered, device="cpu") as store:
        budget = store.plan.budget
        stats = store.stats()
        assert budget.pinned_in_use_bytes == stats.buffers * stats.buffer_bytes > 0
        assert budget.pinned_still_reserved_bytes == 0
    stated = make_config("direct", memory={"limit": "4GiB"})
    async with open_store(stated, device="cpu") as store:
        assert store.plan.budget.pinned_in_use_bytes == 0
        assert store.plan.budget.pinned_still_reserved_bytes == store.stats().pinned_bytes
        # What the plan reserves is what the buffers take, to the byte (on CUDA: both images
        # and the room for rows).
        stats = store.stats()
        assert store.plan.budget.pinned_reservation_bytes == stats.buffers * stats.buffer_bytes


async def test_the_plan_reserves_the_room_for_rows_as_a_cuda_store_allocates_it(
    make_config, monkeypatch
) -> None:
    """A CUDA store's buffers hold two images and then room for appended rows: the reservation
    a stated limit subtracts is what they take, room included. The store's image count is set
    as CUDA's here, so the check runs without a GPU."""
    import dualblade.store.pin_layout as pin_layout

    monkeypatch.setattr(pin_layout, "pin_images_for", lambda device_type: 2)
    monkeypatch.setattr(pin_layout, "pin_images_in_plan", lambda *args, **kwargs: 2)
    stated = make_config("direct", memory={"limit": "4GiB"})
    async with open_store(stated, device="cpu") as store:
        budget, stats = store.plan.budget, store.stats()
        assert budget.pin_images == 2
        assert budget.row_room_bytes > 0
        assert budget.pinned_reservation_bytes == stats.buffers * stats.buffer_bytes


async def test_a_cuda_store_takes_one_image_where_the_second_would_cost_a_page_cache_layer(
    make_config, monkeypatch
) -> None:
    """The store sizes its buffers by ``pin_images_in_plan``: under a stated limit where the
    second image's memory would keep a layer out of the page cache it allocates one image (and
    the room for rows), reserves one, and its plan holds the layers one image leaves room for;
    under a limit where every layer fits with two it keeps two. CUDA's image count is set here,
    so the check runs without a GPU."""
    import dualblade.pipeline.planner as planner
    import dualblade.store.pin_layout as pin_layout
    from dualblade.actors import ROW_STAGING_BYTES
    from dualblade.pipeline import budget_for, make_plan, pin_images_in_plan

    monkeypatch.setattr(pin_layout, "pin_images_for", lambda device_type: 2)
    monkeypatch.setattr(planner, "pin_images_for", lambda device_type: 2)
    base = make_config("dual", memory={"limit": "4GiB", "safety_margin": "0"})
    rows = ROW_STAGING_BYTES
    layers = len(make_plan(base, budget_for(base, None, pin_images=2)).placement.page_cache)
    assert layers == base.shape().num_layers  # 4 GiB holds all: two images

    def page_cache_layers(config, images):
        budget = budget_for(config, None, pin_images=images, row_room=rows)
        return len(make_plan(config, budget).placement.page_cache)

    # the smallest limit (in steps of 64 KiB) at which one image holds more layers than two
    tight = None
    for step in range(1, 4096):
        config = make_config("dual", memory={"limit": step << 16, "safety_margin": "0"})
        if page_cache_layers(config, 1) > page_cache_layers(config, 2):
            tight = config
            break
    assert tight is not None
    assert pin_images_in_plan(tight, "cuda", row_room=rows) == 1
    async with open_store(tight, device="cpu") as store:
        budget, stats = store.plan.budget, store.stats()
        assert store.pin_images == budget.pin_images == 1
        assert stats.buffer_bytes == budget.pin_bytes + budget.row_room_bytes
        assert len(store.plan.placement.page_cache) == page_cache_layers(tight, 1)
    async with open_store(base, device="cpu") as store:
        assert store.pin_images == store.plan.budget.pin_images == 2
        assert store.stats().buffer_bytes == 2 * store.plan.budget.pin_bytes + rows
