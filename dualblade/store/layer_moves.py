"""Moving one layer of a live context to another medium: the step of live re-planning.

A demotion (page cache -> direct) copies the layer's rows to a direct run, switches the
layer's medium, and only then unlinks its page-cache files, so their pages leave the cache
before the kernel would have to evict them. A promotion (direct -> page cache) is the mirror
image. ``cache-policy``'s two media share the same files: its demotion switches the layer to
"dropped after use" and drops its pages now; its promotion only switches back.

Whatever fails, the layer stays readable: the old storage is given back only after the new one
holds every row, and a failed copy switches back and gives back the new storage instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from dualblade.pipeline import Medium
from dualblade.store.context_storage import ContextHoldings


@dataclass(frozen=True)
class LayerMover:
    """What a move needs from its context, handed over under the layer's lock."""

    layer: int
    #: rows to carry over (0: the layer was never written, or its last write was lost)
    rows: int
    storage: ContextHoldings
    #: read the rows from the old medium, switch the layer to the new one, write them there
    copy: Callable[[Medium, Medium], Awaitable[None]]
    #: set the layer's medium (no bytes move)
    switch: Callable[[Medium], None]


async def layer_move(mover: LayerMover, old: Medium, new: Medium) -> None:
    """Move ``mover.layer`` from ``old`` to ``new`` (see the module docstring).

    Raises:
        IOFailedError, TargetError: the copy failed; the layer is back on ``old``.
    """
    if old.uses_page_cache and new.uses_page_cache:
        mover.switch(new)
        if new is Medium.PAGE_CACHE_DROPPED:
            for file in mover.storage.layer_files(mover.layer):
                await anyio.to_thread.run_sync(file.evict)
        return
    try:
        if mover.rows:
            await mover.copy(old, new)
        else:
            mover.switch(new)
    except BaseException:
        mover.switch(old)
        with anyio.CancelScope(shield=True):
            await _give_back(mover.storage, new, mover.layer)
        raise
    with anyio.CancelScope(shield=True):
        await _give_back(mover.storage, old, mover.layer)


async def _give_back(storage: ContextHoldings, medium: Medium, layer: int) -> None:
    if medium is Medium.DIRECT:
        await storage.drop_direct(layer)
    else:
        await storage.drop_files(layer)
