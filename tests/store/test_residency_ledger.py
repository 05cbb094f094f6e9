"""The residency ledger's books over a page-cache order: what a context is admitted with, and
which layer a demotion or a promotion takes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.pipeline import page_cache_order
from dualblade.store.residency_ledger import LedgerFullError, ResidencyLedger

LAYER = 10


@given(st.integers(1, 40), st.integers(0, 45), st.sampled_from(["spread", "leading"]))
def test_admission_is_a_prefix_of_the_order_within_the_budget(layers, fit, how):
    order = page_cache_order(layers, how)
    ledger = ResidencyLedger(fit * LAYER)
    ledger.register(1, (LAYER,) * layers, order)
    admitted = ledger.admit(1)
    assert admitted == order[: min(fit, layers)]
    for layer in admitted:
        ledger.charge(1, layer)
    assert ledger.placed_bytes == len(admitted) * LAYER <= ledger.budget_bytes


@given(st.integers(2, 40), st.data())
def test_demotion_takes_the_last_charged_in_order_and_promotion_the_next(layers, data):
    order = page_cache_order(layers)
    held = data.draw(st.integers(1, layers))
    ledger = ResidencyLedger(layers * LAYER)
    ledger.register(7, (LAYER,) * layers, order)
    for layer in order[:held]:
        ledger.charge(7, layer)
    assert ledger.charged_in_order(7) == list(order[:held])  # the last is order[held - 1]
    assert ledger.next_uncharged(7, layers) == (order[held] if held < layers else None)
    ledger.credit(7, order[held - 1])  # demoted
    assert ledger.next_uncharged(7, held) == order[held - 1]  # the one to promote back


def test_layers_of_different_sizes_are_charged_by_layer_not_by_place():
    ledger = ResidencyLedger(100)
    ledger.register(1, (10, 20, 30), (2, 0, 1))
    assert ledger.admit(1) == (2, 0, 1)  # 30 + 10 + 20 fit in 100
    ledger.charge(1, 2)
    assert ledger.placed_bytes == 30
    assert ledger.fits(1, 1)  # 20 of the 70 left
    ledger.charge(1, 1)
    assert ledger.fits(1, 0)  # 10 of the 50 left
    assert ledger.placed_bytes == 50


def test_a_charge_past_the_budget_is_refused_and_names_the_layer():
    ledger = ResidencyLedger(25)
    ledger.register(1, (10, 20), (1, 0))
    ledger.charge(1, 1)
    with pytest.raises(LedgerFullError, match="layer 0 of context 1 needs 10 B"):
        ledger.charge(1, 0)


def test_an_order_that_is_not_a_permutation_is_refused():
    with pytest.raises(ValueError, match="not a permutation"):
        ResidencyLedger(10).register(1, (1, 1), (0, 0))


@given(
    st.lists(
        st.tuples(st.sampled_from(["register", "charge", "credit", "unregister"]), st.data()),
        max_size=60,
    )
)
def test_the_running_total_is_the_sum_of_what_each_context_holds(steps):
    """``placed_bytes`` is kept as charges come and go (not summed per question): it must stay
    the sum of every live context's charged layers through any sequence of changes."""
    ledger = ResidencyLedger(1 << 40)
    live: dict[int, int] = {}  # context -> layers
    next_id = 0
    for action, data in steps:
        if action == "register" or not live:
            layers = data.draw(st.integers(1, 6))
            sizes = tuple(data.draw(st.integers(1, 1000)) for _ in range(layers))
            ledger.register(next_id, sizes)
            live[next_id] = layers
            next_id += 1
            continue
        context = data.draw(st.sampled_from(sorted(live)))
        layer = data.draw(st.integers(0, live[context] - 1))
        if action == "charge":
            ledger.charge(context, layer)  # twice is once
        elif action == "credit":
            ledger.credit(context, layer)  # an uncharged layer credits nothing
        else:
            ledger.unregister(context)
            del live[context]
        assert ledger.placed_bytes == sum(ledger.snapshot().shares.values())


class _CountingNewestFirst:
    """Newest first, counting the passes over every context that admission should not need."""

    def __init__(self) -> None:
        self.seen = 0  # demands looked at, over every call

    def shares(self, budget, demands):
        self.seen += len(demands)
        left, result = budget, {}
        for demand in sorted(demands, key=lambda d: -d.arrival):
            n = 0
            while n < len(demand.layer_bytes) and demand.layer_bytes[n] <= left:
                left -= demand.layer_bytes[n]
                n += 1
            result[demand.context] = n
        return result

    def newcomer_share(self, budget, demand):
        return self.shares(budget, [demand])[demand.context]


def test_admission_asks_a_newcomer_share_policy_for_the_newcomer_only():
    policy = _CountingNewestFirst()
    ledger = ResidencyLedger(5 * LAYER, policy)
    for context in range(4):
        ledger.register(context, (LAYER, LAYER))
        for layer in ledger.admit(context):
            ledger.charge(context, layer)
    # each admission looked at the newcomer alone: 4 demands, not 1 + 2 + 3 + 4
    assert policy.seen == 4
    # the newest took its share of the whole budget, cut to what the older ones left free
    assert [len(ledger.charged_layers(c)) for c in range(4)] == [2, 2, 1, 0]
    assert ledger.placed_bytes == 5 * LAYER
