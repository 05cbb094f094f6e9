"""Slots for storage transfers on one path, handed on by whichever thread frees one.

The overlap gate lets a fixed number of KPU transfers reach storage at a time (the strategy
decides how many). Held as an anyio ``CapacityLimiter``, a slot went from a read that had
finished to the next read only through the event loop: the ring thread woke the loop, the
finished read's task ran and released the slot, the waiting task ran and submitted its read, and
the ring thread was woken again. On the H200 machine, with a tmpfs target, one of the two slots
sat idle like that for a third of the time (one KPU in flight instead of two, sampled), whatever
else ran on the loop.

Here a transfer can instead wait for its slot *inside the engine*: :meth:`StorageSlots.claim`
queues a start function, and the thread that frees a slot (the ring thread, when the previous
read's last chunk completes) calls it at once, so the next read is submitted in the same pass of
the ring thread. Tasks on the loop can still wait for a slot (:meth:`acquire`, ``async with``);
both kinds of waiters share one first-come-first-served queue, and a slot is counted as taken
from its grant until its holder releases it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from dualblade.io_engine._waker import LoopCaller, loop_caller


@dataclass(eq=False)
class _LoopWaiter:
    """A task on an event loop, woken through ``call`` from other threads."""

    event: anyio.Event
    call: LoopCaller
    thread: int
    granted: bool = False  # set under the slots' lock

    def notify(self) -> None:
        if threading.get_ident() == self.thread:
            self.event.set()
        else:
            self.call(self.event.set)


@dataclass(eq=False)
class _StartWaiter:
    """A transfer the engine starts as soon as it has a slot (on the thread that freed it)."""

    start: Callable[[], None]
    granted: bool = field(default=False)  # set under the slots' lock

    def notify(self) -> None:
        self.start()


class StorageSlots:
    """``total_tokens`` transfers at a time; thread-safe.

    Args:
        total_tokens: slots (at least 1).
    """

    def __init__(self, total_tokens: int) -> None:
        self._lock = threading.Lock()
        self._total = self._checked(total_tokens)
        self._taken = 0
        self._waiters: deque[_LoopWaiter | _StartWaiter] = deque()

    @staticmethod
    def _checked(total: int) -> int:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"storage slots must be an int of at least 1, got {total!r}")
        return total

    @property
    def total_tokens(self) -> int:
        return self._total

    @total_tokens.setter
    def total_tokens(self, total: int) -> None:
        """More slots grant waiting transfers at once; fewer let the ones running finish."""
        with self._lock:
            self._total = self._checked(total)
            granted = self._grant_locked()
        _run(granted)

    @property
    def borrowed_tokens(self) -> int:
        """Slots taken now."""
        return self._taken

    @property
    def waiting(self) -> int:
        """Transfers queued for a slot."""
        return len(self._waiters)

    def _grant_locked(self) -> list[_LoopWaiter | _StartWaiter]:
        """Take slots for the waiters at the head while slots are free (lock held)."""
        granted = []
        while self._waiters and self._taken < self._total:
            self._taken += 1
            waiter = self._waiters.popleft()
            waiter.granted = True
            granted.append(waiter)
        return granted

    def release(self) -> None:
        """Give a slot back (from any thread); the next waiter gets it at once."""
        with self._lock:
            assert self._taken > 0, "release() of a slot nobody holds"
            self._taken -= 1
            granted = self._grant_locked()
        _run(granted)

    def claim(self, start: Callable[[], None]) -> Claim:
        """A place for a transfer in the queue for a slot, not taken yet: :meth:`Claim.enter`
        takes it. Made first, so that the transfer's own end can ask :attr:`Claim.granted`
        even when it comes (on another thread) before ``enter`` has returned."""
        return Claim(self, _StartWaiter(start))

    def _enter(self, waiter: _StartWaiter) -> None:
        with self._lock:
            self._waiters.append(waiter)
            granted = self._grant_locked()
        _run(granted)

    def _withdraw(self, waiter: _StartWaiter) -> bool:
        with self._lock:
            if waiter.granted:
                return False
            self._waiters.remove(waiter)
            return True

    async def acquire(self) -> None:
        """Wait (on the event loop) for a slot; :meth:`release` it when done."""
        with self._lock:
            if not self._waiters and self._taken < self._total:
                self._taken += 1
                return
            waiter = _LoopWaiter(anyio.Event(), loop_caller(), threading.get_ident())
            self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            with self._lock:
                if not waiter.granted:
                    self._waiters.remove(waiter)
                    raise
            self.release()  # granted as it was cancelled: pass the slot on
            raise

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Claim:
    """A transfer's place in the queue for a slot (see :meth:`StorageSlots.claim`)."""

    def __init__(self, slots: StorageSlots, waiter: _StartWaiter) -> None:
        self._slots = slots
        self._waiter = waiter
        #: what the claim is for, set by its maker before :meth:`enter` (the engine's request)
        self.request: Any = None

    def enter(self) -> None:
        """Queue: ``start`` (which must not raise) is called now if a slot is free, else on the
        thread that frees one. Once :attr:`granted`, the slot is the transfer's, and whoever
        ends the transfer must :meth:`StorageSlots.release` it once."""
        self._slots._enter(self._waiter)

    @property
    def granted(self) -> bool:
        """The slot is the transfer's (its start has been, or is being, called)."""
        return self._waiter.granted

    def withdraw(self) -> bool:
        """Leave the queue before the turn came: True when it did (the transfer will never
        start and holds nothing), False when it was already granted."""
        return self._slots._withdraw(self._waiter)


def _run(granted: list[_LoopWaiter | _StartWaiter]) -> None:
    """Tell the waiters that got a slot, outside the lock (a start may submit and take it)."""
    for waiter in granted:
        waiter.notify()
