"""Where a model keeps its KV cache: the small interface the engine runs against, and the
in-memory reference behind it.

The engine needs five calls — open a request's context, write a layer's prefill rows, append one
row, read a layer back, and bracket a decode step — which is exactly what
:class:`~dualblade.store.kv_store.KVStore` and its ``KVContext`` offer. :class:`MemoryKV` offers
the same on plain tensors in RAM: the reference every offloading policy is compared with. It
stores the same dtype as the store (the engine casts before writing), so a policy that returns
every byte it was given yields the very same tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import anyio
import torch

from dualblade.errors import DualbladeError
from dualblade.pipeline import ReadAhead


class KVCache(Protocol):
    """One request's KV cache (``KVContext`` is one). Tensors are ``[rows, batch, width]``."""

    async def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    async def append(self, layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> int: ...

    async def read(self, layer: int, *, out: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All written rows, into ``out`` (one of :meth:`read_buffers`) when given; callers pass
        ``out`` only where :meth:`read_buffers` gave buffers."""
        ...

    def read_buffers(self) -> Any:
        """Buffers a reader reuses for one layer's read, or None where they gain nothing."""
        ...

    def read_order(self, buffers: int) -> ReadAhead:
        """The order a decode step reads the layers in, into ``buffers`` reused buffers."""
        ...


class KVProvider(Protocol):
    """Hands out per-request caches and brackets decode steps (``KVStore`` is one)."""

    #: How many layers' reads the provider moves at once to good effect: a decode step keeps
    #: that many layers ahead of its compute in flight.
    @property
    def read_parallelism(self) -> int: ...

    def context(
        self, *, batch: int | None = None, max_len: int | None = None
    ) -> AbstractAsyncContextManager[KVCache]:
        """A request's cache; ``batch`` and ``max_len`` (rows) size it for the request, up
        to the provider's workload (None: the provider's)."""
        ...

    def iteration(self) -> AbstractAsyncContextManager[Any]: ...

    def metrics(self) -> dict[str, Any]: ...


class MemoryKVError(DualbladeError, ValueError):
    """A tensor handed to the in-memory cache does not fit it."""

    exit_code = 2


class MemoryKVContext:
    """One request's cache as preallocated ``[max_len, batch, width]`` tensors per layer."""

    def __init__(
        self, layers: int, batch: int, max_len: int, width: int, dtype: torch.dtype, device: Any
    ) -> None:
        size = (max_len, batch, width)
        self._k = [torch.empty(size, dtype=dtype, device=device) for _ in range(layers)]
        self._v = [torch.empty(size, dtype=dtype, device=device) for _ in range(layers)]
        self._lengths = [0] * layers
        self._max_len = max_len

    def _check(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        if not 0 <= layer < len(self._k):
            raise MemoryKVError(f"layer must be in 0..{len(self._k) - 1}, got {layer}")
        want = self._k[layer]
        for name, tensor in (("k", k), ("v", v)):
            if tensor.dtype != want.dtype or tuple(tensor.shape[1:]) != tuple(want.shape[1:]):
                raise MemoryKVError(
                    f"{name} is {tensor.dtype} {list(tensor.shape)}; this cache holds "
                    f"{want.dtype} [rows, {want.shape[1]}, {want.shape[2]}]"
                )
        if start + k.shape[0] > self._max_len or k.shape != v.shape:
            raise MemoryKVError(
                f"rows [{start}, {start + k.shape[0]}) of layer {layer} do not fit "
                f"{self._max_len} rows (or k and v differ in shape)"
            )

    async def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``[0, t)`` of a layer (prefill)."""
        self._check(layer, k, v, 0)
        rows = k.shape[0]
        self._k[layer][:rows].copy_(k)
        self._v[layer][:rows].copy_(v)
        self._lengths[layer] = rows
        await anyio.lowlevel.checkpoint()

    async def append(self, layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> int:
        """One more row; returns the layer's new length."""
        k_row, v_row = k_row.reshape(1, *k_row.shape[-2:]), v_row.reshape(1, *v_row.shape[-2:])
        t = self._lengths[layer] if 0 <= layer < len(self._lengths) else 0
        self._check(layer, k_row, v_row, t)
        self._k[layer][t].copy_(k_row[0])
        self._v[layer][t].copy_(v_row[0])
        self._lengths[layer] = t + 1
        await anyio.lowlevel.checkpoint()
        return t + 1

    def read_buffers(self) -> None:
        """None: reads here are copies in memory already."""
        return None

    def read_order(self, buffers: int) -> ReadAhead:
        """Layer order: every layer is equally fast here."""
        return ReadAhead(len(self._k), buffers)

    async def read(self, layer: int, *, out: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the written rows (a caller may keep them while the cache grows)."""
        self._check(layer, self._k[layer][:0], self._v[layer][:0], 0)
        rows = self._lengths[layer]
        await anyio.lowlevel.checkpoint()
        return self._k[layer][:rows].clone(), self._v[layer][:rows].clone()


class MemoryKV:
    """The in-RAM reference provider: the ``memory`` policy of ``dualblade generate``."""

    def __init__(
        self,
        *,
        layers: int,
        batch: int,
        max_len: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self._spec = (layers, batch, max_len, width, dtype, torch.device(device))
        self.open_contexts = 0
        self.steps = 0

    @property
    def read_parallelism(self) -> int:
        """One: a read is a clone in RAM, nothing to overlap beyond the next layer."""
        return 1

    @contextlib.asynccontextmanager
    async def context(
        self, *, batch: int | None = None, max_len: int | None = None
    ) -> AsyncIterator[MemoryKVContext]:
        """A new request's cache (of its own batch and rows, if given), dropped when the block
        exits."""
        layers, own_batch, own_len, width, dtype, device = self._spec
        self.open_contexts += 1
        try:
            yield MemoryKVContext(
                layers, batch or own_batch, max_len or own_len, width, dtype, device
            )
        finally:
            self.open_contexts -= 1

    @contextlib.asynccontextmanager
    async def iteration(self) -> AsyncIterator[None]:
        """Counts decode steps (the store's probe times them; here there is nothing to probe)."""
        self.steps += 1
        yield

    def metrics(self) -> dict[str, Any]:
        """What the store reports, as far as it applies to RAM: no bytes move to storage."""
        return {"open_contexts": self.open_contexts, "decode_steps": self.steps}
