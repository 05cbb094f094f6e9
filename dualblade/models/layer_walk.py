"""A request's decode, step after step: each step's layers read ahead of their use, and the next
step's first layers read in the step's tail.

Within a step the reads follow the cache's read order (:class:`dualblade.pipeline.ReadAhead`):
``len(buffers)`` reused buffers, each read into again once the layer it held has been used.
Near a step's end the order has nothing left to read: the buffers its last layers free would
idle until the next step starts, and that step's first layer would only then be asked for. On
the H100 at 11 GiB (OPT-6.7B, batch 32, everything in the page cache) a step lost 30-72 ms of
its 320-358 ms there before layer 0 could compute: its read, after the logits, the token and
the next embedding (docs/bench.md). So a step reads the layers the next step's order reads first
(layer 0, then its direct layers as early as buffers allow) into those buffers as they free,
each once this step's append of that layer has landed (the next step's read must hold the new
row), and the next step adopts them (:meth:`ReadAhead.adopt`).

It carries one layer fewer than it has buffers: the next step then starts with a buffer free
for its first read beyond them, and the disk is not idle while layer 0 computes. After the
prefill, :meth:`LayerWalk.read_first` reads the first step's layers the same way, or the first
step would start cold and be the slowest.

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
        carry: how many of the next step's first layers a step reads in its tail; default one
            fewer than the buffers (see the module), at most the buffers. 0 walks each step on
            its own.
    """

    def __init__(self, cache: KVCache, buffers: Sequence[Any], *, carry: int | None = None) -> None:
        if not buffers:
            raise ValueError("a walk over the layers needs at least one read buffer")
        if carry is not None and carry < 0:
            raise ValueError(f"a walk carries 0 or more layers into the next step, not {carry}")
        self.cache = cache
        self.buffers = list(buffers)
        wanted = len(self.buffers) - 1 if carry is None else carry
        self.carry = min(wanted, len(self.buffers))  # a carried layer holds a buffer
        self._carried: dict[int, tuple[int, KV]] = {}  # layer -> (buffer, its K and V)
        self._carrying: list[int] = []  # buffers whose carried read is in flight
        self._plan: list[int] | None = None  # the layers to carry, once a step's tail begins

    @property
    def carried_layers(self) -> list[int]:
        """The layers read for the next step already (their buffers are held until it)."""
        return sorted(self._carried)

    async def _read(self, layer: int, buffer: int) -> KV:
        out = self.buffers[buffer]
        return await (self.cache.read(layer) if out is None else self.cache.read(layer, out=out))

    def _carry_into(self, tg: TaskGroup, buffer: int, landed: Sequence[anyio.Event]) -> bool:
        """Read the next layer to carry into the free ``buffer``, once ``landed[layer]`` is
        set; False when nothing more is carried.

        The layers carried are the first the next step's own read order would read: layer 0,
        then its direct layers as early as its buffers allow (the disk's next layers, where a
        step is the disk's to wait for), then layers in order."""
        if self._plan is None:
            starts = self.cache.read_order(len(self.buffers)).start()
            self._plan = [layer for layer, _ in starts][: self.carry]
        index = len(self._carried) + len(self._carrying)
        if index >= len(self._plan):
            return False
        layer = self._plan[index]
        self._carrying.append(buffer)

        async def read() -> None:
            await landed[layer].wait()
            self._carried[layer] = (buffer, await self._read(layer, buffer))
            self._carrying.remove(buffer)

        tg.start_soon(read)
        return True

    def read_first(self, tg: TaskGroup, landed: Sequence[anyio.Event]) -> None:
        """Start, in ``tg``, the first step's carried reads: the ``carry`` layers it reads
        first, each once ``landed[layer]`` is set (its prompt rows written), into the buffers
        in turn.
        Call it while the prefill's task group still runs, after its last layer's compute: the
        reads then overlap the last writes and the logits."""
        if self._carried or self._carrying:
            raise ValueError("the next step's first layers are read already")
        for buffer in range(len(self.buffers)):
            if not self._carry_into(tg, buffer, landed):
                break

    async def step(self, use: UseLayer, *, more: bool, waiting: Waiting = _plain_wait) -> None:
        """One decode step: hand every layer to ``use`` in layer order, each read ahead of it,
        and append the rows ``use`` returns behind it. ``more``: another step follows, so the
        tail reads its first layers (see the module). Returns once every append (and every
        carried read) has landed.

        The wait for each layer's read yields to the event loop even where the read has landed
        (an anyio event's ``wait``): the fetch and the append started for the layer before it
        begin there, and a ``use`` that does not yield (an engine that only queues kernels,
        the sweep's checks) relies on that turn."""
        if self._carrying:
            raise ValueError("a step began while the last one's carried reads were unfinished")
        order = self.cache.read_order(len(self.buffers))
        layers = order.num_layers
        results: dict[int, KV] = {}
        ready = [anyio.Event() for _ in range(layers)]
        appended = [anyio.Event() for _ in range(layers)]
        for layer, (buffer, kv) in self._carried.items():
            order.adopt(layer, buffer)
            results[layer] = kv
            ready[layer].set()
        self._carried = {}
        self._plan = None

        async def fetch(layer: int, buffer: int) -> None:
            results[layer] = await self._read(layer, buffer)
            ready[layer].set()

        async def append(layer: int, k_row: torch.Tensor, v_row: torch.Tensor) -> None:
            await self.cache.append(layer, k_row, v_row)
            appended[layer].set()

        carrying = more
        try:
            with plain_errors():
                async with anyio.create_task_group() as tg:
                    for layer, buffer in order.start():
                        tg.start_soon(fetch, layer, buffer)
                    for layer in range(layers):
                        await waiting(layer, ready[layer].wait())
                        k, v = results.pop(layer)
                        k_row, v_row = await use(layer, k, v)
                        del k, v
                        buffer = order.buffer_of(layer)
                        if (following := order.used(layer)) is not None:
                            tg.start_soon(fetch, *following)  # into the buffer ``layer`` left
                        elif carrying:
                            carrying = self._carry_into(tg, buffer, appended)
                        tg.start_soon(append, layer, k_row, v_row)
        except BaseException:
            self._carried.clear()  # a failed step leaves nothing for the next one
            self._carrying.clear()
            self._plan = None
            raise
