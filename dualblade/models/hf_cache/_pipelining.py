"""Read-ahead and write-behind for a transformers ``Cache``: the OPT engine's overlap.

transformers calls ``update`` layer by layer and waits for each answer; a cache that read its
layer only then would leave the storage idle during every layer's compute and the compute idle
during every read. So when layer ``i`` is updated, the reads of the next ``depth`` layers
(the store's ``read_parallelism``, wrapping into the next step) start, and the new rows are
appended without waiting: the answer for layer ``i`` is the prefetched old rows with the new
rows joined on the device.

The prefill's writes are held back as the engine's are: at most :data:`WRITES_BEHIND` layers'
writes in flight, and the prefill waits for the oldest before it hands over a third. Each holds
its layer's K and V (on the GPU, or in host memory on the CPU path) until it lands. With no bound,
a 32-layer prefill queued every layer and returned its first token with the whole prompt's KV
still in memory; the first decode step then waited for the rest (on the H200, OPT-6.7B, batch
32, 512 tokens at a 6 GiB limit: 5.7-7.1 s against 1.8-2.2 for each later step).

Ordering is the store's: transfers start in call order and a layer's transfers take its lock in
that order, so a read started after an append of the same layer sees the appended row. A
write that failed is raised at the layer's next update (before its rows could be misread) or
at :meth:`LayerPipeline.drain`, which every operation other than ``update`` (crop,
reorder, reset, a plain read, close) calls first.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from dualblade.store import BlockingContext

KV = tuple[torch.Tensor, torch.Tensor]

#: Whole-layer writes (a prefill's) in flight at most, as the OPT engine's prefill allows.
WRITES_BEHIND = 2


class LayerPipeline:
    """Reads in flight ahead of the compute and writes in flight behind it, per layer."""

    def __init__(self, depth: int) -> None:
        self.depth = max(1, depth)
        self._reads: dict[int, tuple[int, Future[KV]]] = {}
        self._writes: dict[int, list[Future[Any]]] = {}
        self._layer_writes: deque[Future[Any]] = deque()
        #: reads answered from a read started ahead, and reads that had to start on demand
        self.prefetch_hits = 0
        self.prefetch_misses = 0

    def write_behind(self, layer: int, future: Future[Any], *, whole_layer: bool = False) -> None:
        """Track a write or append of ``layer`` that runs while the compute goes on.

        ``whole_layer``: a write of the layer's rows so far (a prefill's); once more than
        :data:`WRITES_BEHIND` of them are in flight, wait for the oldest to land. Its error,
        if any, is raised where any write's is (the layer's next update, or a drain).
        """
        self._writes.setdefault(layer, []).append(future)
        if whole_layer:
            self._layer_writes.append(future)
            while len(self._layer_writes) > WRITES_BEHIND:
                _settle(self._layer_writes.popleft())

    def raise_failed_writes(self, layer: int) -> None:
        """Forget the layer's finished writes; raise the first that failed."""
        pending = self._writes.get(layer, [])
        done = [f for f in pending if f.done()]
        self._writes[layer] = [f for f in pending if not f.done()]
        for future in done:
            error = future.exception()
            if error is not None:
                raise error

    def prefetch(self, context: BlockingContext, layer: int, rows: int) -> None:
        """Start reading rows ``[0, rows)`` of ``layer`` unless that read is under way."""
        if rows > 0 and self._reads.get(layer, (None,))[0] != rows:
            self._discard(layer)
            self._reads[layer] = (rows, context.read_soon(layer, (0, rows)))

    def read(self, context: BlockingContext, layer: int, rows: int) -> KV:
        """Rows ``[0, rows)`` of ``layer``: the read started ahead, or one started now.

        The layer's own writes come first (the read queued behind them on the layer's lock
        anyway; they were started a whole step ago): one that failed is raised here, rather
        than the read's complaint about a row that never landed.
        """
        for future in self._writes.pop(layer, []):
            error = _settle(future)
            if error is not None:
                self._discard(layer)
                raise error
        started = self._reads.pop(layer, None)
        if started is not None and started[0] == rows:
            self.prefetch_hits += 1
            return started[1].result()
        if started is not None:
            _settle(started[1])
        self.prefetch_misses += 1
        return context.read_soon(layer, (0, rows)).result()

    def drain(self) -> None:
        """Wait for everything in flight; reads started ahead are dropped, the first failed
        write is raised."""
        for layer in list(self._reads):
            self._discard(layer)
        first: BaseException | None = None
        for futures in self._writes.values():
            for future in futures:
                error = _settle(future)
                first = first or error
        self._writes.clear()
        self._layer_writes.clear()
        if first is not None:
            raise first

    def _discard(self, layer: int) -> None:
        started = self._reads.pop(layer, None)
        if started is not None:
            _settle(started[1])


def _settle(future: Future[Any]) -> BaseException | None:
    """Wait for ``future``; its error, if any (the caller decides whether it matters)."""
    try:
        future.result()
    except BaseException as error:
        return error
    return None
