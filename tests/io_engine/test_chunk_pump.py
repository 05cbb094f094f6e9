"""The native chunk pump: built where a compiler is, every byte right through it, and what it
does not count (errors, short transfers) handled by the Python path as before."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Coroutine, Iterator
from functools import partial
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine, IOFailedError, native
from dualblade.io_engine.ring import Ring
from dualblade.io_engine.targets.base import Target

from .conftest import digest

pytestmark = pytest.mark.anyio

needs_pump = pytest.mark.skipif(
    native.load()[0] is None, reason=f"the native chunk pump is absent: {native.load()[1]}"
)


def ring_of(engine: IOEngine) -> Ring:
    ring = engine._backend
    assert isinstance(ring, Ring)
    return ring


class RawFdTarget(Target):
    """Any file descriptor as a target, byte-addressed, the plain completion rules."""

    def __init__(self, name: str, fd: int, *, max_transfer: int = 4096) -> None:
        self.name, self.fd = name, fd
        self.lba_size = self.alignment = 1
        self.size = 1 << 40
        self.max_transfer = max_transfer

    def trim_blocking(self, offset: int, length: int) -> None:
        raise NotImplementedError


@pytest.fixture
def pump_engine() -> Iterator[IOEngine]:
    """An io_uring engine with the pump (QD 8, 64 KiB chunks)."""
    with IOEngine(queue_depth=8, compat="off", max_chunk=64 << 10) as engine:
        yield engine


def test_the_pump_is_built_where_a_compiler_is() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the ring keeps its Python path")
    if os.environ.get("DUALBLADE_NATIVE_PUMP") == "0":
        pytest.skip("DUALBLADE_NATIVE_PUMP=0 switches the pump off for this run")
    library, why = native.load()
    assert library is not None, why


@needs_pump
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    pages=st.integers(min_value=1, max_value=3 * 16 + 5),
    first_page=st.integers(min_value=0, max_value=200),
)
def test_every_byte_round_trips_through_the_pump(
    pump_engine: IOEngine, direct_file: DirectFile, pages: int, first_page: int
) -> None:
    """Lengths that end inside a chunk, offsets that are not a chunk's: the C side's chunk
    arithmetic (address, offset, last chunk's size) must land every byte where Python would."""
    ring = ring_of(pump_engine)
    assert ring.pump_note == ""
    size, offset = pages * 4096, first_page * 4096
    payload = os.urandom(size)

    async def round_trip() -> None:
        with AlignedBuffer(size + 8192, huge=False) as buffer:
            buffer.view[4096 : 4096 + size] = payload
            before = pump_engine.chunks_submitted
            await pump_engine.pwrite(direct_file, buffer, size, offset, buf_offset=4096)
            buffer.view[:] = bytes(buffer.size)
            await pump_engine.pread(direct_file, buffer, size, offset, buf_offset=4096)
            assert digest(buffer.view[4096 : 4096 + size]) == digest(payload)
            assert bytes(buffer.view[:4096]) == bytes(4096)
            assert bytes(buffer.view[4096 + size :]) == bytes(4096)
            assert pump_engine.chunks_submitted - before == 2 * -(-size // (64 << 10))
            assert pump_engine.peak_inflight <= 8

    anyio.run(round_trip)


@needs_pump
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pages=st.lists(st.integers(min_value=1, max_value=40), min_size=2, max_size=6))
def test_requests_of_a_lane_follow_each_other_in_c_and_every_byte_lands(
    pump_engine: IOEngine, direct_file: DirectFile, pages: list[int]
) -> None:
    """Requests queued together in one lane: as one has posted its last chunk, C posts the next
    one's chunks in its completions' places (its successor), with no return to Python. Every
    request's bytes land in its own region (sha256, guard pages between regions), the queue
    depth holds, and every slot and link is given back."""
    ring = ring_of(pump_engine)
    pump = ring._pump
    assert pump is not None
    sizes = [count * 4096 for count in pages]
    starts = [sum(sizes[:index]) + 4096 * (index + 1) for index in range(len(sizes))]
    payloads = [os.urandom(size) for size in sizes]
    total = starts[-1] + sizes[-1] + 4096

    async def every_region(
        op: Callable[..., Coroutine[object, object, object]], buffer: AlignedBuffer
    ) -> None:
        """``op`` on every region at once: the requests queue together in the lane."""
        async with anyio.create_task_group() as group:
            for start, size in zip(starts, sizes, strict=True):
                group.start_soon(partial(op, buf_offset=start), direct_file, buffer, size, start)

    async def both_ways() -> None:
        with AlignedBuffer(total, huge=False) as buffer:
            for start, payload in zip(starts, payloads, strict=True):
                buffer.view[start : start + len(payload)] = payload
            await every_region(pump_engine.pwrite, buffer)
            buffer.view[:] = bytes(total)
            await every_region(pump_engine.pread, buffer)
            for start, payload in zip(starts, payloads, strict=True):
                assert digest(buffer.view[start : start + len(payload)]) == digest(payload)
                assert bytes(buffer.view[start - 4096 : start]) == bytes(4096)
            assert bytes(buffer.view[total - 4096 :]) == bytes(4096)
            assert pump_engine.peak_inflight <= 8

    anyio.run(both_ways)
    assert pump.holds() == []
    assert pump.free_slots == pump.slot_count
    assert pump._lane_last == {}
    assert pump._predecessor == {}
    assert all(pump._slots[index].successor == 0 for index in range(pump.slot_count))


@needs_pump
async def test_a_lane_long_enough_keeps_its_queue_full_in_c(direct_file: DirectFile) -> None:
    """Eight requests of 32 chunks each at QD 4, queued together: as each one posts its last
    chunk, the next one's chunks take its completions' places in C (counted). A completion
    batch that holds every one of a request's last chunks leaves no place to take, so one
    transition may pass without; seven cannot all do so."""
    with (
        IOEngine(queue_depth=4, compat="off", max_chunk=16 << 10) as engine,
        AlignedBuffer(4 << 20, huge=False) as buffer,
    ):
        pump = ring_of(engine)._pump
        assert pump is not None
        before = pump.successor_posts
        async with anyio.create_task_group() as group:
            for index in range(8):
                start = index * (512 << 10)
                group.start_soon(
                    partial(engine.pread, buf_offset=start), direct_file, buffer, 512 << 10, start
                )
        assert pump.successor_posts - before >= 1
        assert pump.holds() == []


@needs_pump
async def test_a_short_read_through_the_pump_is_completed_by_python(
    tmp_path: os.PathLike[str],
) -> None:
    """A pipe answers a 4 KiB read with what it holds: the pump hands the short completion
    back, and the Python path posts the remainder, in order."""
    read_end, write_end = os.pipe()
    payload = os.urandom(12288)
    with (
        IOEngine(queue_depth=1, compat="off") as engine,
        AlignedBuffer(12288, huge=False) as buffer,
        RawFdTarget("pipe", read_end) as target,
    ):
        os.write(write_end, payload[:1000])  # the first chunk gets 1000 of its 4096 bytes
        async with anyio.create_task_group() as group:
            group.start_soon(engine.pread, target, buffer, 12288, 0)
            await anyio.sleep(0.05)
            os.write(write_end, payload[1000:])
        assert bytes(buffer.view) == payload
        assert engine.chunks_submitted == 4  # three chunks and the first one's remainder
    os.close(write_end)


@needs_pump
async def test_an_error_through_the_pump_names_the_target_and_fails_its_request_only(
    tmp_path: os.PathLike[str], direct_file: DirectFile
) -> None:
    path = os.path.join(tmp_path, "read-only.dat")
    with open(path, "wb") as file:
        file.write(bytes(1 << 20))
    with (
        IOEngine(queue_depth=8, compat="off", max_chunk=64 << 10) as engine,
        RawFdTarget(path, os.open(path, os.O_RDONLY), max_transfer=64 << 10) as read_only,
        AlignedBuffer(1 << 20) as buffer,
    ):
        with pytest.raises(IOFailedError) as caught:
            await engine.pwrite(read_only, buffer, 1 << 20, 0)
        assert caught.value.errno == errno.EBADF
        assert caught.value.target == path
        assert buffer.inflight == 0  # every chunk was reaped before the error came back
        payload = os.urandom(1 << 20)  # the ring goes on with other requests
        buffer.view[:] = payload
        await engine.pwrite(direct_file, buffer, 1 << 20, 0)
        buffer.view[:] = bytes(1 << 20)
        await engine.pread(direct_file, buffer, 1 << 20, 0)
        assert digest(buffer.view) == digest(payload)


async def test_without_the_library_the_ring_takes_its_python_path(
    monkeypatch: pytest.MonkeyPatch, direct_file: DirectFile
) -> None:
    monkeypatch.setattr(native, "load", lambda: (None, "switched off by the test"))
    payload = os.urandom(1 << 20)
    with (
        IOEngine(queue_depth=8, compat="off", max_chunk=64 << 10) as engine,
        AlignedBuffer(1 << 20) as buffer,
    ):
        assert ring_of(engine).pump_note == "switched off by the test"
        buffer.view[:] = payload
        await engine.pwrite(direct_file, buffer, 1 << 20, 0)
        buffer.view[:] = bytes(1 << 20)
        await engine.pread(direct_file, buffer, 1 << 20, 0)
        assert digest(buffer.view) == digest(payload)
        assert engine.chunks_submitted == 32


def test_a_build_without_a_compiler_says_what_to_install(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    with pytest.raises(native.NativeBuildError, match="install gcc"):
        native.build(target=Path(tmp_path) / "pump.so")


def test_a_failed_compile_names_the_compiler_and_leaves_nothing(tmp_path: os.PathLike[str]) -> None:
    target = Path(tmp_path) / "pump.so"
    with pytest.raises(native.NativeBuildError, match=r"false failed on chunk_pump\.c"):
        native.build(compiler=shutil.which("false") or "false", target=target)
    assert list(Path(tmp_path).iterdir()) == []


@needs_pump
async def test_a_request_has_given_its_slot_back_when_its_caller_hears_of_the_end(
    direct_file: DirectFile,
) -> None:
    """The slot is freed before the request's end is told: freed after, a caller that looked at
    the pump (or started its next request) right after its await could find it still held (a
    full-suite run caught ``holds()`` non-empty after ``await engine.pread``)."""
    with (
        IOEngine(queue_depth=2, compat="off", max_chunk=64 << 10) as engine,
        AlignedBuffer(1 << 20) as buffer,
    ):
        pump = ring_of(engine)._pump
        assert pump is not None
        seen: list[tuple[int, int, BaseException | None]] = []
        ended = anyio.Event()
        token = anyio.lowlevel.current_token()

        def then(error: BaseException | None) -> None:  # on the ring thread, as the read ends
            seen.append((len(pump.holds()), pump.free_slots, error))
            anyio.from_thread.run_sync(ended.set, token=token)

        for _ in range(4):
            ended = anyio.Event()
            engine.read_then(direct_file, buffer, 1 << 20, 0, then)
            await ended.wait()
        assert seen == [(0, pump.slot_count, None)] * 4


@needs_pump
async def test_every_request_gives_its_slot_back(direct_file: DirectFile) -> None:
    """A slot kept by a finished request would leave later requests on the Python path, silently
    slower: after many requests (more than the slots), finished, cancelled or failed, none
    holds one."""
    with (
        IOEngine(queue_depth=2, compat="off", max_chunk=64 << 10) as engine,
        AlignedBuffer(1 << 20) as buffer,
    ):
        pump = ring_of(engine)._pump
        assert pump is not None
        for _ in range(3):
            async with anyio.create_task_group() as group:
                for index in range(8):  # 4 slots a lane (2 lanes × depth 2): they must recycle
                    group.start_soon(engine.pread, direct_file, buffer, 128 << 10, index << 17)
        assert pump.holds() == []
        assert pump.free_slots == pump.slot_count
        before = engine.chunks_submitted
        await engine.pread(direct_file, buffer, 1 << 20, 0)
        assert engine.chunks_submitted - before == 16
        assert pump.holds() == []
        assert pump.free_slots == pump.slot_count


@needs_pump
async def test_a_cancelled_request_with_chunks_in_flight_lets_go_of_its_slot_and_buffer() -> None:
    """Reads of an empty pipe stay in flight until cancelled: the cancellation must reach the
    pump's chunks too, the buffer come back only when the kernel let go of it, and the slot
    be free afterwards."""
    read_end, write_end = os.pipe()
    with (
        IOEngine(queue_depth=4, compat="off") as engine,
        AlignedBuffer(4 * 4096, huge=False) as buffer,
        RawFdTarget("pipe", read_end) as target,
    ):
        pump = ring_of(engine)._pump
        assert pump is not None
        with anyio.fail_after(5), anyio.move_on_after(0.2) as scope:  # a lost cancel: hangs
            await engine.pread(target, buffer, 4 * 4096, 0)
        assert scope.cancelled_caught
        assert buffer.inflight == 0
        assert pump.holds() == []
        assert pump.free_slots == pump.slot_count
        os.write(write_end, b"x" * 4096)  # the ring still works: a fresh read takes these bytes
        assert await engine.pread(target, buffer, 4096, 0) == 4096
        assert bytes(buffer.view[:4096]) == b"x" * 4096
    os.close(write_end)
