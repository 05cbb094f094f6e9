"""``IOEngine.read_then``: a read whose end is told on the engine's thread, with no event loop
between (a chained GPU copy starts there). Every byte arrives, errors and cancellation reach
``then`` exactly once, slots are handed on, and nothing ``then`` holds outlives the read."""

from __future__ import annotations

import gc
import os
import threading
import weakref

import anyio
import pytest

from dualblade.io_engine import (
    AlignedBuffer,
    DirectFile,
    IOEngine,
    IOEngineError,
    IOFailedError,
    StorageSlots,
)
from dualblade.testing import FaultKind, FaultPolicy, FaultyTarget

from .conftest import digest

pytestmark = pytest.mark.anyio

SIZE = 1 << 20


class Told:
    """Records how a read ended and on which thread, and wakes a waiting task."""

    def __init__(self) -> None:
        self.calls: list[BaseException | None] = []
        self.threads: list[str] = []
        self.ended = threading.Event()

    def __call__(self, error: BaseException | None) -> None:
        self.calls.append(error)
        self.threads.append(threading.current_thread().name)
        self.ended.set()

    async def wait(self) -> None:
        with anyio.fail_after(10):
            while not self.ended.is_set():
                await anyio.sleep(0.001)


def _write(direct_file: DirectFile, payload: bytes, offset: int = 0) -> None:
    with AlignedBuffer(len(payload)) as staging:
        staging.view[:] = payload
        os.pwrite(direct_file.fd, staging.view, offset)


async def test_every_byte_arrives_and_then_runs_once_off_the_loop(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    payload = os.urandom(SIZE)
    _write(direct_file, payload, 4 << 20)
    told = Told()
    engine.read_then(direct_file, buffer, SIZE, 4 << 20, told, buf_offset=SIZE)
    await told.wait()
    assert told.calls == [None]
    assert told.threads[0] != threading.current_thread().name  # the engine's thread
    assert digest(buffer.view[SIZE : 2 * SIZE]) == digest(payload)
    assert buffer.inflight == 0


async def test_reads_queued_for_one_slot_run_one_at_a_time_and_all_arrive(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    payload = os.urandom(4 * SIZE)
    _write(direct_file, payload)
    slots = StorageSlots(1)
    told = [Told() for _ in range(4)]
    for index, then in enumerate(told):
        engine.read_then(
            direct_file, buffer, SIZE, index * SIZE, then, buf_offset=index * SIZE, slots=slots
        )
    assert slots.borrowed_tokens == 1
    assert slots.waiting == 3
    for then in told:
        await then.wait()
    assert [then.calls for then in told] == [[None]] * 4
    assert slots.borrowed_tokens == 0
    assert digest(buffer.view[: 4 * SIZE]) == digest(payload)


async def test_a_failed_read_tells_then_its_error_and_the_engine_goes_on(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    faulty = FaultyTarget(direct_file, FaultPolicy(1.0, kinds=(FaultKind.EIO,)))
    slots = StorageSlots(1)
    told = Told()
    engine.read_then(faulty, buffer, SIZE, 0, told, slots=slots)
    await told.wait()
    (error,) = told.calls
    assert isinstance(error, IOFailedError)
    assert error.op == "read"
    assert slots.borrowed_tokens == 0  # the failed read gave its slot back
    faulty.policy.enabled = False
    again = Told()
    engine.read_then(faulty, buffer, SIZE, 0, again, slots=slots)
    await again.wait()
    assert again.calls == [None]


async def test_cancelled_while_waiting_for_a_slot_it_never_starts(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    slots = StorageSlots(1)
    await slots.acquire()  # held by the test: the read must wait
    told = Told()
    cancel = engine.read_then(direct_file, buffer, SIZE, 0, told, slots=slots)
    cancel()
    await told.wait()
    (error,) = told.calls
    assert isinstance(error, IOEngineError)
    assert "waiting for a storage slot" in str(error)
    assert slots.waiting == 0
    slots.release()
    assert slots.borrowed_tokens == 0
    assert buffer.inflight == 0


async def test_cancelled_in_flight_then_is_still_told_once(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    slow = FaultyTarget(direct_file, FaultPolicy(1.0, kinds=(FaultKind.SLOW,), slow_s=0.005))
    told = Told()
    cancel = engine.read_then(slow, buffer, 4 * SIZE, 0, told)
    cancel()
    await told.wait()
    await anyio.sleep(0.05)
    assert len(told.calls) == 1  # ended, by cancellation or (if it won the race) in full
    assert buffer.inflight == 0


async def test_bad_arguments_raise_at_once_and_then_is_never_told(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    told = Told()
    with pytest.raises(IOEngineError, match="overruns"):
        engine.read_then(direct_file, buffer, SIZE, 0, told, buf_offset=buffer.size)
    await anyio.sleep(0.01)
    assert told.calls == []


async def test_then_and_what_it_holds_are_let_go_once_the_read_ended(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    """A chained copy's ``then`` holds the caller's tensors, which alias buffers that are
    closed later: nothing may keep it alive once told (the request and its slot claim refer to
    each other, so only the collector would free a ``then`` they kept)."""
    gc.disable()
    try:
        for slots in (None, StorageSlots(1)):
            told = Told()
            gone = weakref.ref(told)
            engine.read_then(direct_file, buffer, SIZE, 0, told, slots=slots)
            ended = told.ended
            with anyio.fail_after(10):
                while not ended.is_set():
                    await anyio.sleep(0.001)
            await anyio.sleep(0.01)  # the engine's thread has left ended()
            del told
            assert gone() is None
    finally:
        gc.enable()
