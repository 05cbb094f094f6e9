"""Storage slots: one queue for tasks and engine starts, slots handed on by the thread that
frees them, cancellation that neither leaks a slot nor starts a withdrawn transfer."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine, StorageSlots, storage_slots

from .conftest import digest

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("total", [0, -1, True, 1.5, "2"])
def test_a_bad_slot_count_is_refused(total: object):
    with pytest.raises(ValueError, match="at least 1"):
        StorageSlots(total)  # type: ignore[arg-type]
    slots = StorageSlots(2)
    with pytest.raises(ValueError, match="at least 1"):
        slots.total_tokens = total  # type: ignore[assignment]
    assert slots.total_tokens == 2


async def test_tasks_and_starts_take_turns_in_arrival_order():
    slots = StorageSlots(1)
    order: list[str] = []
    await slots.acquire()  # held by the test
    first = slots.claim(lambda: order.append("first start"))
    first.enter()

    async def task() -> None:
        await slots.acquire()
        order.append("task")

    async with anyio.create_task_group() as tg:
        tg.start_soon(task)
        await anyio.wait_all_tasks_blocked()
        last = slots.claim(lambda: order.append("last start"))
        last.enter()
        assert order == []
        assert slots.waiting == 3
        slots.release()  # the test's slot goes to the first in line only
        assert order == ["first start"]
        assert first.granted
        assert not last.granted
        slots.release()  # the start's transfer ended: the task is next
        await anyio.wait_all_tasks_blocked()
        assert order == ["first start", "task"]
        slots.release()
        assert order == ["first start", "task", "last start"]
    assert slots.borrowed_tokens == 1  # the last start holds it until its transfer ends
    slots.release()
    assert slots.borrowed_tokens == 0


async def test_a_slot_freed_on_another_thread_wakes_the_waiting_task():
    slots = StorageSlots(1)
    await slots.acquire()
    releaser = threading.Timer(0.05, slots.release)
    releaser.start()
    with anyio.fail_after(5):
        await slots.acquire()  # granted from the timer's thread, woken through the loop
    assert slots.borrowed_tokens == 1
    releaser.join()


async def test_a_cancelled_wait_leaves_the_queue_and_holds_nothing():
    slots = StorageSlots(1)
    await slots.acquire()
    with anyio.move_on_after(0.05):
        await slots.acquire()
    assert slots.waiting == 0
    slots.release()
    assert slots.borrowed_tokens == 0


async def test_a_task_interrupted_as_it_is_granted_passes_the_slot_on(
    monkeypatch: pytest.MonkeyPatch,
):
    class WokenAndInterruptedError(Exception):
        pass

    real_event = anyio.Event

    class GrantedThenInterrupted:
        """An event whose waiter is interrupted just after the grant woke it."""

        def __init__(self) -> None:
            self._event = real_event()

        def set(self) -> None:
            self._event.set()

        async def wait(self) -> None:
            await self._event.wait()
            raise WokenAndInterruptedError

    monkeypatch.setattr(storage_slots.anyio, "Event", GrantedThenInterrupted)
    slots = StorageSlots(1)
    await slots.acquire()
    started: list[str] = []

    async def task() -> None:
        with pytest.raises(WokenAndInterruptedError):
            await slots.acquire()

    async with anyio.create_task_group() as tg:
        tg.start_soon(task)
        await anyio.wait_all_tasks_blocked()
        slots.claim(lambda: started.append("behind")).enter()
        slots.release()  # granted to the task, which is interrupted as it wakes
    assert started == ["behind"]  # the task gave the slot to the next in line
    assert slots.borrowed_tokens == 1  # the start's transfer holds it


async def test_a_withdrawn_claim_never_starts():
    slots = StorageSlots(1)
    await slots.acquire()
    started: list[str] = []
    claim = slots.claim(lambda: started.append("x"))
    claim.enter()
    assert claim.withdraw()
    slots.release()
    assert started == []
    assert slots.borrowed_tokens == 0
    granted = slots.claim(lambda: started.append("y"))
    granted.enter()  # a slot is free: started at once
    assert started == ["y"]
    assert not granted.withdraw()


async def test_more_slots_start_waiters_and_fewer_let_the_running_finish():
    slots = StorageSlots(1)
    started: list[int] = []
    for n in range(3):
        slots.claim(lambda n=n: started.append(n)).enter()
    assert started == [0]
    slots.total_tokens = 3
    assert started == [0, 1, 2]
    slots.total_tokens = 1
    slots.release()
    slots.release()
    assert slots.borrowed_tokens == 1
    slots.claim(lambda: started.append(3)).enter()
    assert started == [0, 1, 2]  # one running, one slot: waits
    slots.release()
    assert started == [0, 1, 2, 3]


async def test_the_ring_thread_starts_the_next_read_while_the_loop_is_blocked(tmp_path):
    """The slot passes from a finished read to the next on the engine's thread: both reads run
    while the event loop sleeps, one at a time, and each lands its own bytes."""
    size = 256 << 10
    with (
        IOEngine(queue_depth=8, compat="off", max_chunk=64 << 10) as engine,
        DirectFile(tmp_path / "d.dat", 2 * size) as target,
        AlignedBuffer(2 * size) as memory,
    ):
        memory.view[:] = bytes(range(256)) * (2 * size // 256)
        expected = digest(memory.view)
        await engine.pwrite(target, memory, 2 * size, 0)
        memory.view[:] = bytes(2 * size)
        spans: dict[int, list[float]] = {0: [], size: []}  # per request: chunk submit, end
        engine.observe_chunks(
            lambda _t, _op, offset, _n, submitted, ended, _res: spans[
                0 if offset < size else size
            ].extend((submitted, ended))
        )
        starters: list[str] = []
        start = engine._start_granted

        def recording_start(request):  # type: ignore[no-untyped-def]
            starters.append(threading.current_thread().name)
            start(request)

        engine._start_granted = recording_start  # type: ignore[method-assign]
        slots = StorageSlots(1)
        await slots.acquire()  # held by the test until the loop sleeps
        async with anyio.create_task_group() as tg:
            for offset in (0, size):
                tg.start_soon(
                    lambda o=offset: engine.pread(
                        target, memory, size, o, buf_offset=o, slots=slots
                    )
                )
                await anyio.wait_all_tasks_blocked()
            assert slots.waiting == 2
            threading.Timer(0.02, slots.release).start()
            time.sleep(0.5)  # the loop is blocked: no task runs until both reads are done
            blocked_until = time.perf_counter()
        assert starters[0] != threading.main_thread().name  # the timer's thread
        assert starters[1] == "dualblade-io"  # the ring thread, as the first read ended
        first, second = spans[0], spans[size]
        assert max(first) <= min(second)  # one at a time
        assert max(second) < blocked_until  # started and done without the loop
        assert digest(memory.view) == expected
        assert slots.borrowed_tokens == 0


async def test_a_read_cancelled_while_queued_is_never_submitted(engine, direct_file, buffer):
    slots = StorageSlots(1)
    await slots.acquire()
    with anyio.move_on_after(0.05) as scope:
        await engine.pread(direct_file, buffer, 64 << 10, 0, slots=slots)
    assert scope.cancelled_caught
    assert slots.waiting == 0
    submitted = engine._backend.chunks_submitted
    slots.release()
    assert slots.borrowed_tokens == 0
    assert engine._backend.chunks_submitted == submitted
    buffer.close()  # not left counted as under I/O
