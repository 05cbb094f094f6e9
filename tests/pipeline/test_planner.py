"""Whole plans: the paper's config at 6 GiB, every batch size, every policy."""

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualblade.pipeline import (
    ExtentOverflowError,
    RowRange,
    budget_for,
    config_from_mapping,
    load_config,
    make_plan,
    page_cache_order,
    pin_bytes,
    pin_images_in_plan,
    plan_slice,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER = load_config(CONFIGS / "opt-6.7b-paper.toml", env={})


def _with(config, **changes):
    data = config.model_dump(mode="json")
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        table = data
        for key in path:
            table = table[key]
        table[last] = value
    return config_from_mapping(data, env={})


def test_paper_at_6_gib():
    budget = budget_for(PAPER, 6 << 30)
    plan = make_plan(PAPER, budget)
    layer = 272 << 20
    n1 = budget.page_cache_bytes // layer
    assert budget.source == "explicit limit"
    assert budget.pin_bytes == pin_bytes(PAPER) == 136 << 20
    assert n1 == 20
    # spread over the model (the default order): the first 20 of the van der Corput order
    page_cache = tuple(sorted(page_cache_order(32)[:20]))
    direct = (1, 3, 5, 9, 11, 13, 17, 19, 21, 25, 27, 29)
    assert plan.placement.page_cache == page_cache
    assert plan.placement.direct == direct == tuple(sorted(set(range(32)) - set(page_cache)))
    extents = plan.lba_map.extents
    # Group 2 still lies on consecutive LBAs, in layer order
    assert [str(e.kpu) for e in extents[:3]] == ["L1.K", "L1.V", "L3.K"]
    assert extents[0].lba_start == PAPER.storage.direct.first_lba
    for before, after in itertools.pairwise(extents):
        assert after.lba_start == before.lba_start + before.n_blocks
    assert all(e.n_blocks == (136 << 20) // 4096 for e in extents)
    data = plan.to_dict()
    assert list(data)[:3] == ["budget", "groups", "placement"]
    assert data["groups"] == {"page_cache": list(page_cache), "direct": list(direct)}


def test_paper_at_6_gib_leading_layers():
    """The paper's literal Algorithm 1: layers 0..n1-1 to the page cache."""
    config = _with(PAPER, page_cache_layers="leading")
    plan = make_plan(config, budget_for(config, 6 << 30))
    assert plan.placement.page_cache == tuple(range(20))
    assert plan.placement.direct == tuple(range(20, 32))
    assert [str(e.kpu) for e in plan.lba_map.extents[:3]] == ["L20.K", "L20.V", "L21.K"]


def test_budget_sources():
    assert budget_for(_with(PAPER, memory__limit="4GiB")).limit_bytes == 4 << 30
    fixed = _with(PAPER, memory__page_cache_budget="1GiB")
    assert budget_for(fixed).page_cache_bytes == 1 << 30
    assert budget_for(fixed, 6 << 30).limit_bytes == 6 << 30  # the caller's limit wins
    discovered = budget_for(PAPER)
    assert discovered.limit_bytes is not None
    assert discovered.limit_bytes > 0
    assert "explicit" not in discovered.source


@pytest.mark.parametrize(
    ("policy", "n1"), [("direct", 0), ("page-cache", 32), ("baseline", 32), ("cache-policy", 32)]
)
def test_policies(policy, n1):
    config = _with(PAPER, policy=policy)
    plan = make_plan(config, budget_for(config, 2 << 30))
    assert plan.placement.n1 == n1
    assert len(plan.lba_map) == 2 * (32 - n1)


def test_declared_extent_too_small():
    config = _with(PAPER, policy="direct", storage__direct__extent_size="8GiB")
    with pytest.raises(ExtentOverflowError, match="enlarge extent_size"):
        make_plan(config, budget_for(config, 2 << 30))


def test_file_target_without_extent_sizes_to_fit():
    config = _with(PAPER, storage__direct={"kind": "file", "path": "/tmp/x.kv", "first_lba": 8})
    plan = make_plan(config, budget_for(config, 2 << 30))
    assert plan.lba_map.region.first_lba == 8
    assert plan.lba_map.end == plan.lba_map.region.end


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 70), preset=st.sampled_from(["opt-6.7b", "opt-13b", "qwen2.5-7b"]))
def test_any_batch_size_plans_and_slices_never_overlap(batch, preset):
    config = _with(
        PAPER, workload__batch=batch, model={"preset": preset}, storage__direct__extent_size="64GiB"
    )
    plan = make_plan(config, budget_for(config, 3 << 30))
    assert plan.layout.row_stride % 4096 == 0
    assert len(plan.lba_map) == 2 * len(plan.placement.direct)
    claimed = []
    for extent in plan.lba_map:
        for rows in (RowRange.prefix(512), RowRange.row(520), RowRange(512, 544)):
            slice_plan = plan_slice(extent, plan.layout, rows, config.max_chunk)
            claimed += [(c.slba, c.slba + c.nlb, str(extent.kpu), rows) for c in slice_plan.chunks]
            assert all(extent.lba_start <= c.slba < extent.end for c in slice_plan.chunks)
    # Chunks of different KPUs never share a block; chunks of one slice never overlap.
    by_slice = {}
    for start, stop, kpu, rows in claimed:
        by_slice.setdefault((kpu, rows), []).append((start, stop))
    for spans in by_slice.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    extents = sorted((e.lba_start, e.end) for e in plan.lba_map)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(extents))


def test_the_embedded_default_sizes_its_direct_file_to_the_plan():
    """A bigger model on the embedded default needs no config: its file grows to fit."""
    from dualblade.pipeline import config_for_model, get_preset, load_default_config

    config = config_for_model(
        load_default_config(env={}),
        get_preset("opt-1.3b"),
        batch=8,
        prompt_len=512,
        max_new_tokens=4,
        policy="direct",
    )
    assert config.storage.direct.extent_blocks() is None
    plan = make_plan(config, budget_for(config, 2 << 30))
    assert len(plan.lba_map) == 2 * 24
    assert plan.lba_map.used_blocks * 4096 > 256 << 20  # the old fixed extent's size


ROWS = 64 << 20  # a CUDA buffer's room for rows beyond its images


def _page_cache_layers(config, limit, images):
    budget = budget_for(config, limit, pin_images=images, row_room=ROWS)
    return len(make_plan(config, budget).placement.page_cache)


@pytest.mark.parametrize("gib", [3, 4, 6, 8, 9, 10, 11, 12, 16])
def test_one_image_where_it_buys_a_page_cache_layer(gib):
    """On CUDA a second image per copy thread is kept unless its memory (one KPU per thread)
    would hold another layer of the context in the page cache: the dual plan at each limit
    takes the image count under which more layers are in the page cache, two on a tie."""
    limit = gib << 30
    one, two = (_page_cache_layers(PAPER, limit, n) for n in (1, 2))
    images = pin_images_in_plan(PAPER, "cuda", limit, row_room=ROWS)
    assert images == (1 if one > two else 2)
    budget = budget_for(PAPER, limit, pin_images=images, row_room=ROWS)
    assert len(make_plan(PAPER, budget).placement.page_cache) == max(one, two)


def test_the_paper_below_its_working_set_takes_one_image_and_above_it_two():
    """The decisions the GPU machine's sweep meets (OPT-6.7B, batch 32): below the 8.7 GB
    working set a limit's page cache gains layers from one image; once every layer fits with
    two, two stay."""
    assert pin_images_in_plan(PAPER, "cuda", 4 << 30, row_room=ROWS) == 1
    assert _page_cache_layers(PAPER, 4 << 30, 1) > _page_cache_layers(PAPER, 4 << 30, 2)
    assert pin_images_in_plan(PAPER, "cuda", 16 << 30, row_room=ROWS) == 2
    assert _page_cache_layers(PAPER, 16 << 30, 2) == PAPER.shape().num_layers


def test_no_budget_no_reason_for_one_image():
    """Policies whose placement no budget moves keep both images: the memory buys nothing."""
    for policy in ("direct", "baseline"):
        config = _with(PAPER, policy=policy)
        assert pin_images_in_plan(config, "cuda", 4 << 30, row_room=ROWS) == 2


def test_a_host_store_has_one_image():
    assert pin_images_in_plan(PAPER, "cpu", 4 << 30) == 1
    assert pin_images_in_plan(PAPER, "cpu", 64 << 30) == 1


def test_one_copy_thread_keeps_two_images():
    """A CUDA copy thread runs one transfer per image and a layer's K and V are leased together:
    with one thread, one image could never take both, so two stay whatever the limit."""
    one_thread = _with(PAPER, copy_threads=1)
    for gib in (3, 4, 5, 8):
        assert pin_images_in_plan(one_thread, "cuda", gib << 30, row_room=ROWS) == 2


def test_memory_reserved_by_the_application_counts_in_the_choice():
    """At 16 GiB every layer fits with two images; with 8 GiB claimed by the application (not
    touched yet) they no longer do, and one image buys a layer back."""
    limit, reserved = 16 << 30, 8 << 30
    assert pin_images_in_plan(PAPER, "cuda", limit, row_room=ROWS) == 2
    assert pin_images_in_plan(PAPER, "cuda", limit, row_room=ROWS, reserved=reserved) == 1
