"""A decode step of the bench workloads: every layer read in layer order, ahead of its use.

The sweep, serving and pressure workers all walk a context's layers the way the OPT engine
(:meth:`dualblade.models.opt.OptModel._decode`) does, without its compute:

- layer ``l`` reads into ``buffers[l % len(buffers)]``, with one read in flight per buffer, and
  is handed to ``use`` (check the bytes); layer ``l + len(buffers)`` starts only once ``use`` is
  done with layer ``l``, which frees its buffer;
- ``use`` returns the step's new K and V row of the layer, and the walk appends it behind the
  walk, as the engine does: the next layers' reads and checks go on while it lands, and the step
  ends when every append has (a later read of the layer waits for its append under the layer's
  lock, so nothing reads a row before it is written).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio
import torch

from dualblade.errors import plain_errors
from dualblade.store import KVContext, ReadBuffers

#: ``use(layer, k, v)``: check the layer's K and V; returns the step's new K and V row for it.
UseLayer = Callable[[int, torch.Tensor, torch.Tensor], Awaitable[tuple[torch.Tensor, torch.Tensor]]]


async def walk_layers(ctx: KVContext, buffers: Sequence[ReadBuffers], use: UseLayer) -> None:
    """Read every layer of ``ctx`` ahead of ``use`` in layer order, and append the rows ``use``
    returns behind it (see the module)."""
    prefetch = max(1, len(buffers))
    layers = ctx.num_layers
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    ready = [anyio.Event() for _ in range(layers)]
    slots = anyio.Semaphore(prefetch)

    async def fetch(layer: int) -> None:
        results[layer] = await ctx.read(layer, out=buffers[layer % prefetch])
        ready[layer].set()

    with plain_errors():
        async with anyio.create_task_group() as tg:

            async def reader() -> None:
                for layer in range(layers):
                    await slots.acquire()
                    tg.start_soon(fetch, layer)

            tg.start_soon(reader)
            for layer in range(layers):
                await ready[layer].wait()
                k, v = results.pop(layer)
                k_row, v_row = await use(layer, k, v)
                del k, v
                slots.release()
                tg.start_soon(ctx.append, layer, k_row, v_row)
