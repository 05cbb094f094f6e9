"""Hands copy threads out to a store's KV transfers."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import anyio

from dualblade.actors import CopyThreadActor, Load, Reply, Store, TransferStats


@dataclass(eq=False)
class _Waiter:
    """A transfer (or K and V together) waiting for room on the copy threads."""

    count: int
    urgent: bool
    granted: anyio.Event = field(default_factory=anyio.Event)
    leases: list[int] | None = None


class CopyThreadPool:
    """Hands copy threads to transfers: the least busy one, at most ``per_thread`` each.

    A copy thread overlaps the tail of one transfer with the head of the next (see
    :mod:`dualblade.actors.copy_thread`): with CUDA one per image of its buffer (one or two), more
    on the host, where most transfers never touch its buffer (the thread's ``max_transfers``,
    which the store passes as ``per_thread``). A transfer waits while every thread holds
    ``per_thread``.

    Urgent transfers (a decode step's reads and appends: a token waits on them) go first:
    while one waits, no other transfer (a prefill's writes, a layer move) gets a thread. But not
    for ever: once urgent transfers have gone past a waiting other one as many times as there are
    threads, the other goes next. So a prefill holds a decode step up by at most one transfer
    per thread, and a stream of decode steps cannot starve a new request's prefill.

    An appended row takes no lease where the threads have room for rows (CUDA): it runs
    beside their transfers (:mod:`dualblade.actors.row_staging`), each thread in turn.

    Waiters queue in arrival order, one queue per kind, and a release wakes only the waiters it
    makes room for. (Waking every waiter on every release, as this pool once did, cost a
    thousand wake-ups per release with hundreds of transfers waiting: LMCache's loads of 512
    objects at once spent half of the event loop's time there.)
    """

    def __init__(self, threads: list[CopyThreadActor], per_thread: int = 2) -> None:
        if per_thread < 1:
            raise ValueError(f"a copy thread takes at least one transfer, not {per_thread}")
        self.threads = threads
        self.per_thread = per_thread
        self._busy = [0] * len(threads)
        self._urgent: deque[_Waiter] = deque()
        self._others: deque[_Waiter] = deque()
        self._bypassed = 0  # urgent leases given while another transfer waited
        self._next_aside = 0  # the thread the next row run aside goes to
        #: leases given to urgent and to other transfers (for tests and stats)
        self.urgent_leases = 0
        self.other_leases = 0

    async def acquire(self, count: int = 1, *, urgent: bool = False) -> list[int]:
        """Room for ``count`` transfers at once, each on the least busy thread then.

        All or nothing: a caller that holds some and waits for more could wait forever on
        callers that do the same (K's transfer leased, V's waiting, on every thread).
        ``urgent``: served before waiting transfers that are not, up to the bound above.
        """
        assert 0 < count <= self.per_thread * len(self.threads)
        waiter = _Waiter(count, urgent)
        (self._urgent if urgent else self._others).append(waiter)
        self._grant()
        if not waiter.granted.is_set():
            try:
                await waiter.granted.wait()
            except BaseException:
                if waiter.granted.is_set():  # granted as it was cancelled: give it back
                    for index in waiter.leases or []:
                        self._busy[index] -= 1
                else:
                    (self._urgent if urgent else self._others).remove(waiter)
                self._grant()  # it may have held the ones behind it
                raise
        assert waiter.leases is not None
        return waiter.leases

    def _next(self) -> deque[_Waiter] | None:
        """The queue whose first waiter goes next."""
        others_due = bool(self._others) and self._bypassed >= len(self.threads)
        if self._others and (others_due or not self._urgent):
            return self._others
        return self._urgent or None

    def _grant(self) -> None:
        """Give room to waiters in turn while the next one fits (it keeps its place when it
        does not: a transfer of K and V is not passed for ever by single ones)."""
        while (queue := self._next()) is not None:
            waiter = queue[0]
            if self.per_thread * len(self.threads) - sum(self._busy) < waiter.count:
                return
            queue.popleft()
            if waiter.urgent:
                self.urgent_leases += 1
                if self._others:
                    self._bypassed += 1
            else:
                self.other_leases += 1
                self._bypassed = 0
            chosen = []
            for _ in range(waiter.count):
                index = min(range(len(self.threads)), key=self._busy.__getitem__)
                self._busy[index] += 1
                chosen.append(index)
            waiter.leases = chosen
            waiter.granted.set()

    def release(self, index: int) -> None:
        """The transfer on thread ``index`` has settled."""
        self._busy[index] -= 1
        self._grant()

    async def transfer_all(
        self, messages: list[Load | Store], *, urgent: bool = False
    ) -> list[TransferStats]:
        """Send ``messages`` to copy threads together and await them all.

        Once a copy thread has accepted a transfer it runs to its end, also when the caller is
        cancelled; so a cancelled or failed caller waits (shielded) for every accepted transfer
        to settle before it leaves (see ``KVContext._both``). The first error is raised.
        ``urgent`` ones (a decode step's) get threads before the others.
        """
        aside = all(self._aside(message) for message in messages)
        leases = (
            self._turns(len(messages))
            if aside
            else await self.acquire(len(messages), urgent=urgent)
        )
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
            for index in [] if aside else leases:
                self.release(index)

    def _aside(self, message: Load | Store) -> bool:
        """Whether ``message`` runs in a copy thread's room for rows, beside its transfers."""
        return self.threads[0].takes_aside(message)

    def _turns(self, count: int) -> list[int]:
        """Threads for ``count`` rows run aside: each thread in turn, no lease taken."""
        first = self._next_aside
        self._next_aside = (first + count) % len(self.threads)
        return [(first + i) % len(self.threads) for i in range(count)]
