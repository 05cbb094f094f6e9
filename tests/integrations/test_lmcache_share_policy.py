"""The adapter's newest-first share policy: the newcomer's share it tells the ledger on
admission is the share it would give in a pass over every object."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dualblade.integrations.lmcache.object_store import NewestFirst
from dualblade.store import ContextDemand

sizes = st.lists(st.integers(1, 64), min_size=1, max_size=4).map(tuple)


@given(st.lists(sizes, min_size=1, max_size=30), st.integers(-5, 600))
def test_the_newcomer_share_is_its_share_among_all(layer_bytes, budget):
    demands = [ContextDemand(i, i, b) for i, b in enumerate(layer_bytes)]
    newest = demands[-1]
    policy = NewestFirst()
    assert policy.newcomer_share(budget, newest) == policy.shares(budget, demands)[newest.context]
