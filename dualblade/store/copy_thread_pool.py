"""Hands copy threads out to a store's KV transfers."""

from __future__ import annotations

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

    async def acquire(self, count: int = 1) -> list[int]:
        """Room for ``count`` transfers at once, each on the least busy thread then.

        All or nothing: a caller that holds some and waits for more could wait forever on
        callers that do the same (K's transfer leased, V's waiting, on every thread).
        """
        assert 0 < count <= self.PER_THREAD * len(self.threads)
        while self.PER_THREAD * len(self.threads) - sum(self._busy) < count:
            await self._changed.wait()
        chosen = []
        for _ in range(count):
            index = min(range(len(self.threads)), key=self._busy.__getitem__)
            self._busy[index] += 1
            chosen.append(index)
        return chosen

    def release(self, index: int) -> None:
        """The transfer on thread ``index`` has settled."""
        self._busy[index] -= 1
        self._changed.set()
        self._changed = anyio.Event()
