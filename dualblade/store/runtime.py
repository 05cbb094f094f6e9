"""The runtime: opens the targets and the I/O engine, starts the five actors, tears them down.

It is the one place that knows both sides: it turns the config into targets and actor arguments,
turns the budgeter's budgets into plans (Algorithm 1), and owns the pool that hands copy threads
out to KV transfers. Everything runs in one task group, opened by :func:`start_runtime`; an actor
that dies cancels the others and the error reaches the owner.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from dualblade.actors import (
    Actor,
    BinderActor,
    Budget,
    BudgetChanged,
    BudgeterActor,
    CopyThreadActor,
    GpuDmaActor,
    OverlapGate,
    PathCounters,
    StrategyProbeActor,
)
from dualblade.errors import plain_errors
from dualblade.io_engine import (
    AlignedBuffer,
    IOEngine,
    PageCacheFile,
    Target,
)
from dualblade.logs import get_logger
from dualblade.pipeline import (
    PageCacheBudget,
    PipelineConfig,
    Plan,
    budget_for,
    make_plan,
    pin_bytes,
)
from dualblade.store.copy_thread_pool import CopyThreadPool
from dualblade.store.direct_target import open_direct_target
from dualblade.store.pin_layout import pin_layout_for
from dualblade.store.reclaim import Reclaimed, reclaim_predecessors
from dualblade.store.store_folder import StoreFolder, claim_store_folder
from dualblade.telemetry import NULL_TRACER, Metrics, Tracer

_log = get_logger(__name__)


@dataclass
class Runtime:
    """Everything a running store holds."""

    config: PipelineConfig
    device: torch.device
    engine: IOEngine
    direct: Target
    budgeter: BudgeterActor
    binder: BinderActor
    dma: GpuDmaActor
    probe: StrategyProbeActor
    gate: OverlapGate
    pool: CopyThreadPool
    buffers: list[AlignedBuffer]
    #: KPU images in each buffer (``pipeline.pin_images_in_plan``)
    pin_images: int
    tracer: Tracer
    metrics: Metrics
    counters: PathCounters
    plan: Plan
    #: what dead predecessors left and this store removed before it served
    reclaimed: Reclaimed = field(default_factory=Reclaimed)

    def replan(self, budget: Budget) -> Plan:
        """The plan for new contexts under ``budget`` (Algorithm 1 again)."""
        assert isinstance(budget.detail, PageCacheBudget)
        self.plan = make_plan(self.config, budget.detail)
        return self.plan


def _trace_chunks(engine: IOEngine, tracer: Tracer) -> None:
    """One trace slice per I/O chunk, on an ``io_uring`` track."""

    def observe(
        target: str,
        op: str,
        offset: int,
        length: int,
        submitted: float,
        completed: float,
        result: int,
    ) -> None:
        tracer.complete(
            "io_uring",
            f"{op} {length >> 10} KiB",
            tracer.us(submitted),
            tracer.us(completed),
            target=target,
            offset=offset,
            result=result,
        )

    engine.observe_chunks(observe)


#: How long a starting store waits for the direct target's lock: a predecessor killed with I/O
#: in flight holds it until the kernel has reaped that I/O (see ``Target.lock_exclusive``).
LOCK_WAIT_S = 2.0

#: Seconds between counter samples in a trace.
SAMPLE_INTERVAL = 0.05


async def _sample_counters(runtime: Runtime, scope: anyio.CancelScope) -> None:
    """Counters for the trace: queue depth and throughput per direction, until ``scope`` ends."""
    with scope:
        await _sample_loop(runtime)


async def _sample_loop(runtime: Runtime) -> None:
    tracer, counters = runtime.tracer, runtime.counters
    last = time.perf_counter()
    last_read = last_written = 0
    while True:
        await anyio.sleep(SAMPLE_INTERVAL)
        now = time.perf_counter()
        snapshot = counters.snapshot()
        read = sum(snapshot["read_bytes"].values())  # type: ignore[attr-defined]
        written = sum(snapshot["write_bytes"].values())  # type: ignore[attr-defined]
        tracer.counter("queue depth", chunks_in_flight=runtime.engine.inflight)
        tracer.counter(
            "throughput",
            read_bytes_per_s=(read - last_read) / (now - last),
            write_bytes_per_s=(written - last_written) / (now - last),
        )
        last, last_read, last_written = now, read, written


def _budget_reader(
    config: PipelineConfig,
    memory_limit: int | None,
    pinned_in_use: int = 0,
    pin_images: int = 1,
    reserved: Callable[[], int] | None = None,
    row_room: int = 0,
) -> Budget:
    """The budget now; ``pinned_in_use``: the copy threads' buffers, allocated already (a
    discovered limit counts them in use, so the plan must not reserve them again);
    ``reserved``: asked at each reading how much memory is claimed but not touched yet;
    ``row_room``: each buffer's bytes beyond its images."""
    derived = budget_for(
        config,
        memory_limit,
        pinned_in_use=pinned_in_use,
        pin_images=pin_images,
        row_room=row_room,
        reserved=reserved() if reserved is not None else 0,
    )
    return Budget(
        page_cache_bytes=derived.page_cache_bytes,
        limit_bytes=derived.limit_bytes,
        derivation=derived.to_dict(),
        detail=derived,
    )


@contextlib.contextmanager
def _all_closed(actors: list[Actor[Any]]) -> Iterator[None]:
    """Close every actor on the way out, also when start-up was cut short (an error or a
    cancellation while starting them): started or not, none leaves an open mailbox behind."""
    try:
        yield
    finally:
        for actor in actors:
            actor.close()


#: Seconds between the budgeter's readings of the memory limit and usage. A live context is
#: re-planned from these readings, so this is how late a squeeze is noticed: at one reading a
#: second the pressure preset spent 0.1-1.0 s of its 2 s recovery window before the first
#: demotion could start. A reading costs a few cgroup file reads in a worker thread.
BUDGET_POLL_S = 0.25


@contextlib.asynccontextmanager
async def start_runtime(
    config: PipelineConfig,
    *,
    device: torch.device,
    tracer: Tracer = NULL_TRACER,
    memory_limit: int | None = None,
    budget_interval: float = BUDGET_POLL_S,
    wrap_direct: Callable[[Target], Target] | None = None,
    page_cache_file: Callable[[Path, int], PageCacheFile] = PageCacheFile,
    reserved_memory: Callable[[], int] | None = None,
) -> AsyncIterator[Runtime]:
    """Open targets and engine, start the actors, yield the runtime, then stop it all.

    ``wrap_direct`` replaces the opened direct target by a wrapper of it (the soak and the
    fault tests wrap it in a :class:`~dualblade.testing.FaultyTarget`);
    ``page_cache_file`` makes the page-cache files (a ``FaultyPageCacheFile`` there);
    ``reserved_memory``, asked at each budget reading (in a worker thread), says how much
    memory the embedding application has claimed but not touched yet: it is kept out of the
    budget (:func:`dualblade.pipeline.derive_budget`'s ``reserved``).

    Raises:
        ConfigError, TargetError, IoUringUnavailableError: the config cannot run here; the
            message says why.
    """
    direct, first_lba, n_blocks = open_direct_target(config)
    if wrap_direct is not None:
        direct = wrap_direct(direct)
    buffers: list[AlignedBuffer] = []
    engine: IOEngine | None = None
    folder: StoreFolder | None = None
    try:
        await anyio.to_thread.run_sync(direct.lock_exclusive, LOCK_WAIT_S)
        engine = IOEngine(
            queue_depth=config.queue_depth,
            passthrough=direct.passthrough,
            max_chunk=config.max_chunk,
            name="dualblade-ring",
        )
        folder = claim_store_folder(Path(config.storage.page_cache_dir))
        reclaimed = await reclaim_predecessors(
            engine, direct, first_lba, n_blocks, folder.path.parent
        )
        layout = await anyio.to_thread.run_sync(
            lambda: pin_layout_for(
                config,
                device.type,
                memory_limit,
                reserved=reserved_memory() if reserved_memory is not None else 0,
            )
        )
        images, row_room, rows_aside = layout.images, layout.row_room, layout.rows_aside
        pin = pin_bytes(config)
        size = images * pin + row_room
        buffers = [AlignedBuffer(size) for _ in range(config.copy_threads)]
        if engine.kind == "io_uring" and not direct.passthrough:
            engine.register_buffers(buffers)
        if device.type == "cuda":
            for buffer in buffers:
                buffer.pin_for_cuda()
        fixed = (
            memory_limit is not None
            or config.memory.page_cache_budget is not None
            or config.memory.limit is not None
        )
        page_cache_dir = folder.path
        # The binder first: it may refuse the extent, and no other actor exists yet to leak.
        binder = BinderActor(
            engine,
            direct,
            first_lba,
            n_blocks,
            page_cache_dir,
            tracer=tracer,
            file_factory=page_cache_file,
        )
        budgeter = BudgeterActor(
            lambda: _budget_reader(
                config,
                memory_limit,
                sum(b.size for b in buffers),
                images,
                reserved_memory,
                row_room,
            ),
            interval=0 if fixed else budget_interval,
            tracer=tracer,
        )
        dma = GpuDmaActor(device, tracer=tracer)
        gate = OverlapGate(config.copy_threads)
        probe = StrategyProbeActor(gate, config.strategy, tracer=tracer)
        threads = [
            CopyThreadActor(
                i, buffer, dma, gate, images=images, rows_aside=rows_aside, tracer=tracer
            )
            for i, buffer in enumerate(buffers)
        ]
        actors: list[Actor[Any]] = [budgeter, binder, dma, probe, *threads]
        # An error of the owner's body (or of one actor) leaves as itself, so that callers and
        # the CLI can catch DualbladeError; the task group alone would wrap it in a group.
        with plain_errors(), _all_closed(actors):
            async with anyio.create_task_group() as tg:
                for actor in actors:
                    await tg.start(actor.run)
                assert budgeter.current is not None
                runtime = Runtime(
                    config=config,
                    device=device,
                    engine=engine,
                    direct=direct,
                    budgeter=budgeter,
                    binder=binder,
                    dma=dma,
                    probe=probe,
                    gate=gate,
                    pool=CopyThreadPool(threads, per_thread=threads[0].max_transfers),
                    buffers=buffers,
                    pin_images=images,
                    tracer=tracer,
                    metrics=Metrics(),
                    counters=PathCounters(),
                    plan=make_plan(config, budgeter.current.detail),  # type: ignore[arg-type]
                    reclaimed=reclaimed,
                )

                async def on_budget(budget: Budget) -> None:
                    before = runtime.plan.placement
                    after = runtime.replan(budget).placement
                    # Only a change of placement changes the traffic the probe measured.
                    if (before.page_cache, before.direct) != (after.page_cache, after.direct):
                        await probe.send(BudgetChanged(budget.page_cache_bytes))

                budgeter.subscribe(on_budget)
                sampler = anyio.CancelScope()
                if tracer.enabled:
                    _trace_chunks(engine, tracer)
                    tg.start_soon(_sample_counters, runtime, sampler)
                try:
                    yield runtime
                finally:
                    sampler.cancel()
                    # Copy threads and the DMA actor first, the binder last: it trims on stop.
                    for actor in reversed(actors):
                        actor.close()
    finally:
        if engine is not None:
            engine.close()
        for buffer in buffers:
            buffer.close()
        direct.close()
        if folder is not None:
            folder.close()
