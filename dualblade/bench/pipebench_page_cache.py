"""``dualblade pipebench --path page-cache``: the page-cache path against the machine's limit.

Where the whole KV cache fits in memory, decode reads resident page-cache files, and what sets
its speed is how fast the pipeline moves them to the device. One context with every layer on
the page-cache path (policy ``page-cache``, a budget that holds them all) is written once; each
run then reads every layer's K and V ``passes`` times through the pipeline (``ctx.read`` into
read buffers on the device, as many layers in flight as there are copy threads) and moves the
very same files with plain threads (:mod:`.page_cache_limit`: ``preadv`` into pinned memory and
copies on their own streams, the best of several thread counts). Runs alternate which goes
first; the ratio is of medians. The files' residency is checked before and after.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from dualblade.bench.floor import page_cache_reads
from dualblade.bench.page_cache_limit import FileToMove, LimitRun, measure_page_cache_limit
from dualblade.bench.pipebench import pipeline_pass, prefill_random
from dualblade.bench.process_stats import cpu_seconds_between, thread_cpu_seconds
from dualblade.errors import ConfigError
from dualblade.pipeline import PipelineConfig, layer_page_cache_bytes
from dualblade.store import open_store


@dataclass(frozen=True)
class PageCachePipeBenchResult:
    """Per run: the pipeline's rate, the limit's (its best thread count) and that count."""

    pipeline: list[float]
    limit: list[float]
    limit_threads: list[int]
    pipeline_cpu_s_per_gb: list[float]
    #: CPU seconds this process's other threads (the store's, io_uring's workers) spent while
    #: the limit's threads ran: a limit slowed by our own idle store would show here.
    limit_others_cpu_s: list[float]
    bytes_per_pass: int
    passes: int
    resident_fraction: float  # of the files' bytes, after the last run
    device: str

    def to_json(self) -> dict[str, Any]:
        return {
            "path": "page-cache",
            "pipeline_bytes_per_s": [round(x) for x in self.pipeline],
            "limit_bytes_per_s": [round(x) for x in self.limit],
            "limit_threads": self.limit_threads,
            "pipeline_median_bytes_per_s": round(statistics.median(self.pipeline)),
            "limit_median_bytes_per_s": round(statistics.median(self.limit)),
            "ratio": round(statistics.median(self.pipeline) / statistics.median(self.limit), 3),
            "pipeline_cpu_s_per_gb": round(statistics.median(self.pipeline_cpu_s_per_gb), 4),
            "limit_others_cpu_s": [round(x, 3) for x in self.limit_others_cpu_s],
            "bytes_per_pass": self.bytes_per_pass,
            "passes": self.passes,
            "resident_fraction": round(self.resident_fraction, 4),
            "device": self.device,
        }


def page_cache_only(config: PipelineConfig) -> PipelineConfig:
    """``config`` with every layer on the page-cache path, under a budget that holds them."""
    data = config.model_dump()
    data["policy"] = "page-cache"
    data["memory"]["page_cache_budget"] = sum(layer_page_cache_bytes(config))
    return PipelineConfig.model_validate(data)


def _resident(files: list[tuple[Any, int]]) -> float:
    total = sum(n for _, n in files)
    return sum(min(n, file.resident_bytes(0, n)) for file, n in files) / total if total else 0.0


async def run_page_cache_pipebench(
    config: PipelineConfig,
    *,
    runs: int,
    passes: int,
    device: str = "cpu",
    progress: Callable[[str], None] = lambda _line: None,
) -> PageCachePipeBenchResult:
    """Measure (see the module); the config's policy and budget are overridden."""
    forced = page_cache_only(config)
    layers = forced.shape().num_layers
    async with open_store(forced, device=device) as store, store.context() as ctx:
        if any(str(medium) != "page-cache" for medium in ctx.media):
            media = [str(medium) for medium in ctx.media]
            raise ConfigError(f"not every layer went to the page cache: {media}")
        await prefill_random(ctx, store)
        files = await page_cache_reads(ctx)
        resident = _resident(files)
        if resident < 0.99:
            raise ConfigError(
                f"only {resident:.0%} of the page-cache files stayed resident after they were "
                "written: the machine has too little memory for this config's KV cache"
            )
        to_move = [FileToMove(file.fd, n) for file, n in files]
        bytes_per_pass = sum(n for _, n in files)
        pool = [ctx.read_buffers() for _ in range(forced.copy_threads)]
        pipeline: list[float] = []
        cpu: list[float] = []
        best: list[LimitRun] = []
        others_cpu: list[float] = []

        async def pipeline_side(run: int) -> None:
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(passes):
                await pipeline_pass(ctx, layers, pool)
            seconds = time.perf_counter() - start
            pipeline.append(bytes_per_pass * passes / seconds)
            cpu.append((time.process_time() - cpu_start) / (bytes_per_pass * passes / 1e9))
            progress(f"run {run + 1} pipeline {pipeline[-1] / 1e6:9.1f} MB/s")

        async def limit_side(run: int) -> None:
            threads_before = thread_cpu_seconds()
            counts = await anyio.to_thread.run_sync(
                lambda: measure_page_cache_limit(to_move, torch.device(device), passes=passes)
            )
            # the limit's own threads have ended by now: what is counted is everyone else's
            others_cpu.append(cpu_seconds_between(threads_before, thread_cpu_seconds()))
            best.append(max(counts, key=lambda c: c.bytes_per_s))
            rates = ", ".join(f"{c.threads}: {c.bytes_per_s / 1e6:.0f}" for c in counts)
            progress(
                f"run {run + 1} limit    {best[-1].bytes_per_s / 1e6:9.1f} MB/s ({rates}; "
                f"the process's other threads meanwhile: {others_cpu[-1]:.2f} CPU s)"
            )

        try:
            for run in range(runs):
                sides = [pipeline_side, limit_side]
                for side in sides if run % 2 == 0 else sides[::-1]:
                    await side(run)
        finally:
            for buffers in pool:
                buffers.close()
        resident = _resident(files)
    return PageCachePipeBenchResult(
        pipeline,
        [run.bytes_per_s for run in best],
        [run.threads for run in best],
        cpu,
        others_cpu,
        bytes_per_pass,
        passes,
        resident,
        str(device),
    )
