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

The adapter also makes L1 resident when it starts, where it fits in the memory free then
(:func:`populate_within`), its bytes unchanged. Our
direct loads land in L1 by O_DIRECT, so L1's physical pages are the I/O's scatter list. Pages
that LMCache touches late, once the page cache has filled the memory cgroup, come one at a time
from reclaim: under ``lmcache bench l2`` in a 2.5 GiB cgroup, L1's load half had 1.3 pages per
physically contiguous run (24.5 without the limit), a 1 MiB read became ~256 segments, split in
two requests by the disk's segment limit, and the virtio disk here took 24-70 ms per request
instead of about 1 ms: loads ran at 0.84-0.87 GB/s against 1.56-1.80 with L1 made resident at
the start, the same objects on the same paths. In LMCache's server L1 is pinned for the GPU and
resident already; there this costs a walk over its page tables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Any

from dualblade.pipeline import MemorySnapshot

_PAGE = mmap.PAGESIZE


#: ``madvise`` advice (Linux 5.14): fault a range in as if written to, leaving its bytes as they
#: are (a page never touched becomes a page of zeroes, which is what reading it gave).
MADV_POPULATE_WRITE = 23


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mincore() -> Any:
    fn = _libc().mincore
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


def populate(address: int, size: int) -> str | None:
    """Make ``[address, address + size)`` resident now, its bytes unchanged (see the module
    docstring). Returns None once done, else why not: the kernel's error (one older than 5.14
    does not know the advice; memory running out part-way leaves the pages made resident so
    far as they are, which is what LMCache would have touched anyway)."""
    if size <= 0 or address <= 0:
        return None
    start = address - address % _PAGE
    fn = _libc().madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    if fn(start, address + size - start, MADV_POPULATE_WRITE) != 0:
        return f"madvise(MADV_POPULATE_WRITE): {os.strerror(ctypes.get_errno())}"
    return None


def free_memory(snapshot: MemorySnapshot) -> int:
    """Bytes that can be made resident now without reclaiming more than page cache: the host's
    ``MemAvailable``, and under a memory cgroup's limit what the limit leaves beside the memory
    the group holds that is not reclaimable page cache."""
    room = snapshot.host.available_bytes
    cgroup = snapshot.cgroup
    if cgroup is not None and cgroup.limit_bytes is not None:
        room = min(room, cgroup.limit_bytes - cgroup.non_file_bytes)
    return max(0, room)


def populate_within(address: int, size: int, free: int) -> str | None:
    """:func:`populate`, where the untouched part of the range fits in ``free`` bytes (see
    :func:`free_memory`) with a tenth of them to spare; else why not, the range left as it was.
    An L1 larger than the memory at hand, meant to fill lazily, would otherwise be faulted in
    whole at the start, into swap or an OOM kill."""
    untouched = untouched_bytes(address, size)
    if untouched > free * 9 // 10:
        return (
            f"its untouched {untouched} bytes are more than nine tenths of the {free} bytes "
            "of memory free now"
        )
    return populate(address, size)


def l1_region(l1_memory_desc: Any) -> tuple[int, int] | None:
    """The address and size of LMCache's L1 description (None, for None or one without
    them)."""
    address = getattr(l1_memory_desc, "ptr", None)
    size = getattr(l1_memory_desc, "size", None)
    if not isinstance(address, int) or not isinstance(size, int):
        return None
    return address, size
