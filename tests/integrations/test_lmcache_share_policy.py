"""The adapter's striped share policy: one object in every ``capacity / budget`` takes the
page-cache path, spread over the store order, within the budget; the newcomer's share it tells
the ledger on admission is the share it would give in a pass over every object."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.integrations.lmcache.striped_shares import StripedShares
from dualblade.store import ContextDemand

sizes = st.lists(st.integers(1, 64), min_size=1, max_size=4).map(tuple)


@given(st.lists(sizes, min_size=1, max_size=30), st.integers(-5, 600), st.integers(1, 900))
def test_the_newcomer_share_is_its_share_among_all(layer_bytes, budget, capacity):
    demands = [ContextDemand(i, i, b) for i, b in enumerate(layer_bytes)]
    newest = demands[-1]
    policy = StripedShares(capacity)
    assert policy.newcomer_share(budget, newest) == policy.shares(budget, demands)[newest.context]


@given(st.lists(sizes, min_size=1, max_size=30), st.integers(-5, 600), st.integers(1, 900))
def test_shares_fit_the_budget(layer_bytes, budget, capacity):
    demands = [ContextDemand(i, i, b) for i, b in enumerate(layer_bytes)]
    shares = StripedShares(capacity).shares(budget, demands)
    held = sum(sum(d.layer_bytes[: shares[d.context]]) for d in demands)
    assert held <= max(0, budget)
    assert all(0 <= shares[d.context] <= len(d.layer_bytes) for d in demands)


@given(st.integers(0, 2000), st.integers(1, 2000), st.integers(0, 500), st.integers(1, 500))
def test_the_stripe_picks_its_fraction_of_any_run_of_arrivals(budget, capacity, start, count):
    """Of any ``count`` consecutive arrivals, ``count * budget / capacity`` are picked, to
    within 3.2 (3.17 at worst in that range, computed): the page-cache objects are spread
    evenly, not bunched."""
    policy = StripedShares(capacity)
    picked = sum(policy.picked(budget, a) for a in range(start, start + count))
    fraction = min(1.0, budget / capacity)
    assert abs(picked - count * fraction) < 3.2


@given(st.integers(0, 2000), st.integers(0, 2000), st.integers(1, 2000), st.integers(0, 10**6))
def test_a_larger_budget_keeps_every_pick_of_a_smaller_one(low, high, capacity, arrival):
    """Monotone: re-planning to a new budget moves only the objects between the two."""
    low, high = sorted((low, high))
    policy = StripedShares(capacity)
    assert policy.picked(high, arrival) or not policy.picked(low, arrival)


def test_a_budget_that_covers_the_capacity_picks_every_object():
    policy = StripedShares(100)
    assert all(policy.picked(100, a) for a in range(50))
    assert not any(policy.picked(0, a) for a in range(50))


def test_a_capacity_must_be_positive():
    with pytest.raises(ValueError, match="at least 1 byte"):
        StripedShares(0)
