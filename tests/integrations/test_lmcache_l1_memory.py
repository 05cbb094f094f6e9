"""LMCache's L1 as the adapter handles it: made resident without a byte changed, and how much
of it is still untouched."""

from __future__ import annotations

import mmap
import os

import pytest

pytest.importorskip("lmcache")

from dualblade.integrations.lmcache.l1_memory import populate, untouched_bytes

PAGE = mmap.PAGESIZE


def _address(region: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def test_populate_makes_every_page_resident_and_keeps_the_bytes() -> None:
    region = mmap.mmap(-1, 256 * PAGE)
    try:
        address = _address(region)
        written = os.urandom(3 * PAGE + 17)
        region[5 * PAGE : 5 * PAGE + len(written)] = written  # a few pages touched, unaligned end
        assert untouched_bytes(address, 256 * PAGE) >= 250 * PAGE
        assert populate(address + 100, 256 * PAGE - 100) is None  # an unaligned start too
        assert untouched_bytes(address, 256 * PAGE) == 0
        assert region[5 * PAGE : 5 * PAGE + len(written)] == written
        assert region[: 5 * PAGE] == bytes(5 * PAGE)  # pages never written read as zeroes
    finally:
        del address
        region.close()


def test_populate_of_memory_not_mapped_says_why() -> None:
    region = mmap.mmap(-1, 4 * PAGE)
    address = _address(region)
    region.close()  # unmapped now: nothing there to make resident
    why = populate(address, 4 * PAGE)
    assert why is not None
    assert why.startswith("madvise(MADV_POPULATE_WRITE): ")


def test_nothing_to_populate_is_no_error() -> None:
    assert populate(0, 1 << 20) is None
    assert populate(4096, 0) is None
