"""Algorithm 1: hand-computed groups and the properties the paper's argument needs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.pipeline import Medium, PlanError, assign_groups, place_layers

MIB = 1 << 20


def test_paper_example():
    # OPT-6.7B, batch 32, 544 rows: 272 MiB per layer; X = 5 GiB fits 18 layers (4896 MiB).
    placement = assign_groups([272 * MIB] * 32, 6 << 30, 5 << 30)
    assert placement.n1 == 18
    assert placement.page_cache == tuple(range(18))
    assert placement.direct == tuple(range(18, 32))
    assert placement.page_cache_bytes == 18 * 272 * MIB
    assert placement.direct_bytes == 14 * 272 * MIB
    assert placement.medium_of(17) is Medium.PAGE_CACHE
    assert placement.medium_of(18) is Medium.DIRECT


def test_x_defaults_to_budget_and_is_clamped():
    assert assign_groups([10] * 5, 35).n1 == 3
    assert assign_groups([10] * 5, 35, 1000).n1 == 3
    assert assign_groups([10] * 5, 35, 20).n1 == 2
    assert assign_groups([10] * 5, 35, -4).n1 == 0


def test_exact_fit_and_uneven_layers():
    assert assign_groups([10] * 4, 40).n1 == 4
    assert assign_groups([10] * 4, 39).n1 == 3
    # Longest fitting prefix: layer 1 does not fit, so nothing after it goes to the page cache.
    assert assign_groups([10, 30, 5], 20).page_cache == (0,)


@pytest.mark.parametrize("policy", ["page-cache", "cache-policy", "baseline"])
def test_page_cache_policies(policy):
    placement = place_layers(policy, [10] * 4, 0)
    assert placement.page_cache == (0, 1, 2, 3)
    assert placement.direct == ()
    assert placement.policy == policy


def test_direct_and_dual_policies():
    assert place_layers("direct", [10] * 4, 10**9).direct == (0, 1, 2, 3)
    assert place_layers("dual", [10] * 4, 25).n1 == 2


def test_refusals():
    with pytest.raises(PlanError, match="unknown policy"):
        place_layers("lru", [10], 0)
    with pytest.raises(PlanError, match="positive"):
        assign_groups([10, 0], 100)
    with pytest.raises(PlanError, match="negative"):
        assign_groups([10], -1)
    with pytest.raises(PlanError, match="outside"):
        assign_groups([10], 100).medium_of(1)


sizes = st.lists(st.integers(1, 1 << 30), min_size=1, max_size=64)
budgets = st.integers(0, 1 << 36)


@given(sizes, budgets, st.integers(0, 1 << 36))
def test_every_layer_placed_once_and_within_x(layer_bytes, budget, x):
    placement = assign_groups(layer_bytes, budget, x)
    assert sorted(placement.page_cache + placement.direct) == list(range(len(layer_bytes)))
    assert placement.page_cache == tuple(range(placement.n1))
    assert placement.page_cache_bytes <= min(x, budget)
    assert placement.page_cache_bytes + placement.direct_bytes == sum(layer_bytes)


@given(st.integers(1, 1 << 30), st.integers(1, 80), budgets, budgets)
def test_n1_is_floor_and_monotone(size, layers, x1, x2):
    budget = 1 << 37
    low, high = sorted((x1, x2))
    a = assign_groups([size] * layers, budget, low)
    b = assign_groups([size] * layers, budget, high)
    assert a.n1 == min(layers, low // size)
    assert a.n1 <= b.n1


@given(sizes, budgets)
def test_extremes(layer_bytes, budget):
    assert assign_groups(layer_bytes, budget, 0).n1 == 0
    assert assign_groups(layer_bytes, sum(layer_bytes)).direct == ()
    assert assign_groups(layer_bytes, sum(layer_bytes) + budget).n1 == len(layer_bytes)


def test_each_policy_names_its_layers_media() -> None:
    sizes = [10] * 5
    assert place_layers("dual", sizes, 25).media == (Medium.PAGE_CACHE,) * 2 + (Medium.DIRECT,) * 3
    assert place_layers("direct", sizes, 25).media == (Medium.DIRECT,) * 5
    assert place_layers("page-cache", sizes, 25).media == (Medium.PAGE_CACHE,) * 5
    assert place_layers("baseline", sizes, 25).media == (Medium.MMAP,) * 5
    # cache-policy keeps Algorithm 1's layers and drops the others' pages after each use
    kept = place_layers("cache-policy", sizes, 25, 15)
    assert kept.media == (Medium.PAGE_CACHE,) + (Medium.PAGE_CACHE_DROPPED,) * 4
    assert kept.page_cache == tuple(range(5))
    assert kept.direct == ()
