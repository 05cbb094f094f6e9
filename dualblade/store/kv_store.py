"""The KV store that serving apps embed: per-request contexts over the actor pipeline.

::

    async with open_store(config) as store:
        async with store.context() as ctx:
            await ctx.write(layer, k, v)            # prefill: rows [0, t)
            await ctx.append(layer, k_row, v_row)   # decode: row t
            k, v = await ctx.read(layer)            # rows [0, t) on the store's device

A K or V tensor is ``[rows, batch, kv_heads * head_dim]`` (``[rows, batch, kv_heads, head_dim]``
is accepted too) of the config's dtype. Each context materializes its storage on first use — a
contiguous run of blocks on the direct target for its Group-2 layers, one page-cache file per
Group-1 KPU — and deallocates it (TRIM, unlink) when it closes. Contexts never share storage.

Every policy runs through this API: ``dual`` places layers by Algorithm 1, ``direct`` puts all
on the direct path, ``page-cache`` all on the page cache, ``cache-policy`` all on the page cache
with the layers beyond the budget written back and dropped after use, and ``baseline`` all on
memory-mapped files (FlexLLMGen's path).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

from dualblade.actors import (
    ClaimExtent,
    ClaimFile,
    DirectSpan,
    GetStrategy,
    IterationEnd,
    IterationStart,
    Load,
    MmapSpan,
    PageCacheSpan,
    ProbeState,
    ReleaseContext,
    Reply,
    RowView,
    Store,
    StrategyName,
    TransferStats,
    count_residency,
)
from dualblade.errors import DualbladeError, plain_errors
from dualblade.io_engine import PageCacheFile, Target
from dualblade.logs import get_logger
from dualblade.pipeline import (
    BlockCount,
    ByteCount,
    KpuId,
    Lba,
    LbaMap,
    PipelineConfig,
    Plan,
    Region,
    RowRange,
    TensorKind,
    TensorLayout,
    assign_groups,
    plan_slice,
)
from dualblade.store.dtypes import torch_dtype
from dualblade.store.runtime import Runtime, start_runtime
from dualblade.telemetry import NULL_TRACER, Tracer

_log = get_logger(__name__)


class KVShapeError(DualbladeError, ValueError):
    """A tensor handed to the store has the wrong shape, dtype, layer or rows."""

    exit_code = 2


class ContextClosedError(DualbladeError):
    """The context was used after it closed."""


class LayerLostError(DualbladeError):
    """A write to the layer failed or was cancelled part-way: its stored rows are a mix of old
    and new bytes, so reads and appends are refused until the layer is written again."""


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class _Placed:
    """Where one context keeps one layer."""

    group: str  # "page_cache" or "direct"


def _on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """``cuda`` (no index) means the current CUDA device: ``cuda:0`` tensors match it."""
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


class KVContext:
    """One request's KV cache. Use through ``async with store.context() as ctx``."""

    def __init__(self, store: KVStore, context_id: int, plan: Plan) -> None:
        self.store = store
        self.id = context_id
        self.plan = plan
        self._runtime = store.runtime
        config = store.config
        shape = config.shape()
        self.batch = config.workload.batch
        self.max_len = config.workload.max_len
        self.width = shape.kv_width
        self.kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.dtype = torch_dtype(shape.dtype)
        self.num_layers = shape.num_layers
        self.direct_layout: TensorLayout = plan.layout
        self.file_layout = TensorLayout(self.max_len, plan.layout.row_bytes, ByteCount(1))
        self._lengths = [0] * self.num_layers
        self._lost: set[int] = set()  # layers whose last write failed or was cancelled
        self._lba_map: LbaMap | None = None
        self._map_lock = anyio.Lock()
        self._files: dict[KpuId, PageCacheFile] = {}
        # cache-policy keeps the layers its budget can hold and evicts the rest after use;
        # decided once, from this context's own plan (a later budget change re-plans new ones).
        budget = plan.budget
        self.resident_layers = assign_groups(
            list(plan.placement.layer_bytes), budget.page_cache_bytes, budget.knob_x_bytes
        ).n1
        self._closed = False
        self.log = _log.bind(store=store.name, context=context_id)

    # -- validation ------------------------------------------------------------------------
    def length(self, layer: int) -> int:
        """Rows written for ``layer``."""
        self._check_layer(layer)
        return self._lengths[layer]

    def _check_layer(self, layer: int) -> None:
        if self._closed:
            raise ContextClosedError(f"context {self.id} is closed")
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < self.num_layers
        ):
            raise KVShapeError(f"layer must be in 0..{self.num_layers - 1}, got {layer!r}")

    def _check_intact(self, layer: int) -> None:
        if layer in self._lost:
            raise LayerLostError(
                f"layer {layer} of context {self.id} was being written when that write failed "
                "or was cancelled; its rows are lost: write the layer again"
            )

    def _normalize(self, name: str, tensor: torch.Tensor, rows: int | None) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise KVShapeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != self.dtype:
            raise KVShapeError(f"{name} has dtype {tensor.dtype}; this store holds {self.dtype}")
        shape = tuple(tensor.shape)
        if len(shape) == 4 and shape[2:] == (self.kv_heads, self.head_dim):
            tensor = tensor.reshape(shape[0], shape[1], self.width)
        elif len(shape) == 2 and rows == 1:
            tensor = tensor.reshape(1, *shape)
        shape = tuple(tensor.shape)
        expected = (
            f"[rows, {self.batch}, {self.width}] "
            f"(or [rows, {self.batch}, {self.kv_heads}, {self.head_dim}])"
        )
        if len(shape) != 3 or shape[1] != self.batch or shape[2] != self.width:
            raise KVShapeError(f"{name} has shape {list(shape)}; expected {expected}")
        if rows is not None and shape[0] != rows:
            raise KVShapeError(f"{name} has {shape[0]} rows; expected {rows}")
        return tensor

    # -- placement ---------------------------------------------------------------------------
    def _group(self, layer: int) -> str:
        return self.plan.placement.group_of(layer)

    async def direct_map(self) -> LbaMap:
        """The LBA map of this context's direct KPUs, claimed from the binder on first use."""
        async with self._map_lock:
            if self._lba_map is None:
                direct_layers = self.plan.placement.direct
                tensors = [
                    (KpuId(layer, t), self.direct_layout.image_bytes)
                    for layer in direct_layers
                    for t in ("K", "V")
                ]
                blocks = sum(n for _, n in tensors) // self.direct_layout.lba_size
                reply: Reply[int] = Reply()
                first = await self._runtime.binder.ask(ClaimExtent(self.id, blocks, reply), reply)
                region = Region(Lba(first), BlockCount(blocks))
                self._lba_map = LbaMap.bind(tensors, region, self.direct_layout.lba_size)
            return self._lba_map

    async def _file(self, kpu: KpuId) -> PageCacheFile:
        """The KPU's page-cache file, created by the binder on first use, then remembered."""
        file = self._files.get(kpu)
        if file is None:
            reply: Reply[PageCacheFile] = Reply()
            claim = ClaimFile(self.id, str(kpu), self.file_layout.image_bytes, reply)
            file = await self._runtime.binder.ask(claim, reply)
            self._files[kpu] = file
        return file

    async def _span(self, layer: int, tensor: TensorKind, rows: RowRange) -> tuple[Any, RowView]:
        kpu = KpuId(layer, tensor)
        runtime = self._runtime
        policy = self.store.config.policy
        if self._group(layer) == "direct":
            layout = self.direct_layout
            lba_map = await self.direct_map()
            plan = plan_slice(
                lba_map.lookup(kpu), layout, rows, runtime.engine.max_chunk or layout.image_bytes
            )
            first_offset, _, _ = plan.file_ranges()[0]
            span: Any = DirectSpan(
                runtime.engine,
                runtime.direct,
                first_offset,
                plan.buffer_bytes,
                plan.image_offset,
                f"{kpu} rows {rows.start}-{rows.stop}",
                runtime.counters,
            )
        else:
            layout = self.file_layout
            file = await self._file(kpu)
            offset = rows.start * layout.row_stride
            nbytes = len(rows) * layout.row_stride
            label = f"{kpu} rows {rows.start}-{rows.stop}"
            if policy == "baseline":
                span = MmapSpan(file, offset, nbytes, offset, label, runtime.counters)
            else:
                evict = policy == "cache-policy" and layer >= self.resident_layers
                span = PageCacheSpan(
                    runtime.engine,
                    file,
                    offset,
                    nbytes,
                    offset,
                    label,
                    runtime.counters,
                    evict=evict,
                )
        view = RowView(
            offset=rows.start * layout.row_stride,
            rows=len(rows),
            row_bytes=layout.row_bytes,
            row_stride=layout.row_stride,
            dtype=self.dtype,
            shape=(len(rows), self.batch, self.width),
        )
        return span, view

    # -- transfers ----------------------------------------------------------------------------
    async def _store_rows(
        self, layer: int, tensor: TensorKind, rows: RowRange, source: torch.Tensor
    ) -> TransferStats:
        span, view = await self._span(layer, tensor, rows)
        reply: Reply[TransferStats] = Reply()
        return await self._transfer(Store(source, view, span, reply), reply)

    async def _load_rows(
        self, layer: int, tensor: TensorKind, rows: RowRange, destination: torch.Tensor
    ) -> TransferStats:
        span, view = await self._span(layer, tensor, rows)
        count_residency(span)
        reply: Reply[TransferStats] = Reply()
        return await self._transfer(Load(span, view, destination, reply), reply)

    async def _transfer(self, message: Load | Store, reply: Reply[TransferStats]) -> TransferStats:
        """Hand a transfer to a copy thread and await it.

        Once a copy thread has accepted the transfer it runs to its end, also when this caller
        is cancelled; so a cancelled caller waits (shielded) for it to settle. Otherwise the
        context could go on while its old transfer still writes: a cancelled append landing
        over the next one, or — after :meth:`close` freed the run — over another context's
        new data.
        """
        async with self._runtime.pool.lease() as thread:
            await thread.send(message)
            try:
                return await reply.wait()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await reply.settled()
                raise

    async def _both(self, work: Any) -> list[TransferStats]:
        results: list[TransferStats] = []

        async def one(tensor: TensorKind) -> None:
            results.append(await work(tensor))

        with plain_errors():  # callers catch KVShapeError, IOFailedError ... as themselves
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "K")
                tg.start_soon(one, "V")
        return results

    async def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows ``[0, t)`` of a layer's K and V (prefill); ``t`` = ``k.shape[0]``.

        If it fails or is cancelled part-way, the layer is lost (:class:`LayerLostError` on
        reads and appends) until a later write of it succeeds.

        Raises:
            KVShapeError: wrong layer, shape, dtype, or more rows than the config's max length.
        """
        self._check_layer(layer)
        k = self._normalize("k", k, None)
        v = self._normalize("v", v, k.shape[0])
        rows = k.shape[0]
        if not 0 < rows <= self.max_len:
            raise KVShapeError(f"write of {rows} rows; a context holds 1..{self.max_len} rows")
        span = RowRange(0, rows)
        try:
            await self._both(lambda t: self._store_rows(layer, t, span, k if t == "K" else v))
        except BaseException:
            # Some rows may hold new bytes and some old ones; never serve the mix.
            self._lost.add(layer)
            raise
        self._lost.discard(layer)
        self._lengths[layer] = rows

    async def append(self, layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> int:
        """Append one row (a decode step's K and V); returns the layer's new length.

        A failed or cancelled append leaves the layer as it was (the row owns its own blocks,
        and the length only grows once both K and V landed).

        Raises:
            KVShapeError: wrong shape, or the context already holds ``max_len`` rows.
            LayerLostError: an earlier write of the layer failed or was cancelled.
        """
        self._check_layer(layer)
        self._check_intact(layer)
        k_row = self._normalize("k_row", k_row, 1)
        v_row = self._normalize("v_row", v_row, 1)
        t = self._lengths[layer]
        if t >= self.max_len:
            raise KVShapeError(
                f"layer {layer} already holds {self.max_len} rows (prompt + max new tokens)"
            )
        span = RowRange.row(t)
        await self._both(
            lambda kind: self._store_rows(layer, kind, span, k_row if kind == "K" else v_row)
        )
        self._lengths[layer] = t + 1
        return t + 1

    async def read(
        self,
        layer: int,
        rows: tuple[int, int] | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[a, b)`` (default: all written rows) of a layer's K and V, on the device.

        ``out``: tensors of ``[>= b - a, batch, width]`` on the store's device to read into
        (their first ``b - a`` rows are filled and returned as views). A caller that reads every
        step reuses its buffers this way; a fresh host tensor costs a page fault and a page of
        zeroes per 4 KiB before the first byte is copied, which on the CPU path cost as much as
        the copy itself.

        Raises:
            KVShapeError: rows outside what was written; ``out`` of the wrong shape, dtype or
                device.
            LayerLostError: an earlier write of the layer failed or was cancelled.
        """
        self._check_layer(layer)
        self._check_intact(layer)
        written = self._lengths[layer]
        if rows is None:
            start, stop = 0, written
        elif (
            isinstance(rows, tuple | list)
            and len(rows) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in rows)
        ):
            start, stop = rows
        else:
            raise KVShapeError(f"rows must be a (start, stop) pair of ints, got {rows!r}")
        if not 0 <= start < stop <= written:
            raise KVShapeError(
                f"rows [{start}, {stop}) of layer {layer} were never written "
                f"(it holds rows [0, {written}))"
            )
        shape = (stop - start, self.batch, self.width)
        device = self._runtime.device
        if out is None:
            k = torch.empty(shape, dtype=self.dtype, device=device)
            v = torch.empty(shape, dtype=self.dtype, device=device)
        else:
            k, v = self._out_views(out, shape)
        span = RowRange(start, stop)
        await self._both(lambda t: self._load_rows(layer, t, span, k if t == "K" else v))
        return k, v

    def _out_views(
        self, out: object, shape: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise KVShapeError("out must be a (k, v) pair of tensors")
        views = []
        for name, tensor in zip("kv", out, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise KVShapeError(f"out {name} must be a tensor, got {type(tensor).__name__}")
            if (
                tensor.dim() != 3
                or tensor.shape[0] < shape[0]
                or tuple(tensor.shape[1:]) != shape[1:]
                or tensor.dtype != self.dtype
                or not _on_device(tensor, self._runtime.device)
                or not tensor.is_contiguous()
            ):
                raise KVShapeError(
                    f"out {name} is {tensor.dtype} {list(tensor.shape)} on {tensor.device}; "
                    f"this read needs a contiguous {self.dtype} [>= {shape[0]}, {shape[1]}, "
                    f"{shape[2]}] on {self._runtime.device}"
                )
            views.append(tensor[: shape[0]])
        return views[0], views[1]

    async def close(self) -> None:
        """Deallocate the context's storage (TRIM its direct run, unlink its files)."""
        if self._closed:
            return
        self._closed = True
        reply: Reply[Any] = Reply()
        with anyio.CancelScope(shield=True):
            released = await self._runtime.binder.ask(ReleaseContext(self.id, reply), reply)
        self.log.debug(
            "context released", trimmed_blocks=released.trimmed_blocks, files=released.files
        )


class KVStore:
    """A running dualblade pipeline. Create with :func:`open_store`."""

    _ids = itertools.count(1)

    def __init__(self, config: PipelineConfig, runtime: Runtime) -> None:
        self.config = config
        self.runtime = runtime
        self.name = f"store-{next(self._ids)}"
        self._context_ids = itertools.count(1)
        self.open_contexts = 0
        self._step = 0

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def read_parallelism(self) -> int:
        """The copy threads: each moves one KPU at a time, so a caller that keeps this many
        layers' reads in flight ahead of its compute keeps them all busy."""
        return self.config.copy_threads

    @property
    def plan(self) -> Plan:
        """The plan new contexts get (it changes with the budget)."""
        return self.runtime.plan

    @contextlib.asynccontextmanager
    async def context(self) -> AsyncIterator[KVContext]:
        """A new request context; its storage is released when the block exits."""
        ctx = KVContext(self, next(self._context_ids), self.runtime.plan)
        self.open_contexts += 1
        try:
            yield ctx
        finally:
            self.open_contexts -= 1
            await ctx.close()

    @contextlib.asynccontextmanager
    async def iteration(self) -> AsyncIterator[StrategyName]:
        """Bracket one decode iteration: the strategy probe times it; yields its strategy."""
        self._step += 1
        step = self._step
        reply: Reply[StrategyName] = Reply()
        strategy = await self.runtime.probe.ask(IterationStart(step, reply), reply)
        before = self._moved_bytes()
        start = time.perf_counter()
        try:
            yield strategy
        finally:
            seconds = time.perf_counter() - start
            with anyio.CancelScope(shield=True):
                await self.runtime.probe.send(
                    IterationEnd(step, self._moved_bytes() - before, seconds)
                )

    def _moved_bytes(self) -> int:
        threads = self.runtime.pool.threads
        return sum(t.bytes_loaded + t.bytes_stored for t in threads)

    async def strategy(self) -> ProbeState:
        """The strategy probe's state: current strategy, whether locked, measured throughput."""
        reply: Reply[ProbeState] = Reply()
        return await self.runtime.probe.ask(GetStrategy(reply), reply)

    def metrics(self) -> dict[str, Any]:
        """A snapshot an application can read or export."""
        counters = self.runtime.counters
        snapshot = counters.snapshot()
        dma = self.runtime.dma
        return {
            **snapshot,
            "page_cache_hit_rate": counters.hit_rate,
            "strategy": self.runtime.gate.strategy,
            "page_cache_budget_bytes": self.runtime.plan.budget.page_cache_bytes,
            "dma_h2d_bytes": dma.bytes_h2d,
            "dma_d2h_bytes": dma.bytes_d2h,
            "co_dma": {
                "direct_transfers": sum(t.direct_transfers for t in self.runtime.pool.threads),
                "same_buffer": sum(t.co_dma_transfers for t in self.runtime.pool.threads),
                "staged_host_copies": dma.staged_copies,
                "cpu_fallback_copies": dma.host_copies,
                "pinned_for_cuda": sum(b.cuda_registered for b in self.runtime.buffers),
            },
            "open_contexts": self.open_contexts,
            "io_chunks": self.runtime.engine.chunks_submitted,
            "trimmed_blocks": self.runtime.binder.trimmed_blocks,
        }

    def prometheus(self) -> str:
        """The metrics in the Prometheus text format."""
        metrics = self.runtime.metrics
        snapshot = self.metrics()
        for path, value in snapshot["read_bytes"].items():
            metrics.set(f"read_bytes_{path.replace('-', '_')}", value, "bytes read per path")
        for path, value in snapshot["write_bytes"].items():
            metrics.set(f"write_bytes_{path.replace('-', '_')}", value, "bytes written per path")
        if snapshot["page_cache_hit_rate"] is not None:
            metrics.set("page_cache_hit_rate", snapshot["page_cache_hit_rate"])
        metrics.set("page_cache_budget_bytes", snapshot["page_cache_budget_bytes"])
        metrics.set("open_contexts", snapshot["open_contexts"])
        return metrics.prometheus()


@contextlib.asynccontextmanager
async def open_store(
    config: PipelineConfig,
    *,
    device: torch.device | str | None = None,
    tracer: Tracer = NULL_TRACER,
    memory_limit: int | None = None,
    wrap_direct: Callable[[Target], Target] | None = None,
    page_cache_file: Callable[[Path, int], PageCacheFile] = PageCacheFile,
) -> AsyncIterator[KVStore]:
    """Start a store for ``config`` (see the module docstring).

    Args:
        device: where read tensors land (default: CUDA when available, else CPU).
        tracer: receives the actors' trace events.
        memory_limit: plan against this limit instead of the discovered one.
        wrap_direct: wraps the opened direct target (fault injection in tests and the soak).
        page_cache_file: makes page-cache files from path and size (fault injection too).
    """
    resolved = torch.device(device) if device is not None else _default_device()
    async with start_runtime(
        config,
        device=resolved,
        tracer=tracer,
        memory_limit=memory_limit,
        wrap_direct=wrap_direct,
        page_cache_file=page_cache_file,
    ) as runtime:
        yield KVStore(config, runtime)
