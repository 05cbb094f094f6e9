"""Page-cache hits are counted per whole read, before it starts: readahead cannot fake them."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from dualblade.store import open_store

from .conftest import MakeConfig, random_kv

pytestmark = pytest.mark.anyio


def _evict_all(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@pytest.mark.parametrize("policy", ["page-cache", "baseline"])
async def test_cold_read_counts_no_hits_and_warm_read_counts_all(
    make_config: MakeConfig, tmp_path: Path, policy: str
) -> None:
    # 1024 rows of 4 KiB: a 4 MiB KPU, read in several ~1 MiB pieces.
    config = make_config(policy, "aligned", prompt_len=1020, max_new_tokens=4)
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        k, v = random_kv(config, 1020, seed=3)
        await ctx.write(0, k, v)
        counters = store.runtime.counters
        for file in ctx.page_cache_files():  # the baseline's shared mappings pin their pages
            if file._mmap is not None:
                file._mmap.madvise(mmap.MADV_DONTNEED)
        _evict_all(tmp_path / "pc")
        before = counters.snapshot()
        await ctx.read(0)
        cold = counters.snapshot()
        await ctx.read(0)
        warm = counters.snapshot()

    def delta(a: dict[str, object], b: dict[str, object], key: str) -> int:
        after, earlier = b[key], a[key]
        assert isinstance(after, int)
        assert isinstance(earlier, int)
        return after - earlier

    looked_up = delta(before, cold, "cache_lookup_bytes")
    assert looked_up == 2 * 1020 * 4096
    # Piece by piece, readahead from the first piece made the rest look cached (>80 % here).
    assert delta(before, cold, "cache_hit_bytes") <= looked_up // 10
    assert delta(cold, warm, "cache_hit_bytes") == delta(cold, warm, "cache_lookup_bytes")
