"""A buffer is never released or reused while the kernel may still DMA into it.

A pipe gives an io_uring read that stays in flight as long as we like: nothing arrives until the
test writes. That makes "the awaiting task was cancelled while the kernel owned the buffer"
deterministic instead of a race.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import anyio
import pytest

from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine
from dualblade.io_engine.ring import Ring
from dualblade.io_engine.targets.base import Target

from .conftest import digest

pytestmark = pytest.mark.anyio


class PipeTarget(Target):
    """The read end of a pipe, as a target (reads block until the test writes)."""

    def __init__(self, fd: int) -> None:
        self.name, self.fd = "pipe", fd
        self.lba_size = self.alignment = 1
        self.size = 1 << 40
        self.max_transfer = 4096

    def trim_blocking(self, offset: int, length: int) -> None:
        raise NotImplementedError


@pytest.fixture
def pipe() -> Iterator[tuple[PipeTarget, int]]:
    read_end, write_end = os.pipe()
    target = PipeTarget(read_end)
    yield target, write_end
    target.close()
    os.close(write_end)


async def test_cancel_waits_for_the_kernel_to_release_the_buffer(
    pipe: tuple[PipeTarget, int],
) -> None:
    target, write_end = pipe
    with IOEngine(queue_depth=4, compat="off") as engine, AlignedBuffer(4096, huge=False) as buf:
        with anyio.move_on_after(0.2) as scope:
            await engine.pread(target, buf, 4096, 0)
        assert scope.cancelled_caught
        # The kernel's cancel completed before the cancellation reached us.
        assert buf.inflight == 0
        os.write(write_end, b"x" * 4096)
        # The cancelled read did not consume the data, nor write into the buffer.
        assert os.read(target.fd, 4096) == b"x" * 4096
        assert bytes(buf.view) == bytes(4096)
        buf.close()  # releasing is allowed now


async def test_cancel_of_an_uncancellable_read_waits_for_its_completion(
    pipe: tuple[PipeTarget, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel cannot cancel (a read already on the device), we wait for the CQE."""
    target, write_end = pipe
    monkeypatch.setattr(Ring, "_cancel", lambda self, request: request.cancel())
    delivered_at: list[float] = []

    def deliver_later() -> None:
        time.sleep(0.4)
        delivered_at.append(time.monotonic())
        os.write(write_end, b"y" * 4096)

    with IOEngine(queue_depth=4, compat="off") as engine, AlignedBuffer(4096, huge=False) as buf:
        writer = threading.Thread(target=deliver_later)
        writer.start()
        with anyio.move_on_after(0.1) as scope:
            await engine.pread(target, buf, 4096, 0)
        returned_at = time.monotonic()
        writer.join()
        assert scope.cancelled_caught
        assert delivered_at
        assert returned_at >= delivered_at[0]
        assert buf.inflight == 0
        assert bytes(buf.view) == b"y" * 4096  # the kernel's DMA landed before we returned


@pytest.mark.parametrize("compat", ["off", "on"])
async def test_cancelled_large_reads_never_corrupt_the_next_one(
    tmp_path: os.PathLike[str], compat: str
) -> None:
    size = 8 << 20
    with (
        IOEngine(queue_depth=8, compat=compat, max_chunk=64 << 10) as engine,
        DirectFile(os.path.join(tmp_path, "c.dat"), size) as target,
        AlignedBuffer(size) as buf,
    ):
        first, second = os.urandom(size // 2), os.urandom(size // 2)
        buf.view[: size // 2] = first
        buf.view[size // 2 :] = second
        await engine.pwrite(target, buf, size, 0)
        for delay in (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01):
            buf.view[:] = bytes(size)
            with anyio.move_on_after(delay):
                await engine.pread(target, buf, size // 2, 0)
            assert buf.inflight == 0, f"returned with DMA in flight after {delay}s"
            # Reuse the same buffer at once: no late completion of the cancelled read may land.
            buf.view[:] = bytes(size)
            await engine.pread(target, buf, size // 2, size // 2, buf_offset=0)
            await anyio.sleep(0.01)
            assert digest(buf.view[: size // 2]) == digest(second)
            assert bytes(buf.view[size // 2 :]) == bytes(size // 2)


async def test_threadpool_cancel_waits_for_running_workers(tmp_path: os.PathLike[str]) -> None:
    gate = threading.Event()
    finished: list[float] = []

    class SlowFile(DirectFile):
        def pread_blocking(self, view: memoryview, offset: int) -> int:
            gate.wait(5)
            n = super().pread_blocking(view, offset)
            finished.append(time.monotonic())
            return n

    with (
        IOEngine(queue_depth=2, compat="on", max_chunk=4096) as engine,
        SlowFile(os.path.join(tmp_path, "s.dat"), 1 << 20) as target,
        AlignedBuffer(1 << 20, huge=False) as buf,
    ):
        threading.Timer(0.3, gate.set).start()
        with anyio.move_on_after(0.05) as scope:
            await engine.pread(target, buf, 1 << 20, 0)
        assert scope.cancelled_caught
        assert buf.inflight == 0
        # Only the two chunks already running were executed; the rest were never started.
        assert len(finished) == 2


async def test_buffer_refuses_release_while_in_flight(pipe: tuple[PipeTarget, int]) -> None:
    target, write_end = pipe
    from dualblade.io_engine import BufferBusyError

    with IOEngine(queue_depth=2, compat="off") as engine:
        buf = AlignedBuffer(4096, huge=False)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.pread, target, buf, 4096, 0)
            await anyio.wait_all_tasks_blocked()
            while buf.inflight == 0:
                await anyio.sleep(0.001)
            with pytest.raises(BufferBusyError, match="in flight"):
                buf.close()
            os.write(write_end, b"z" * 4096)
        buf.close()


async def test_a_dead_ring_fails_waiters_and_keeps_their_buffer_pinned(
    pipe: tuple[PipeTarget, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the ring thread dies, callers get an error, never a hang, and no buffer is reused."""
    from dualblade.io_engine import BufferBusyError, IOEngineError

    target, _write_end = pipe
    engine = IOEngine(queue_depth=2, compat="off")
    buf = AlignedBuffer(4096, huge=False)
    ring = engine._backend
    assert isinstance(ring, Ring)
    original = Ring._submit_and_wait

    def dying_wait(self: Ring) -> int:
        # Dies at the first wait with the pipe read posted (it never completes by itself).
        if self.inflight:
            raise OSError(14, "injected: the ring's memory went bad")
        return original(self)

    monkeypatch.setattr(Ring, "_submit_and_wait", dying_wait)
    with anyio.fail_after(10), pytest.raises(IOEngineError, match="ring thread died"):
        await engine.pread(target, buf, 4096, 0)
    assert buf.inflight == 1  # the kernel may still write into it: never released
    with pytest.raises(BufferBusyError):
        buf.close()
    with pytest.raises(IOEngineError, match="died"):
        await engine.pread(target, AlignedBuffer(4096, huge=False), 4096, 0)
