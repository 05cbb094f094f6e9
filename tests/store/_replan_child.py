"""A store in a real memory cgroup whose limit the test lowers, for test_replan_cgroup.py:
``python _replan_child.py CONFIG PROCS REPORT GO``.

It joins the cgroup (``PROCS``: its ``cgroup.procs``), writes every layer of one context, and
reports its ledger (a JSON line in ``REPORT``); once ``GO`` exists (the limit was lowered) it
waits until the budgeter's reading has moved layers, checks every byte and reports again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import anyio
import torch

from dualblade.pipeline import PipelineConfig
from dualblade.store import KVContext, KVStore, open_store


def _report(path: Path, store: KVStore, ctx: KVContext, **extra: object) -> None:
    ledger = store.stats().ledger
    line = {
        "budget": ledger.budget_bytes,
        "placed": ledger.placed_bytes,
        "resident_layers": ctx.resident_layers,
        "demotions": ledger.demotions,
        "failed_moves": ledger.failed_moves,
        **extra,
    }
    with path.open("a") as out:
        out.write(json.dumps(line) + "\n")


def _layer(ctx: KVContext, rows: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer)
    shape = (rows, ctx.batch, ctx.width)
    k, v = (torch.randn(shape, generator=g).to(ctx.dtype) for _ in "KV")
    return k, v


def _digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """What a layer held, kept as a digest: kept as tensors, the layers would be anonymous
    memory that the lowered limit must also hold (and the child could be OOM-killed)."""
    digest = hashlib.sha256()
    for tensor in (k, v):
        digest.update(tensor.contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


async def _exact(ctx: KVContext, digests: list[str]) -> bool:
    """Every layer read back, one at a time (a layer's K and V are all this holds at once)."""
    exact = True
    for layer, want in enumerate(digests):
        exact &= _digest(*await ctx.read(layer)) == want
    return exact


async def main(config_path: Path, procs: Path, report: Path, go: Path) -> None:
    procs.write_text(str(os.getpid()))
    config = PipelineConfig.model_validate_json(config_path.read_text())
    async with open_store(config, device="cpu") as store, store.context() as ctx:
        await store.replanned()
        rows = config.workload.prompt_len
        digests = []
        for layer in range(ctx.num_layers):
            k, v = _layer(ctx, rows, layer)
            await ctx.write(layer, k, v)
            digests.append(_digest(k, v))
            del k, v
        gc.collect()
        os.sync()  # the files' pages are clean: the lowered limit can reclaim them
        _report(report, store, ctx)
        deadline = time.monotonic() + 60
        while not go.exists():
            await anyio.sleep(0.05)
            assert time.monotonic() < deadline, "the test never lowered the limit"
        before = store.stats().ledger.demotions
        while store.stats().ledger.demotions == before:  # the budgeter reads every second
            await anyio.sleep(0.1)
            assert time.monotonic() < deadline, "no demotion after the limit was lowered"
        await store.replanned()
        _report(report, store, ctx, exact=await _exact(ctx, digests))


if __name__ == "__main__":
    anyio.run(main, *(Path(arg) for arg in sys.argv[1:5]))
