"""The copy-thread pool serves a decode step's transfers before a prefill's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from dualblade.actors import Reply, Store, TransferStats, stages_rows
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
        pool.release(held.pop())
        pool.release(held.pop())  # room for one of them: the decode's
        assert (pool.urgent_leases, pool.other_leases) == (1, 4)
        pool.release(held.pop())
        pool.release(held.pop())
    assert sorted(order) == ["decode", "prefill"]
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
    done = anyio.Event()  # leases are held until the end: only the test's releases grant

    async def lease(name: str, urgent: bool) -> None:
        (index,) = await pool.acquire(1, urgent=urgent)
        order.append(name)
        await done.wait()
        pool.release(index)

    async def granted(count: int) -> None:
        with anyio.fail_after(5):
            while len(order) < count:
                await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lease, "prefill", False)
        await anyio.wait_all_tasks_blocked()
        for n in range(3):
            tg.start_soon(lease, f"decode-{n}", True)
        await anyio.wait_all_tasks_blocked()
        pool.release(held.pop())  # one slot frees: a decode goes past the prefill
        await granted(1)
        pool.release(held.pop())  # the next slot: the prefill's turn
        await granted(2)
        done.set()
    assert order[0].startswith("decode")  # which decode the scheduler queued first is its own
    assert order[1] == "prefill"
    assert sorted(order) == ["decode-0", "decode-1", "decode-2", "prefill"]


async def test_a_transfer_of_k_and_v_is_not_passed_by_later_single_ones() -> None:
    """Waiters keep their place: one slot free is no room for K and V together, and a single
    transfer that came later waits behind them instead of taking it (it would, again and
    again, and K and V would wait for ever)."""
    pool = CopyThreadPool([object(), object()])  # type: ignore[list-item]
    held = [index for _ in range(4) for index in await pool.acquire(1)]
    order: list[str] = []

    async def lease(name: str, count: int) -> None:
        got = await pool.acquire(count)
        order.append(name)
        for index in got:
            pool.release(index)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lease, "k-and-v", 2)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(lease, "single", 1)
        await anyio.wait_all_tasks_blocked()
        pool.release(held.pop())
        await anyio.wait_all_tasks_blocked()
        assert order == []  # one slot: not enough for the first in line
        pool.release(held.pop())
        await anyio.wait_all_tasks_blocked()
        assert order == ["k-and-v", "single"]
    for index in held:
        pool.release(index)


async def test_waiters_go_in_arrival_order_and_only_as_room_frees() -> None:
    """Hundreds of waiters: each release lets exactly as many go as it makes room for, in the
    order they came."""
    pool = CopyThreadPool([object()])  # type: ignore[list-item]
    held = [index for _ in range(2) for index in await pool.acquire(1)]
    done: list[int] = []
    got: dict[int, list[int]] = {}

    async def lease(n: int) -> None:
        got[n] = await pool.acquire(1, urgent=True)
        done.append(n)

    async with anyio.create_task_group() as tg:
        for n in range(300):
            tg.start_soon(lease, n)
            await anyio.wait_all_tasks_blocked()
        pool.release(held.pop())
        await anyio.wait_all_tasks_blocked()
        assert done == [0]
        for n in range(299):
            pool.release(got[n][0])
            await anyio.wait_all_tasks_blocked()
            assert done == list(range(n + 2))
    pool.release(held.pop())
    pool.release(got[299][0])
    assert await pool.acquire(2) == [0, 0]  # everything was given back


async def test_a_cancelled_waiter_gives_its_place_and_any_room_back() -> None:
    pool = CopyThreadPool([object()])  # type: ignore[list-item]
    held = [index for _ in range(2) for index in await pool.acquire(1)]
    granted_then_cancelled = anyio.CancelScope()

    async def wait_in(scope: anyio.CancelScope) -> None:
        """A transfer_all's lease: given back when the holder leaves. Granted and cancelled
        before it resumes, asyncio raises the cancellation in acquire (which gives the room
        back itself); trio lets acquire return, and the holder gives it back."""
        with scope:
            got = await pool.acquire(2)
            try:
                await anyio.sleep_forever()
            finally:
                for index in got:
                    pool.release(index)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_in, granted_then_cancelled)
        await anyio.wait_all_tasks_blocked()
        for index in held:  # room for it: granted, then cancelled before it resumes
            pool.release(index)
        granted_then_cancelled.cancel()
    with anyio.fail_after(1):
        assert len(await pool.acquire(2)) == 2  # its room came back

    before = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_in, before)
        await anyio.wait_all_tasks_blocked()
        before.cancel()  # cancelled while waiting: it leaves the queue
    assert not pool._urgent
    assert not pool._others


async def test_a_thread_takes_as_many_transfers_as_it_runs_at_once() -> None:
    pool = CopyThreadPool([object(), object()], per_thread=4)  # type: ignore[list-item]
    held = [index for _ in range(8) for index in await pool.acquire(1)]
    assert sorted(held) == [0] * 4 + [1] * 4  # spread evenly, four each
    with anyio.move_on_after(0.05) as waited:
        await pool.acquire(1)
    assert waited.cancelled_caught  # the ninth waits for room
    pool.release(held.pop())
    with anyio.fail_after(1):
        assert await pool.acquire(1) == [1]
    with pytest.raises(ValueError, match="at least one"):
        CopyThreadPool([object()], per_thread=0)  # type: ignore[list-item]


class _RowThread:
    """A copy thread with room for rows that answers at once (what the pool sees of one)."""

    rows = object()

    def takes_aside(self, message: Store) -> bool:
        return stages_rows(message)

    def __init__(self) -> None:
        self.got: list[Store] = []

    async def send(self, message: Store) -> None:
        self.got.append(message)
        message.reply.set(TransferStats(message.span.nbytes, 0.0, 0.0, "direct", 0, 0))


def _store(nbytes: int) -> Store:
    span = SimpleNamespace(nbytes=nbytes, label="row")
    return Store(torch.empty(0), None, span, Reply())  # type: ignore[arg-type]


async def test_rows_run_aside_without_a_lease_and_larger_stores_wait_for_one() -> None:
    threads = [_RowThread(), _RowThread()]
    pool = CopyThreadPool(threads, per_thread=1)  # type: ignore[arg-type]
    held = [index for _ in range(2) for index in await pool.acquire(1)]  # every lease taken
    with anyio.fail_after(1):
        for _ in range(3):  # a K and V row each time, on both threads in turn
            await pool.transfer_all([_store(4096), _store(4096)], urgent=True)
    assert [len(thread.got) for thread in threads] == [3, 3]
    assert pool.urgent_leases == 0
    with anyio.move_on_after(0.05) as waited:
        await pool.transfer_all([_store(2 << 20)], urgent=True)  # a layer: no row
    assert waited.cancelled_caught
    for index in held:
        pool.release(index)
