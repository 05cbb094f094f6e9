"""A context makes a KPU's span once for the same medium and rows, hands out copies of it, and
makes it again once the layer has moved (its old blocks or files are given back)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from dualblade.pipeline import KpuId, Medium, RowRange
from dualblade.store import media, open_store

from .conftest import MakeConfig, random_kv

pytestmark = pytest.mark.anyio


async def _reads_back(ctx: Any, k: torch.Tensor, v: torch.Tensor) -> bool:
    got_k, got_v = await ctx.read(0)
    return torch.equal(got_k, k) and torch.equal(got_v, v)


async def test_spans_are_made_once_per_rows_and_again_after_a_move(
    make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config("direct", "aligned", prompt_len=16, max_new_tokens=4)
    made: Counter[tuple[Medium, KpuId, int, int]] = Counter()

    def counting(medium: Medium) -> Any:
        real = media.SPAN_MAKERS[medium]

        async def make(storage: Any, kpu: KpuId, rows: RowRange) -> media.PlacedSpan:
            made[(medium, kpu, rows.start, rows.stop)] += 1
            return await real(storage, kpu, rows)

        return make

    for medium in (Medium.DIRECT, Medium.PAGE_CACHE):
        monkeypatch.setitem(media.SPAN_MAKERS, medium, counting(medium))
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 16, seed=5)
        await ctx.write(0, k, v)
        for _ in range(3):
            assert await _reads_back(ctx, k, v)
        k0 = KpuId(0, "K")
        assert made[(Medium.DIRECT, k0, 0, 16)] == 1  # the write's serves every read

        first, _ = await ctx._placed(0, "K", RowRange(0, 16))
        second, _ = await ctx._placed(0, "K", RowRange(0, 16))
        assert first is not second  # copies: a caller may set fields on its own
        assert first == second
        assert made[(Medium.DIRECT, k0, 0, 16)] == 1

        assert await ctx.move_layer(0, Medium.PAGE_CACHE)
        assert await _reads_back(ctx, k, v)
        assert await ctx.move_layer(0, Medium.DIRECT)  # the run was trimmed: a new span
        assert await _reads_back(ctx, k, v)
        assert made[(Medium.PAGE_CACHE, k0, 0, 16)] == 1
        assert made[(Medium.DIRECT, k0, 0, 16)] == 2
