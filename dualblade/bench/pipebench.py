"""``dualblade pipebench``: what the actor pipeline costs over the raw engine, on the same bytes.

A pure-direct decode-read workload: one context's KV cache is written once, then each run reads
every layer's K and V ``passes`` times — through the pipeline (``ctx.read``: copy-thread actors,
the overlap gate, the GPU-DMA actor's copy into a fresh tensor) and through the raw engine
(``pread`` of the very same extents into as many pinned buffers as there are copy threads, with
the same concurrency). Runs alternate so drift hits both; the ratio is of medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from dualblade.io_engine import AlignedBuffer
from dualblade.pipeline import PipelineConfig
from dualblade.store import KVContext, KVStore, open_store


@dataclass(frozen=True)
class PipeBenchResult:
    """Throughputs of both sides, per run, in bytes per second."""

    pipeline: list[float]
    raw: list[float]
    bytes_per_pass: int
    passes: int
    strategy: str

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline_bytes_per_s": [round(x) for x in self.pipeline],
            "raw_bytes_per_s": [round(x) for x in self.raw],
            "pipeline_median_bytes_per_s": round(statistics.median(self.pipeline)),
            "raw_median_bytes_per_s": round(statistics.median(self.raw)),
            "ratio": round(statistics.median(self.pipeline) / statistics.median(self.raw), 3),
            "bytes_per_pass": self.bytes_per_pass,
            "passes": self.passes,
            "strategy": self.strategy,
        }


async def _prefill(ctx: KVContext, store: KVStore) -> None:
    shape = store.config.shape()
    rows = store.config.workload.max_len
    dtype = ctx.dtype
    for layer in range(shape.num_layers):
        k = torch.randn(rows, ctx.batch, ctx.width).to(dtype).to(store.device)
        v = torch.randn(rows, ctx.batch, ctx.width).to(dtype).to(store.device)
        await ctx.write(layer, k, v)


async def _pipeline_pass(ctx: KVContext, layers: int) -> None:
    async with anyio.create_task_group() as tg:
        for layer in range(layers):
            tg.start_soon(ctx.read, layer)


async def _raw_pass(store: KVStore, ctx: KVContext, buffers: list[AlignedBuffer]) -> None:
    lba_map = await ctx.direct_map()
    extents = list(lba_map)
    free = anyio.create_memory_object_stream[AlignedBuffer](len(buffers))
    for buffer in buffers:
        free[0].send_nowait(buffer)

    async def one(offset: int, nbytes: int) -> None:
        buffer = await free[1].receive()
        try:
            await store.raw_direct_read(buffer, nbytes, offset)
        finally:
            free[0].send_nowait(buffer)

    async with anyio.create_task_group() as tg:
        for extent in extents:
            tg.start_soon(one, extent.byte_offset, extent.nbytes)


async def run_pipebench(
    config: PipelineConfig,
    *,
    runs: int,
    passes: int,
    device: str = "cpu",
    progress: Callable[[str], None] = lambda _line: None,
) -> PipeBenchResult:
    """Measure; the config's policy is forced to ``direct``."""
    data = config.model_dump()
    data["policy"] = "direct"
    direct_config = PipelineConfig.model_validate(data)
    layers = direct_config.shape().num_layers
    pipeline: list[float] = []
    raw: list[float] = []
    async with open_store(direct_config, device=device) as store:
        stats = store.stats()
        buffers = [AlignedBuffer(stats.buffer_bytes) for _ in range(stats.buffers)]
        try:
            async with store.context() as ctx:
                await _prefill(ctx, store)
                lba_map = await ctx.direct_map()
                bytes_per_pass = sum(extent.nbytes for extent in lba_map)
                for run in range(runs):
                    order = ["pipeline", "raw"] if run % 2 == 0 else ["raw", "pipeline"]
                    for side in order:
                        start = time.perf_counter()
                        for _ in range(passes):
                            if side == "pipeline":
                                await _pipeline_pass(ctx, layers)
                            else:
                                await _raw_pass(store, ctx, buffers)
                        rate = bytes_per_pass * passes / (time.perf_counter() - start)
                        (pipeline if side == "pipeline" else raw).append(rate)
                        progress(f"run {run + 1}/{runs} {side:8} {rate / 1e6:8.1f} MB/s")
                strategy = store.stats().strategy
        finally:
            for buffer in buffers:
                buffer.close()
    return PipeBenchResult(pipeline, raw, bytes_per_pass, passes, strategy)
