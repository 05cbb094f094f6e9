"""LMCache's L1 memory, as the page-cache budget must see it.

The store's budget is what the memory limit leaves once the memory in use is counted. LMCache
hands the adapter its L1 buffer's address and size (``l1_memory_desc``); the part of it that no
one has touched yet is not in use yet, so a budget read at the adapter's start would count it
as room for the page cache — and once LMCache fills its L1, objects placed on that promise
would be evicted by the kernel, the cliff that dual-path placement exists to avoid (measured
here under a memory cgroup: every object placed on the page-cache path, 0 % of loads hit).
The adapter therefore keeps the untouched part of L1 out of the budget, and asks again at each
of the budget's readings: as LMCache fills L1, what it touched is counted in use and leaves the
untouched part, so the budget stays put. (Measured once at the start, it was counted twice once
touched: under ``lmcache bench l2`` the budget fell from about 1 GiB to 0.5 GiB while the
objects were stored, and the last ones stored found no room on the page-cache path.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import Any

_PAGE = mmap.PAGESIZE


def _mincore() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.mincore
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return fn


def untouched_bytes(address: int, size: int) -> int:
    """Bytes of ``[address, address + size)`` whose pages are not resident (never touched, or
    swapped out); 0 when the kernel cannot say (``mincore`` fails), so that nothing is held
    back on a guess."""
    if size <= 0 or address <= 0:
        return 0
    start = address - address % _PAGE
    pages = -(-(address + size - start) // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _mincore()(start, pages * _PAGE, vec) != 0:
        return 0
    # Bit 0 of each byte says resident; the others are reserved. Counted in C: the budget asks
    # four times a second, and 1 GiB of L1 is 262,144 pages.
    untouched = bytes(vec).translate(_NOT_RESIDENT).count(1)
    return max(0, min(size, untouched * _PAGE))


#: Maps a ``mincore`` flag byte to 1 where its page is not resident, else 0.
_NOT_RESIDENT = bytes(0 if flag & 1 else 1 for flag in range(256))


def l1_region(l1_memory_desc: Any) -> tuple[int, int] | None:
    """The address and size of LMCache's L1 description (None, for None or one without
    them)."""
    address = getattr(l1_memory_desc, "ptr", None)
    size = getattr(l1_memory_desc, "size", None)
    if not isinstance(address, int) or not isinstance(size, int):
        return None
    return address, size
