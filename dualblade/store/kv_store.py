"""The KV store that serving apps embed: a running pipeline and its per-request contexts.

::

    async with open_store(config) as store:
        async with store.context() as ctx:
            await ctx.write(layer, k, v)            # prefill: rows [0, t)
            k, v = await ctx.read(layer)            # rows [0, t) on the store's device
        print(store.stats())

Every policy runs through this API: ``dual`` places layers by Algorithm 1, ``direct`` puts all
on the direct path, ``page-cache`` all on the page cache, ``cache-policy`` all on the page cache
with the layers beyond the budget written back and dropped after use, and ``baseline`` all on
memory-mapped files (FlexLLMGen's path). The plan says which medium each layer gets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import torch

from dualblade.actors import (
    Budget,
    GetStrategy,
    IterationEnd,
    IterationStart,
    ProbeState,
    Reply,
    StrategyName,
    TrafficChanged,
)
from dualblade.errors import ConfigError, plain_errors
from dualblade.io_engine import (
    AlignedBuffer,
    BufferWindow,
    ChunkObserver,
    PageCacheFile,
    StorageSlots,
    Target,
)
from dualblade.pipeline import (
    PipelineConfig,
    Plan,
    layer_page_cache_bytes,
    make_plan,
    page_cache_order,
)
from dualblade.store.context import KVContext
from dualblade.store.context_shape import context_config
from dualblade.store.read_buffers import ReadBuffers
from dualblade.store.replanner import BUDGETED_MEDIA, Replanner
from dualblade.store.residency_ledger import ResidencyLedger
from dualblade.store.runtime import Runtime, start_runtime
from dualblade.store.share_policy import SharePolicy
from dualblade.store.stats import StoreStats, collect_stats
from dualblade.telemetry import NULL_TRACER, Tracer


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class KVStore:
    """A running dualblade pipeline. Create with :func:`open_store`.

    ``runtime`` is the store's insides (its actors, engine and buffers), there for the store's
    own tests; code above the store reads :meth:`stats` instead.
    """

    _ids = itertools.count(1)

    def __init__(
        self,
        config: PipelineConfig,
        runtime: Runtime,
        share_policy: SharePolicy | None = None,
        *,
        replan: bool = True,
    ) -> None:
        self.config = config
        self.runtime = runtime
        self.name = f"store-{next(self._ids)}"
        self._context_ids = itertools.count(1)
        #: numbers of the binder holdings a context takes besides its own (per-layer files,
        #: runs of layers moved to the direct path): far above any context's number
        self.holding_ids = itertools.count(1 << 32)
        self.open_contexts = 0
        self._step = 0
        self._budget_cap: int | None = None
        self._traffic_band: int | None = None
        self.ledger = ResidencyLedger(self._ledger_budget(), share_policy)
        self._contexts: dict[int, KVContext] = {}
        self.replanner = Replanner(self.ledger, self._contexts)
        self.replanner.enabled = replan
        runtime.budgeter.subscribe(self._on_budget)

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
    async def context(
        self,
        *,
        batch: int | None = None,
        max_len: int | None = None,
        dtype: str | None = None,
    ) -> AsyncIterator[KVContext]:
        """A new request context; its storage is released when the block exits.

        ``batch``, ``max_len`` (rows: prompt plus new tokens) and ``dtype`` give the context a
        shape of its own, up to the store's workload (None: the store's). Its plan, extents and
        files are sized for that shape.

        Raises:
            KVShapeError: a shape whose KPUs do not fit the store's copy-thread buffers, or an
                invalid value.
        """
        context = next(self._context_ids)
        plan = self._plan_context(context, batch, max_len, dtype)
        ctx = KVContext(self, context, plan)
        self._contexts[context] = ctx
        self.open_contexts += 1
        await self._traffic_changed()
        try:
            yield ctx
        finally:
            self.open_contexts -= 1
            del self._contexts[context]
            with anyio.CancelScope(shield=True):
                await self._traffic_changed()
            try:
                await ctx.close()
            finally:
                # Its files are unlinked: its pages are gone, its share goes to the others.
                self.ledger.unregister(context)
                self.replanner.wake(settle=True)

    def _plan_context(
        self, context: int, batch: int | None, max_len: int | None, dtype: str | None
    ) -> Plan:
        """The context's plan: its shape, and (dual, cache-policy) its admitted share of the
        store's page-cache budget, charged to the ledger before any byte is placed."""
        config = self.config
        if (batch, max_len, dtype) != (None, None, None):
            config = context_config(
                config, self.runtime.buffers[0].size, batch=batch, max_len=max_len, dtype=dtype
            )
        budget = self.runtime.plan.budget
        if config.policy not in BUDGETED_MEDIA:
            return make_plan(config, budget)
        layer_bytes = tuple(layer_page_cache_bytes(config))
        order = page_cache_order(len(layer_bytes), config.page_cache_layers)
        self.ledger.register(context, layer_bytes, order)
        try:
            admitted = self.ledger.admit(context)
            share = sum(layer_bytes[layer] for layer in admitted)
            plan = make_plan(
                config, dataclasses.replace(budget, page_cache_bytes=share, knob_x_bytes=share)
            )
            for layer in admitted:
                self.ledger.charge(context, layer)
        except BaseException:
            self.ledger.unregister(context)
            raise
        self.replanner.wake(settle=True)
        return plan

    async def _traffic_changed(self) -> None:
        """Re-probe the overlap strategy when the number of open contexts moves to another
        power-of-two band (1, 2, 3-4, 5-8, ...): the probe measures the traffic the store
        carries, and that changes with the mix of requests. Bands, not every arrival: under
        serving churn a probe per arrival would never lock."""
        band = (self.open_contexts - 1).bit_length() if self.open_contexts else -1
        if band != self._traffic_band:
            if self._traffic_band is not None and self.open_contexts:
                await self.runtime.probe.send(TrafficChanged(self.open_contexts))
            self._traffic_band = band

    # -- the budget ----------------------------------------------------------------------------
    def _ledger_budget(self) -> int:
        x = self.runtime.plan.budget.knob_x_bytes
        return x if self._budget_cap is None else min(x, self._budget_cap)

    async def _on_budget(self, budget: Budget) -> None:
        self.replanner.follow_budget(self._ledger_budget(), reading=True)

    def set_page_cache_budget(self, nbytes: int | None) -> None:
        """Cap the page-cache budget the contexts share at ``nbytes`` (None: no cap; the
        budgeter's reading holds). Live contexts are re-planned to it: an operator (or a test)
        squeezes or frees the store's page cache without changing the cgroup.

        Raises:
            ConfigError: a negative cap.
        """
        if nbytes is not None and (isinstance(nbytes, bool) or nbytes < 0):
            raise ConfigError(f"a page-cache budget cap must be >= 0 bytes, got {nbytes!r}")
        self._budget_cap = nbytes
        self.replanner.follow_budget(self._ledger_budget(), reading=False)

    async def replanned(self) -> None:
        """Wait until every live context holds the page-cache share the policy gives it."""
        await self.replanner.settled()

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

    def stats(self) -> StoreStats:
        """A typed snapshot of the store (see :class:`StoreStats`); call it on the store's
        event loop. It stays readable after the store has closed (its last counters)."""
        return collect_stats(self.runtime, self.name, self.open_contexts, self.ledger.snapshot())

    def metrics(self) -> dict[str, Any]:
        """:meth:`stats` as a JSON-ready dict, for an application to read or export."""
        return self.stats().to_dict()

    def prometheus(self) -> str:
        """The metrics in the Prometheus text format."""
        metrics = self.runtime.metrics
        stats = self.stats()
        for path, value in stats.read_bytes.items():
            metrics.set(f"read_bytes_{path.replace('-', '_')}", value, "bytes read per path")
        for path, value in stats.write_bytes.items():
            metrics.set(f"write_bytes_{path.replace('-', '_')}", value, "bytes written per path")
        if stats.page_cache_hit_rate is not None:
            metrics.set("page_cache_hit_rate", stats.page_cache_hit_rate)
        metrics.set("page_cache_budget_bytes", stats.page_cache_budget_bytes)
        metrics.set("open_contexts", stats.open_contexts)
        ledger = stats.ledger
        metrics.set("ledger_budget_bytes", ledger.budget_bytes, "page-cache budget contexts share")
        metrics.set("ledger_placed_bytes", ledger.placed_bytes, "page-cache bytes contexts hold")
        metrics.set("ledger_demotions", ledger.demotions, "layers moved off the page cache")
        metrics.set("ledger_promotions", ledger.promotions, "layers moved onto the page cache")
        return metrics.prometheus()

    def observe_chunks(self, observer: ChunkObserver) -> None:
        """Call ``observer`` for each completed I/O chunk (io_uring only; on the ring thread):
        the bench's request log and a trace's I/O track."""
        self.runtime.engine.observe_chunks(observer)

    def fix_read_buffers(self, buffers: ReadBuffers) -> bool:
        """Register read buffers made before the store with its ring, as ``ctx.read_buffers()``
        does its own (a bench makes its buffers first, so that the budget counts their pages);
        see :meth:`ReadBuffers.fix_in`."""
        return buffers.fix_in(self.runtime.engine)

    def pinned_buffers(self) -> list[AlignedBuffer]:
        """The copy threads' pinned buffers, registered with the ring where it can: memory that
        a reference reading as the pipeline does (``dualblade pipebench``'s raw side on a GPU)
        reads into, and only while no transfer runs."""
        return list(self.runtime.buffers)

    def pinned_images(self) -> list[BufferWindow]:
        """The KPU images of :meth:`pinned_buffers`, the windows its copy threads place KPUs in
        (the room for rows left out): what a reference moving bytes as the pipeline does reads
        into, and only while no transfer runs."""
        return [window for thread in self.runtime.pool.threads for window in thread.image_windows]

    @property
    def pin_images(self) -> int:
        """KPU images in each pinned buffer: two on CUDA unless the second's memory would keep
        a layer out of the page cache (``pipeline.pin_images_in_plan``)."""
        return self.runtime.pin_images

    async def raw_direct_read(
        self,
        buffer: AlignedBuffer,
        nbytes: int,
        offset: int,
        *,
        buf_offset: int = 0,
        slots: StorageSlots | None = None,
    ) -> None:
        """Read ``nbytes`` at byte ``offset`` of the direct target into ``buffer[buf_offset:]``
        through the store's I/O engine, around the actors: the raw reference ``dualblade
        pipebench`` holds the pipeline against. A context's extents come from
        ``ctx.direct_map()``. ``slots``: the read waits for one in the engine
        (``IOEngine.pread``).

        Raises:
            ConfigError: the range leaves the configured extent.
            IOFailedError: the read failed.
        """
        first, end = self.runtime.binder.book().region
        lba = self.runtime.direct.lba_size
        if not first * lba <= offset <= offset + nbytes <= end * lba:
            raise ConfigError(
                f"bytes [{offset}, {offset + nbytes}) are outside the store's direct extent "
                f"[{first * lba}, {end * lba})"
            )
        await self.runtime.engine.pread(
            self.runtime.direct, buffer, nbytes, offset, buf_offset=buf_offset, slots=slots
        )


@contextlib.asynccontextmanager
async def open_store(
    config: PipelineConfig,
    *,
    device: torch.device | str | None = None,
    tracer: Tracer = NULL_TRACER,
    memory_limit: int | None = None,
    wrap_direct: Callable[[Target], Target] | None = None,
    page_cache_file: Callable[[Path, int], PageCacheFile] = PageCacheFile,
    share_policy: SharePolicy | None = None,
    replan: bool = True,
    reserved_memory: Callable[[], int] | None = None,
) -> AsyncIterator[KVStore]:
    """Start a store for ``config`` (see the module docstring).

    Args:
        device: where read tensors land (default: CUDA when available, else CPU).
        tracer: receives the actors' trace events.
        memory_limit: plan against this limit instead of the discovered one.
        wrap_direct: wraps the opened direct target (fault injection: :mod:`dualblade.testing`).
        page_cache_file: makes page-cache files from path and size (fault injection too).
        share_policy: how live contexts share the page-cache budget (default
            :class:`FairShares`; :class:`FirstComeShares` never moves a layer for a newcomer).
        replan: move live contexts' layers when the budget or the set of contexts changes
            (False: each context keeps the share it was admitted with).
        reserved_memory: asked at each budget reading: bytes the embedding application has
            claimed but not touched yet (its own buffers), kept out of the page-cache budget so
            that they are counted once, before and after they are touched.

    Raises:
        ConfigError, TargetError, IoUringUnavailableError: the config cannot run here; the
            message says why.
    """
    resolved = torch.device(device) if device is not None else _default_device()
    async with start_runtime(
        config,
        device=resolved,
        tracer=tracer,
        memory_limit=memory_limit,
        wrap_direct=wrap_direct,
        page_cache_file=page_cache_file,
        reserved_memory=reserved_memory,
    ) as runtime:
        store = KVStore(config, runtime, share_policy, replan=replan)
        with plain_errors():
            async with anyio.create_task_group() as tg:
                await tg.start(store.replanner.run)
                try:
                    yield store
                finally:
                    tg.cancel_scope.cancel()
