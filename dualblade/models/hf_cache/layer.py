"""``DualBladeLayer``: one decoder layer's K and V, kept in the cache's store context.

transformers hands over ``[batch, kv_heads, seq, head_dim]``; the store keeps FlexLLMGen's
row-major ``[seq, batch, kv_heads * head_dim]`` so that a decode step's append is one contiguous
row. Each transfer converts between the two (one copy on the device).
"""

from __future__ import annotations

from typing import Any

import torch

from dualblade.models.hf_cache._backing import Backing
from dualblade.models.hf_cache._transformers import CacheLayerMixin
from dualblade.models.hf_cache.errors import DualBladeCacheError


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

    def __init__(self, backing: Backing, layer_idx: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._backing = backing
        self.layer_idx = layer_idx

    @property
    def rows(self) -> int:
        """Rows the store holds (or will, once the writes behind the compute land)."""
        return self._backing.rows[self.layer_idx]

    @rows.setter
    def rows(self, value: int) -> None:
        self._backing.rows[self.layer_idx] = value

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
        pipeline = self._backing.pipeline
        layer = self.layer_idx
        if self.rows == 0:
            if new:
                pipeline.raise_failed_writes(layer)
                k_rows, v_rows = _to_rows(key_states), _to_rows(value_states)
                written = context.write_soon(layer, k_rows, v_rows)
                pipeline.write_behind(layer, written, whole_layer=True)
                self.rows = new
            return key_states, value_states
        old_k, old_v = pipeline.read(context, layer, self.rows)
        k_rows, v_rows = _to_rows(key_states), _to_rows(value_states)
        for row in range(new):
            appended = context.append_soon(layer, k_rows[row : row + 1], v_rows[row : row + 1])
            pipeline.write_behind(layer, appended)
        self.rows += new
        self._read_ahead(context)
        k = torch.cat([old_k, k_rows.to(old_k.device)])
        v = torch.cat([old_v, v_rows.to(old_v.device)])
        return _to_heads(k, self.num_heads, self.head_dim), _to_heads(
            v, self.num_heads, self.head_dim
        )

    def _read_ahead(self, context: Any) -> None:
        """Start the reads of the next layers' rows (into the next step past the last layer):
        they run while this layer's attention computes."""
        rows, pipeline = self._backing.rows, self._backing.pipeline
        for ahead in range(1, pipeline.depth + 1):
            layer = (self.layer_idx + ahead) % len(rows)
            if layer != self.layer_idx:
                pipeline.prefetch(context, layer, rows[layer])

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V read back from the store, ``[batch, kv_heads, seq, head_dim]``."""
        context = self._backing.context()
        self._backing.pipeline.drain()
        k, v = context.read(self.layer_idx, (0, self.rows))
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
        if self._backing.store is not None and not self._backing.closed:
            self._backing.pipeline.drain()
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
        context = self._backing.context()
        self._backing.pipeline.drain()
        if keep <= 0:
            self.rows = 0
            return
        k, v = context.read(self.layer_idx, (0, keep))
        context.write(self.layer_idx, k, v)
        self.rows = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Permute the batch for beam search: read, select, write back."""
        if self.rows == 0:
            return
        context = self._backing.context()
        self._backing.pipeline.drain()
        k, v = context.read(self.layer_idx, (0, self.rows))
        index = beam_idx.to(k.device)
        context.write(self.layer_idx, k.index_select(1, index), v.index_select(1, index))

    def offload(self) -> None:
        """Nothing to do: the layer's KV is never resident (transformers' CPU offloading)."""

    def prefetch(self) -> None:
        """Nothing to do: each update starts the reads of the layers after it."""

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
