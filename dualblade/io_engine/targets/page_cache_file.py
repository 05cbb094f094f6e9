"""A buffered file: the page-cache path (Group 1), and the baseline's way of reaching storage.

Reads and writes go through the kernel page cache (io_uring buffered I/O, or ``preadv`` in compat
mode); :meth:`PageCacheFile.mmap` gives the FlexLLMGen-style memory-mapped view. The
``posix_fadvise`` hooks let a cache policy evict (``DONTNEED``) or prefetch (``WILLNEED``) ranges.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from pathlib import Path

from dualblade.io_engine._uapi import IOSQE_ASYNC
from dualblade.io_engine.errors import IOFailedError, TargetError
from dualblade.io_engine.targets._private_dirs import make_private_dirs
from dualblade.io_engine.targets.base import Target

#: A buffered read or write is cut into about this many commands: each is one memory copy by an
#: io_uring worker, so the copies of one request run side by side.
COPIES_PER_REQUEST = 8
#: ... none smaller than this (each costs the ring thread a completion in Python) ...
MIN_COPY_BYTES = 1 << 20
#: ... nor larger than this (the default ``max_transfer``). Measured on the H200 machine, moving
#: a resident OPT-6.7B cache to the GPU in 64 MiB pieces (``pipebench --path page-cache``, 4 copy
#: threads): 1 MiB commands for every request (the device's chunk, as before) reached 21-23.5
#: GB/s, 8 MiB 26-31 GB/s, 32 MiB 22-25. Here (2 cores, 3.3 MB layers) 1 MiB commands beat one
#: command per layer: 0.70-0.81 of the limit against 0.67-0.75 (docs/bench.md).
PAGE_CACHE_CHUNK = 8 << 20


class PageCacheFile(Target):
    """A regular file used through the page cache.

    Its commands carry ``IOSQE_ASYNC``: a buffered read of cached pages (or a buffered write)
    is a memory copy that io_uring would otherwise do inline, on the one thread that submits —
    the ring thread, for every copy thread of the store at once. Punted to io_uring's worker
    threads the copies of different files run on different CPUs (measured on the GPU machine:
    the page-cache path moved 1.9 GB/s through the inline ring thread, while FlexGen's four
    threads copied 7 GB/s from the same cache).

    Args:
        path: the file; parent folders are created.
        size: the file is extended to at least this many bytes, with its blocks allocated
            (``posix_fallocate``) where the file system can: a full disk is then an error here,
            not a SIGBUS when a memory map (the baseline's path) first writes a hole.
        max_transfer: the largest single command in bytes.

    Raises:
        TargetError: the file cannot be opened.
        IOFailedError: no room for it (errno ENOSPC; the file is removed).
    """

    sqe_flags = IOSQE_ASYNC
    #: A copy out of (or into) memory must not queue behind the device's chunks.
    lane = "page-cache"

    def __init__(
        self, path: str | os.PathLike[str], size: int, *, max_transfer: int = PAGE_CACHE_CHUNK
    ) -> None:
        self.name = str(path)
        self.lba_size = 1
        self.alignment = 1
        self.max_transfer = max_transfer
        file = Path(path)
        try:
            make_private_dirs(file.parent)
            existed = file.exists()
            self.fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise TargetError(
                f"cannot open {file} for the page-cache path: {error.strerror}"
            ) from error
        try:
            if os.fstat(self.fd).st_size < size:
                _allocate(self.fd, size)
        except OSError as error:
            os.close(self.fd)
            if not existed:
                file.unlink(missing_ok=True)
            # The same error a write that finds no room raises: a full disk is one kind of
            # failure wherever it is met.
            raise IOFailedError(
                str(file), "allocate", 0, size, errno=error.errno, detail="no room for the file"
            ) from error
        self.size = max(size, os.fstat(self.fd).st_size)
        self._mmap: mmap.mmap | None = None

    def command_bytes(self, size: int, max_chunk: int | None) -> int:
        """About :data:`COPIES_PER_REQUEST` commands per request, of :data:`MIN_COPY_BYTES` to
        ``max_transfer`` bytes each, whole pages. The engine's ``max_chunk`` is a device's
        command size and does not apply to memory copies."""
        per_copy = -(-size // COPIES_PER_REQUEST)
        per_copy = -(-per_copy // mmap.PAGESIZE) * mmap.PAGESIZE
        return min(self.max_transfer, max(MIN_COPY_BYTES, per_copy))

    # -- fadvise hooks -------------------------------------------------------------------------
    def pread_cached(self, view: memoryview, offset: int) -> int:
        """``preadv2`` with ``RWF_NOWAIT`` into ``view``: the bytes from ``offset`` on that are
        in the page cache now, never waiting for the disk; 0 where the first page is not
        cached (``EAGAIN``) or the kernel cannot say (``EOPNOTSUPP``). The read starts
        readahead for the pages it misses without waiting for it; pages that readahead filled
        before the copy reached them are returned too, so a miss is not always 0.

        Raises:
            OSError: any other error of the read.
        """
        try:
            return os.preadv(self.fd, [view], offset, os.RWF_NOWAIT)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return 0
            raise

    def advise_dontneed(self, offset: int = 0, length: int = 0) -> None:
        """Drop clean cached pages of the range (length 0: to the end); dirty pages stay."""
        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def advise_willneed(self, offset: int = 0, length: int = 0) -> None:
        """Start reading the range into the page cache."""
        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_WILLNEED)

    def advise_sequential(self) -> None:
        """Tell readahead the file is read sequentially."""
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def flush(self) -> None:
        """Write the file's dirty pages back to storage and wait (``fdatasync``).

        Raises:
            IOFailedError: write-back failed (op ``write-back``: EIO, ENOSPC, ...), now or
                since the last check. The kernel marks pages it could not write clean anyway,
                so storage holds stale bytes under them: dropping them next (``DONTNEED``, or
                eviction) would make a later read return stale or zero data.
        """
        try:
            os.fdatasync(self.fd)
        except OSError as error:
            raise self._write_back_error(error.errno, 0, self.size) from None

    def write_back(self, offset: int, length: int) -> None:
        """Write the range's dirty pages back and wait (``sync_file_range``): cheaper than
        :meth:`flush` for a range (no file metadata to commit: the file is preallocated).

        Raises:
            IOFailedError: as :meth:`flush`.
        """
        flags = _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER
        code = _sync_file_range(self.fd, offset, length, flags)
        if code:
            raise self._write_back_error(code, offset, length)

    def start_write_back(self, offset: int, length: int) -> None:
        """Start writing the range's dirty pages back, without waiting for them
        (``sync_file_range`` with only ``WRITE``); the pages stay cached, and clean.

        Left to the kernel, a prefill's gigabytes of dirty pages are written back seconds
        later, under the first decode steps: in a memory cgroup near its limit those steps'
        appends are throttled until the write-back catches up (OPT-6.7B at 11 GiB on the H200
        machine: a first step of 1.7-4.0 s against 0.45 s for the next, with 2.3-5.6 GB written
        during the decode). Started as each layer is written, the write-back runs under the
        prefill's compute instead.

        Raises:
            IOFailedError: as :meth:`flush` (a write-back that failed since the last check).
        """
        code = _sync_file_range(self.fd, offset, length, _SYNC_WRITE)
        if code:
            raise self._write_back_error(code, offset, length)

    def check_write_back(self) -> None:
        """Raise a write-back error the kernel met since the last check, starting no I/O
        (``sync_file_range`` with only ``WAIT_BEFORE`` reports the file's error sequence).

        Call it before reading pages that may have been dropped since they were written.

        Raises:
            IOFailedError: as :meth:`flush`.
        """
        code = _sync_file_range(self.fd, 0, 0, _SYNC_WAIT_BEFORE)
        if code:
            raise self._write_back_error(code, 0, self.size)

    def drop(self, offset: int = 0, length: int = 0) -> None:
        """Write the range back, then drop its cached pages (length 0: to the end). The pages
        stay when write-back fails, so nothing stale can be read in their place.

        Raises:
            IOFailedError: as :meth:`flush`.
        """
        self.write_back(offset, length if length else max(0, self.size - offset))
        self.advise_dontneed(offset, length)

    def evict(self) -> None:
        """Write back, then drop every cached page of the file.

        Raises:
            IOFailedError: as :meth:`flush` (the pages stay).
        """
        self.flush()
        self.advise_dontneed()

    def _write_back_error(self, code: int | None, offset: int, length: int) -> IOFailedError:
        return IOFailedError(
            self.name,
            "write-back",
            offset,
            length,
            errno=code or errno.EIO,
            detail="the page cache could not write the file back",
        )

    # -- mmap path ---------------------------------------------------------------------------
    def mmap(self) -> mmap.mmap:
        """A shared read-write mapping of the whole file (created once, closed with the target)."""
        if self._mmap is None:
            self._mmap = mmap.mmap(self.fd, self.size)
        return self._mmap

    def copy_mapped(self, memory: memoryview, offset: int, *, to_memory: bool) -> None:
        """Copy ``len(memory)`` bytes between the file's mapping at ``offset`` and ``memory``.

        A torch copy, as FlexLLMGen's ``copy_`` from its numpy memmap: it releases the GIL for
        the whole copy, page faults included. A memoryview slice assignment would hold the GIL
        throughout and stall every other Python thread of the process (the application's compute
        among them) for as long as the kernel takes to fault the mapping's pages in.
        """
        import torch

        mapping = memoryview(self.mmap())
        nbytes = memory.nbytes
        file_bytes = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        memory_bytes = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes)
        try:
            if to_memory:
                memory_bytes.copy_(file_bytes)
            else:
                file_bytes.copy_(memory_bytes)
        finally:
            del file_bytes, memory_bytes  # they export the views: release needs them gone
            mapping.release()

    def resident_bytes(self, offset: int, length: int) -> int:
        """Bytes of ``[offset, offset + length)`` now in the page cache.

        This is how dualblade measures its page-cache hit rate: a read's resident bytes just
        before it is issued are its hits. Counted by ``cachestat`` where the kernel has it (a
        few microseconds from the descriptor: see ``_cachestat``), else by ``mincore`` through
        the file's mapping (about 0.5 ms per 33 MiB here).
        """
        from dualblade.io_engine._cachestat import cached_bytes
        from dualblade.io_engine._libc import mincore_resident

        length = min(length, self.size - offset)
        if length <= 0:
            return 0
        counted = cached_bytes(self.fd, offset, length)
        if counted is not None:
            return counted
        return mincore_resident(self.mmap(), offset, length)

    def trim_blocking(self, offset: int, length: int) -> None:
        from dualblade.io_engine import _uapi
        from dualblade.io_engine._libc import fallocate

        fallocate(self.fd, _uapi.FALLOC_FL_PUNCH_HOLE | _uapi.FALLOC_FL_KEEP_SIZE, offset, length)

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        super().close()


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_libc.sync_file_range.restype = ctypes.c_int
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


def _sync_file_range(fd: int, offset: int, length: int, flags: int) -> int:
    """``sync_file_range``; returns 0, or the errno it failed with."""
    if _libc.sync_file_range(fd, offset, length, flags) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def _allocate(fd: int, size: int) -> None:
    """Extend the file to ``size`` bytes with its blocks allocated; sparse where the file
    system cannot allocate ahead (the hole then fills on first write, as before)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        os.ftruncate(fd, size)
