"""A context can read only rows it wrote: no returned tensor, nor the memory behind its view,
shows bytes an earlier context left on the disk.

The earlier context's bytes are kept on purpose: its direct run is not trimmed when it closes
(as after a crash, or on a device whose TRIM does not zero), and the next context is handed the
same run (first fit). It writes fewer rows than the earlier one did; every read path (a fresh
tensor, the context's read buffers that direct reads land in, the caller's own tensors, a slice
of rows) must give back its rows and nothing of the earlier ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualblade.io_engine import Target
from dualblade.store import open_store
from dualblade.testing import FaultPolicy, FaultyTarget

from .conftest import POLICIES, MakeConfig, random_kv

#: Every 16-bit word the earlier context wrote.
PATTERN = 0x5A5A


def _untrimmed(target: Target) -> Target:
    """``target`` whose TRIM does nothing: a released run keeps its bytes."""
    wrapped = FaultyTarget(target, FaultPolicy(0.0))
    wrapped.trim_op = lambda offset, length: None  # type: ignore[method-assign]
    wrapped.trim_blocking = lambda offset, length: None  # type: ignore[method-assign]
    return wrapped


def _pattern(rows: int, batch: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, batch, width), PATTERN, dtype=torch.int16).view(dtype)


def _pattern_words(tensor: torch.Tensor) -> int:
    """16-bit words equal to the pattern in the tensor's whole storage, beyond its view too."""
    storage = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    words = storage[: storage.numel() // 2 * 2].view(torch.int16)
    return int((words == PATTERN).sum())


@pytest.mark.anyio
@pytest.mark.parametrize("shape", ["aligned", "odd-gqa"])
@pytest.mark.parametrize("policy", POLICIES)
async def test_a_context_reads_only_rows_it_wrote(
    tmp_path: Path, make_config: MakeConfig, policy: str, shape: str
) -> None:
    config = make_config(policy, shape, prompt_len=16, max_new_tokens=4)
    async with open_store(config, device="cpu", wrap_direct=_untrimmed) as store:
        async with store.context() as old:
            full = _pattern(old.max_len, old.batch, old.width, old.dtype)
            for layer in range(old.num_layers):
                await old.write(layer, full, full)
            old_run = (await old.direct_map()).region if old.plan.placement.direct else None
        async with store.context() as ctx:
            if old_run is not None:
                assert (await ctx.direct_map()).region == old_run, "not the same run: no test"
            rows = 3
            mine = {layer: random_kv(config, rows, seed=layer) for layer in range(ctx.num_layers)}
            for layer, (k, v) in mine.items():
                await ctx.write(layer, k, v)
            if old_run is not None:  # the earlier rows are still on the disk, beyond ours
                assert bytes([0x5A]) * 256 in (tmp_path / "direct.kv").read_bytes()
            buffers = ctx.read_buffers()
            own = (
                torch.zeros(ctx.max_len, ctx.batch, ctx.width, dtype=ctx.dtype),
                torch.zeros(ctx.max_len, ctx.batch, ctx.width, dtype=ctx.dtype),
            )
            for layer, (k, v) in mine.items():
                for out in (None, buffers, own):
                    got = await ctx.read(layer, out=out)
                    assert torch.equal(got[0], k)
                    assert torch.equal(got[1], v)
                    # Random data hits the pattern by chance (1 word in 65536), a row of the
                    # earlier context's would be batch x width words.
                    assert max(_pattern_words(t) for t in got) < 8, f"old bytes behind {out}"
                got = await ctx.read(layer, (1, 3))
                assert torch.equal(got[0], k[1:3])
                assert max(_pattern_words(t) for t in got) < 8
            del got
            buffers.close()
