"""Hands copy threads out to a store's KV transfers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from dualblade.actors import CopyThreadActor


class CopyThreadPool:
    """Hands copy threads to transfers: the least busy one, at most two transfers each.

    A copy thread overlaps the tail of one transfer with the head of the next inside its one
    buffer (see :mod:`dualblade.actors.copy_thread`), so each may hold two; a transfer waits
    while every thread holds two.
    """

    PER_THREAD = 2

    def __init__(self, threads: list[CopyThreadActor]) -> None:
        self.threads = threads
        self._busy = [0] * len(threads)
        self._changed = anyio.Event()

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[CopyThreadActor]:
        while True:
            index = min(range(len(self.threads)), key=self._busy.__getitem__)
            if self._busy[index] < self.PER_THREAD:
                break
            await self._changed.wait()
        self._busy[index] += 1
        try:
            yield self.threads[index]
        finally:
            self._busy[index] -= 1
            self._changed.set()
            self._changed = anyio.Event()
