"""``dualblade pipebench``: what the actor pipeline costs over the raw engine, on the same bytes.

A pure-direct decode-read workload: one context's KV cache is written once, then each run reads
every layer's K and V ``passes`` times — through the pipeline (``ctx.read`` into the context's
read buffers, as a decoder reads: copy-thread actors, the overlap gate, the GPU-DMA actor) and
through the raw engine (``pread`` of the very same extents into as many buffers as there are
copy threads, of the memory the pipeline's reads land in, each buffer's reads chained in the
engine: the pipeline's overlap gate lets as many KPUs at a time reach storage). The
pipeline keeps as many layers' reads in flight as there are copy threads, each into its own read
buffers, so a KPU is always waiting when a storage slot frees. Runs alternate so drift hits both;
the ratio is of medians. Each run also reports the process's CPU seconds (all threads) per GB
moved: what a GB of decode reads costs, apart from how fast the target is.

On a GPU the raw side makes the pipeline's whole move, the reads and the copies to the device,
without the actors (:mod:`dualblade.bench.pipebench_device_raw`); the reads into pinned memory
alone run too, as ``raw_host``, beside it.

fio, where installed, reads the same extents of the same file in each run too (O_DIRECT,
io_uring, the engine's chunk as its block size and the ring's queue depth): the reference the
raw engine's reads are held against, on data of the same age.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from dualblade.bench.pipebench_device_raw import DeviceLane, device_lanes, raw_device_pass
from dualblade.io_engine import (
    DIRECT_FILE_ALIGNMENT,
    AlignedBuffer,
    StorageSlots,
    fio_path,
    run_fio,
)
from dualblade.pipeline import KpuExtent, PipelineConfig
from dualblade.store import KVContext, KVStore, ReadBuffers, open_store


@dataclass(frozen=True)
class PipeBenchResult:
    """Throughputs (bytes per second) and CPU costs (seconds per GB) of both sides, per run."""

    pipeline: list[float]
    raw: list[float]
    pipeline_cpu_s_per_gb: list[float]
    raw_cpu_s_per_gb: list[float]
    bytes_per_pass: int
    passes: int
    strategy: str
    target: str
    #: fio's read of the same extents, per run; empty where fio did not run (``fio_note`` why)
    fio: list[float] = field(default_factory=list)
    fio_note: str | None = None
    #: On a GPU, the raw engine's reads into pinned memory alone, per run (``raw`` adds the
    #: copies to the device); empty on the host, where the raw side's reads are the whole move.
    raw_host: list[float] = field(default_factory=list)
    raw_host_cpu_s_per_gb: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        reads = self.raw_host or self.raw  # what fio's reads compare with: reads alone
        fio: dict[str, Any] = (
            {
                "fio_bytes_per_s": [round(x) for x in self.fio],
                "fio_median_bytes_per_s": round(statistics.median(self.fio)),
                "raw_vs_fio": round(statistics.median(reads) / statistics.median(self.fio), 3),
            }
            if self.fio
            else {"fio_note": self.fio_note}
        )
        host: dict[str, Any] = (
            {
                "raw_host_bytes_per_s": [round(x) for x in self.raw_host],
                "raw_host_median_bytes_per_s": round(statistics.median(self.raw_host)),
                "ratio_vs_raw_host": round(
                    statistics.median(self.pipeline) / statistics.median(self.raw_host), 3
                ),
                "raw_host_cpu_s_per_gb": round(statistics.median(self.raw_host_cpu_s_per_gb), 4),
            }
            if self.raw_host
            else {}
        )
        return {
            "pipeline_bytes_per_s": [round(x) for x in self.pipeline],
            "raw_bytes_per_s": [round(x) for x in self.raw],
            "pipeline_median_bytes_per_s": round(statistics.median(self.pipeline)),
            "raw_median_bytes_per_s": round(statistics.median(self.raw)),
            "ratio": round(statistics.median(self.pipeline) / statistics.median(self.raw), 3),
            "pipeline_cpu_s_per_gb": round(statistics.median(self.pipeline_cpu_s_per_gb), 4),
            "raw_cpu_s_per_gb": round(statistics.median(self.raw_cpu_s_per_gb), 4),
            "bytes_per_pass": self.bytes_per_pass,
            "passes": self.passes,
            "strategy": self.strategy,
            "target": self.target,
            **fio,
            **host,
        }


async def prefill_random(ctx: KVContext, store: KVStore) -> None:
    """Every layer of ``ctx`` written with random K and V of its full length."""
    shape = store.config.shape()
    rows = store.config.workload.max_len
    dtype = ctx.dtype
    for layer in range(shape.num_layers):
        k = torch.randn(rows, ctx.batch, ctx.width).to(dtype).to(store.device)
        v = torch.randn(rows, ctx.batch, ctx.width).to(dtype).to(store.device)
        await ctx.write(layer, k, v)


async def pipeline_pass(ctx: KVContext, layers: int, pool: list[ReadBuffers]) -> None:
    """Every layer once, as many layers in flight as there are read buffers: a task per buffer,
    each reading the next layer not yet taken once its last read is done, as a decode's walk
    starts its next read into the buffer a layer leaves.

    A task per layer, waiting for a buffer on a stream, was the driver until 2026-12-04: at
    each pass's start its twelve tasks ran before any copy thread saw a message, and on the
    H200 machine the first chunk reached the ring 1.0-1.3 ms after the pass began, against
    0.38-0.42 ms on the raw side; that gap was most of the device's idle time in a pass
    (docs/pipeline-profile.md).
    """
    order = iter(range(layers))  # shared: each task takes the next layer when it is free

    async def reader(buffers: ReadBuffers) -> None:
        for layer in order:
            await ctx.read(layer, out=buffers)

    async with anyio.create_task_group() as tg:
        for buffers in pool:
            tg.start_soon(reader, buffers)


async def _raw_pass(store: KVStore, ctx: KVContext, buffers: list[AlignedBuffer]) -> None:
    """Every extent once through the engine, one read per buffer at a time, with nothing
    between two reads of a buffer: each buffer's reads queue for its one slot in the engine,
    and the ring thread starts the next as the last ends (no event-loop round trip, which the
    pipeline pays), so the raw side bounds the pipeline at the same storage concurrency."""
    extents = list(await ctx.direct_map())
    slots = [StorageSlots(1) for _ in buffers]
    async with anyio.create_task_group() as tg:
        for index, extent in enumerate(extents):
            turn = index % len(buffers)
            tg.start_soon(
                functools.partial(
                    store.raw_direct_read,
                    buffers[turn],
                    extent.nbytes,
                    extent.byte_offset,
                    slots=slots[turn],
                )
            )


async def _one_run(
    sides: dict[str, Callable[[], Awaitable[None]]],
    run: int,
    passes: int,
    bytes_per_pass: int,
    progress: Callable[[str], None],
) -> dict[str, tuple[float, float]]:
    """Each side ``passes`` times, in an order that alternates from run to run: per side, bytes
    per second and CPU seconds per GB."""
    out: dict[str, tuple[float, float]] = {}
    names = list(sides)
    for side in names if run % 2 == 0 else names[::-1]:
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(passes):
            await sides[side]()
        seconds = time.perf_counter() - start
        moved = bytes_per_pass * passes
        out[side] = (moved / seconds, (time.process_time() - cpu_start) / (moved / 1e9))
        progress(
            f"run {run + 1} {side:8} {out[side][0] / 1e6:8.1f} MB/s {out[side][1]:.3f} CPU s/GB"
        )
    return out


def _raw_buffers(
    store: KVStore, ctx: KVContext, count: int
) -> tuple[list[ReadBuffers], list[AlignedBuffer]]:
    """Memory of the kind the pipeline's reads land in, for the raw side: on the host the read
    buffers' own aligned memory (the pipeline lands there), on a GPU the copy threads' pinned
    buffers, registered with the ring (the pipeline reads into them with fixed-buffer reads).
    A plain buffer of a KPU's size read 3 % slower here than read-buffer memory (the pipeline
    beat that raw side by up to 7.7 %), and on a GPU it was read without the ring's fixed
    buffers: no bound either way (docs/pipeline-profile.md). Returns the read buffers to close,
    and the buffers to read into."""
    if store.device.type == "cpu":
        memory = [ctx.read_buffers() for _ in range(count)]
        landings = [buffers.landings[0] for buffers in memory]
        return memory, [landing.buffer for landing in landings if landing is not None]
    return [], store.pinned_buffers()[:count]


def _fio_reader(
    config: PipelineConfig, extents: list[KpuExtent], passes: int
) -> Callable[[], float]:
    """fio reading the region the extents cover, ``passes`` times: bytes per second."""
    first = min(extent.byte_offset for extent in extents)
    end = max(extent.byte_offset + extent.nbytes for extent in extents)
    direct = config.storage.direct

    def read() -> float:
        return run_fio(
            str(direct.path),
            "read",
            end - first,
            min(config.max_chunk, end - first),  # fio refuses a block larger than the region
            config.queue_depth,
            passthrough=direct.kind == "nvme",
            offset=first,
            io_size=(end - first) * passes,
        ).bytes_per_s

    return read


def direct_only(config: PipelineConfig, target: str | None = None) -> PipelineConfig:
    """``config`` with every layer on the direct path, optionally on another file target."""
    data = config.model_dump()
    data["policy"] = "direct"
    if target is not None:
        # a file target moves O_DIRECT-aligned blocks whatever the config's device had
        data["storage"]["direct"].update(kind="file", path=target, lba_size=DIRECT_FILE_ALIGNMENT)
    return PipelineConfig.model_validate(data)


async def run_pipebench(
    config: PipelineConfig,
    *,
    runs: int,
    passes: int,
    device: str = "cpu",
    target: str | None = None,
    use_fio: bool = True,
    progress: Callable[[str], None] = lambda _line: None,
) -> PipeBenchResult:
    """Measure; the config's policy is forced to ``direct`` (on ``target`` when given).

    ``use_fio``: read the same extents with fio in each run too, where fio is installed.
    """
    direct_config = direct_only(config, target)
    layers = direct_config.shape().num_layers
    threads = direct_config.copy_threads
    async with open_store(direct_config, device=device) as store, store.context() as ctx:
        await prefill_random(ctx, store)
        extents = list(await ctx.direct_map())
        bytes_per_pass = sum(extent.nbytes for extent in extents)
        fio_note = None if use_fio else "--no-fio"
        if fio_note is None and fio_path() is None:
            fio_note = "fio is not installed (apt-get install fio)"
        read_with_fio = _fio_reader(direct_config, extents, passes)
        rates: dict[str, list[float]] = {"pipeline": [], "raw": [], "raw_host": [], "fio": []}
        cpu: dict[str, list[float]] = {"pipeline": [], "raw": [], "raw_host": []}
        pipeline = [ctx.read_buffers() for _ in range(threads)]
        raw_memory, raw = _raw_buffers(store, ctx, threads)
        lanes: list[DeviceLane] = []
        try:
            sides: dict[str, Callable[[], Awaitable[None]]] = {
                "pipeline": lambda: pipeline_pass(ctx, layers, pipeline),
                "raw": lambda: _raw_pass(store, ctx, raw),
            }
            if store.device.type == "cuda":
                lanes = device_lanes(store.pinned_images(), store.device)
                gate = StorageSlots(threads)  # the overlap gate's direct slots under Intra
                sides["raw_host"] = sides["raw"]
                sides["raw"] = lambda: raw_device_pass(store, ctx, lanes, gate)
            for run in range(runs):
                if fio_note is None and run % 2:
                    rates["fio"].append(await anyio.to_thread.run_sync(read_with_fio))
                for side, (rate, seconds_per_gb) in (
                    await _one_run(sides, run, passes, bytes_per_pass, progress)
                ).items():
                    rates[side].append(rate)
                    cpu[side].append(seconds_per_gb)
                if fio_note is None and not run % 2:
                    rates["fio"].append(await anyio.to_thread.run_sync(read_with_fio))
                if rates["fio"]:
                    progress(f"run {run + 1} fio      {rates['fio'][-1] / 1e6:8.1f} MB/s")
        finally:
            lanes.clear()  # their host tensors alias the pinned buffers the store closes
            for buffers in [*pipeline, *raw_memory]:
                buffers.close()
        strategy = store.stats().strategy
    return PipeBenchResult(
        rates["pipeline"],
        rates["raw"],
        cpu["pipeline"],
        cpu["raw"],
        bytes_per_pass,
        passes,
        strategy,
        str(direct_config.storage.direct.path),
        rates["fio"],
        fio_note,
        rates["raw_host"],
        cpu["raw_host"],
    )
