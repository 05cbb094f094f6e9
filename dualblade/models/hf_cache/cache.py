"""``DualBladeCache``: a transformers ``Cache`` of one :class:`DualBladeLayer` per decoder layer,
all in one context of a dualblade store (see the package docstring for how to use it)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import torch

from dualblade.models.hf_cache._backing import Backing
from dualblade.models.hf_cache._sizing import Geometry, caller_overrides
from dualblade.models.hf_cache._transformers import Cache, PreTrainedConfig
from dualblade.models.hf_cache.errors import DualBladeCacheError
from dualblade.models.hf_cache.layer import DualBladeLayer
from dualblade.pipeline import PipelineConfig, Policy, StorageSection, parse_size
from dualblade.store import BlockingStore


class DualBladeCache(Cache):
    """A transformers ``Cache`` that keeps every layer's K and V in one dualblade store context.

    Args:
        config: the model's config (``model.config``); layers, KV heads and head size come
            from its (text) decoder config.
        max_cache_len: rows each layer can hold, at least prompt length + max_new_tokens - 1.
        batch_size: sequences per step; None takes it from the first update.
        policy: the store's policy (``dual``, ``direct``, ``page-cache``, ``cache-policy``,
            ``baseline``); default ``dual``.
        storage: the ``storage`` section (page-cache dir, direct target) as a mapping or a
            :class:`~dualblade.pipeline.config.StorageSection`; default under
            ``$XDG_CACHE_HOME/dualblade``.
        memory_limit: plan the page-cache budget against this limit (bytes or ``"2GiB"``).
        pipeline: any further pipeline settings (``memory``, ``copy_threads``, ...), as a
            mapping or a whole :class:`~dualblade.pipeline.config.PipelineConfig` whose model
            and workload are replaced. Environment overrides (``DUALBLADE__*``) do not apply:
            what the caller passes is what runs.
        device: where read-back K/V land; default the device of the first K/V.

    Raises:
        DualBladeCacheError: the model is not a decoder of attention layers.
        ConfigError: the pipeline settings are invalid (checked here, before any I/O).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        max_cache_len: int,
        *,
        batch_size: int | None = None,
        policy: Policy | None = None,
        storage: Mapping[str, Any] | StorageSection | None = None,
        memory_limit: int | str | None = None,
        pipeline: Mapping[str, Any] | PipelineConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if max_cache_len <= 0:
            raise DualBladeCacheError(f"max_cache_len must be positive, got {max_cache_len}")
        if batch_size is not None and batch_size <= 0:
            raise DualBladeCacheError(f"batch_size must be positive, got {batch_size}")
        geometry = Geometry(config)
        overrides = caller_overrides(pipeline, policy, storage)
        limit = None if memory_limit is None else parse_size(memory_limit)
        resolved = None if device is None else torch.device(device)
        self._backing = Backing(geometry, max_cache_len, batch_size, overrides, limit, resolved)
        # Validate the settings now: a typo should fail here, not inside generate().
        self._backing.pipeline_config(batch_size or 1, geometry.dtype or torch.float32)
        layers: list[Any] = [DualBladeLayer(self._backing, i) for i in range(geometry.num_layers)]
        super().__init__(layers=layers)
        self._finalizer = weakref.finalize(self, self._backing.close)

    @classmethod
    def in_store(
        cls,
        config: PreTrainedConfig,
        store: BlockingStore,
        *,
        batch_size: int | None = None,
        max_cache_len: int | None = None,
    ) -> Self:
        """A cache that takes one context of a store the caller opened and closes.

        One store serves many caches at once (one per request), each in its own context
        and storage, under the store's one page-cache budget: two caches that opened stores
        of their own on one target would collide. The store's config must describe this model
        (layers, KV heads, head size), its model dtype gives the KV dtype. ``batch_size`` and
        ``max_cache_len`` are this request's (default: the store's workload, which is also
        their upper bound), so requests of different sizes share one store unpadded.

        Raises:
            DualBladeCacheError: the store was configured for another model shape.
            KVShapeError: a request larger than the store's workload (on first use).
        """
        workload = store.store.config.workload
        cache = cls(
            config,
            max_cache_len or workload.max_len,
            batch_size=batch_size or workload.batch,
        )
        cache._backing.share(store)
        return cache

    def open(
        self,
        batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Self:
        """Open the store now rather than on the first update (to pay its start-up up front).

        ``dtype`` defaults to the model config's (else float32), ``device`` to the
        constructor's, else CUDA when available: give the model's device.

        Raises:
            DualBladeCacheError: no batch size known, or it disagrees with the constructor's.
        """
        batch = batch_size or self._backing.batch_size
        if batch is None:
            raise DualBladeCacheError("open() needs a batch_size (none was given to the cache)")
        dtype = dtype or self._backing.geometry.dtype or torch.float32
        where = torch.device(device) if device is not None else None
        self._backing.open(batch, dtype, self._backing.device or where)
        return self

    def close(self) -> None:
        """Release the store: its context's storage (TRIM, unlinked files), actors and thread.

        Idempotent. The cache cannot be used afterwards.
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._backing.closed

    @property
    def pipeline_config(self) -> PipelineConfig | None:
        """The config the store was opened with; None until it opens."""
        return self._backing.config

    def config_for(self, batch_size: int, dtype: torch.dtype = torch.float32) -> PipelineConfig:
        """The config the store would open with for this batch and dtype (to inspect the plan)."""
        return self._backing.pipeline_config(batch_size, dtype)

    def metrics(self) -> dict[str, Any]:
        """The store's metrics (bytes per path, hit rate...), and how many of this cache's
        reads were started ahead of the compute (``cache_read_ahead_hits``) or on demand.

        Raises:
            DualBladeCacheError: the store is not open.
        """
        store = self._backing.store
        if store is None:
            raise DualBladeCacheError("the store is not open, so it has no metrics")
        pipeline = self._backing.pipeline
        return {
            **store.metrics(),
            "cache_read_ahead_hits": pipeline.prefetch_hits,
            "cache_read_ahead_misses": pipeline.prefetch_misses,
        }

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
