"""The budgeter: answers queries, publishes changes of at least ``min_change`` only."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from dualblade.actors import Budget, BudgeterActor, Reply
from dualblade.actors.budgeter import GetBudget, Refresh
from dualblade.telemetry import Tracer

pytestmark = pytest.mark.anyio


def reader(values: list[int]) -> tuple[Iterator[int], object]:
    """A read function returning ``values`` one per call, then the last one forever."""
    calls = iter(values)
    last = [values[0]]

    def read() -> Budget:
        last[0] = next(calls, last[0])
        return Budget(page_cache_bytes=last[0], limit_bytes=8 * last[0])

    return calls, read


async def ask(actor: BudgeterActor, kind: type) -> Budget:
    reply: Reply[Budget] = Reply()
    return await actor.ask(kind(reply), reply)


async def test_publishes_changes_of_at_least_min_change():
    _, read = reader([1000, 1050, 1200, 1150, 1101, 1100, 1100, 1000])
    tracer = Tracer()
    budgeter = BudgeterActor(read, interval=0, min_change=100, tracer=tracer)  # type: ignore[arg-type]
    published: list[int] = []

    async def subscriber(budget: Budget) -> None:
        published.append(budget.page_cache_bytes)

    budgeter.subscribe(subscriber)
    async with anyio.create_task_group() as tg:
        await tg.start(budgeter.run)
        assert budgeter.current == Budget(1000, 8000)
        assert (await ask(budgeter, GetBudget)).page_cache_bytes == 1000
        assert published == []  # the initial budget is not a change
        seen = [(await ask(budgeter, Refresh)).page_cache_bytes for _ in range(7)]
        budgeter.close()
    # 1050: too small (kept 1000); 1200: published; 1150, 1101: within 100 of 1200;
    # 1100: exactly min_change away, published; 1100 again: no change; 1000: published.
    assert seen == [1000, 1200, 1200, 1200, 1100, 1100, 1000]
    assert published == [1200, 1100, 1000]
    assert budgeter.changes == 3
    samples = [
        e["args"]["page_cache_bytes"]
        for e in tracer.document()["traceEvents"]
        if e["ph"] == "C" and e["name"] == "budget"
    ]
    assert samples == [1000, 1200, 1100, 1000]


async def test_get_budget_returns_the_current_budget_without_reading():
    calls = 0

    def read() -> Budget:
        nonlocal calls
        calls += 1
        return Budget(page_cache_bytes=calls << 30, limit_bytes=None)

    budgeter = BudgeterActor(read, interval=0, min_change=1)
    async with anyio.create_task_group() as tg:
        await tg.start(budgeter.run)
        for _ in range(3):
            assert (await ask(budgeter, GetBudget)).page_cache_bytes == 1 << 30
        assert calls == 1
        assert (await ask(budgeter, Refresh)).page_cache_bytes == 2 << 30
        assert (await ask(budgeter, GetBudget)).page_cache_bytes == 2 << 30
        budgeter.close()


async def test_polling_publishes_without_being_asked():
    _, read = reader([10 << 20, 10 << 20, 200 << 20])
    budgeter = BudgeterActor(read, interval=0.001, min_change=64 << 20)  # type: ignore[arg-type]
    changed = anyio.Event()
    published: list[int] = []

    async def subscriber(budget: Budget) -> None:
        published.append(budget.page_cache_bytes)
        changed.set()

    budgeter.subscribe(subscriber)
    async with anyio.create_task_group() as tg:
        await tg.start(budgeter.run)
        with anyio.fail_after(10):
            await changed.wait()
        budgeter.close()  # also stops the poller: the task group exits
    assert published == [200 << 20]
