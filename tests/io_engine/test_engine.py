"""Round trips, splitting, queue depth, short transfers and errors, on both backends."""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualblade.io_engine import (
    AlignedBuffer,
    DirectFile,
    IOEngine,
    IOEngineError,
    IOFailedError,
    PageCacheFile,
    TargetError,
)

from .conftest import digest

pytestmark = pytest.mark.anyio


async def test_async_round_trip(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    payload = os.urandom(3 << 20)
    buffer.view[: len(payload)] = payload
    assert await engine.pwrite(direct_file, buffer, len(payload), 1 << 20) == len(payload)
    buffer.view[:] = bytes(buffer.size)
    assert await engine.pread(direct_file, buffer, len(payload), 1 << 20) == len(payload)
    assert digest(buffer.view[: len(payload)]) == digest(payload)


async def test_buffer_offset_and_file_offset(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    payload = os.urandom(256 << 10)
    buffer.view[8192 : 8192 + len(payload)] = payload
    await engine.pwrite(direct_file, buffer, len(payload), 12 << 20, buf_offset=8192)
    with AlignedBuffer(1 << 20, huge=False) as other:
        await engine.pread(direct_file, other, len(payload), 12 << 20, buf_offset=4096)
        assert bytes(other.view[4096 : 4096 + len(payload)]) == payload
        assert bytes(other.view[:4096]) == bytes(4096)  # nothing written before the offset


async def test_chunk_observers_add_up_and_each_sees_every_chunk(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    if engine.kind != "io_uring":
        pytest.skip("chunks are observed on the io_uring backend only")
    seen: dict[str, list[tuple[str, int, int]]] = {"first": [], "second": []}
    for name in seen:
        engine.observe_chunks(
            lambda _t, op, offset, length, _s, _c, _r, name=name: seen[name].append(
                (op, offset, length)
            )
        )
    await engine.pwrite(direct_file, buffer, 1 << 20, 2 << 20)
    await engine.pread(direct_file, buffer, 1 << 20, 2 << 20)
    chunks = (1 << 20) // (64 << 10)
    assert len(seen["first"]) == 2 * chunks  # every chunk of the write and of the read
    assert sorted(seen["first"]) == sorted(seen["second"])  # the second observer, the same
    assert {op for op, _, _ in seen["first"]} == {"read", "write"}


async def test_requests_split_at_max_chunk_and_queue_depth_is_respected(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    before = engine.chunks_submitted
    await engine.pwrite(direct_file, buffer, 4 << 20, 0)
    assert engine.chunks_submitted - before == (4 << 20) // (64 << 10)
    assert engine.peak_inflight == engine.queue_depth  # the queue was kept full


async def test_max_chunk_cuts_device_commands_only(
    engine: IOEngine, buffer: AlignedBuffer, tmp_path: str
) -> None:
    """A buffered file's commands are memory copies: they keep the file's own size, while the
    engine's 64 KiB max_chunk cuts a device's (the test above)."""
    payload = os.urandom(3 << 20)
    buffer.view[: len(payload)] = payload
    path = os.path.join(tmp_path, "pc.dat")
    with PageCacheFile(path, 4 << 20, max_transfer=1 << 20) as target:
        before = engine.chunks_submitted
        await engine.pwrite(target, buffer, len(payload), 4096)
        buffer.view[: len(payload)] = bytes(len(payload))
        await engine.pread(target, buffer, len(payload), 4096)
        assert engine.chunks_submitted - before == 2 * 3  # 1 MiB commands, not 48 of 64 KiB
    assert digest(buffer.view[: len(payload)]) == digest(payload)


async def test_many_concurrent_requests_never_mix(
    engine: IOEngine, direct_file: DirectFile
) -> None:
    region = 512 << 10
    payloads = [os.urandom(region) for _ in range(16)]
    buffers = [AlignedBuffer(region, huge=False) for _ in payloads]
    try:

        async def write_then_read(i: int) -> None:
            buffers[i].view[:] = payloads[i]
            await engine.pwrite(direct_file, buffers[i], region, i * region)
            buffers[i].view[:] = bytes(region)
            await engine.pread(direct_file, buffers[i], region, i * region)

        async with anyio.create_task_group() as tg:
            for i in range(len(payloads)):
                tg.start_soon(write_then_read, i)
        for i, payload in enumerate(payloads):
            assert digest(buffers[i].view) == digest(payload), f"region {i}"
    finally:
        for b in buffers:
            b.close()


def test_blocking_api_from_several_threads(engine: IOEngine, direct_file: DirectFile) -> None:
    region = 1 << 20
    payloads = [os.urandom(region) for _ in range(8)]

    def roundtrip(i: int) -> str:
        with AlignedBuffer(region) as buf:
            buf.view[:] = payloads[i]
            engine.write(direct_file, buf, region, i * region)
            buf.view[:] = bytes(region)
            engine.read(direct_file, buf, region, i * region)
            return digest(buf.view)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(roundtrip, range(8))) == [digest(p) for p in payloads]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    blocks=st.integers(1, 300),
    start_block=st.integers(0, 3000),
    chunk_blocks=st.integers(1, 40),
    queue_depth=st.integers(1, 9),
    seed=st.binary(min_size=8, max_size=8),
)
def test_round_trip_property(
    tmp_path_factory: pytest.TempPathFactory,
    blocks: int,
    start_block: int,
    chunk_blocks: int,
    queue_depth: int,
    seed: bytes,
) -> None:
    path = tmp_path_factory.mktemp("prop") / "f.dat"
    length, offset = blocks * 4096, start_block * 4096
    payload = (seed * (length // 8 + 1))[:length]
    for compat in ("off", "on"):
        with (
            IOEngine(queue_depth=queue_depth, compat=compat, max_chunk=chunk_blocks * 4096) as eng,
            DirectFile(path, 16 << 20) as target,
            AlignedBuffer(length, huge=False) as buf,
        ):
            buf.view[:] = payload
            eng.write(target, buf, length, offset)
            buf.view[:] = bytes(length)
            eng.read(target, buf, length, offset)
            assert bytes(buf.view) == payload
            assert eng.chunks_submitted == 2 * -(-blocks // chunk_blocks)
            assert eng.peak_inflight <= queue_depth


async def test_fixed_buffers_round_trip(direct_file: DirectFile) -> None:
    with IOEngine(queue_depth=4, compat="off") as eng, AlignedBuffer(2 << 20) as buf:
        eng.register_buffers([buf])
        assert eng.is_registered(buf)
        payload = os.urandom(2 << 20)
        buf.view[:] = payload
        await eng.pwrite(direct_file, buf, 2 << 20, 0)
        buf.view[:] = bytes(2 << 20)
        await eng.pread(direct_file, buf, 2 << 20, 0)
        assert bytes(buf.view) == payload
        with pytest.raises(IOEngineError, match="already registered"):
            eng.register_buffers([buf])


async def test_page_cache_file_round_trip_and_mmap(
    engine: IOEngine, tmp_path: os.PathLike[str]
) -> None:
    with (
        PageCacheFile(os.path.join(tmp_path, "pc.dat"), 1 << 20) as target,
        AlignedBuffer(1 << 20, huge=False) as buf,
    ):
        payload = os.urandom(5000)
        buf.view[:5000] = payload
        await engine.pwrite(target, buf, 5000, 123)  # no alignment needed on this path
        target.flush()
        assert target.mmap()[123 : 123 + 5000] == payload
        target.advise_dontneed()
        buf.view[:5000] = bytes(5000)
        await engine.pread(target, buf, 5000, 123)
        assert bytes(buf.view[:5000]) == payload


async def test_zero_length_requests_complete(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    assert await engine.pread(direct_file, buffer, 0, 0) == 0


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "offset", "buf_offset", "message"),
    [
        (4096, 100, 0, "multiples of the target's LBA size"),
        (100, 0, 0, "multiples of the target's LBA size"),
        (4096, 16 << 20, 0, "ends past the target"),
        (4096, 0, 512, "not aligned"),
        (8 << 20, 0, 0, "overruns"),
    ],
)
async def test_bad_requests_get_clear_errors(
    engine: IOEngine,
    direct_file: DirectFile,
    buffer: AlignedBuffer,
    size: int,
    offset: int,
    buf_offset: int,
    message: str,
) -> None:
    with pytest.raises(IOEngineError, match=message):
        await engine.pread(direct_file, buffer, size, offset, buf_offset=buf_offset)
    assert buffer.inflight == 0


def test_closed_engine_refuses_work(direct_file: DirectFile, buffer: AlignedBuffer) -> None:
    eng = IOEngine(queue_depth=2)
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(IOEngineError, match="closed"):
        eng.read(direct_file, buffer, 4096, 0)


def test_bad_engine_arguments() -> None:
    with pytest.raises(IOEngineError, match="compat mode"):
        IOEngine(compat="maybe")  # type: ignore[arg-type]
    with pytest.raises(IOEngineError, match="max_chunk"):
        IOEngine(max_chunk=0)
    with pytest.raises(ValueError, match="queue_depth"):
        IOEngine(queue_depth=0)


def test_direct_file_bad_max_transfer(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(TargetError, match="multiple of 4096"):
        DirectFile(os.path.join(tmp_path, "x.dat"), 1 << 20, max_transfer=1000)


# -- faults ------------------------------------------------------------------------------------
class ShortTransferFile(DirectFile):
    """Every other chunk moves only half its bytes (the rest must be resubmitted)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.shorts = 0
        self._lock = threading.Lock()

    def _short(self, length: int) -> int | None:
        with self._lock:
            self.shorts += 1
            if self.shorts % 2 and length >= 8192:
                return length // 2 // 4096 * 4096
        return None

    def transferred(self, op: str, res: int, length: int, offset: int, extra: int) -> int:
        done = super().transferred(op, res, length, offset, extra)
        short = self._short(length)
        return done if short is None else short

    def pread_blocking(self, view: memoryview, offset: int) -> int:
        short = self._short(len(view))
        return super().pread_blocking(view if short is None else view[:short], offset)

    def pwrite_blocking(self, view: memoryview, offset: int) -> int:
        short = self._short(len(view))
        return super().pwrite_blocking(view if short is None else view[:short], offset)


async def test_short_transfers_are_completed(
    engine: IOEngine, tmp_path: os.PathLike[str], buffer: AlignedBuffer
) -> None:
    with ShortTransferFile(os.path.join(tmp_path, "short.dat"), 8 << 20) as target:
        payload = os.urandom(2 << 20)
        buffer.view[: len(payload)] = payload
        assert await engine.pwrite(target, buffer, len(payload), 4096) == len(payload)
        buffer.view[:] = bytes(buffer.size)
        assert await engine.pread(target, buffer, len(payload), 4096) == len(payload)
        assert digest(buffer.view[: len(payload)]) == digest(payload)
        assert target.shorts > 0


class FailingFile(DirectFile):
    """Chunks that touch ``bad_offset`` fail with EIO."""

    bad_offset = 1 << 20

    def _hits(self, offset: int, length: int) -> bool:
        return offset <= self.bad_offset < offset + length

    def transferred(self, op: str, res: int, length: int, offset: int, extra: int) -> int:
        if self._hits(offset, length):
            raise IOFailedError(self.name, op, offset, length, errno=errno.EIO)
        return super().transferred(op, res, length, offset, extra)

    def pread_blocking(self, view: memoryview, offset: int) -> int:
        if self._hits(offset, len(view)):
            raise OSError(errno.EIO, "injected")
        return super().pread_blocking(view, offset)


async def test_a_failed_chunk_fails_only_its_request(
    engine: IOEngine, tmp_path: os.PathLike[str]
) -> None:
    with (
        FailingFile(os.path.join(tmp_path, "bad.dat"), 8 << 20) as target,
        AlignedBuffer(2 << 20) as bad_buf,
        AlignedBuffer(2 << 20) as good_buf,
    ):
        good = os.urandom(1 << 20)
        good_buf.view[: 1 << 20] = good
        await engine.pwrite(target, good_buf, 1 << 20, 4 << 20)
        good_buf.view[:] = bytes(good_buf.size)

        outcome: dict[str, object] = {}

        async def bad_read() -> None:
            try:
                await engine.pread(target, bad_buf, 2 << 20, 0)
            except IOFailedError as error:
                outcome["error"] = error

        async def good_read() -> None:
            outcome["n"] = await engine.pread(target, good_buf, 1 << 20, 4 << 20)

        async with anyio.create_task_group() as tg:
            tg.start_soon(bad_read)
            tg.start_soon(good_read)
        error = outcome["error"]
        assert isinstance(error, IOFailedError)
        assert error.errno == errno.EIO
        assert error.target == target.name
        assert error.offset <= FailingFile.bad_offset < error.offset + error.length
        assert "EIO" in str(error)
        assert target.name in str(error)
        assert outcome["n"] == 1 << 20
        assert bytes(good_buf.view[: 1 << 20]) == good
        assert bad_buf.inflight == 0


async def test_kernel_errors_name_target_offset_and_errno(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    read_only = os.open(direct_file.name, os.O_RDONLY | os.O_DIRECT)
    writable, direct_file.fd = direct_file.fd, read_only
    try:
        with pytest.raises(IOFailedError, match=r"write of \d+ bytes at offset 8192 on .*EBADF"):
            await engine.pwrite(direct_file, buffer, 64 << 10, 8192)
    finally:
        direct_file.fd = writable
        os.close(read_only)
    assert buffer.inflight == 0


async def test_trim_punches_holes(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    buffer.view[:] = b"\x5a" * buffer.size
    await engine.pwrite(direct_file, buffer, 4 << 20, 0)
    os.fsync(direct_file.fd)
    allocated = os.fstat(direct_file.fd).st_blocks
    await engine.trim(direct_file, 1 << 20, 2 << 20)
    assert os.fstat(direct_file.fd).st_blocks <= allocated - (2 << 20) // 512
    await engine.pread(direct_file, buffer, 4 << 20, 0)
    assert bytes(buffer.view[(1 << 20) : (3 << 20)]) == bytes(2 << 20)
    assert bytes(buffer.view[: 1 << 20]) == b"\x5a" * (1 << 20)
    assert bytes(buffer.view[3 << 20 : 4 << 20]) == b"\x5a" * (1 << 20)


async def test_zero_length_trim_completes(engine: IOEngine, direct_file: DirectFile) -> None:
    with anyio.fail_after(5):
        await engine.trim(direct_file, 4096, 0)
    engine.trim_blocking(direct_file, 4096, 0)
