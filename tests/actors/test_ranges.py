"""RangeLocks: overlapping byte ranges wait for each other, disjoint ones do not."""

from __future__ import annotations

import anyio
import pytest

from dualblade.actors._ranges import RangeLocks

pytestmark = pytest.mark.anyio


async def test_disjoint_and_adjacent_ranges_do_not_wait():
    locks = RangeLocks()
    with anyio.fail_after(5):
        await locks.acquire(0, 100)
        await locks.acquire(100, 200)  # half-open: touching is not overlapping
        await locks.acquire(300, 400)
    assert locks.held == [(0, 100), (100, 200), (300, 400)]


@pytest.mark.parametrize(("start", "end"), [(0, 100), (50, 60), (99, 150), (-10, 1), (0, 1000)])
async def test_overlapping_range_waits_until_release(start, end):
    locks = RangeLocks()
    await locks.acquire(0, 100)
    got = anyio.Event()

    async def waiter() -> None:
        await locks.acquire(start, end)
        got.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert not got.is_set()
        assert locks.held == [(0, 100)]
        locks.release(0, 100)
        with anyio.fail_after(5):
            await got.wait()
    assert locks.held == [(start, end)]


async def test_release_wakes_waiters_one_overlap_at_a_time():
    locks = RangeLocks()
    await locks.acquire(0, 100)
    order: list[str] = []

    async def take(name: str, start: int, end: int) -> None:
        await locks.acquire(start, end)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "b", 0, 50)
        tg.start_soon(take, "c", 40, 80)  # overlaps both the holder and b
        tg.start_soon(take, "d", 200, 300)  # overlaps nobody
        await anyio.wait_all_tasks_blocked()
        assert order == ["d"]
        locks.release(0, 100)
        await anyio.wait_all_tasks_blocked()
        # Exactly one of b and c got its range: they overlap each other.
        assert len(order) == 2
        first = order[1]
        held = (0, 50) if first == "b" else (40, 80)
        assert held in locks.held
        locks.release(*held)
        await anyio.wait_all_tasks_blocked()
    assert sorted(order) == ["b", "c", "d"]
    assert sorted(locks.held) == sorted([(200, 300), (40, 80) if first == "b" else (0, 50)])


async def test_cancelled_waiter_holds_nothing():
    locks = RangeLocks()
    await locks.acquire(0, 10)
    with anyio.move_on_after(0.01):
        await locks.acquire(5, 15)
    assert locks.held == [(0, 10)]
    locks.release(0, 10)
    with anyio.fail_after(5):
        await locks.acquire(5, 15)


def test_release_of_unheld_range_raises():
    locks = RangeLocks()
    with pytest.raises(RuntimeError, match=r"\[0, 10\) is not held"):
        locks.release(0, 10)
