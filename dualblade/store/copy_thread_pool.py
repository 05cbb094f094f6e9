"""Hands copy threads out to a store's KV transfers."""

from __future__ import annotations

import anyio

from dualblade.actors import CopyThreadActor, Load, Reply, Store, TransferStats


class CopyThreadPool:
    """Hands copy threads to transfers: the least busy one, at most two transfers each.

    A copy thread overlaps the tail of one transfer with the head of the next inside its one
    buffer (see :mod:`dualblade.actors.copy_thread`), so each may hold two; a transfer waits
    while every thread holds two.

    Urgent transfers (a decode step's reads and appends: a token waits on them) go first:
    while one waits, no other transfer (a prefill's writes, a layer move) gets a thread. But not
    for ever: once urgent transfers have gone past a waiting other one as many times as there are
    threads, the other goes next. So a prefill holds a decode step up by at most one transfer
    per thread, and a stream of decode steps cannot starve a new request's prefill.
    """

    PER_THREAD = 2

    def __init__(self, threads: list[CopyThreadActor]) -> None:
        self.threads = threads
        self._busy = [0] * len(threads)
        self._changed = anyio.Event()
        self._urgent_waiting = 0
        self._other_waiting = 0
        self._bypassed = 0  # urgent leases given while another transfer waited
        #: leases given to urgent and to other transfers (for tests and stats)
        self.urgent_leases = 0
        self.other_leases = 0

    async def acquire(self, count: int = 1, *, urgent: bool = False) -> list[int]:
        """Room for ``count`` transfers at once, each on the least busy thread then.

        All or nothing: a caller that holds some and waits for more could wait forever on
        callers that do the same (K's transfer leased, V's waiting, on every thread).
        ``urgent``: served before waiting transfers that are not, up to the bound above.
        """
        assert 0 < count <= self.PER_THREAD * len(self.threads)
        if urgent:
            self._urgent_waiting += 1
        else:
            self._other_waiting += 1
        try:
            while not self._may_go(count, urgent):
                await self._changed.wait()
        finally:
            if urgent:
                self._urgent_waiting -= 1
            else:
                self._other_waiting -= 1
            if self._urgent_waiting or self._other_waiting:
                self._notify()  # whoever was held back for this one may go now
        if urgent:
            self.urgent_leases += 1
            if self._other_waiting:
                self._bypassed += 1
        else:
            self.other_leases += 1
            self._bypassed = 0
        chosen = []
        for _ in range(count):
            index = min(range(len(self.threads)), key=self._busy.__getitem__)
            self._busy[index] += 1
            chosen.append(index)
        return chosen

    def _may_go(self, count: int, urgent: bool) -> bool:
        if self.PER_THREAD * len(self.threads) - sum(self._busy) < count:
            return False
        others_due = self._other_waiting > 0 and self._bypassed >= len(self.threads)
        if urgent:
            return not others_due
        return not self._urgent_waiting or others_due

    def release(self, index: int) -> None:
        """The transfer on thread ``index`` has settled."""
        self._busy[index] -= 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def transfer_all(
        self, messages: list[Load | Store], *, urgent: bool = False
    ) -> list[TransferStats]:
        """Send ``messages`` to copy threads together and await them all.

        Once a copy thread has accepted a transfer it runs to its end, also when the caller is
        cancelled; so a cancelled or failed caller waits (shielded) for every accepted transfer
        to settle before it leaves (see ``KVContext._both``). The first error is raised.
        ``urgent`` ones (a decode step's) get threads before the others.
        """
        leases = await self.acquire(len(messages), urgent=urgent)
        accepted: list[Reply[TransferStats]] = []
        try:
            for message, index in zip(messages, leases, strict=True):
                await self.threads[index].send(message)
                accepted.append(message.reply)
            return [await reply.wait() for reply in accepted]
        except BaseException:
            with anyio.CancelScope(shield=True):
                for reply in accepted:
                    await reply.settled()
            raise
        finally:
            for index in leases:
                self.release(index)
