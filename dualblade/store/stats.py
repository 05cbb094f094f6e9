"""A running store's state as one typed, frozen snapshot.

Everything above the store — metrics, Prometheus, the bench, the soak, an application's
dashboard — reads :class:`StoreStats` (``store.stats()``), never the runtime's actors, engine or
buffers, so their insides can change without breaking a reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dualblade.store.reclaim import Reclaimed
from dualblade.store.residency_ledger import LedgerSnapshot

if TYPE_CHECKING:
    from dualblade.store.runtime import Runtime


@dataclass(frozen=True)
class CoDmaStats:
    """Evidence of Co-DMA: which transfers shared the copy thread's one pinned buffer."""

    direct_transfers: int  # transfers of direct KPUs
    same_buffer: int  # of those, storage DMA and device DMA through the same pinned buffer
    staged_host_copies: int  # device copies staged through a host tensor
    cpu_fallback_copies: int  # copies the CPU made because there is no GPU
    pinned_for_cuda: int  # pinned buffers registered with CUDA
    h2d_bytes: int
    d2h_bytes: int


@dataclass(frozen=True)
class StoreStats:
    """One store at one instant. Counters only grow; the rest is the current state."""

    name: str
    device: str
    #: bytes moved per path ("direct", "page-cache", "baseline") and direction
    read_bytes: Mapping[str, int]
    write_bytes: Mapping[str, int]
    #: page-cache-path read bytes looked up, and of those resident before the read
    cache_lookup_bytes: int
    cache_hit_bytes: int
    page_cache_hit_rate: float | None
    #: the overlap strategy in force and whether the probe has locked it
    strategy: str
    strategy_locked: bool
    #: the budget new contexts are planned against, and the memory limit it came from
    page_cache_budget_bytes: int
    memory_limit_bytes: int | None
    #: the copy threads' pinned buffers (images, and room for rows on CUDA), reserved out of
    #: the limit
    pinned_bytes: int
    #: the ledger: bytes of page-cache files that live contexts hold now
    page_cache_placed_bytes: int
    open_contexts: int
    #: the I/O engine ("io_uring" or "threadpool"), chunks submitted and in flight now
    io_engine: str
    io_chunks: int
    io_chunks_in_flight: int
    #: the direct target, blocks trimmed so far, storage held now
    direct_target: str
    trimmed_blocks: int
    extents_held: int  # contexts holding a run of direct blocks
    files_held: int  # page-cache files, over all contexts
    #: the copy threads' pinned buffers
    buffers: int
    buffer_bytes: int  # each
    buffers_in_flight: int  # I/Os the kernel may still be doing into them
    buffers_open: int  # not yet closed (0 once the store has closed)
    co_dma: CoDmaStats
    #: the residency ledger: the budget live contexts share, what they hold, the moves made
    ledger: LedgerSnapshot
    #: what dead predecessors had left on this store's storage, removed before it served
    reclaimed: Reclaimed

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the keys ``KVStore.metrics()`` has always had."""
        data = asdict(self)
        data["read_bytes"] = dict(self.read_bytes)
        data["write_bytes"] = dict(self.write_bytes)
        data["dma_h2d_bytes"] = self.co_dma.h2d_bytes
        data["dma_d2h_bytes"] = self.co_dma.d2h_bytes
        data["ledger"] = self.ledger.to_dict()
        data["reclaimed"] = self.reclaimed.to_dict()
        return data


def collect_stats(
    runtime: Runtime, name: str, open_contexts: int, ledger: LedgerSnapshot
) -> StoreStats:
    """Read the runtime's counters into a snapshot (on the event loop's thread)."""
    counters = runtime.counters.snapshot()
    threads = runtime.pool.threads
    dma = runtime.dma
    book = runtime.binder.book()
    budget = runtime.plan.budget
    return StoreStats(
        name=name,
        device=str(runtime.device),
        read_bytes=counters["read_bytes"],  # type: ignore[arg-type]
        write_bytes=counters["write_bytes"],  # type: ignore[arg-type]
        cache_lookup_bytes=counters["cache_lookup_bytes"],  # type: ignore[arg-type]
        cache_hit_bytes=counters["cache_hit_bytes"],  # type: ignore[arg-type]
        page_cache_hit_rate=runtime.counters.hit_rate,
        strategy=runtime.gate.strategy,
        strategy_locked=runtime.probe.locked,
        page_cache_budget_bytes=budget.page_cache_bytes,
        memory_limit_bytes=budget.limit_bytes,
        pinned_bytes=budget.pinned_reservation_bytes,
        page_cache_placed_bytes=sum(book.file_bytes.values()),
        open_contexts=open_contexts,
        io_engine=runtime.engine.kind,
        io_chunks=runtime.engine.chunks_submitted,
        io_chunks_in_flight=runtime.engine.inflight,
        direct_target=runtime.direct.name,
        trimmed_blocks=runtime.binder.trimmed_blocks,
        extents_held=len(book.extents),
        files_held=sum(len(files) for files in book.files.values()),
        buffers=len(runtime.buffers),
        buffer_bytes=runtime.buffers[0].size if runtime.buffers else 0,
        buffers_in_flight=sum(b.inflight for b in runtime.buffers),
        buffers_open=sum(not b.closed for b in runtime.buffers),
        co_dma=CoDmaStats(
            direct_transfers=sum(t.direct_transfers for t in threads),
            same_buffer=sum(t.co_dma_transfers for t in threads),
            staged_host_copies=dma.staged_copies,
            cpu_fallback_copies=dma.host_copies,
            pinned_for_cuda=sum(b.cuda_registered for b in runtime.buffers),
            h2d_bytes=dma.bytes_h2d,
            d2h_bytes=dma.bytes_d2h,
        ),
        ledger=ledger,
        reclaimed=runtime.reclaimed,
    )
