"""NVMe passthrough on a real namespace: identify, chunked round trips, DSM, errors, cancellation.

Run inside ``scripts/nvme-vm`` (QEMU's emulated controller); elsewhere every test skips. The
harness describes the namespace it made in ``DUALBLADE_NVME_VM_{LBA_SIZE,MDTS,SIZE}``; on a real
device (those unset) only the self-consistency of identify is checked. Each test works in its own
slot of the namespace and writes fresh random bytes, so no test can pass on another's data.

No torch here: importing it takes ~40 s in the TCG guest.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from dualblade.io_engine import AlignedBuffer, IOEngine, IOFailedError, NvmeNamespace

pytestmark = pytest.mark.anyio

MiB = 1 << 20
#: Each test gets its own 32 MiB slot of the namespace (slot 0 is never used).
SLOT = 32 * MiB


@pytest.fixture
def anyio_backend() -> str:
    """asyncio only: each extra backend costs seconds in the guest (see the cancel test)."""
    return "asyncio"


@pytest.fixture(scope="module")
def namespace(nvme_namespace_path: Path) -> Iterator[NvmeNamespace]:
    with NvmeNamespace(str(nvme_namespace_path)) as target:
        assert isinstance(target, NvmeNamespace)
        yield target


def vm_param(name: str) -> int | None:
    """A ``DUALBLADE_NVME_VM_<name>`` the harness set, or None outside scripts/nvme-vm."""
    value = os.environ.get(f"DUALBLADE_NVME_VM_{name}")
    return None if value is None else int(value)


def slot(index: int) -> int:
    return index * SLOT


def fill_random(buf: AlignedBuffer, size: int, seed: object, at: int = 0) -> str:
    """Fill ``buf[at:at + size]`` with seeded random bytes; returns their SHA-256."""
    data = random.Random(str(seed)).randbytes(size)
    buf.view[at : at + size] = data
    return hashlib.sha256(data).hexdigest()


def digest(buf: AlignedBuffer, size: int, offset: int = 0) -> str:
    return hashlib.sha256(buf.view[offset : offset + size]).hexdigest()


# -- identify ---------------------------------------------------------------------------------
def test_identify_matches_the_namespace(namespace: NvmeNamespace) -> None:
    lba = namespace.lba_size
    assert lba in (512, 4096)
    assert namespace.namespace.metadata_size == 0
    assert namespace.size == namespace.namespace.nsze * lba
    assert namespace.controller.supports_dsm
    if (want_lba := vm_param("LBA_SIZE")) is not None:
        assert "QEMU" in namespace.controller.model
        assert lba == want_lba
        assert namespace.size == vm_param("SIZE")
        assert namespace.controller.mdts == vm_param("MDTS")

    # Buffers need LBA alignment only: the store's padded rows start on LBA boundaries.
    assert namespace.alignment == lba

    # max transfer: min(MDTS, max_hw_sectors_kb, max_segments pages, 65536 blocks), in LBAs;
    # one page fewer when a chunk may start inside a page (LBAs smaller than a page).
    mdts_bytes = namespace.controller.max_transfer_bytes()
    if namespace.controller.mdts:
        assert mdts_bytes == (1 << namespace.controller.mdts) * 4096
    segments = namespace.queue["max_segments"]
    hw_bytes = namespace.queue["max_hw_sectors_kb"] * 1024
    assert 1 < segments <= 4096
    pages = segments - 1 if lba < 4096 else segments
    caps = [65536 * lba, hw_bytes, pages * 4096, *([mdts_bytes] if mdts_bytes else [])]
    assert namespace.max_transfer == min(caps) // lba * lba
    assert namespace.max_transfer % lba == 0
    assert lba <= namespace.max_transfer <= pages * 4096
    if mdts_bytes:
        assert namespace.max_transfer <= mdts_bytes
        # The QEMU controller (127 segments): one page short of MDTS at mdts=7, the segments'
        # 508 KiB at mdts=8 (scripts/nvme-vm --mdts 8). Never half of the smaller limit.
        assert namespace.max_transfer > min(mdts_bytes, pages * 4096) // 2

    described = namespace.describe()
    assert described["lba_size"] == lba
    assert described["max_segments"] == segments
    assert described["mdts"] == namespace.controller.mdts


# -- round trips -----------------------------------------------------------------------------
SIZES = ["one-lba", "one-page", "max-transfer", "max-transfer+lba", "4-chunks+3-lbas", "33-chunks"]


def size_for(name: str, namespace: NvmeNamespace) -> int:
    lba, chunk = namespace.lba_size, namespace.max_transfer
    return {
        "one-lba": lba,
        "one-page": 4096,
        "max-transfer": chunk,
        "max-transfer+lba": chunk + lba,
        "4-chunks+3-lbas": 4 * chunk + 3 * lba,
        "33-chunks": 33 * chunk,  # fills QD 32 with one left waiting
    }[name]


#: Every size at every queue depth, except 33 chunks (slow to checksum under TCG) only at QD 32.
ROUND_TRIPS = [
    (size_name, queue_depth)
    for size_name in SIZES
    for queue_depth in (1, 4, 32)
    if size_name != "33-chunks" or queue_depth == 32
]


@pytest.mark.parametrize(("size_name", "queue_depth"), ROUND_TRIPS)
async def test_round_trip_is_byte_exact_and_chunked(
    namespace: NvmeNamespace, queue_depth: int, size_name: str
) -> None:
    size = size_for(size_name, namespace)
    index = 1 + SIZES.index(size_name) * 3 + [1, 4, 32].index(queue_depth)
    # Start one LBA into the slot: an odd starting LBA exercises the SLBA encoding.
    offset = slot(index) + namespace.lba_size
    chunks = math.ceil(size / namespace.max_transfer)
    with (
        IOEngine(queue_depth=queue_depth, compat="off", passthrough=True) as engine,
        AlignedBuffer(size) as buf,
    ):
        written = fill_random(buf, size, (size_name, queue_depth))
        assert await engine.pwrite(namespace, buf, size, offset) == size
        assert engine.chunks_submitted == chunks
        assert engine.peak_inflight == min(queue_depth, chunks)
        buf.view[:size] = bytes(size)

        assert await engine.pread(namespace, buf, size, offset) == size
        assert engine.chunks_submitted == 2 * chunks
        assert digest(buf, size) == written
        assert buf.inflight == 0

        # The blocking API moves the same bytes.
        buf.view[:size] = bytes(size)
        assert engine.read(namespace, buf, size, offset) == size
        assert digest(buf, size) == written


@pytest.mark.parametrize("max_chunk", [None, 64 * 1024])
async def test_round_trip_from_an_lba_aligned_buffer_offset(
    namespace: NvmeNamespace, max_chunk: int | None
) -> None:
    """Buffer offsets need LBA alignment only (the store's rows start mid-page on 512-byte LBAs);
    ``max_chunk`` below the controller's limit splits finer."""
    lba = namespace.lba_size
    at = 3 * lba  # inside a page for 512-byte LBAs
    size = 2 * namespace.max_transfer + lba
    offset = slot(20) + (4 * MiB if max_chunk else 0)
    chunk = namespace.max_transfer if max_chunk is None else max_chunk
    with (
        IOEngine(queue_depth=4, compat="off", passthrough=True, max_chunk=max_chunk) as engine,
        AlignedBuffer(at + size, huge=False) as buf,
    ):
        written = fill_random(buf, size, ("offsets", max_chunk), at)
        await engine.pwrite(namespace, buf, size, offset, buf_offset=at)
        assert engine.chunks_submitted == math.ceil(size / chunk)
        buf.view[: at + size] = bytes(at + size)
        await engine.pread(namespace, buf, size, offset, buf_offset=at)
        assert digest(buf, size, at) == written
        assert bytes(buf.view[:at]) == bytes(at)


# -- Dataset Management ------------------------------------------------------------------------
async def test_deallocate_reads_back_zeros(namespace: NvmeNamespace) -> None:
    lba = namespace.lba_size
    size = 2 * MiB
    offset = slot(21)
    # Odd LBAs on both ends, longer than one max transfer.
    trim_start, trim_length = 3 * lba, namespace.max_transfer + 5 * lba
    with (
        IOEngine(queue_depth=8, compat="off", passthrough=True) as engine,
        AlignedBuffer(size) as buf,
    ):
        fill_random(buf, size, "dsm")
        original = bytes(buf.view[:size])
        await engine.pwrite(namespace, buf, size, offset)
        submitted = engine.chunks_submitted

        await engine.trim(namespace, offset + trim_start, trim_length)
        assert engine.chunks_submitted == submitted + 1  # one DSM command, one range

        buf.view[:size] = b"\xa5" * size
        await engine.pread(namespace, buf, size, offset)
        back = bytes(buf.view[:size])
        end = trim_start + trim_length
        assert back[trim_start:end] == bytes(trim_length)
        assert back[:trim_start] == original[:trim_start]
        assert back[end:] == original[end:]


# -- errors ----------------------------------------------------------------------------------
async def test_read_past_the_end_is_an_nvme_status(nvme_namespace_path: Path) -> None:
    """A target that believes the namespace is larger: the controller answers LBA out of range."""
    with NvmeNamespace(str(nvme_namespace_path)) as target:
        real_size = target.size
        target.size = real_size + 16 * MiB  # our own range check now lets the read through
        past = real_size + 4 * MiB
        with (
            IOEngine(queue_depth=4, compat="off", passthrough=True) as engine,
            AlignedBuffer(64 * 1024) as buf,
        ):
            with pytest.raises(IOFailedError) as info:
                await engine.pread(target, buf, 64 * 1024, past)
            error = info.value
            assert error.nvme_status == 0x4080  # DNR + generic "LBA out of range"
            assert error.errno is None
            path = str(nvme_namespace_path)
            assert (error.target, error.op, error.offset) == (path, "read", past)
            message = str(error)
            assert path in message
            assert f"offset {past}" in message
            assert "0x4080" in message
            assert "LBA out of range" in message
            assert buf.inflight == 0

            # The engine is still good for in-range I/O afterwards.
            fill_random(buf, 4096, "after-error")
            await engine.pwrite(target, buf, 4096, slot(22))
            assert await engine.pread(target, buf, 4096, slot(22)) == 4096


async def test_transfer_over_mdts_is_refused_by_the_kernel(nvme_namespace_path: Path) -> None:
    """The kernel does not split passthrough commands: over MDTS is -EINVAL, with a hint."""
    probe = NvmeNamespace(str(nvme_namespace_path))
    mdts = probe.controller.max_transfer_bytes()
    probe.close()
    if mdts is None:  # pragma: no cover - the harness always sets an MDTS
        pytest.skip("the controller sets no MDTS")
    too_big = 2 * mdts
    with (
        NvmeNamespace(str(nvme_namespace_path), max_transfer=too_big) as target,
        IOEngine(queue_depth=2, compat="off", passthrough=True) as engine,
        AlignedBuffer(too_big) as buf,
    ):
        with pytest.raises(IOFailedError) as info:
            await engine.pread(target, buf, too_big, slot(23))
        assert info.value.errno == 22
        assert "exceeds the controller's limit" in str(info.value)
        assert buf.inflight == 0


# -- cancellation ----------------------------------------------------------------------------
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_cancelled_read_does_not_corrupt_the_next(namespace: NvmeNamespace) -> None:
    """Cancel a many-chunk read at several points, then read other bytes into the same buffer.

    NVMe passthrough commands cannot be cancelled once on the device, so the engine must wait for
    their completions before the cancellation reaches us: no DMA may land after we regain the
    buffer.
    """
    size = 16 * namespace.max_transfer
    first, second = slot(24), slot(25)
    with (
        IOEngine(queue_depth=4, compat="off", passthrough=True) as engine,
        AlignedBuffer(size) as buf,
    ):
        fill_random(buf, size, "cancel-first")
        await engine.pwrite(namespace, buf, size, first)
        expected = fill_random(buf, size, "cancel-second")
        await engine.pwrite(namespace, buf, size, second)

        cancelled = 0
        for delay in (0.0, 0.0005, 0.002, 0.005, 0.02):
            buf.view[:size] = bytes(size)
            with anyio.move_on_after(delay) as scope:
                await engine.pread(namespace, buf, size, first)
            cancelled += scope.cancelled_caught
            assert buf.inflight == 0
            assert engine.peak_inflight <= 4

            buf.view[:size] = b"\x5a" * size
            assert await engine.pread(namespace, buf, size, second) == size
            assert digest(buf, size) == expected, f"corrupted after a cancel at {delay} s"
        assert cancelled >= 1
        buf.close()  # allowed: nothing is in flight
