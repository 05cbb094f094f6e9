"""The DMA completion thread: answers in queue order, in batches, errors to their own copy."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import anyio
import pytest

from dualblade.actors.dma_completions import DmaCompletions
from dualblade.io_engine import loop_caller

pytestmark = pytest.mark.anyio


class FakeEvent:
    """A copy's event that completes when the test says so (or fails when it does)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._done = threading.Event()
        self._error = error
        self.waited_on_thread: str | None = None
        self.kernel_name: str | None = None  # the waiting thread's name in the kernel (Linux)

    def finish(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self.waited_on_thread = threading.current_thread().name
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        self.kernel_name = comm.read_text().strip() if comm.exists() else None
        self._done.wait()
        if self._error is not None:
            raise self._error

    def query(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise self._error  # as torch.cuda.Event.query raises a CUDA error
        return self._done.is_set()


async def _settle(completions: DmaCompletions, answered: int) -> None:
    with anyio.fail_after(5):
        while completions.answered < answered:
            await anyio.sleep(0.001)
        await anyio.sleep(0.01)  # let the loop run the batch's call


async def test_answers_in_queue_order_on_the_loop_thread() -> None:
    completions = DmaCompletions(loop_caller(), name="test-completions")
    completions.start()
    loop_thread = threading.current_thread()
    seen: list[tuple[int, BaseException | None, threading.Thread]] = []
    events = [FakeEvent() for _ in range(5)]
    for index, event in enumerate(events):
        completions.watch(
            event, lambda error, i=index: seen.append((i, error, threading.current_thread()))
        )
    for event in reversed(events):  # the last finishes first: still answered in order
        event.finish()
    await _settle(completions, 5)
    completions.close()
    await anyio.to_thread.run_sync(completions.join)
    assert [index for index, _, _ in seen] == [0, 1, 2, 3, 4]
    assert all(error is None and thread is loop_thread for _, error, thread in seen)
    assert all(event.waited_on_thread == "test-completions" for event in events[:1])
    if sys.platform.startswith("linux"):  # tools outside Python see the name too
        assert events[0].kernel_name == "test-completions"[:15]


async def test_copies_already_finished_are_answered_in_one_batch() -> None:
    completions = DmaCompletions(loop_caller())
    completions.start()
    answered: list[int] = []
    first = FakeEvent()
    later = [FakeEvent() for _ in range(7)]
    for event in later:
        event.finish()
    completions.watch(first, lambda _error: answered.append(0))
    for index, event in enumerate(later, start=1):
        completions.watch(event, lambda _error, i=index: answered.append(i))
    first.finish()
    await _settle(completions, 8)
    completions.close()
    await anyio.to_thread.run_sync(completions.join)
    assert answered == list(range(8))
    assert completions.batches == 1


async def test_a_failed_copy_fails_alone() -> None:
    completions = DmaCompletions(loop_caller())
    completions.start()
    outcomes: dict[int, BaseException | None] = {}
    broken = RuntimeError("CUDA error: an illegal memory access was encountered")
    events = [FakeEvent(), FakeEvent(error=broken), FakeEvent()]
    for index, event in enumerate(events):
        completions.watch(event, lambda error, i=index: outcomes.__setitem__(i, error))
        event.finish()
    await _settle(completions, 3)
    completions.close()
    await anyio.to_thread.run_sync(completions.join)
    assert outcomes == {0: None, 1: broken, 2: None}


async def test_close_waits_for_every_queued_copy_and_refuses_new_ones() -> None:
    completions = DmaCompletions(loop_caller())
    completions.start()
    answered: list[int] = []
    events = [FakeEvent() for _ in range(3)]
    for index, event in enumerate(events):
        completions.watch(event, lambda _error, i=index: answered.append(i))
    completions.close()
    with pytest.raises(RuntimeError, match="closed"):
        completions.watch(FakeEvent(), lambda _error: None)
    assert completions.pending == 3

    async def finish_later() -> None:
        await anyio.sleep(0.05)
        for event in events:
            event.finish()

    async with anyio.create_task_group() as tg:
        tg.start_soon(finish_later)
        await anyio.to_thread.run_sync(completions.join)  # returns only after all three
    await anyio.sleep(0.01)
    assert completions.pending == 0
    assert answered == [0, 1, 2]
