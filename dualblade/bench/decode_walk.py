"""A decode step of the bench workloads: every layer used in layer order, read ahead of its use.

The sweep, serving and pressure workers all walk a context's layers the way the OPT engine
(:meth:`dualblade.models.opt.OptModel._decode`) does, without its compute:

- every layer is read into one of ``buffers``, with one read in flight per buffer, in the
  context's read order (:meth:`KVContext.read_order`: its direct layers as early as a buffer
  allows), and handed to ``use`` in layer order (check the bytes); a buffer is read into again
  only once ``use`` is done with the layer it held;
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
    """Hand every layer of ``ctx`` to ``use`` in layer order, each read ahead of it in the
    context's read order, and append the rows ``use`` returns behind it (see the module)."""
    layers = ctx.num_layers
    order = ctx.read_order(max(1, len(buffers)))
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    ready = [anyio.Event() for _ in range(layers)]

    async def fetch(layer: int, buffer: int) -> None:
        results[layer] = await ctx.read(layer, out=buffers[buffer])
        ready[layer].set()

    with plain_errors():
        async with anyio.create_task_group() as tg:
            for layer, buffer in order.start():
                tg.start_soon(fetch, layer, buffer)
            for layer in range(layers):
                await ready[layer].wait()
                k, v = results.pop(layer)
                k_row, v_row = await use(layer, k, v)
                del k, v
                if (following := order.used(layer)) is not None:
                    tg.start_soon(fetch, *following)  # into the buffer ``layer`` left
                tg.start_soon(ctx.append, layer, k_row, v_row)
