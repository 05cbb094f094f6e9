"""Which layers take the page-cache path: the order, its spread, and Algorithm 1 over it."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.pipeline import Medium, PlanError, assign_groups, page_cache_order


def _longest_run(layers: int, group: set[int], inside: bool) -> int:
    flags = [(layer in group) is inside for layer in range(layers)]
    return max((len(list(run)) for flag, run in itertools.groupby(flags) if flag), default=0)


@given(st.integers(0, 200), st.sampled_from(["spread", "leading"]))
def test_every_layer_once(layers, how):
    assert sorted(page_cache_order(layers, how)) == list(range(layers))


def test_leading_is_the_papers_algorithm_1():
    assert page_cache_order(5, "leading") == (0, 1, 2, 3, 4)


def test_spread_orders_of_the_models_here():
    assert page_cache_order(12) == (0, 6, 2, 8, 4, 10, 11, 5, 9, 3, 7, 1)
    order = page_cache_order(32)
    assert set(order[:16]) == set(range(0, 32, 2))  # half and half alternate
    assert order[:4] == (0, 16, 8, 24)


@given(st.integers(2, 160).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n - 1))))
def test_spread_keeps_both_groups_spread_at_every_share(case):
    """Neither group has a run of layers more than 2.5x the shortest possible longest run (the
    layers of the other group cutting it as evenly as can be): a decode step that reads a few
    layers ahead finds both paths among them. The leading order fails this at once."""
    layers, n1 = case
    group = set(page_cache_order(layers)[:n1])
    for inside, count in ((True, n1), (False, layers - n1)):
        best = math.ceil(count / (layers - count + 1))
        assert _longest_run(layers, group, inside) <= 2.5 * best, (layers, n1, inside)


def test_leading_does_not_spread():
    group = set(page_cache_order(32, "leading")[:16])
    assert _longest_run(32, group, True) == 16


def test_unknown_order_and_negative_count():
    with pytest.raises(ValueError, match="unknown layer order"):
        page_cache_order(4, "middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative"):
        page_cache_order(-1)


def test_algorithm_1_takes_a_prefix_of_the_order():
    order = page_cache_order(8)
    placement = assign_groups([10] * 8, page_cache_budget=35, order=order)
    assert placement.page_cache == tuple(sorted(order[:3]))
    assert all(placement.medium_of(layer) is Medium.DIRECT for layer in order[3:])


def test_algorithm_1_stops_at_the_first_layer_that_does_not_fit():
    """Layers of different sizes: the longest prefix of the order that fits, as in the paper
    (a smaller layer later in the order does not jump the queue)."""
    placement = assign_groups([10, 30, 10, 10], page_cache_budget=25, order=(0, 1, 2, 3))
    assert placement.page_cache == (0,)


def test_an_order_that_is_not_a_permutation_is_refused():
    with pytest.raises(PlanError, match="each of the 3 layers once"):
        assign_groups([1, 1, 1], 3, order=(0, 0, 1))
