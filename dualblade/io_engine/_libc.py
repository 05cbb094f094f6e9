"""The few libc calls Python's ``os`` module lacks."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

from dualblade.io_engine import _uapi

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_libc.fallocate.restype = ctypes.c_int


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """``fallocate(2)`` with a mode (Python's ``os.posix_fallocate`` has none).

    Raises:
        OSError: with the errno the kernel reported.
    """
    if _libc.fallocate(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mincore.restype = ctypes.c_int


def mincore_resident(mapping: mmap.mmap, offset: int, length: int) -> int:
    """Bytes of ``mapping[offset : offset + length]`` resident in memory, page-granular.

    Raises:
        OSError: with the errno mincore reported.
    """
    page = mmap.PAGESIZE
    start = offset // page * page
    end = min(len(mapping), offset + length)
    if end <= start:
        return 0
    pages = -(-(end - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        base = ctypes.addressof(anchor)
        if _libc.mincore(base + start, end - start, vector) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        del anchor
    flags = bytes(vector)
    resident = (pages - flags.count(0)) * page
    # Trim the parts of the first and last page that lie outside the asked range.
    if flags[0] & 1:
        resident -= offset - start
    if flags[-1] & 1:
        resident -= start + pages * page - end
    return resident


_libc.syscall.restype = ctypes.c_long


def cachestat_pages(fd: int, start: int, length: int) -> int:
    """``cachestat(2)`` (Linux 6.5): how many of the pages covering ``[start, start + length)``
    of ``fd`` are in the page cache. glibc has no wrapper: called by its syscall number.

    Raises:
        OSError: with the errno the kernel reported (``ENOSYS`` where it has no cachestat).
    """
    span = _uapi.CachestatRange(start, length)
    stat = _uapi.Cachestat()
    number = ctypes.c_long(_uapi.NR_CACHESTAT)
    flags = ctypes.c_uint(0)
    if _libc.syscall(number, ctypes.c_int(fd), ctypes.byref(span), ctypes.byref(stat), flags):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(stat.nr_cache)
