"""LMCache's threads hand tasks to the adapter's loop without waiting for it (TaskInbox), and a
load posts its first key's read in its own first step."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
from anyio.from_thread import start_blocking_portal

from dualblade.integrations.lmcache.object_store import ObjectStore
from dualblade.integrations.lmcache.task_inbox import TaskInbox

from .conftest import Driver, MakeAdapter, digest, key, random_obj


def test_a_submission_returns_while_the_loop_is_busy() -> None:
    """The loop is held inside a plain function, so it runs nothing else: a submit that
    waited for it would never return before the loop is let go."""
    inbox = TaskInbox()
    ran = threading.Event()
    with start_blocking_portal() as portal:
        portal.start_task(inbox.serve)
        loop_held, let_go = threading.Event(), threading.Event()

        def hold_the_loop() -> None:
            loop_held.set()
            let_go.wait(10)

        portal.start_task_soon(hold_the_loop)
        assert loop_held.wait(10)
        inbox.submit(ran.set)  # plain functions run as tasks too
        assert not ran.is_set()  # returned with the loop still held
        let_go.set()
        assert ran.wait(10)
        portal.call(inbox.stop)


def test_tasks_start_in_submission_order_and_a_raising_one_stops_none() -> None:
    inbox = TaskInbox()
    order: list[int] = []
    done = threading.Event()

    async def one(i: int) -> None:
        order.append(i)
        if i == 1:
            raise RuntimeError("a task's own error")
        if i == 4:
            done.set()

    with start_blocking_portal() as portal:
        portal.start_task(inbox.serve)
        for i in range(5):
            inbox.submit(one, i)
        assert done.wait(10)
        portal.call(inbox.stop)
    assert order == [0, 1, 2, 3, 4]


def test_a_submission_before_serving_is_refused() -> None:
    with pytest.raises(RuntimeError, match="not serving"):
        TaskInbox().submit(print)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the adapter's loop is asyncio's
async def test_each_load_posts_its_first_key_before_any_load_spawns_the_rest() -> None:
    """Three loads of three keys submitted together: each load's first key is read in the
    load's own first step, ahead of the keys that wait for a task of their own."""
    entered: list[str] = []

    class Recording(ObjectStore):
        def __init__(self) -> None:  # no store: only get_many's scheduling is under test
            pass

        async def get(self, key: Any, obj: Any) -> bool:
            entered.append(key)
            await anyio.sleep(0)
            return True

    objects = Recording()
    async with anyio.create_task_group() as tg:
        for load in "abc":
            tg.start_soon(objects.get_many, [f"{load}0", f"{load}1", f"{load}2"], [None] * 3)
    assert entered[:3] == ["a0", "b0", "c0"]
    assert sorted(entered) == sorted(f"{x}{i}" for x in "abc" for i in range(3))


def test_loads_and_stores_submitted_together_all_land(make_adapter: MakeAdapter) -> None:
    """Many submits from one thread in a row (as lmcache bench l2 makes them), through the
    inbox: every object round-trips."""
    adapter = make_adapter()
    drive = Driver(adapter)
    keys = [key(i) for i in range(24)]
    objects = [random_obj(16 << 10, seed=i) for i in range(24)]
    batches = range(0, 24, 3)
    tasks = [adapter.submit_store_task(keys[i : i + 3], objects[i : i + 3]) for i in batches]
    for task in tasks:
        assert drive.store_result(task).is_successful()
    targets = [random_obj(16 << 10, seed=100 + i) for i in range(24)]
    loads = [adapter.submit_load_task(keys[i : i + 3], targets[i : i + 3]) for i in batches]
    assert [bit for task in loads for bit in drive.load_result(task, 3)] == [True] * 24
    assert [digest(t) for t in targets] == [digest(o) for o in objects]
