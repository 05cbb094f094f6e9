"""Free locks taken without a trip through the event loop; taken ones waited for as anyio does."""

from __future__ import annotations

import anyio
import pytest

from dualblade.actors import fast_sync

pytestmark = pytest.mark.anyio


async def _others_ran_while(take) -> bool:
    """Whether another task got to run while ``take()`` was awaited."""
    ran = anyio.Event()

    async def mark() -> None:
        ran.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(mark)  # runs at this task's first checkpoint
        await take()
        result = ran.is_set()
    return result


async def test_a_free_lock_is_taken_without_a_checkpoint(anyio_backend_name: str):
    lock = anyio.Lock()
    assert not await _others_ran_while(lambda: fast_sync.acquire(lock))
    lock.release()
    if anyio_backend_name == "asyncio":
        # anyio's own acquire yields even when the lock is free: that trip is what is saved
        # (asyncio runs ready tasks in order; trio's scheduler may resume this one first)
        assert await _others_ran_while(lock.acquire)
        lock.release()


async def test_a_held_lock_is_waited_for_in_order():
    lock = anyio.Lock()
    order: list[int] = []

    async def take(n: int) -> None:
        async with fast_sync.holding(lock):
            order.append(n)
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        await fast_sync.acquire(lock)
        for n in range(3):
            tg.start_soon(take, n)
            await anyio.sleep(0.001)  # queue them in this order
        assert order == []  # all wait while it is held
        lock.release()
    assert order == [0, 1, 2]
    assert not lock.locked()


async def test_a_wait_for_a_held_lock_can_be_cancelled():
    lock = anyio.Lock()
    await fast_sync.acquire(lock)

    async def wait_briefly() -> None:
        with anyio.move_on_after(0.01) as scope:
            await fast_sync.acquire(lock)
        assert scope.cancelled_caught

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_briefly)
    lock.release()
    assert not lock.locked()  # the cancelled waiter took nothing
