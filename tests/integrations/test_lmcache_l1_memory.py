"""LMCache's L1 as the adapter handles it: made resident without a byte changed, and how much
of it is still untouched."""

from __future__ import annotations

import mmap
import os

import pytest

pytest.importorskip("lmcache")

from dualblade.integrations.lmcache.l1_memory import (
    free_memory,
    populate,
    populate_within,
    untouched_bytes,
)
from dualblade.pipeline import CgroupMemory, HostMemory, MemorySnapshot

PAGE = mmap.PAGESIZE


def _address(region: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def test_populate_makes_every_page_resident_and_keeps_the_bytes() -> None:
    region = mmap.mmap(-1, 256 * PAGE)
    address = _address(region)
    try:
        written = os.urandom(3 * PAGE + 17)
        region[5 * PAGE : 5 * PAGE + len(written)] = written  # a few pages touched, unaligned end
        assert untouched_bytes(address, 256 * PAGE) >= 250 * PAGE
        assert populate(address + 100, 256 * PAGE - 100) is None  # an unaligned start too
        assert untouched_bytes(address, 256 * PAGE) == 0
        assert region[5 * PAGE : 5 * PAGE + len(written)] == written
        assert region[: 5 * PAGE] == bytes(5 * PAGE)  # pages never written read as zeroes
    finally:
        region.close()


def test_memory_that_cannot_be_written_says_why() -> None:
    """A read-only mapping cannot be faulted in for writing: the kernel's error is returned and
    nothing is made resident (an unmapped range would do too, but its address could be reused
    by another thread's mapping before the call)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    address = libc.mmap(None, 4 * PAGE, mmap.PROT_READ, private, -1, 0)
    assert address not in (None, ctypes.c_void_p(-1).value)
    try:
        why = populate(address, 4 * PAGE)
        assert why is not None
        assert why.startswith("madvise(MADV_POPULATE_WRITE): ")
        assert untouched_bytes(address, 4 * PAGE) == 4 * PAGE
    finally:
        libc.munmap(address, 4 * PAGE)


def test_nothing_to_populate_is_no_error() -> None:
    assert populate(0, 1 << 20) is None
    assert populate(4096, 0) is None


def test_an_l1_larger_than_the_free_memory_is_left_untouched() -> None:
    """An L1 meant to fill lazily and larger than the memory at hand is not faulted in whole
    (swap, or an OOM kill): the adapter says why and leaves it."""
    region = mmap.mmap(-1, 64 * PAGE)
    address = _address(region)
    try:
        why = populate_within(address, 64 * PAGE, free=64 * PAGE)  # no tenth to spare
        assert why is not None
        assert "nine tenths" in why
        assert untouched_bytes(address, 64 * PAGE) == 64 * PAGE
        assert populate_within(address, 64 * PAGE, free=72 * PAGE) is None
        assert untouched_bytes(address, 64 * PAGE) == 0
    finally:
        region.close()


def test_free_memory_is_the_tighter_of_the_host_and_the_cgroup() -> None:
    host = HostMemory(total_bytes=64 << 30, available_bytes=40 << 30, file_bytes=8 << 30)
    limited = CgroupMemory(1, "/g", 4 << 30, usage_bytes=3 << 30, file_bytes=2 << 30)
    # the cgroup holds 1 GiB that is not page cache: 3 GiB of its limit are free to fill
    assert free_memory(MemorySnapshot(host, limited)) == 3 << 30
    unlimited = CgroupMemory(2, "/g", None, usage_bytes=3 << 30, file_bytes=2 << 30)
    assert free_memory(MemorySnapshot(host, unlimited)) == 40 << 30
    assert free_memory(MemorySnapshot(host, None)) == 40 << 30
    over = CgroupMemory(1, "/g", 1 << 30, usage_bytes=3 << 30, file_bytes=0)
    assert free_memory(MemorySnapshot(host, over)) == 0
