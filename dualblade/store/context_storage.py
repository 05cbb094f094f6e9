"""The storage one context holds, claimed from the binder layer by layer as it is first used.

- The layers the context's plan put on the direct path share one contiguous run (consecutive
  LBAs, as the paper lays them out), claimed on the first direct transfer.
- A layer that moves to the direct path later (a demotion) gets a run of its own; a layer that
  leaves the direct path has its blocks trimmed (its own run is given back).
- Each layer's page-cache files are a holding of their own, so a demoted layer's files are
  unlinked (its pages dropped) without touching the other layers'.

The binder books holdings by number; the context's own number holds the shared run, and the
store hands out fresh numbers for the per-layer holdings (:attr:`KVStore.holding_ids`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import anyio

from dualblade.actors import ClaimExtent, ClaimFile, ReleaseContext, Reply
from dualblade.io_engine import IOEngine, PageCacheFile, Target
from dualblade.pipeline import BlockCount, KpuId, Lba, LbaMap, Region, TensorLayout
from dualblade.store.media import SpanCache
from dualblade.store.runtime import Runtime


class ContextHoldings:
    """What one context holds on the direct target and in page-cache files."""

    def __init__(
        self,
        runtime: Runtime,
        context: int,
        holding_ids: Iterator[int],
        direct_layout: TensorLayout,
        file_layout: TensorLayout,
        planned_direct: tuple[int, ...],
    ) -> None:
        self._runtime = runtime
        self._context = context
        self._holding_ids = holding_ids
        self.direct_layout = direct_layout
        self.file_layout = file_layout
        self._planned_direct = planned_direct
        self._shared_map: LbaMap | None = None
        self._own_runs: dict[int, tuple[int, LbaMap]] = {}  # layer -> (holding, map)
        self._file_holdings: dict[int, int] = {}  # layer -> holding
        self._files: dict[KpuId, PageCacheFile] = {}
        self._lock = anyio.Lock()
        #: spans already made over this storage; a layer's are forgotten when it is given back
        self.spans = SpanCache()

    # -- what the span makers need ------------------------------------------------------------
    @property
    def engine(self) -> IOEngine:
        return self._runtime.engine

    @property
    def direct_target(self) -> Target:
        return self._runtime.direct

    async def shared_map(self) -> LbaMap:
        """The run of the layers the plan put on the direct path, claimed on first use."""
        if self._shared_map is not None:
            # claimed already: no lock, whose acquire costs a trip through the event loop
            return self._shared_map
        async with self._lock:
            if self._shared_map is None:
                tensors = [
                    (KpuId(layer, t), self.direct_layout.image_bytes)
                    for layer in self._planned_direct
                    for t in ("K", "V")
                ]
                self._shared_map = await self._claim_run(self._context, tensors)
            return self._shared_map

    async def direct_map(self, layer: int) -> LbaMap:
        """The map that holds ``layer``'s direct KPUs: the shared run for a planned direct
        layer, else a run of its own, claimed on first use."""
        if layer in self._planned_direct:
            return await self.shared_map()
        claimed = self._own_runs.get(layer)
        if claimed is not None:
            return claimed[1]
        async with self._lock:
            own = self._own_runs.get(layer)
            if own is None:
                holding = next(self._holding_ids)
                tensors = [(KpuId(layer, t), self.direct_layout.image_bytes) for t in ("K", "V")]
                own = (holding, await self._claim_run(holding, tensors))
                self._own_runs[layer] = own
            return own[1]

    async def file(self, kpu: KpuId) -> PageCacheFile:
        """The KPU's page-cache file, created on first use, then remembered."""
        file = self._files.get(kpu)
        if file is None:
            holding = self._file_holdings.get(kpu.layer)
            if holding is None:
                holding = self._file_holdings[kpu.layer] = next(self._holding_ids)
            reply: Reply[PageCacheFile] = Reply()
            claim = ClaimFile(
                holding,
                str(kpu),
                self.file_layout.image_bytes,
                reply,
                folder=f"context-{self._context}",
            )
            file = await self._runtime.binder.ask(claim, reply)
            self._files[kpu] = file
        return file

    def files(self) -> list[PageCacheFile]:
        """The page-cache files held now, by KPU."""
        return [self._files[kpu] for kpu in sorted(self._files)]

    def layer_files(self, layer: int) -> list[PageCacheFile]:
        return [f for kpu, f in self._files.items() if kpu.layer == layer]

    # -- giving storage back ------------------------------------------------------------------
    async def drop_files(self, layer: int) -> None:
        """Unlink the layer's page-cache files: their pages leave the cache with them."""
        self.spans.forget(layer, direct=False)
        holding = self._file_holdings.pop(layer, None)
        for kpu in [k for k in self._files if k.layer == layer]:
            del self._files[kpu]
        if holding is not None:
            await self._release(holding)

    async def drop_direct(self, layer: int) -> None:
        """Free the layer's direct blocks: its own run goes back, or its share of the shared
        run is trimmed (the run stays the context's, ready for the layer to come back)."""
        self.spans.forget(layer, direct=True)
        own = self._own_runs.pop(layer, None)
        if own is not None:
            await self._release(own[0])
            return
        if self._shared_map is None or layer not in self._planned_direct:
            return
        for tensor in ("K", "V"):
            extent = self._shared_map.lookup(KpuId(layer, tensor))
            await self.engine.trim(self.direct_target, extent.byte_offset, extent.nbytes)

    async def release_all(self) -> Any:
        """Give back everything (the context closes); the reply of the shared holding."""
        self.spans.forget_all()
        for holding, _ in self._own_runs.values():
            await self._release(holding)
        for holding in self._file_holdings.values():
            await self._release(holding)
        self._own_runs.clear()
        self._file_holdings.clear()
        self._files.clear()
        return await self._release(self._context)

    # -- the binder ------------------------------------------------------------------------------
    async def _claim_run(self, holding: int, tensors: Sequence[tuple[KpuId, int]]) -> LbaMap:
        lba_size = self.direct_layout.lba_size
        blocks = sum(n for _, n in tensors) // lba_size
        reply: Reply[int] = Reply()
        first = await self._runtime.binder.ask(ClaimExtent(holding, blocks, reply), reply)
        return LbaMap.bind(tensors, Region(Lba(first), BlockCount(blocks)), lba_size)

    async def _release(self, holding: int) -> Any:
        reply: Reply[Any] = Reply()
        with anyio.CancelScope(shield=True):
            return await self._runtime.binder.ask(ReleaseContext(holding, reply), reply)
