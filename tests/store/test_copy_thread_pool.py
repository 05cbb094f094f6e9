"""The copy-thread pool serves a decode step's transfers before a prefill's."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from dualblade.store.copy_thread_pool import CopyThreadPool

pytestmark = pytest.mark.anyio


async def test_an_urgent_transfer_goes_before_waiting_others() -> None:
    pool = CopyThreadPool([object(), object()])  # type: ignore[list-item]
    held = [index for _ in range(4) for index in await pool.acquire(1)]  # every slot taken
    order: list[str] = []

    async def lease(name: str, urgent: bool) -> Any:
        got = await pool.acquire(2, urgent=urgent)
        order.append(name)
        for index in got:
            pool.release(index)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lease, "prefill", False)
        await anyio.sleep(0.01)  # the prefill's write waits first
        tg.start_soon(lease, "decode", True)
        await anyio.sleep(0.01)
        for index in held:
            pool.release(index)
    assert order == ["decode", "prefill"]
    assert (pool.urgent_leases, pool.other_leases) == (1, 5)


async def test_others_proceed_when_no_urgent_transfer_waits() -> None:
    pool = CopyThreadPool([object()])  # type: ignore[list-item]
    with anyio.fail_after(1):
        first = await pool.acquire(2)
    for index in first:
        pool.release(index)
    with anyio.fail_after(1):
        assert len(await pool.acquire(2)) == 2


async def test_decode_steps_cannot_starve_a_waiting_prefill() -> None:
    """After one urgent lease per thread has gone past it, the waiting prefill goes next."""
    pool = CopyThreadPool([object()])  # type: ignore[list-item]
    held = [index for _ in range(2) for index in await pool.acquire(1)]
    order: list[str] = []

    async def lease(name: str, urgent: bool) -> None:
        (index,) = await pool.acquire(1, urgent=urgent)
        order.append(name)
        await anyio.sleep(0.01)
        pool.release(index)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lease, "prefill", False)
        await anyio.sleep(0.01)
        for n in range(3):
            tg.start_soon(lease, f"decode-{n}", True)
        await anyio.sleep(0.01)
        pool.release(held.pop())  # one slot frees: a decode goes past the prefill
        await anyio.sleep(0.005)
        pool.release(held.pop())  # the next slot: the prefill's turn
    assert order[0].startswith("decode")  # which decode the scheduler wakes first is its own
    assert order[1] == "prefill"
    assert sorted(order) == ["decode-0", "decode-1", "decode-2", "prefill"]
