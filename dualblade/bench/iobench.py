"""``dualblade iobench``: our direct and page-cache paths against fio on the same file.

The target is a file, a raw block device, or an NVMe namespace's generic char device
(``/dev/ngXnY``): that one is driven through our passthrough path and compared with fio's
``io_uring_cmd`` engine, which sends the same NVMe commands through the ring.

Each run writes the whole target sequentially and then reads it back cold (page cache dropped
first), through our engine and, alternating in the same invocation, through fio with the same
size, block size and queue depth. Ratios are medians of ours over medians of fio, so a noisy disk
hits both alike. The first write of a fresh file converts unwritten extents and is done once,
unmeasured, before the runs.

Our direct path is exercised the way the KV pipeline uses it: large requests (one KPU-sized
buffer each, two of them in flight so the queue stays full across request boundaries) that the
engine splits into ``block_size`` chunks with at most ``queue_depth`` in flight.
"""

from __future__ import annotations

import os
import resource
import stat
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from dualblade import event_loop
from dualblade.bench.page_cache import drop_file_cache
from dualblade.errors import ConfigError
from dualblade.io_engine import (
    AlignedBuffer,
    BlockDevice,
    DirectFile,
    IOEngine,
    NvmeNamespace,
    PageCacheFile,
    Target,
    fio_path,
    run_fio,
)

#: The size of one request (a KPU-sized copy-thread buffer); two are kept in flight. 128 MiB is
#: the paper's decode read of one K or V tensor (OPT-6.7B, batch 32: 128-135 MB). Measured here
#: at 1 MiB chunks, QD 32 (medians of 3): 8 MiB requests 762 MB/s, 64 MiB 863, 256 MiB 1131,
#: fio 1123 in the same run; larger requests read faster although the queue stays full.
DEFAULT_REQUEST_BYTES = 128 << 20


@dataclass(frozen=True)
class IoBenchConfig:
    """What to measure."""

    path: str
    size: int
    block_size: int
    queue_depth: int
    runs: int
    use_fio: bool = True
    page_cache: bool = True
    request_bytes: int = DEFAULT_REQUEST_BYTES


@dataclass
class Series:
    """Throughput samples of one (path, op) in bytes per second."""

    samples: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float | int | list[float]]:
        return {
            "median_bytes_per_s": statistics.median(self.samples),
            "min_bytes_per_s": min(self.samples),
            "max_bytes_per_s": max(self.samples),
            "runs": len(self.samples),
            "samples": [round(s) for s in self.samples],
        }


@dataclass
class IoBenchResult:
    """Everything one invocation measured."""

    config: IoBenchConfig
    target: dict[str, object]
    engine: str
    series: dict[str, dict[str, Series]]
    cpu_us_per_chunk: float
    fio_cpu_us_per_chunk: float | None
    cache_drop: str

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "config": {
                "path": self.config.path,
                "size": self.config.size,
                "block_size": self.config.block_size,
                "queue_depth": self.config.queue_depth,
                "runs": self.config.runs,
                "request_bytes": self.config.request_bytes,
            },
            "target": self.target,
            "engine": self.engine,
            "cache_drop": self.cache_drop,
            "results": {
                path: {op: s.summary() for op, s in ops.items()}
                for path, ops in self.series.items()
            },
            "cpu_us_per_chunk": round(self.cpu_us_per_chunk, 2),
            "fio_cpu_us_per_chunk": (
                None if self.fio_cpu_us_per_chunk is None else round(self.fio_cpu_us_per_chunk, 2)
            ),
        }
        if "fio" in self.series:
            out["direct_vs_fio"] = {
                op: round(
                    statistics.median(self.series["direct"][op].samples)
                    / statistics.median(self.series["fio"][op].samples),
                    3,
                )
                for op in ("read", "write")
            }
        return out


def _open_direct(path: str, size: int) -> Target:
    if os.path.exists(path) and not os.path.isfile(path):
        if stat.S_ISCHR(os.stat(path).st_mode):
            return NvmeNamespace(path)  # a TargetError names what else it must be
        return BlockDevice(path)
    return DirectFile(path, size)


async def _stream(
    engine: IOEngine, target: Target, buffers: list[AlignedBuffer], size: int, write: bool
) -> None:
    """Move ``size`` bytes sequentially, each buffer carrying every other request."""
    request = buffers[0].size

    async def lane(index: int) -> None:
        buffer = buffers[index]
        offset = index * request
        while offset < size:
            length = min(request, size - offset)
            if write:
                await engine.pwrite(target, buffer, length, offset)
            else:
                await engine.pread(target, buffer, length, offset)
            offset += len(buffers) * request

    async with anyio.create_task_group() as tg:
        for index in range(len(buffers)):
            tg.start_soon(lane, index)


def run_iobench(
    config: IoBenchConfig, progress: Callable[[str], None] = lambda _line: None
) -> IoBenchResult:
    """Measure; ``progress`` receives one line per run."""
    target = _open_direct(config.path, config.size)
    size = min(config.size, target.size) // config.block_size * config.block_size
    use_fio = config.use_fio and fio_path() is not None
    series: dict[str, dict[str, Series]] = {
        name: {"write": Series(), "read": Series()}
        for name in (
            "direct",
            *(("fio",) if use_fio else ()),
            *(("page_cache",) if config.page_cache and isinstance(target, DirectFile) else ()),
        )
    }
    if use_fio and target.passthrough and config.block_size > target.max_transfer:
        # fio sends block_size commands, which the namespace refuses (EINVAL) above its limit
        # (MDTS, or max_segments 4 KiB pages: 127 on QEMU's controller, huge pages or not);
        # our engine would cut them, so the two sides would not move the same commands.
        target.close()
        raise ConfigError(
            f"{target.name} takes at most {target.max_transfer} bytes per command; "
            f"use --block-size {target.max_transfer} or less to compare with fio"
        )
    request = min(config.request_bytes, size)
    buffers = [AlignedBuffer(request) for _ in range(2)]
    for buffer in buffers:
        buffer.view[:] = os.urandom(buffer.size)
    cpu_us = 0.0
    chunks = 0
    fio_cpu: list[float] = []
    cache_drop = "none"
    engine = IOEngine(
        queue_depth=config.queue_depth,
        max_chunk=config.block_size,
        passthrough=target.passthrough,
    )
    try:
        engine.register_buffers(buffers)
        # Unmeasured first write: materialize the file's extents for everyone.
        event_loop.run(_stream, engine, target, buffers, size, True)

        def ours(op: str) -> float:
            nonlocal cpu_us, chunks
            before_chunks = engine.chunks_submitted
            before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
            start = time.perf_counter()
            event_loop.run(_stream, engine, target, buffers, size, op == "write")
            elapsed = time.perf_counter() - start
            cpu_us += (resource.getrusage(resource.RUSAGE_SELF).ru_utime - before) * 1e6
            chunks += engine.chunks_submitted - before_chunks
            return size / elapsed

        def theirs(op: str) -> float:
            result = run_fio(
                target.name,
                op,
                size,
                config.block_size,
                config.queue_depth,
                direct=True,
                passthrough=target.passthrough,
            )
            fio_cpu.append(result.usr_cpu_us_per_io)
            return result.bytes_per_s

        for run in range(config.runs):
            # Alternate who goes first, so drift within a run hits both sides alike.
            order: list[tuple[str, Callable[[str], float]]] = [("direct", ours)]
            if use_fio:
                order.append(("fio", theirs))
                if run % 2:
                    order.reverse()
            for op in ("write", "read"):
                for name, measure in order:
                    if op == "read" and not target.passthrough:  # passthrough has no cache
                        cache_drop = drop_file_cache(target.name)
                    value = measure(op)
                    series[name][op].samples.append(value)
                    progress(f"run {run + 1}/{config.runs} {name:6} {op:5} {value / 1e6:9.1f} MB/s")
        # The page-cache path after all direct/fio runs: its 2 x size of buffered traffic
        # between them disturbed whichever side read next (the host's cache of the disk too).
        for run in range(config.runs if "page_cache" in series else 0):
            write_bw, read_bw = _page_cache_run(engine, config.path, size, buffers)
            series["page_cache"]["write"].samples.append(write_bw)
            series["page_cache"]["read"].samples.append(read_bw)
            progress(
                f"run {run + 1}/{config.runs} page-cache write {write_bw / 1e6:9.1f} MB/s, "
                f"cold read {read_bw / 1e6:9.1f} MB/s"
            )
    finally:
        engine.close()
        for buffer in buffers:
            buffer.close()
        description = target.describe()
        target.close()
    return IoBenchResult(
        config=config,
        target=description,
        engine=engine.kind,
        series=series,
        cpu_us_per_chunk=cpu_us / chunks if chunks else 0.0,
        fio_cpu_us_per_chunk=statistics.median(fio_cpu) if fio_cpu else None,
        cache_drop=cache_drop,
    )


def _page_cache_run(
    engine: IOEngine, path: str, size: int, buffers: list[AlignedBuffer]
) -> tuple[float, float]:
    """Buffered write (with fdatasync) then cold buffered read of a sibling file."""
    cached_path = path + ".pagecache"
    target = PageCacheFile(cached_path, size)
    try:
        start = time.perf_counter()
        event_loop.run(_stream, engine, target, buffers, size, True)
        target.flush()
        write_bw = size / (time.perf_counter() - start)
        drop_file_cache(cached_path)
        start = time.perf_counter()
        event_loop.run(_stream, engine, target, buffers, size, False)
        read_bw = size / (time.perf_counter() - start)
    finally:
        target.close()
        os.unlink(cached_path)  # a scratch file: do not leave gigabytes in the user's cache
    return write_bw, read_bw
