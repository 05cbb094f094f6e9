"""anyio's locks and semaphores taken without a trip through the event loop when free.

Why: anyio's ``acquire`` always checkpoints — it yields to the event loop once even when the
lock is free — so that a task looping on a free lock cannot starve the others. A context's
read or write takes its layer's lock and then awaits its I/O, which is a checkpoint of its
own; the extra trip cost a task switch each time, a third of a straight load's Python in the
LMCache adapter's profile. A lock that is taken waits as before (FIFO, cancellable).

Used for the layer locks only. The copy threads' slot and the overlap gate's limiter were
tried too: `dualblade pipebench --target /dev/shm/...` spent the same CPU per GB (pipeline
0.211-0.243 s/GB after, 0.203-0.240 before), so they were left as they were. (The gate's slots
are now :class:`~dualblade.io_engine.StorageSlots`, which take a free slot without a
checkpoint themselves.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

import anyio


class _Acquirable(Protocol):
    def acquire_nowait(self) -> None: ...
    async def acquire(self) -> None: ...
    def release(self) -> None: ...


async def acquire(lock: _Acquirable) -> None:
    """``await lock.acquire()``, without its checkpoint when the lock is free."""
    try:
        lock.acquire_nowait()
    except anyio.WouldBlock:
        await lock.acquire()


@contextlib.asynccontextmanager
async def holding(lock: _Acquirable) -> AsyncIterator[None]:
    """``async with lock``, without the checkpoint of taking it when it is free."""
    await acquire(lock)
    try:
        yield
    finally:
        lock.release()
