"""The engine's attention: a decode step's one-row form against SDPA, and which form runs where."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from dualblade.models.attention import attention, one_row_attention


def heads(
    rows: int, batch: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """``[batch, heads, rows, head_dim]`` as the engine makes them: a permuted view of
    ``[rows, batch, hidden]`` (strided, not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, batch, num_heads * head_dim, generator=g).to(dtype)
    return x.view(rows, batch, num_heads, head_dim).permute(1, 2, 0, 3)


@pytest.mark.parametrize("cached", [1, 7, 513])
def test_one_row_attention_is_sdpa_in_float32(cached: int) -> None:
    q = heads(1, 3, 4, 16, torch.float32, 0)
    k, v = heads(cached, 3, 4, 16, torch.float32, 1), heads(cached, 3, 4, 16, torch.float32, 2)
    expected = F.scaled_dot_product_attention(q, k, v)
    got = one_row_attention(q, k, v)
    assert got.shape == expected.shape == (3, 4, 1, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_one_row_attention_in_half_precision_stays_near_float32() -> None:
    q, k, v = (heads(r, 2, 4, 64, torch.float16, s) for r, s in ((1, 0), (300, 1), (300, 2)))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    got = one_row_attention(q, k, v)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=2e-3)


def test_large_scores_do_not_overflow_the_softmax() -> None:
    # scores of several hundred: exp() of them overflows unless the softmax subtracts the max
    q = torch.full((1, 1, 1, 64), 4.0)
    k = torch.full((1, 1, 5, 64), 4.0)
    v = torch.arange(5.0).view(1, 1, 5, 1).expand(1, 1, 5, 64).contiguous()
    got = one_row_attention(q, k, v)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.full((1, 1, 1, 64), 2.0))  # equal weights: the mean


def test_on_the_host_every_shape_goes_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    real = F.scaled_dot_product_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(bool(kwargs.get("is_causal")))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    row, cached = heads(1, 2, 2, 8, torch.float32, 0), heads(9, 2, 2, 8, torch.float32, 1)
    attention(row, cached, cached, causal=False)
    attention(cached, cached, cached, causal=True)
    assert calls == [False, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_decode_row_skips_sdpa_and_a_prompt_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q, k, v = (heads(r, 4, 8, 64, torch.float16, s).cuda() for r, s in ((1, 0), (77, 1), (77, 2)))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())

    def refused(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a one-row decode query went to SDPA")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refused)
    got = attention(q, k, v, causal=False)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=2e-3)
    with pytest.raises(AssertionError, match="went to SDPA"):
        attention(k, k, v, causal=True)
