"""One request's KV cache: a context of a store.

::

    async with store.context() as ctx:
        await ctx.write(layer, k, v)            # prefill: rows [0, t)
        await ctx.append(layer, k_row, v_row)   # decode: row t
        k, v = await ctx.read(layer)            # rows [0, t) on the store's device

Each context materializes its storage on first use — a contiguous run of blocks on the direct
target for its direct layers, one page-cache file per page-cache KPU — and deallocates it (TRIM,
unlink) when it closes. Contexts never share storage. Which medium each layer lives on comes
from the context's plan; :mod:`.media` turns it into the span a copy thread moves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import torch

from dualblade.actors import (
    Landing,
    Load,
    PathCounters,
    Reply,
    RowView,
    Store,
    TransferStats,
    check_write_back,
    count_residency,
    fast_sync,
)
from dualblade.io_engine import IOEngine, IOFailedError, PageCacheFile, Target
from dualblade.logs import get_logger
from dualblade.pipeline import (
    ByteCount,
    KpuId,
    LbaMap,
    Medium,
    Plan,
    ReadAhead,
    RowRange,
    TensorKind,
    TensorLayout,
)
from dualblade.store.context_storage import ContextHoldings
from dualblade.store.dtypes import torch_dtype
from dualblade.store.errors import ContextClosedError, KVShapeError, LayerLostError
from dualblade.store.layer_moves import LayerMover, layer_move
from dualblade.store.read_buffers import ReadBuffers
from dualblade.store.tensor_shape import KVTensorShape, requested_rows

if TYPE_CHECKING:
    from dualblade.store.kv_store import KVStore

_log = get_logger(__name__)


class KVContext:
    """One request's KV cache. Use through ``async with store.context() as ctx``."""

    def __init__(self, store: KVStore, context_id: int, plan: Plan) -> None:
        self.store = store
        self.id = context_id
        self.plan = plan
        self._runtime = store.runtime
        config = plan.config
        shape = plan.shape
        self.batch = config.workload.batch
        self.max_len = config.workload.max_len
        self.num_layers = shape.num_layers
        self.tensor_shape = KVTensorShape(
            self.batch, shape.num_kv_heads, shape.head_dim, torch_dtype(shape.dtype)
        )
        self.direct_layout: TensorLayout = plan.layout
        self.file_layout = TensorLayout(self.max_len, plan.layout.row_bytes, ByteCount(1))
        self._lengths = [0] * self.num_layers
        self._lost: set[int] = set()  # layers whose last write failed or was cancelled
        # Each layer's medium now: the plan's, until the store's re-planner moves the layer.
        self._media = list(plan.placement.media)
        # A layer's transfers and its moves exclude each other; other layers go on.
        self._layer_locks = [anyio.Lock() for _ in range(self.num_layers)]
        self._moving = anyio.Lock()  # held by a move; close() waits for it
        self._storage = ContextHoldings(
            self._runtime,
            context_id,
            store.holding_ids,
            self.direct_layout,
            self.file_layout,
            plan.placement.direct,
        )
        self._closed = False
        self.log = _log.bind(store=store.name, context=context_id)

    @property
    def width(self) -> int:
        return self.tensor_shape.width

    @property
    def kv_heads(self) -> int:
        return self.tensor_shape.kv_heads

    @property
    def head_dim(self) -> int:
        return self.tensor_shape.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor_shape.dtype

    @property
    def resident_layers(self) -> int:
        """Layers whose pages stay cached (the rest are direct, or dropped after each use)."""
        return self._media.count(Medium.PAGE_CACHE)

    @property
    def media(self) -> tuple[Medium, ...]:
        """Each layer's medium now (the plan's, or where the store's re-planner moved it)."""
        return tuple(self._media)

    # -- what the span makers need (see media.ContextStorage) --------------------------------
    @property
    def engine(self) -> IOEngine:
        return self._runtime.engine

    @property
    def direct_target(self) -> Target:
        return self._runtime.direct

    @property
    def counters(self) -> PathCounters:
        return self._runtime.counters

    # -- validation ------------------------------------------------------------------------
    def length(self, layer: int) -> int:
        """Rows written for ``layer``."""
        self._check_layer(layer)
        return self._lengths[layer]

    def _check_layer(self, layer: int) -> None:
        if self._closed:
            raise ContextClosedError(f"context {self.id} is closed")
        valid = isinstance(layer, int) and not isinstance(layer, bool)
        if not valid or not 0 <= layer < self.num_layers:
            raise KVShapeError(f"layer must be in 0..{self.num_layers - 1}, got {layer!r}")

    def _check_intact(self, layer: int) -> None:
        if layer in self._lost:
            raise LayerLostError(
                f"layer {layer} of context {self.id} was being written when that write failed or "
                "was cancelled; its rows are lost: write the layer again"
            )

    # -- storage -----------------------------------------------------------------------------
    async def direct_map(self) -> LbaMap:
        """The LBA map of the run that holds the plan's direct KPUs, claimed on first use."""
        return await self._storage.shared_map()

    async def layer_direct_map(self, layer: int) -> LbaMap:
        """The map that holds ``layer``'s direct KPUs (its own run if it was moved there)."""
        return await self._storage.direct_map(layer)

    async def file(self, kpu: KpuId) -> PageCacheFile:
        """The KPU's page-cache file, created by the binder on first use, then remembered."""
        return await self._storage.file(kpu)

    def page_cache_files(self) -> list[PageCacheFile]:
        """The page-cache files this context holds now (read-only use: residency, floors)."""
        return self._storage.files()

    async def _placed(self, layer: int, tensor: TensorKind, rows: RowRange) -> tuple[Any, RowView]:
        medium = self._media[layer]
        placed = await self._storage.spans.placed(self, medium, KpuId(layer, tensor), rows)
        layout = placed.layout
        view = RowView(
            offset=rows.start * layout.row_stride,
            rows=len(rows),
            row_bytes=layout.row_bytes,
            row_stride=layout.row_stride,
            dtype=self.dtype,
            shape=(len(rows), self.batch, self.width),
        )
        return placed.span, view

    # -- transfers ----------------------------------------------------------------------------
    async def _store_message(
        self, layer: int, tensor: TensorKind, rows: RowRange, source: torch.Tensor
    ) -> Store:
        span, view = await self._placed(layer, tensor, rows)
        return Store(source, view, span, Reply())

    async def _load_message(
        self,
        layer: int,
        tensor: TensorKind,
        rows: RowRange,
        destination: torch.Tensor,
        landing: Landing | None,
    ) -> Load:
        span, view = await self._placed(layer, tensor, rows)
        count_residency(span)
        try:
            await check_write_back(span)
        except IOFailedError:
            # The file's bytes on disk are older than what was written: never serve them.
            self._lost.add(layer)
            raise
        return Load(span, view, destination, Reply(), landing)

    async def _both(
        self,
        message_for: Callable[[TensorKind], Awaitable[Load | Store]],
        *,
        urgent: bool = False,
    ) -> list[TransferStats]:
        """Hand K's and V's transfers to copy threads, then await both.

        Both are in flight together (on two threads when two are free), with no task of their
        own. Once a copy thread has accepted a transfer it runs to its end, also when this
        caller is cancelled; so a cancelled or failed caller waits (shielded) for every accepted
        transfer to settle before it leaves. Otherwise the context could go on while its old
        transfer still writes: a cancelled append landing over the next one, or — after
        :meth:`close` freed the run — over another context's new data. K's error goes first.
        """
        messages = [await message_for("K"), await message_for("V")]
        return await self._transfer_all(messages, urgent=urgent)

    async def _transfer_all(
        self, messages: list[Load | Store], *, urgent: bool = False
    ) -> list[TransferStats]:
        return await self._runtime.pool.transfer_all(messages, urgent=urgent)

    async def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows ``[0, t)`` of a layer's K and V (prefill); ``t`` = ``k.shape[0]``.

        If it fails or is cancelled part-way, the layer is lost (:class:`LayerLostError` on
        reads and appends) until a later write of it succeeds.

        Raises:
            KVShapeError: wrong layer, shape, dtype, or more rows than the config's max length.
        """
        self._check_layer(layer)
        k = self.tensor_shape.normalize("k", k, None)
        v = self.tensor_shape.normalize("v", v, k.shape[0])
        rows = k.shape[0]
        if not 0 < rows <= self.max_len:
            raise KVShapeError(f"write of {rows} rows; a context holds 1..{self.max_len} rows")
        span = RowRange(0, rows)
        try:
            # Waiting for the layer's lock (a move) counts as part of the write: cancelled
            # there, the layer is lost as the contract says, whatever it still holds.
            async with fast_sync.holding(self._layer_locks[layer]):
                await self._both(
                    lambda t: self._store_message(layer, t, span, k if t == "K" else v)
                )
                self._lost.discard(layer)
                self._lengths[layer] = rows
        except BaseException:
            # Some rows may hold new bytes and some old ones; never serve the mix.
            self._lost.add(layer)
            raise

    async def append(self, layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> int:
        """Append one row (a decode step's K and V); returns the layer's new length.

        A failed or cancelled append leaves the layer as it was (the row owns its own blocks,
        and the length only grows once both K and V landed).

        Raises:
            KVShapeError: wrong shape, or the context already holds ``max_len`` rows.
            LayerLostError: an earlier write of the layer failed or was cancelled.
        """
        self._check_layer(layer)
        k_row = self.tensor_shape.normalize("k_row", k_row, 1)
        v_row = self.tensor_shape.normalize("v_row", v_row, 1)
        async with fast_sync.holding(self._layer_locks[layer]):
            self._check_intact(layer)
            t = self._lengths[layer]
            if t >= self.max_len:
                raise KVShapeError(
                    f"layer {layer} already holds {self.max_len} rows (prompt + max new tokens)"
                )
            span = RowRange.row(t)
            await self._both(
                lambda kind: self._store_message(
                    layer, kind, span, k_row if kind == "K" else v_row
                ),
                urgent=True,
            )
            self._lengths[layer] = t + 1
        return t + 1

    def read_buffers(self) -> ReadBuffers:
        """Buffers for :meth:`read`'s ``out``, one layer each (on the host, aligned memory that
        direct reads land in, fixed in the store's ring); ``store.read_parallelism`` reads in
        flight need as many."""
        r = self._runtime
        return ReadBuffers(self.max_len, self.batch, self.width, self.dtype, r.device, r.engine)

    def read_order(self, buffers: int) -> ReadAhead:
        """How a decode step reads the layers into ``buffers`` buffers: direct ones early."""
        return ReadAhead.for_media(self._media, buffers)

    async def read(
        self,
        layer: int,
        rows: tuple[int, int] | None = None,
        *,
        out: ReadBuffers | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[a, b)`` (default: all written rows) of a layer's K and V, on the device.

        ``out``: :meth:`read_buffers`, or tensors of ``[>= b - a, batch, width]`` on the store's
        device to read into (their first ``b - a`` rows are filled and returned as views): a
        fresh host tensor per read costs a page fault and a page of zeroes per 4 KiB, as much
        as the copy on the CPU path. :meth:`read_buffers` take rows ``[0, b)`` from storage.

        Raises:
            KVShapeError: rows outside what was written; ``out`` of a wrong shape, dtype or device.
            LayerLostError: an earlier write of the layer failed or was cancelled.
        """
        self._check_layer(layer)
        # Under the layer's lock: a write or append started before this read lands first.
        async with fast_sync.holding(self._layer_locks[layer]):
            self._check_intact(layer)
            start, stop = requested_rows(rows, self._lengths[layer], layer)
            shape = (stop - start, self.batch, self.width)
            device = self._runtime.device
            landings: tuple[Landing | None, Landing | None] = (None, None)
            if out is None:
                k = torch.empty(shape, dtype=self.dtype, device=device)
                v = torch.empty(shape, dtype=self.dtype, device=device)
            elif isinstance(out, ReadBuffers):
                k, v = out.first_rows(shape[0], self.tensor_shape, device)
                landings = out.landings
            else:
                k, v = self.tensor_shape.out_views(out, shape[0], device)
            span = RowRange(start, stop)
            await self._both(
                lambda t: self._load_message(
                    layer, t, span, *((k, landings[0]) if t == "K" else (v, landings[1]))
                ),
                urgent=True,
            )
        return k, v

    async def move_layer(self, layer: int, medium: Medium, *, urgent: bool = False) -> bool:
        """Move a layer to ``medium`` between its uses (the store's re-planner calls this): its
        rows are read, written to the new medium, and only then is the old storage given back;
        a failed move leaves the layer where it was (:mod:`.layer_moves`). Transfers of this
        layer wait for the move, other layers' go on. False: nothing to move, or closed.

        Raises:
            IOFailedError, TargetError: the move's read or write failed (the layer stays).
        """
        async with self._moving, self._layer_locks[layer]:
            old = self._media[layer]
            if self._closed or old is medium:
                return False
            await layer_move(self._mover(layer, urgent), old, medium)
            return True

    def _mover(self, layer: int, urgent: bool) -> LayerMover:
        rows = 0 if layer in self._lost else self._lengths[layer]

        async def copy(old: Medium, new: Medium) -> None:
            span = RowRange(0, rows)
            shape = (rows, self.batch, self.width)
            device = self._runtime.device
            k, v = (torch.empty(shape, dtype=self.dtype, device=device) for _ in "KV")
            await self._both(
                lambda t: self._load_message(layer, t, span, k if t == "K" else v, None),
                urgent=urgent,
            )
            self._media[layer] = new
            await self._both(
                lambda t: self._store_message(layer, t, span, k if t == "K" else v), urgent=urgent
            )

        def switch(medium: Medium) -> None:
            self._media[layer] = medium

        return LayerMover(layer, rows, self._storage, copy, switch)

    async def close(self) -> None:
        """Deallocate the context's storage (TRIM its direct run, unlink its files)."""
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            async with self._moving:  # a move in progress ends first
                self._closed = True
                released = await self._storage.release_all()
        self.log.debug(
            "context released", trimmed_blocks=released.trimmed_blocks, files=released.files
        )
