"""The blocking facade: the KV store for synchronous callers.

A :class:`BlockingStore` runs the asynchronous store on an event loop in a background thread
(anyio's blocking portal) and forwards each call to it, so a synchronous program gets the same
pipeline, the same actors and the same guarantees::

    with open_store_blocking(config) as store:
        with store.context() as ctx:
            ctx.write(0, k, v)
            k, v = ctx.read(0)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from dualblade import event_loop
from dualblade.pipeline import PipelineConfig
from dualblade.store.context import KVContext
from dualblade.store.kv_store import KVStore, open_store


class BlockingContext:
    """A :class:`~dualblade.store.kv_store.KVContext` with blocking methods."""

    def __init__(self, portal: BlockingPortal, context: KVContext) -> None:
        self._portal = portal
        self.context = context

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._portal.call(self.context.write, layer, k, v)

    def append(self, layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> int:
        return self._portal.call(self.context.append, layer, k_row, v_row)

    def read(
        self, layer: int, rows: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._portal.call(self.context.read, layer, rows)

    def length(self, layer: int) -> int:
        return self.context.length(layer)

    # -- without waiting: the transfer starts now, the future settles when it is done ------------
    # Started in call order on the store's loop, and a layer's transfers take its lock in that
    # order: a read started after an append of the same layer sees the appended row.
    def read_soon(
        self, layer: int, rows: tuple[int, int] | None = None
    ) -> Future[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`read`, started now; the future holds K and V (read ahead of the compute)."""
        return self._portal.start_task_soon(self._read, layer, rows)

    def write_soon(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Future[None]:
        """:meth:`write`, started now (written behind the compute)."""
        return self._portal.start_task_soon(self.context.write, layer, k, v)

    def append_soon(self, layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> Future[int]:
        """:meth:`append`, started now (written behind the compute)."""
        return self._portal.start_task_soon(self.context.append, layer, k_row, v_row)

    async def _read(
        self, layer: int, rows: tuple[int, int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return await self.context.read(layer, rows)


class BlockingStore:
    """A :class:`~dualblade.store.kv_store.KVStore` with blocking methods."""

    def __init__(self, portal: BlockingPortal, store: KVStore) -> None:
        self._portal = portal
        self.store = store

    @contextlib.contextmanager
    def context(
        self, *, batch: int | None = None, max_len: int | None = None, dtype: str | None = None
    ) -> Iterator[BlockingContext]:
        """A context of its own shape (None: the store's), as :meth:`KVStore.context`."""
        manager = self.store.context(batch=batch, max_len=max_len, dtype=dtype)
        with self._portal.wrap_async_context_manager(manager) as context:
            yield BlockingContext(self._portal, context)

    def metrics(self) -> dict[str, Any]:
        return self.store.metrics()


@contextlib.contextmanager
def open_store_blocking(
    config: PipelineConfig, *, backend: str = "asyncio", **options: Any
) -> Iterator[BlockingStore]:
    """Start a store on a background event loop (asyncio's: on uvloop where installed, see
    :mod:`dualblade.event_loop`); arguments as :func:`open_store`."""
    loop_options = event_loop.backend_options() if backend == "asyncio" else None
    with (
        start_blocking_portal(backend, loop_options) as portal,
        portal.wrap_async_context_manager(open_store(config, **options)) as store,
    ):
        yield BlockingStore(portal, store)
