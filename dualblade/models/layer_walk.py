"""A request's decode, step after step: each step's layers read ahead of their use, and the next
step's first layers read in the step's tail.

Within a step the reads follow the cache's read order (:class:`dualblade.pipeline.ReadAhead`):
``len(buffers)`` reused buffers, each read into again once the layer it held has been used.
Near a step's end the order has nothing left to read: the buffers its last layers free would
idle until the next step starts, and that step's first layer would only then be asked for. On
the H100 at 11 GiB (OPT-6.7B, batch 32, everything in the page cache) a step lost 30-72 ms of
its 320-358 ms there before layer 0 could compute: its read, after the logits, the token and
the next embedding (docs/bench.md). So a step's order runs on into the next step's
(:meth:`ReadAhead.then`): the buffers its last layers free read the next step's first layers,
and its next direct layers as early as its own (so the disk goes from this step's last direct
layer straight to the next one's first), each once this step's append of that layer has
landed (the next step's read must hold the new row). The next step adopts them
(:meth:`ReadAhead.adopt`). After the prefill, :meth:`LayerWalk.read_first` reads the first
step's first layers the same way, or the first step would start cold and be the slowest.

A step carries the layers the next step's order reads first, into one fewer than its buffers:
the next step starts with a buffer free for its next read. With every buffer carried, that
read (a direct layer, in the quick preset at 2 GiB) waited for layer 0's use to free one, and
the disk idled 6-11 ms at each step's start.

Carried reads finish inside the step that started them: a task group cannot stay open across an
async generator's ``yield`` (the engine's :meth:`~dualblade.models.opt.OptModel.stream`), and
a read left running there would outlive a request that is closed. The step therefore ends when
its appends and its carried reads have landed; the carried reads overlap its last layers' use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from dualblade.errors import plain_errors
from dualblade.models.kv import KVCache

#: ``use(layer, k, v)``: compute (or check) a layer with its K and V read back; returns the
#: step's new K and V row for it.
UseLayer = Callable[[int, torch.Tensor, torch.Tensor], Awaitable[tuple[torch.Tensor, torch.Tensor]]]
#: ``waiting(layer, until)``: awaits ``until`` (the layer's read landing); a hook for the trace.
Waiting = Callable[[int, Awaitable[Any]], Awaitable[Any]]

KV = tuple[torch.Tensor, torch.Tensor]


async def _plain_wait(layer: int, until: Awaitable[Any]) -> None:
    await until


class LayerWalk:
    """The decode steps of one request over ``cache``, with ``buffers`` reused by every step
    (``cache.read_buffers()`` each, or None where the cache reads without them).

    Args:
        cache: the request's KV cache.
        buffers: the read buffers; one read is in flight per buffer.
        carry: whether a step reads the next step's first layers in its tail (see the module);
            False walks each step on its own.
    """

    def __init__(self, cache: KVCache, buffers: Sequence[Any], *, carry: bool = True) -> None:
        if not buffers:
            raise ValueError("a walk over the layers needs at least one read buffer")
        self.cache = cache
        self.buffers = list(buffers)
        self.carry = carry
        self._carried: dict[int, tuple[int, KV]] = {}  # layer -> (buffer, its K and V)
        self._carrying = 0  # carried reads in flight

    @property
    def _carry_count(self) -> int:
        """How many of the next step's first reads a step (or the prefill) makes: one fewer
        than the buffers (see the module), none without the carry."""
        return len(self.buffers) - 1 if self.carry else 0

    @property
    def carried_layers(self) -> list[int]:
        """The layers read for the next step already (their buffers are held until it)."""
        return sorted(self._carried)

    async def _read(self, layer: int, buffer: int) -> KV:
        out = self.buffers[buffer]
        return await (self.cache.read(layer) if out is None else self.cache.read(layer, out=out))

    def _carry(self, tg: TaskGroup, layer: int, buffer: int, landed: anyio.Event) -> None:
        """Start, in ``tg``, the next step's read of ``layer`` into ``buffer``, once
        ``landed`` is set (this step's append of it, or the prefill's write)."""
        self._carrying += 1

        async def read() -> None:
            await landed.wait()
            self._carried[layer] = (buffer, await self._read(layer, buffer))
            self._carrying -= 1

        tg.start_soon(read)

    def read_first(self, tg: TaskGroup, landed: Sequence[anyio.Event]) -> None:
        """Start, in ``tg``, the first step's first reads (its read order's start, into every
        buffer but one), each once ``landed[layer]`` is set (its prompt rows written).
        Call it while the prefill's task group still runs, after its last layer's compute: the
        reads then overlap the last writes and the logits. A walk that does not carry reads
        nothing here.
        """
        if self._carried or self._carrying:
            raise ValueError("the next step's first layers are read already")
        starts = self.cache.read_order(len(self.buffers)).start()
        for layer, buffer in starts[: self._carry_count]:
            self._carry(tg, layer, buffer, landed[layer])

    async def step(self, use: UseLayer, *, more: bool, waiting: Waiting = _plain_wait) -> None:
        """One decode step: hand every layer to ``use`` in layer order, each read ahead of it,
        and append the rows ``use`` returns behind it. ``more``: another step follows, so the
        step's read order runs on into the next step's (:meth:`ReadAhead.then`) and its tail
        reads the next step's first layers (see the module). Returns once every append (and
        every carried read) has landed.

        The wait for each layer's read yields to the event loop even where the read has landed
        (an anyio event's ``wait``): the fetch and the append started for the layer before it
        begin there, and a ``use`` that does not yield (an engine that only queues kernels,
        the sweep's checks) relies on that turn."""
        if self._carrying:
            raise ValueError("a step began while the last one's carried reads were unfinished")
        order = self.cache.read_order(len(self.buffers))
        layers = order.num_layers
        if more and self._carry_count:
            # The next step reads in this step's order: the same context, the same media.
            order = order.then(order, carry=self._carry_count)
        results: dict[int, KV] = {}
        ready = [anyio.Event() for _ in range(layers)]
        appended = [anyio.Event() for _ in range(layers)]
        for layer, (buffer, kv) in self._carried.items():
            order.adopt(layer, buffer)
            results[layer] = kv
            ready[layer].set()
        self._carried = {}

        async def fetch(layer: int, buffer: int) -> None:
            results[layer] = await self._read(layer, buffer)
            ready[layer].set()

        def start(tg: TaskGroup, layer: int, buffer: int) -> None:
            if layer < layers:
                tg.start_soon(fetch, layer, buffer)
            else:  # the next step's: its read must hold the row this step appends
                self._carry(tg, layer - layers, buffer, appended[layer - layers])

        async def append(layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> None:
            await self.cache.append(layer, k_row, v_row)
            appended[layer].set()

        try:
            with plain_errors():
                async with anyio.create_task_group() as tg:
                    for layer, buffer in order.start():
                        start(tg, layer, buffer)
                    for layer in range(layers):
                        await waiting(layer, ready[layer].wait())
                        k, v = results.pop(layer)
                        k_row, v_row = await use(layer, k, v)
                        del k, v
                        if (following := order.used(layer)) is not None:
                            start(tg, *following)  # into the buffer ``layer`` left
                        tg.start_soon(append, layer, k_row, v_row)
        except BaseException:
            self._carried.clear()  # a failed step leaves nothing for the next one
            self._carrying = 0
            raise
