"""The rows the benches' sampled checks compare, and the checks built on their cached index."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dualblade.bench.kv_workload import VerificationError
from dualblade.bench.row_sample import SAMPLE_STRIDE, sampled_row_list, sampled_rows
from dualblade.bench.serving_requests import RequestSpec
from dualblade.bench.serving_workload import ServingKV
from dualblade.bench.sweep_workload import DerivedKV


@given(st.integers(min_value=1, max_value=5000))
def test_the_sample_spans_the_prompt_in_steps_of_the_stride(prompt: int) -> None:
    rows = sampled_row_list(prompt)
    assert rows[0] == 0
    assert rows[-1] == prompt - 1
    assert all(a < b <= a + SAMPLE_STRIDE for a, b in itertools.pairwise(rows))
    assert set(range(0, prompt, SAMPLE_STRIDE)) <= set(rows)
    assert torch.equal(sampled_rows(prompt), torch.tensor(rows))


def test_the_index_is_made_once_per_prompt_and_device() -> None:
    assert sampled_rows(130) is sampled_rows(130)
    assert sampled_rows(130, "cpu") is sampled_rows(130, "cpu")
    assert sampled_rows(131) is not sampled_rows(130)
    assert sampled_rows(130).dtype == torch.long


def test_a_prompt_without_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one prompt row"):
        sampled_row_list(0)


def test_the_sweeps_check_uses_each_layers_code_after_the_rows_are_gathered() -> None:
    data = DerivedKV(prompt=130, batch=3, width=8, dtype="float16", seed=1)
    for layer in (5, 6, 5):  # the second layer and the return find the gathered base rows
        assert data.check("K", layer, data.prompt_rows("K", layer), "sample") > 0
    with pytest.raises(VerificationError):
        data.check("K", 5, data.prompt_rows("K", 6), "sample")
    with pytest.raises(VerificationError):
        data.check("V", 5, data.prompt_rows("K", 5), "sample")


def test_a_shorter_read_is_checked_on_its_own_sample() -> None:
    data = DerivedKV(prompt=130, batch=3, width=8, dtype="float16", seed=1)
    k = data.prompt_rows("K", 2)
    assert data.check("K", 2, k, "sample") > 0
    short = k[:100].clone()
    assert data.check("K", 2, short, "sample") == len(sampled_row_list(100)) * 3 * 8 * 2
    short[99, 1, 1] += 1  # the last row of the shorter read is sampled
    with pytest.raises(VerificationError):
        data.check("K", 2, short, "sample")


def test_every_sampled_row_is_compared() -> None:
    data = DerivedKV(prompt=130, batch=3, width=8, dtype="float32", seed=4)
    k = data.prompt_rows("K", 1)
    for row in sampled_row_list(130):
        bad = k.clone()
        bad[row, 2, 7] += 1
        with pytest.raises(VerificationError):
            data.check("K", 1, bad, "sample")


def test_the_serving_check_keeps_a_sample_per_batch() -> None:
    data = ServingKV(60, 4, 16, "float16", seed=0)
    for index, batch in ((0, 2), (1, 4), (2, 2)):
        request = RequestSpec(index=index, arrival_s=0.0, batch=batch, prompt_len=50, new_tokens=2)
        read = data.prompt_rows("V", request, 3)
        assert data.check("V", request, 3, read) > 0
        bad = read.clone()
        bad[sampled_row_list(50)[1], batch - 1, 0] += 1
        with pytest.raises(VerificationError):
            data.check("V", request, 3, bad)
