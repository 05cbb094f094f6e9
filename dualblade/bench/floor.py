"""The decode floor of one run: how fast the run's own storage hands over the bytes it read.

A sweep run measures its floor itself, right after its decode and before its context closes,
so the floor is made of the same things as the decode it bounds:

- the same storage and the same data: the context's own direct extents, and its own page-cache
  files where they are now (the pages the decode found resident are still resident);
- the same age of data: both machines here are VMs whose disk sits on the host, and data
  written or read seconds ago may come back from the host's cache faster than the disk delivers
  cold data, so a scratch file written minutes earlier is no reference for a run's own extents;
- the same moves: the store's own engine (its ring, queue depth and chunk size), one request
  per KPU of the rows the decode read, as many requests in flight as the store has copy threads.

Three passes, each of them repeated and the fastest taken (noise only ever slows a pass down):

- ``direct``: every direct KPU once, O_DIRECT through :meth:`KVStore.raw_direct_read`;
- ``resident``: every page-cache KPU whose rows are all resident, a buffered read through the
  store's engine — a memory copy out of the page cache, what a hit costs (where the limit has
  evicted them all since, one of the run's files is read once to make it resident, then timed);
- ``file_disk``: the page-cache KPUs that are not resident, read as the page-cache path meets a
  miss — buffered through the store's engine, each repetition after dropping their pages
  (left dropped). On this VM such reads, readahead and all, can beat O_DIRECT at the same queue
  depth, so the direct rate is no bound for them.

A run on a GPU has a fourth pass, ``to_device``: the resident files moved all the way to the
device as :mod:`.page_cache_limit` moves them (plain threads, ``preadv`` into pinned pieces, each
copied on a stream of its own; the best of 1, 2, 4 ... threads up to the cores). A hit costs a
CUDA decode that copy as well as the one out of the page cache, and the two share the host's
memory: on the H200 machine the copy out of the page cache alone ran at 58-63 GB/s and the whole
move at 29-46, so a floor of the host copy alone was no floor for the all-fits regime. The
pieces are carved from the store's own pinned KPU images (no transfer runs after the decode), not
allocated: inside the run's memory limit, new pinned memory would push the run's own pages out
of the cache. Carved from the floor's one KPU-sized buffer instead, 16 threads' pieces were
about 4 MiB where the pipeline moves each KPU as one piece, and a run at 11 GiB beat that floor.

The baseline reaches its files through a memory map, a whole KPU copied by one thread (page
faults and the kernel's readahead for maps), not through the engine; its two file passes copy
through the map the same way. Read through the engine instead, 32 chunks of 1 MiB at once,
its misses took longer than the baseline's own steps did (0.87 and 0.90 of the floor in the
pressure preset): a reference of another I/O shape.

:func:`decode_floor` then prices the decode's own bytes at these rates. The disk part (direct
bytes at the direct rate, page-cache misses at the faster disk rate) and the memory part (hits)
can overlap, so the floor is the larger of the two; the serial sum is reported beside it. It
leaves out what decode also does (the appended rows' writes, the reads' checks, a real model's
compute): the floor is a lower bound.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from dualblade.bench.page_cache_limit import FileToMove, measure_page_cache_limit
from dualblade.io_engine import AlignedBuffer, BufferWindow, PageCacheFile
from dualblade.pipeline import KpuId, Medium
from dualblade.store import KVContext, KVStore

#: Each pass runs this often; the fastest counts.
FLOOR_REPEATS = 3
#: A decode that beats its floor by more than this is not bounded by it: the floor is invalid.
VALID_RATIO = 0.95

_FILE_MEDIA = (Medium.PAGE_CACHE, Medium.PAGE_CACHE_DROPPED, Medium.MMAP)

#: ``(buffer, nbytes, offset)``: one request of a pass.
ReadFn = Callable[[AlignedBuffer, int, int], Awaitable[Any]]


@dataclass(frozen=True)
class PassTime:
    """One pass over a source: the bytes it reads and the seconds each repetition took."""

    nbytes: int
    seconds: tuple[float, ...]
    #: ``(threads, bytes per second)``, the best of the repetitions at each thread count, for a
    #: pass that tries several (``to_device``); its ``seconds`` are those of the best count
    by_threads: tuple[tuple[int, float], ...] = ()

    @property
    def rate(self) -> float:
        """Bytes per second of the fastest repetition."""
        return self.nbytes / min(self.seconds)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bytes": self.nbytes,
            "seconds": [round(s, 4) for s in self.seconds],
            "bytes_per_s": round(self.rate),
        }
        if self.by_threads:
            out["bytes_per_s_by_threads"] = {str(n): round(rate) for n, rate in self.by_threads}
        return out


@dataclass(frozen=True)
class FloorRates:
    """What the passes measured (None: that source did not exist in the run)."""

    direct: PassTime | None = None
    resident: PassTime | None = None
    file_disk: PassTime | None = None
    #: the resident files moved to the GPU (a CUDA run only); prices the hits when present
    to_device: PassTime | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            name: None if rate is None else rate.to_dict()
            for name, rate in (
                ("direct", self.direct),
                ("resident", self.resident),
                ("file_disk", self.file_disk),
                ("to_device", self.to_device),
            )
        }


@dataclass(frozen=True)
class DecodeReads:
    """The bytes a decode read, by where they came from."""

    direct: int
    page_cache: int  # through the page cache or the baseline's map, hits and misses
    resident: int  # of ``page_cache``, resident when their read was requested


def decode_floor(reads: DecodeReads, rates: FloorRates) -> dict[str, Any]:
    """The floor of a decode that read ``reads``, at the run's measured ``rates``.

    Returns ``floor_s`` (None when a source the decode read from could not be measured, with
    ``floor_error`` saying which), ``floor_serial_s`` and the parts in ``floor``.
    """
    misses = max(0, reads.page_cache - reads.resident)
    disk_rates = [rate for rate in (rates.file_disk, rates.direct) if rate is not None]
    disk_rate_for_misses = max(disk_rates, key=lambda rate: rate.rate, default=None)
    missing = [
        name
        for name, needed, rate in (
            ("direct extents", reads.direct, rates.direct),
            ("page-cache misses", misses, disk_rate_for_misses),
        )
        if needed > 0 and rate is None
    ]
    detail: dict[str, Any] = {
        "decode_direct_bytes": reads.direct,
        "decode_miss_bytes": misses,
        "decode_resident_bytes": reads.resident,
        "passes": rates.to_dict(),
    }
    if missing:
        return {
            "floor_s": None,
            "floor_serial_s": None,
            "floor_error": f"no pass could read the run's {', '.join(missing)}",
            "floor": detail,
        }
    disk_s = 0.0
    if reads.direct:
        assert rates.direct is not None
        disk_s += reads.direct / rates.direct.rate
    if misses:
        assert disk_rate_for_misses is not None
        disk_s += misses / disk_rate_for_misses.rate
    hits = rates.to_device or rates.resident  # on a GPU a hit is only done on the device
    memory_s = reads.resident / hits.rate if hits else 0.0
    detail.update(disk_s=round(disk_s, 4), memory_s=round(memory_s, 4))
    if rates.to_device is not None:
        detail["memory_part"] = "hits moved to the device"
    if reads.resident and hits is None:
        # Still a lower bound, only a looser one: the floor is the disk part alone.
        detail["note"] = "no resident file could be timed: the memory part counts as 0"
    return {
        "floor_s": max(disk_s, memory_s),
        "floor_serial_s": disk_s + memory_s,
        "floor": detail,
    }


async def _timed(
    requests: Sequence[tuple[int, int]],
    read: ReadFn,
    memory: Sequence[AlignedBuffer],
    in_flight: int,
    repeats: int,
    *,
    before: Callable[[], None] | None = None,
) -> PassTime:
    """Every request once per repetition, ``in_flight`` at a time, each into a buffer of its
    own (buffers are shared round-robin when there are fewer); ``before`` runs ahead of each
    repetition, untimed."""
    queue = list(requests)
    smallest = min(buffer.size for buffer in memory)
    if any(nbytes > smallest for _, nbytes in queue):
        raise ValueError(f"a floor pass's request is larger than its {smallest}-byte buffer")
    seconds = []
    for _ in range(repeats):
        if before is not None:
            before()
        position = 0

        async def worker(buffer: AlignedBuffer) -> None:
            nonlocal position
            while position < len(queue):
                offset, nbytes = queue[position]
                position += 1
                await read(buffer, nbytes, offset)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for index in range(max(1, in_flight)):
                tg.start_soon(worker, memory[index % len(memory)])
        seconds.append(time.perf_counter() - start)
    return PassTime(sum(n for _, n in queue), tuple(seconds))


async def page_cache_reads(ctx: KVContext) -> list[tuple[PageCacheFile, int]]:
    """The context's page-cache files with the bytes a decode step reads from each (its
    layers' written rows)."""
    stride = ctx.file_layout.row_stride
    out = []
    for layer, medium in enumerate(ctx.media):
        if medium in _FILE_MEDIA:
            for tensor in ("K", "V"):
                out.append((await ctx.file(KpuId(layer, tensor)), ctx.length(layer) * stride))
    return out


def _copy_through_map(file: PageCacheFile, buffer: AlignedBuffer, nbytes: int) -> None:
    """The first ``nbytes`` of ``file`` into ``buffer`` through the file's shared mapping, as
    the baseline's copy threads move a KPU."""
    with buffer.view[:nbytes] as window:
        file.copy_mapped(window, 0, to_memory=True)


async def _direct_pass(
    store: KVStore, ctx: KVContext, memory: Sequence[AlignedBuffer], repeats: int
) -> PassTime | None:
    layers = [layer for layer, m in enumerate(ctx.media) if m is Medium.DIRECT]
    if not layers:
        return None
    layout = ctx.direct_layout
    requests = []
    for layer in layers:
        # the shared run of the plan's direct layers, or the layer's own if it was moved there
        lba_map = await ctx.layer_direct_map(layer)
        rows_bytes = -(-ctx.length(layer) * layout.row_stride // layout.lba_size) * layout.lba_size
        for tensor in ("K", "V"):
            extent = lba_map.lookup(KpuId(layer, tensor))
            requests.append((int(extent.byte_offset), min(rows_bytes, int(extent.nbytes))))

    async def read(buffer: AlignedBuffer, nbytes: int, offset: int) -> None:
        await store.raw_direct_read(buffer, nbytes, offset)

    return await _timed(requests, read, memory, store.read_parallelism, repeats)


async def _to_device_pass(
    resident: list[tuple[PageCacheFile, int]],
    device: torch.device,
    memory: Sequence[BufferWindow],
    repeats: int,
) -> PassTime:
    """The resident files moved to ``device`` (see the module) through pieces of ``memory``,
    each repetition's time that of its best thread count. Every count's best rate is kept
    beside it: the store moves its hits with ``copy_threads`` threads, which may be fewer than
    the best count."""
    files = [FileToMove(file.fd, nbytes) for file, nbytes in resident]
    nbytes = sum(file.nbytes for file in files)
    seconds = []
    by_threads: dict[int, float] = {}
    for _ in range(repeats):
        runs = await anyio.to_thread.run_sync(
            lambda: measure_page_cache_limit(files, device, passes=1, memory=memory)
        )
        seconds.append(nbytes / max(run.bytes_per_s for run in runs))
        for run in runs:
            by_threads[run.threads] = max(by_threads.get(run.threads, 0.0), run.bytes_per_s)
    return PassTime(nbytes, tuple(seconds), tuple(sorted(by_threads.items())))


async def _file_passes(
    store: KVStore, ctx: KVContext, memory: Sequence[AlignedBuffer], repeats: int
) -> tuple[PassTime | None, PassTime | None, PassTime | None]:
    """The resident pass, the cold pass over the files that are not resident and, on a GPU,
    the resident files' move to the device."""
    files = [(f, n) for f, n in await page_cache_reads(ctx) if n > 0]
    resident = [(f, n) for f, n in files if f.resident_bytes(0, n) >= n]
    cold = [(f, n) for f, n in files if (f, n) not in resident]
    engine = ctx.engine
    if not resident and files:
        # The limit evicted the hits since: make one of the run's files resident to time a
        # copy from the cache (what a hit costs does not depend on the data's age).
        file, nbytes = files[0]
        await engine.pread(file, memory[0], nbytes, 0)
        if file.resident_bytes(0, nbytes) >= nbytes:
            resident = [(file, nbytes)]
    in_flight = store.read_parallelism
    through_map = Medium.MMAP in ctx.media

    def reader(chosen: list[tuple[PageCacheFile, int]]) -> ReadFn:
        async def read(buffer: AlignedBuffer, nbytes: int, index: int) -> None:
            if through_map:
                await anyio.to_thread.run_sync(_copy_through_map, chosen[index][0], buffer, nbytes)
            else:
                await engine.pread(chosen[index][0], buffer, nbytes, 0)

        return read

    def requests(chosen: list[tuple[PageCacheFile, int]]) -> list[tuple[int, int]]:
        return [(index, nbytes) for index, (_, nbytes) in enumerate(chosen)]

    def drop_cold() -> None:
        for file, nbytes in cold:
            if through_map:
                # Pages mapped into this process cannot be evicted: unmap them first (a shared
                # file mapping faults them back in from the file).
                file.mmap().madvise(mmap.MADV_DONTNEED, 0, nbytes)
            file.advise_dontneed(0, nbytes)

    resident_pass = cold_pass = device_pass = None
    if resident:
        resident_pass = await _timed(
            requests(resident), reader(resident), memory, in_flight, repeats
        )
        if store.device.type == "cuda":
            device_pass = await _to_device_pass(
                resident, store.device, store.pinned_images(), repeats
            )
    if cold:
        # A miss the way the page-cache path meets one: a buffered read of pages not in the
        # cache (readahead included), each repetition from a dropped cache.
        cold_pass = await _timed(
            requests(cold), reader(cold), memory, in_flight, repeats, before=drop_cold
        )
        drop_cold()
    return resident_pass, cold_pass, device_pass


async def measure_floor_rates(
    store: KVStore,
    ctx: KVContext,
    memory: Sequence[AlignedBuffer],
    *,
    repeats: int = FLOOR_REPEATS,
) -> FloorRates:
    """Run the passes over ``ctx``'s storage (see the module docstring) into ``memory``: host
    buffers each at least one KPU's image (the run's own read buffers where they are on the
    host). Call it after the decode, while ``ctx`` is open."""
    if not memory:
        raise ValueError("the floor's passes need at least one host buffer")
    direct = await _direct_pass(store, ctx, memory, repeats)
    resident, file_disk, to_device = await _file_passes(store, ctx, memory, repeats)
    return FloorRates(direct, resident, file_disk, to_device)
