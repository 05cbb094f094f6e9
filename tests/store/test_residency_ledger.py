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
    assert ledger.last_charged(7) == order[held - 1]
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
