"""The store and the one context that all layers of one cache share: opened on the first update
(or ``DualBladeCache.open``), checked against every later one, released on close."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from dualblade.models.hf_cache._pipelining import LayerPipeline
from dualblade.models.hf_cache._sizing import Geometry, held_dtype, store_config
from dualblade.models.hf_cache.errors import DualBladeCacheError
from dualblade.pipeline import PipelineConfig
from dualblade.store import BlockingContext, BlockingStore, open_store_blocking


class Backing:
    """The store and the one context that all layers of one cache share, opened lazily.

    Kept apart from :class:`~dualblade.models.hf_cache.DualBladeCache` so that the cache's
    finalizer can hold it without holding the cache (which would keep the cache alive forever).
    """

    def __init__(
        self,
        geometry: Geometry,
        max_cache_len: int,
        batch_size: int | None,
        overrides: dict[str, Any],
        memory_limit: int | None,
        device: torch.device | None,
    ) -> None:
        self.geometry = geometry
        self.max_cache_len = max_cache_len
        self.batch_size = batch_size
        self.overrides = overrides
        self.memory_limit = memory_limit
        self.device = device
        self.config: PipelineConfig | None = None
        self.read_device = torch.device("cpu")  # the store's, once open
        self.dtype_name = ""  # the store's KV dtype, once open
        self.store: BlockingStore | None = None
        #: A store the caller owns (see DualBladeCache.in_store); only a context is ours then.
        self.shared_store: BlockingStore | None = None
        self._context: BlockingContext | None = None
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()
        self.closed = False
        #: rows each layer holds, and the reads and writes in flight around the compute
        self.rows = [0] * geometry.num_layers
        self.pipeline = LayerPipeline(1)

    def pipeline_config(self, batch_size: int, dtype: torch.dtype) -> PipelineConfig:
        """The store's config for this batch and dtype.

        Raises:
            DualBladeCacheError: the dtype is not one the store holds.
            ConfigError: an override is not a valid pipeline config.
        """
        return store_config(self.geometry, self.overrides, self.max_cache_len, batch_size, dtype)

    def open(
        self, batch_size: int, dtype: torch.dtype, device: torch.device | None
    ) -> BlockingContext:
        """Open the store and its context (once); later calls check that they agree.

        ``device`` is where the K/V come from and where the read-back must land (None: the
        store's default, CUDA when available); the constructor's ``device`` wins.

        Raises:
            DualBladeCacheError: closed already, or a batch, dtype or device other than the
                opened one.
        """
        with self._lock:
            if self.closed:
                raise DualBladeCacheError("this DualBladeCache is closed; make a new one")
            if self.batch_size is not None and batch_size != self.batch_size:
                raise DualBladeCacheError(
                    f"generate() runs a batch of {batch_size} sequences but this DualBladeCache "
                    f"was made for {self.batch_size}: build it with batch_size={batch_size} "
                    "(num_beams and num_return_sequences multiply the batch)"
                )
            if self._context is None:
                if self.shared_store is not None:
                    store, config = self.shared_store, self.shared_store.store.config
                else:
                    config = self.pipeline_config(batch_size, dtype)
                try:
                    if self.shared_store is None:
                        store = self._stack.enter_context(
                            open_store_blocking(
                                config,
                                device=self.device or device,
                                memory_limit=self.memory_limit,
                            )
                        )
                    if self.shared_store is None:
                        self._context = self._stack.enter_context(store.context())
                    else:  # one request of many: a context of the request's own shape
                        shaped = store.context(batch=batch_size, max_len=self.max_cache_len)
                        self._context = self._stack.enter_context(shaped)
                except BaseException:
                    self._stack.close()
                    raise
                self.store, self.config, self.batch_size = store, config, batch_size
                self.pipeline = LayerPipeline(store.store.read_parallelism)
                self.read_device = store.store.device
                self.dtype_name = config.shape().dtype
            if held_dtype(dtype) != self.dtype_name:
                raise DualBladeCacheError(
                    f"KV of dtype {dtype} for a cache opened with {self.dtype_name}"
                )
            if device is not None and not _same_device(device, self.read_device):
                raise DualBladeCacheError(
                    f"KV on {device} for a cache whose store reads back to {self.read_device}: "
                    "give the model's device (or none) to the cache"
                )
            return self._context

    def share(self, store: BlockingStore) -> None:
        """Take contexts from ``store`` instead of opening a store of our own.

        Raises:
            DualBladeCacheError: the store was configured for another model shape.
        """
        config = store.store.config
        shape, g = config.shape(), self.geometry
        ours = (g.num_layers, g.num_kv_heads, g.head_dim)
        theirs = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
        if ours != theirs:
            raise DualBladeCacheError(
                f"the store holds {theirs[0]} layers of {theirs[1]} KV heads x {theirs[2]}, the "
                f"model has {ours[0]} layers of {ours[1]} x {ours[2]}"
            )
        self.shared_store = store
        if self.batch_size is None:
            self.batch_size = config.workload.batch

    def context(self) -> BlockingContext:
        """The open context.

        Raises:
            DualBladeCacheError: not opened yet, or closed.
        """
        if self.closed:
            raise DualBladeCacheError("this DualBladeCache is closed; make a new one")
        if self._context is None:
            raise DualBladeCacheError("the store is not open yet (it opens on the first update)")
        return self._context

    def close(self) -> None:
        """Release the context (TRIM, unlink); stop the actors and the event-loop thread
        unless the store is shared (its owner closes it)."""
        with self._lock:
            if self._context is not None:
                # Nothing may land after the context is gone; a write that failed no longer
                # matters to anyone.
                with contextlib.suppress(Exception):
                    self.pipeline.drain()
            self.closed = True
            self._context = None
            self.store = None
            self._stack.close()


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same place unless both name an index."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
