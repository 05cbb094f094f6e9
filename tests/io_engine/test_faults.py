"""Injected faults (EIO, ENOSPC, short, slow) on both backends: typed errors, nothing swallowed.

Each test wraps a real O_DIRECT file in a :class:`FaultyTarget`, so the faults travel the
engine's real completion, retry and error paths (the ring's ``transferred`` hook, the thread
pool's ``preadv``/``pwritev`` calls).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random

import anyio
import pytest

from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine, IOFailedError, PageCacheFile
from dualblade.testing import (
    FaultKind,
    FaultLog,
    FaultPolicy,
    FaultyPageCacheFile,
    FaultyTarget,
    InjectedIOError,
)

pytestmark = pytest.mark.anyio

CHUNK = 64 << 10  # the engine fixture's max_chunk


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("kind", [FaultKind.EIO, FaultKind.ENOSPC])
async def test_hard_fault_fails_the_request_with_its_errno(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer, kind: FaultKind
) -> None:
    faulty = FaultyTarget(direct_file, FaultPolicy(1.0, kinds=(kind,)))
    with pytest.raises(IOFailedError) as caught:
        await engine.pwrite(faulty, buffer, 1 << 20, 0)
    assert caught.value.errno == (errno.EIO if kind is FaultKind.EIO else errno.ENOSPC)
    assert caught.value.op == "write"
    assert isinstance(caught.value, InjectedIOError)
    assert caught.value.serial in {f.serial for f in faulty.injected}
    assert buffer.inflight == 0  # every chunk came back before the caller heard of the error
    # The engine goes on: the same target without faults round-trips.
    faulty.policy.enabled = False
    payload = os.urandom(1 << 20)
    buffer.view[: len(payload)] = payload
    await engine.pwrite(faulty, buffer, len(payload), 0)
    buffer.view[: len(payload)] = bytes(len(payload))
    await engine.pread(faulty, buffer, len(payload), 0)
    assert bytes(buffer.view[: len(payload)]) == payload


async def test_enospc_is_never_injected_into_reads(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    faulty = FaultyTarget(direct_file, FaultPolicy(1.0, kinds=(FaultKind.ENOSPC,)))
    assert await engine.pread(faulty, buffer, 1 << 20, 0) == 1 << 20
    assert faulty.injected == []


@pytest.mark.parametrize("kind", [FaultKind.SHORT, FaultKind.SLOW])
async def test_short_and_slow_chunks_still_move_every_byte(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer, kind: FaultKind
) -> None:
    faulty = FaultyTarget(direct_file, FaultPolicy(1.0, kinds=(kind,), slow_s=0.001))
    payload = os.urandom(1 << 20)
    buffer.view[: len(payload)] = payload
    before = engine.chunks_submitted
    assert await engine.pwrite(faulty, buffer, len(payload), 4096) == len(payload)
    buffer.view[: len(payload)] = bytes(len(payload))
    assert await engine.pread(faulty, buffer, len(payload), 4096) == len(payload)
    assert bytes(buffer.view[: len(payload)]) == payload
    plain_chunks = 2 * len(payload) // CHUNK
    if kind is FaultKind.SHORT:
        # Every short chunk was resubmitted for its remainder.
        assert engine.chunks_submitted - before > plain_chunks
    assert len(faulty.injected) >= plain_chunks


async def test_random_faults_under_concurrency_none_swallowed_none_invented(
    engine: IOEngine, direct_file: DirectFile
) -> None:
    """Sixteen requests at once over disjoint ranges, a quarter of chunks faulted.

    A request whose range got a hard fault must fail with one of those faults; a request without
    one must succeed and move exactly its bytes; nothing leaks.
    """
    fds = _open_fds()
    faulty = FaultyTarget(direct_file, FaultPolicy(0.25, seed=7, slow_s=0.0005))
    rng = random.Random(3)
    region = 1 << 20
    buffers = [AlignedBuffer(region, huge=False) for _ in range(16)]
    payloads = [os.urandom(region) for _ in range(16)]
    outcome: dict[int, BaseException | None] = {}
    written: set[int] = set()  # regions that one whole write reached

    async def one(i: int, write: bool) -> None:
        buf = buffers[i]
        try:
            if write:
                buf.view[:] = payloads[i]
                await engine.pwrite(faulty, buf, region, i * region)
            else:
                await engine.pread(faulty, buf, region, i * region)
            outcome[i] = None
        except IOFailedError as error:
            outcome[i] = error

    for write in (True, False):
        for _round in range(3):
            outcome.clear()
            mark = len(faulty.injected)
            async with anyio.create_task_group() as tg:
                for i in rng.sample(range(16), 16):
                    tg.start_soon(one, i, write)
            new = faulty.injected[mark:]
            for i in range(16):
                hard = {
                    f.serial
                    for f in new
                    if f.kind.hard and i * region <= f.offset < (i + 1) * region
                }
                error = outcome[i]
                if hard:
                    assert isinstance(error, InjectedIOError), f"fault in request {i} swallowed"
                    assert error.serial in hard
                else:
                    assert error is None, f"request {i} failed without an injected fault"
                    if write:
                        written.add(i)
                    elif i in written:
                        assert bytes(buffers[i].view) == payloads[i]
    assert any(f.kind.hard for f in faulty.injected)
    assert any(f.kind is FaultKind.SHORT for f in faulty.injected)
    for buf in buffers:
        assert buf.inflight == 0
        buf.close()
    assert _open_fds() == fds


async def test_cancelled_request_with_faults_releases_its_buffer(
    engine: IOEngine, direct_file: DirectFile, buffer: AlignedBuffer
) -> None:
    faulty = FaultyTarget(direct_file, FaultPolicy(0.5, seed=1, slow_s=0.002))
    for delay in (0.0, 0.0005, 0.002, 0.005):
        with anyio.move_on_after(delay):
            with contextlib.suppress(IOFailedError):
                await engine.pwrite(faulty, buffer, 4 << 20, 0)
        assert buffer.inflight == 0


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="rate"):
        FaultPolicy(1.5)
    with pytest.raises(ValueError, match="kind"):
        FaultPolicy(0.1, kinds=())
    with pytest.raises(ValueError, match="slow_s"):
        FaultPolicy(0.1, slow_s=-1)


def test_policy_is_repeatable() -> None:
    a, b = FaultPolicy(0.3, seed=5), FaultPolicy(0.3, seed=5)
    assert [a.decide("write") for _ in range(200)] == [b.decide("write") for _ in range(200)]


@pytest.mark.parametrize("kind", list(FaultKind))
async def test_faults_on_the_page_cache_path(
    engine: IOEngine, tmp_path: os.PathLike[str], buffer: AlignedBuffer, kind: FaultKind
) -> None:
    """Buffered files (Group 1) take the same faults; short transfers of odd byte counts too."""
    with PageCacheFile(os.path.join(tmp_path, "kpu.bin"), 1 << 20) as file:
        faulty = FaultyTarget(file, FaultPolicy(1.0, kinds=(kind,), slow_s=0.0005))
        payload = os.urandom(300_001)  # not a multiple of anything
        buffer.view[: len(payload)] = payload
        if kind.hard:
            with pytest.raises(IOFailedError) as caught:
                await engine.pwrite(faulty, buffer, len(payload), 7)
            assert isinstance(caught.value, InjectedIOError)
            assert buffer.inflight == 0
            return
        assert await engine.pwrite(faulty, buffer, len(payload), 7) == len(payload)
        buffer.view[: len(payload)] = bytes(len(payload))
        assert await engine.pread(faulty, buffer, len(payload), 7) == len(payload)
        assert bytes(buffer.view[: len(payload)]) == payload


async def test_faulty_page_cache_file_keeps_its_page_cache_calls(
    engine: IOEngine, tmp_path: os.PathLike[str], buffer: AlignedBuffer
) -> None:
    """The subclass injects like the wrapper, records into a shared log, and its residency,
    fadvise and mmap calls stay those of a real page-cache file."""
    log = FaultLog()
    policy = FaultPolicy(1.0, kinds=(FaultKind.EIO,))
    path = os.path.join(tmp_path, "kpu.bin")
    file = FaultyPageCacheFile(path, 1 << 20, policy, log)
    with file:
        with pytest.raises(InjectedIOError) as caught:
            await engine.pwrite(file, buffer, 64 << 10, 0)
        assert caught.value.target == path
        assert [f.target for f in log.injected] == [path] * len(log.injected)
        policy.enabled = False
        buffer.view[: 64 << 10] = b"x" * (64 << 10)
        await engine.pwrite(file, buffer, 64 << 10, 0)
        assert file.resident_bytes(0, 64 << 10) == 64 << 10
        assert bytes(file.mmap()[:4]) == b"xxxx"
        file.advise_dontneed()
