"""``DualBladeCache``: a transformers ``Cache`` whose KV lives in a dualblade store.

Any transformers decoder offloads its KV cache by taking this cache instead of its default one::

    from dualblade.models.hf_cache import DualBladeCache

    with DualBladeCache(model.config, max_cache_len=prompt_len + new_tokens, batch_size=4,
                        policy="dual") as cache:
        ids = model.generate(input_ids, max_new_tokens=new_tokens, cache=cache)

(recent transformers 5.x, 5.24 here, call the argument ``cache``; earlier 5.x releases call
it ``past_key_values``, which later ones still take with a FutureWarning. Tested with 5.0,
5.17 and 5.24.) One :class:`DualBladeLayer` per decoder layer forwards ``update`` to one context of
a blocking :class:`~dualblade.store.blocking.BlockingStore`: the prefill writes rows
``[0, t)`` of the layer's K and V, each decode step appends one row and reads the whole layer
back from the store. That read is the offload: between two steps the model holds no KV at all,
and during a step only the layer that is computing. The store's policy decides the path
(Algorithm 1 under ``dual``), as for every other user of the store.

Layouts: transformers hands over ``[batch, kv_heads, seq, head_dim]``; the store keeps
FlexLLMGen's row-major ``[seq, batch, kv_heads * head_dim]`` so that a decode step's append is
one contiguous row. Each transfer converts between the two (one copy on the device).

The store fixes batch, dtype and row count when it opens, so the cache does too: the batch and
dtype are taken from the first ``update`` (or given up front), the row count is
``max_cache_len``. ``generate`` never caches its last token, so ``prompt_len + max_new_tokens - 1``
rows suffice; ``num_beams`` and ``num_return_sequences`` multiply the batch.

The cache owns a background event-loop thread, the store's actors and its files until
:meth:`DualBladeCache.close` (or the end of its ``with`` block); a cache that is garbage
collected unclosed closes itself, but only ``close`` releases at a moment the caller chooses.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import torch

from dualblade.errors import DualbladeError
from dualblade.pipeline import (
    PipelineConfig,
    Policy,
    StorageSection,
    config_from_mapping,
    parse_size,
)
from dualblade.store import BlockingContext, BlockingStore, open_store_blocking

try:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dualblade.models.hf_cache needs transformers 5.x: pip install 'dualblade[hf]'"
    ) from error

__all__ = ["DualBladeCache", "DualBladeCacheError", "DualBladeLayer"]

_STORE_DTYPES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}

# Layer kinds whose cache is a plain, growing K/V per token. Sliding and chunked layers are kept
# in full: their masks, built from get_mask_sizes' absolute positions, do the windowing.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


class DualBladeCacheError(DualbladeError, ValueError):
    """The cache was used in a way its store cannot serve (batch, length, dtype, closed...)."""

    exit_code = 2


class _Geometry:
    """The attention shape of a transformers decoder config: what sizes the store."""

    def __init__(self, config: PreTrainedConfig) -> None:
        text = config.get_text_config(decoder=True)
        if getattr(text, "is_encoder_decoder", False):
            raise DualBladeCacheError(
                "DualBladeCache offloads decoder-only models; encoder-decoder models keep a "
                "cross-attention cache it does not implement"
            )
        layer_types = getattr(text, "layer_types", None)
        unsupported = sorted(set(layer_types or []) - _ATTENTION_LAYER_TYPES)
        if unsupported:
            raise DualBladeCacheError(
                f"the model has layers of type {unsupported}; DualBladeCache stores per-token K "
                f"and V of attention layers only ({sorted(_ATTENTION_LAYER_TYPES)})"
            )
        self.num_layers = int(text.num_hidden_layers)
        self.num_heads = int(text.num_attention_heads)
        self.hidden_size = int(text.hidden_size)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or self.hidden_size // self.num_heads)
        # transformers keeps the dtype as a torch.dtype, a name ("float16") or None.
        model_dtype = getattr(text, "dtype", None)
        if isinstance(model_dtype, str):
            model_dtype = getattr(torch, model_dtype, None)
        self.dtype = model_dtype if isinstance(model_dtype, torch.dtype) else None


class _Backing:
    """The store and the one context that all layers of one cache share, opened lazily.

    Kept apart from :class:`DualBladeCache` so that the cache's finalizer can hold it without
    holding the cache (which would keep the cache alive forever).
    """

    def __init__(
        self,
        geometry: _Geometry,
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

    def pipeline_config(self, batch_size: int, dtype: torch.dtype) -> PipelineConfig:
        """The store's config for this batch and dtype.

        Raises:
            DualBladeCacheError: the dtype is not one the store holds.
            ConfigError: an override is not a valid pipeline config.
        """
        if dtype not in _STORE_DTYPES:
            raise DualBladeCacheError(
                f"the model's KV dtype is {dtype}; the store holds "
                f"{', '.join(_STORE_DTYPES.values())}: load the model in one of them"
            )
        g = self.geometry
        data = {
            **self.overrides,
            "model": {
                "num_layers": g.num_layers,
                "hidden_size": g.hidden_size,
                "num_heads": g.num_heads,
                "num_kv_heads": g.num_kv_heads,
                "head_dim": g.head_dim,
                "dtype": _STORE_DTYPES[dtype],
            },
            # max_len = prompt_len + max_new_tokens is all the store uses of the workload.
            "workload": {
                "batch": batch_size,
                "prompt_len": self.max_cache_len,
                "max_new_tokens": 0,
            },
        }
        return config_from_mapping(data, source="DualBladeCache", env={})

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
                    self._context = self._stack.enter_context(store.context())
                except BaseException:
                    self._stack.close()
                    raise
                self.store, self.config, self.batch_size = store, config, batch_size
                self.read_device = store.store.device
                self.dtype_name = config.shape().dtype
            if _STORE_DTYPES.get(dtype) != self.dtype_name:
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
            self.closed = True
            self._context = None
            self.store = None
            self._stack.close()


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same place unless both name an index."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _to_rows(states: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, seq, dim]`` -> the store's ``[seq, batch, heads * dim]`` (a copy)."""
    batch, heads, seq, dim = states.shape
    return states.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)


def _to_heads(rows: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """The store's ``[seq, batch, heads * dim]`` -> a contiguous ``[batch, heads, seq, dim]``."""
    seq, batch, _ = rows.shape
    return rows.view(seq, batch, heads, dim).permute(1, 2, 0, 3).contiguous()


class DualBladeLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # untyped __init_subclass__
    """One decoder layer's K and V, kept in the shared store under this layer's index.

    ``keys`` and ``values`` stay ``None``: nothing of the layer is held between updates, which
    is the point. Sequence bookkeeping is a plain count of the rows the store holds.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, backing: _Backing, layer_idx: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._backing = backing
        self.layer_idx = layer_idx
        self.rows = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Open the store on first use, sized from the first K/V that arrive.

        Raises:
            DualBladeCacheError: K and V differ in shape, the heads or head size are not the
                model config's, or the batch or dtype disagree with the opened store.
        """
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise DualBladeCacheError(
                f"layer {self.layer_idx}: K {list(key_states.shape)} and V "
                f"{list(value_states.shape)} must both be [batch, kv_heads, seq, head_dim] "
                "of one shape (a model with a separate value head size is not supported)"
            )
        batch, heads, _, dim = key_states.shape
        geometry = self._backing.geometry
        if (heads, dim) != (geometry.num_kv_heads, geometry.head_dim):
            raise DualBladeCacheError(
                f"layer {self.layer_idx}: the model produced {heads} KV heads of {dim}, its "
                f"config says {geometry.num_kv_heads} of {geometry.head_dim}"
            )
        self._backing.open(batch, key_states.dtype, key_states.device)
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size = batch
        self.num_heads = heads
        self.head_dim = dim
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new rows and return the layer's whole K and V.

        The first update of a layer (the prefill) writes rows ``[0, t)`` and returns its own
        input, which is exactly what was written; later updates append row by row (one row per
        decode step) and return all rows read back from the store.

        Raises:
            DualBladeCacheError: more rows than ``max_cache_len``, or a batch, shape or dtype
                other than the store's.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            self._backing.open(key_states.shape[0], key_states.dtype, key_states.device)
        if key_states.shape != value_states.shape or tuple(key_states.shape[1::2]) != (
            self.num_heads,
            self.head_dim,
        ):
            raise DualBladeCacheError(
                f"layer {self.layer_idx}: K {list(key_states.shape)} / V "
                f"{list(value_states.shape)} do not match the cache's "
                f"[{self.batch_size}, {self.num_heads}, seq, {self.head_dim}]"
            )
        new = key_states.shape[2]
        limit = self._backing.max_cache_len
        if self.rows + new > limit:
            raise DualBladeCacheError(
                f"layer {self.layer_idx} holds {self.rows} rows and gets {new} more, past "
                f"max_cache_len={limit}: build the cache with max_cache_len >= prompt length + "
                "max_new_tokens"
            )
        context = self._backing.context()
        if self.rows == 0:
            if new:
                context.write(self.layer_idx, _to_rows(key_states), _to_rows(value_states))
                self.rows = new
            return key_states, value_states
        k_rows, v_rows = _to_rows(key_states), _to_rows(value_states)
        for row in range(new):
            context.append(self.layer_idx, k_rows[row : row + 1], v_rows[row : row + 1])
        self.rows += new
        return self.read()

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V read back from the store, ``[batch, kv_heads, seq, head_dim]``."""
        k, v = self._backing.context().read(self.layer_idx, (0, self.rows))
        return _to_heads(k, self.num_heads, self.head_dim), _to_heads(
            v, self.num_heads, self.head_dim
        )

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: every cached row plus the query, from position 0.

        transformers before about 5.10 passes the query's ``cache_position`` tensor instead of
        its length.
        """
        length = query_length if isinstance(query_length, int) else query_length.shape[0]
        return self.rows + length, 0

    def get_seq_length(self) -> int:
        """Rows the store holds for this layer."""
        return self.rows

    def get_max_length(self) -> int:
        """The most rows the store can hold: ``max_cache_len``."""
        return self._backing.max_cache_len

    def get_max_cache_shape(self) -> int:
        """:meth:`get_max_length` under its earlier name (abstract in transformers 5.0)."""
        return self._backing.max_cache_len

    def reset(self) -> None:
        """Forget the rows; the next update writes from row 0 again (the store stays open)."""
        self.rows = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` rows (assisted decoding rolls back this way).

        A positive argument is the length to keep, as early transformers 5 releases call it
        (later ones only pass counts <= 0). The store only appends after its last written row,
        so the kept rows are read and written back as a fresh prefix.
        """
        keep = self.rows + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        if keep >= self.rows:
            return
        if keep <= 0:
            self.rows = 0
            return
        context = self._backing.context()
        k, v = context.read(self.layer_idx, (0, keep))
        context.write(self.layer_idx, k, v)
        self.rows = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Permute the batch for beam search: read, select, write back."""
        if self.rows == 0:
            return
        context = self._backing.context()
        k, v = context.read(self.layer_idx, (0, self.rows))
        index = beam_idx.to(k.device)
        context.write(self.layer_idx, k.index_select(1, index), v.index_select(1, index))

    def offload(self) -> None:
        """Nothing to do: the layer's KV is never resident (transformers' CPU offloading)."""

    def prefetch(self) -> None:
        """Nothing to do: each update reads what it needs from the store."""

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Unsupported: the store's batch is fixed when it opens.

        Raises:
            DualBladeCacheError: always; build the cache for the expanded batch instead.
        """
        raise DualBladeCacheError(
            "DualBladeCache cannot change its batch after opening; give batch_size for the "
            "whole expanded batch (batch x num_beams x num_return_sequences)"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Unsupported, for the same reason as :meth:`batch_repeat_interleave`.

        Raises:
            DualBladeCacheError: always.
        """
        raise DualBladeCacheError(
            "DualBladeCache cannot drop sequences from its batch: the store's batch is fixed"
        )


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
        geometry = _Geometry(config)
        overrides = _overrides(pipeline, policy, storage)
        limit = None if memory_limit is None else parse_size(memory_limit)
        resolved = None if device is None else torch.device(device)
        self._backing = _Backing(geometry, max_cache_len, batch_size, overrides, limit, resolved)
        # Validate the settings now: a typo should fail here, not inside generate().
        self._backing.pipeline_config(batch_size or 1, geometry.dtype or torch.float32)
        layers: list[Any] = [DualBladeLayer(self._backing, i) for i in range(geometry.num_layers)]
        super().__init__(layers=layers)
        self._finalizer = weakref.finalize(self, self._backing.close)

    @classmethod
    def in_store(cls, config: PreTrainedConfig, store: BlockingStore) -> Self:
        """A cache that takes one context of a store the caller opened and closes.

        One store serves many caches at once (one per request), each in its own context
        and storage: two caches that opened stores of their own on one target would collide.
        The store's config must describe this model (layers, KV heads, head size); its
        workload gives the batch and ``max_cache_len``, its model dtype the KV dtype.

        Raises:
            DualBladeCacheError: the store was configured for another model shape.
        """
        workload = store.store.config.workload
        cache = cls(config, workload.max_len, batch_size=workload.batch)
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
        """The store's metrics (bytes per path, hit rate...).

        Raises:
            DualBladeCacheError: the store is not open.
        """
        store = self._backing.store
        if store is None:
            raise DualBladeCacheError("the store is not open, so it has no metrics")
        return store.metrics()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _overrides(
    pipeline: Mapping[str, Any] | PipelineConfig | None,
    policy: Policy | None,
    storage: Mapping[str, Any] | StorageSection | None,
) -> dict[str, Any]:
    """The caller's pipeline settings as one mapping; model and workload are the cache's own.

    Raises:
        DualBladeCacheError: ``pipeline`` sets the model or the workload.
    """
    if isinstance(pipeline, PipelineConfig):
        data: dict[str, Any] = pipeline.model_dump()
        del data["model"], data["workload"]
    else:
        data = dict(pipeline or {})
        clash = sorted({"model", "workload"} & set(data))
        if clash:
            raise DualBladeCacheError(
                f"pipeline sets {clash}: DualBladeCache takes the model shape from the model's "
                "config and the workload from batch_size and max_cache_len"
            )
    if policy is not None:
        data["policy"] = policy
    if storage is not None:
        data["storage"] = (
            storage.model_dump() if isinstance(storage, StorageSection) else dict(storage)
        )
    return data
