"""The storage side of one copy-thread transfer, one class per path a KPU can take.

- :class:`DirectSpan` — Group 2: the KPU's extent on the direct target, through the ring
  (O_DIRECT file, raw block device or NVMe passthrough). Storage DMA goes straight into the copy
  thread's pinned buffer.
- :class:`PageCacheSpan` — Group 1: the KPU's own file, buffered I/O through the ring, so the
  bytes pass through the page cache. With ``evict`` (the ``cache-policy`` configuration) the
  range is written back and dropped after use, so layers beyond the budget cannot push the
  budgeted ones out.
- :class:`MmapSpan` — the FlexLLMGen-style baseline: the same file through a shared memory map
  (numpy ``memmap`` semantics), a CPU copy between the mapping and the pinned buffer.

The two page-cache spans can also move bytes straight between the file and a host tensor
(``read_to_host`` / ``write_from_host``, ``host_direct = True``): when the compute device *is* the
host there is no DMA to share a pinned buffer with, and staging through it would copy every byte
twice.

Every span counts the bytes it moves into a shared :class:`PathCounters`; :func:`count_residency`
adds a whole read's page-cache hits (bytes resident, by ``mincore``, before any of it is read).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import anyio
import torch

from dualblade.io_engine import (
    AlignedBuffer,
    IOEngine,
    IOFailedError,
    PageCacheFile,
    StorageSlots,
    Target,
)


@dataclass
class PathCounters:
    """Bytes moved per path and page-cache hits, shared by all spans of a store."""

    read_bytes: dict[str, int] = field(default_factory=lambda: {})
    write_bytes: dict[str, int] = field(default_factory=lambda: {})
    cache_lookup_bytes: int = 0
    cache_hit_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, path: str, *, read: int = 0, written: int = 0) -> None:
        with self._lock:
            if read:
                self.read_bytes[path] = self.read_bytes.get(path, 0) + read
            if written:
                self.write_bytes[path] = self.write_bytes.get(path, 0) + written

    def add_lookup(self, looked_up: int, hit: int) -> None:
        with self._lock:
            self.cache_lookup_bytes += looked_up
            self.cache_hit_bytes += hit

    @property
    def hit_rate(self) -> float | None:
        """Share of page-cache-path read bytes that were resident (None before any read)."""
        if not self.cache_lookup_bytes:
            return None
        return self.cache_hit_bytes / self.cache_lookup_bytes

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "read_bytes": dict(self.read_bytes),
                "write_bytes": dict(self.write_bytes),
                "cache_lookup_bytes": self.cache_lookup_bytes,
                "cache_hit_bytes": self.cache_hit_bytes,
            }


#: Told on the engine's thread how a read ended (None: every byte arrived); must not raise.
Then = Callable[[BaseException | None], None]
#: Cancels a read started with ``read_then`` (its ``then`` is still called).
Cancel = Callable[[], None]


def _after(then: Then, done: Callable[[], None]) -> Then:
    """``then``, calling ``done`` (the span's accounting) first when the read succeeded; an
    error there reaches ``then`` (nothing may raise on the engine's thread)."""

    def ended(error: BaseException | None) -> None:
        if error is None:
            try:
                done()
            except Exception as failure:
                error = failure
        then(error)

    return ended


def host_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (any dtype, bf16 too)."""
    assert tensor.device.type == "cpu", "a host tensor"
    assert tensor.is_contiguous(), "a contiguous tensor"
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _transfer_all(
    call: Callable[[memoryview, int], int], view: memoryview, offset: int, name: str, op: str
) -> None:
    """``call`` (a ``preadv``/``pwritev``) until every byte moved: short transfers go on.

    Raises:
        IOFailedError: the call failed (its errno) or met the end of the file.
    """
    done = 0
    while done < len(view):
        with view[done:] as rest:
            try:
                moved = call(rest, offset + done)
            except OSError as error:
                raise IOFailedError(
                    name, op, offset + done, len(view) - done, errno=error.errno
                ) from None
        if moved <= 0:
            raise IOFailedError(
                name, op, offset + done, len(view) - done, detail="unexpected end of file"
            )
        done += moved


class _Placement:
    """What every span shares: a range of storage mirrored at an offset of a buffer."""

    file_offset: int
    nbytes: int
    buffer_offset: int

    def piece(self, buffer_offset: int, nbytes: int) -> Self:
        """The part of this span at ``buffer_offset``: storage and buffer shift together."""
        shift = buffer_offset - self.buffer_offset
        assert shift >= 0, "piece starts before the span"
        assert shift + nbytes <= self.nbytes, "piece ends after the span"
        return self._moved(
            file_offset=self.file_offset + shift, nbytes=nbytes, buffer_offset=buffer_offset
        )

    def at(self, buffer_offset: int) -> Self:
        """The same bytes of storage, moved to ``buffer_offset`` of another buffer."""
        return self._moved(buffer_offset=buffer_offset)

    def _moved(self, **fields: int) -> Self:
        """A copy with ``fields`` changed, at a third of ``dataclasses.replace``'s cost: every
        KPU moved passes here (docs/pipeline-profile.md)."""
        moved = object.__new__(type(self))
        moved.__dict__.update(self.__dict__, **fields)
        return moved


@dataclass
class DirectSpan(_Placement):
    """A byte range of the direct target, moved by the ring into/out of the pinned buffer."""

    engine: IOEngine
    target: Target
    file_offset: int
    nbytes: int
    buffer_offset: int
    label: str
    counters: PathCounters
    path: str = "direct"

    async def read_into(self, buffer: AlignedBuffer, slots: StorageSlots | None = None) -> None:
        await self.engine.pread(
            self.target,
            buffer,
            self.nbytes,
            self.file_offset,
            buf_offset=self.buffer_offset,
            slots=slots,
        )
        self.counters.add(self.path, read=self.nbytes)

    def read_then(self, buffer: AlignedBuffer, slots: StorageSlots | None, then: Then) -> Cancel:
        """:meth:`read_into` without the loop: ``then`` runs on the engine's thread
        (:meth:`IOEngine.read_then`)."""
        return self.engine.read_then(
            self.target,
            buffer,
            self.nbytes,
            self.file_offset,
            _after(then, lambda: self.counters.add(self.path, read=self.nbytes)),
            buf_offset=self.buffer_offset,
            slots=slots,
        )

    async def write_from(self, buffer: AlignedBuffer) -> None:
        await self.engine.pwrite(
            self.target, buffer, self.nbytes, self.file_offset, buf_offset=self.buffer_offset
        )
        self.counters.add(self.path, written=self.nbytes)


#: Page-cache writes of at least this many bytes (a prefill's layer pieces, a promoted layer;
#: not a decode step's appended row) start their write-back at once.
START_WRITE_BACK_BYTES = 1 << 20


@dataclass
class PageCacheSpan(_Placement):
    """A byte range of a KPU's page-cache file, buffered I/O through the ring."""

    engine: IOEngine
    file: PageCacheFile
    file_offset: int
    nbytes: int
    buffer_offset: int
    label: str
    counters: PathCounters
    evict: bool = False
    path: str = "page-cache"
    #: bytes of the span not resident when a read was looked up (see count_residency)
    missing: int = 0

    def _read_done(self) -> None:
        self.counters.add(self.path, read=self.nbytes)
        if self.evict:
            self.file.advise_dontneed(self.file_offset, self.nbytes)

    async def _write_done(self) -> None:
        self.counters.add(self.path, written=self.nbytes)
        if self.evict:
            # Dirty pages cannot be dropped: write them back first (the policy's known cost).
            await anyio.to_thread.run_sync(self.file.flush)
            self.file.advise_dontneed(self.file_offset, self.nbytes)
        elif self.nbytes >= START_WRITE_BACK_BYTES:
            # A layer's worth of pages: have the disk take them now, under the prefill,
            # rather than under the first decode steps (see PageCacheFile.start_write_back).
            await anyio.to_thread.run_sync(
                self.file.start_write_back, self.file_offset, self.nbytes
            )

    async def read_into(self, buffer: AlignedBuffer, slots: StorageSlots | None = None) -> None:
        await self.engine.pread(
            self.file,
            buffer,
            self.nbytes,
            self.file_offset,
            buf_offset=self.buffer_offset,
            slots=slots,
        )
        self._read_done()

    def read_then(self, buffer: AlignedBuffer, slots: StorageSlots | None, then: Then) -> Cancel:
        """:meth:`read_into` without the loop (see :meth:`DirectSpan.read_then`)."""
        return self.engine.read_then(
            self.file,
            buffer,
            self.nbytes,
            self.file_offset,
            _after(then, self._read_done),
            buf_offset=self.buffer_offset,
            slots=slots,
        )

    async def write_from(self, buffer: AlignedBuffer) -> None:
        await self.engine.pwrite(
            self.file, buffer, self.nbytes, self.file_offset, buf_offset=self.buffer_offset
        )
        await self._write_done()

    def read_cached_into(self, buffer: AlignedBuffer) -> int:
        """Read what of the span is in the page cache into ``buffer``, on this thread and never
        waiting for the disk (``RWF_NOWAIT``); returns the bytes read, a prefix of the span.

        What is resident is a memory copy (GIL released), cheaper than a trip through the ring
        and back; the first page that is not ends the prefix, and the caller reads the rest
        through the ring. A dropped-after-use span (``evict``) drops the prefix it read.

        Raises:
            IOFailedError: the read failed.
        """
        done = 0
        with buffer.view[self.buffer_offset : self.buffer_offset + self.nbytes] as view:
            while done < self.nbytes:
                with view[done:] as rest:
                    try:
                        moved = self.file.pread_cached(rest, self.file_offset + done)
                    except OSError as error:
                        raise IOFailedError(
                            self.file.name,
                            "read",
                            self.file_offset + done,
                            self.nbytes - done,
                            errno=error.errno,
                        ) from None
                if moved <= 0:
                    break
                done += moved
        if done:
            self.counters.add(self.path, read=done)
            if self.evict:
                self.file.advise_dontneed(self.file_offset, done)
        return done

    host_direct = True

    async def read_to_host(self, destination: torch.Tensor) -> None:
        """Read the span straight into a host tensor of exactly its bytes (a worker thread's
        ``preadv``: copies of different files run on different CPUs)."""
        view = host_view(destination)
        assert len(view) == self.nbytes, "destination must hold exactly the span"
        name, read = self.file.name, self.file.pread_blocking
        await anyio.to_thread.run_sync(_transfer_all, read, view, self.file_offset, name, "read")
        self._read_done()

    async def write_from_host(self, source: torch.Tensor) -> None:
        """Write a host tensor of exactly the span's bytes to the file."""
        view = host_view(source)
        assert len(view) == self.nbytes, "source must hold exactly the span"
        name, write = self.file.name, self.file.pwrite_blocking
        await anyio.to_thread.run_sync(_transfer_all, write, view, self.file_offset, name, "write")
        await self._write_done()


@dataclass
class MmapSpan(_Placement):
    """A byte range of a KPU's file through a shared mapping, copied by the CPU (baseline)."""

    file: PageCacheFile
    file_offset: int
    nbytes: int
    buffer_offset: int
    label: str
    counters: PathCounters
    path: str = "baseline"
    missing: int = 0

    def _copy(self, to_memory: bool, memory: memoryview) -> None:
        """Copy the span between the mapping and ``memory`` (exactly its bytes)."""
        try:
            self.file.copy_mapped(memory, self.file_offset, to_memory=to_memory)
        finally:
            memory.release()

    def _window(self, buffer: AlignedBuffer) -> memoryview:
        return buffer.view[self.buffer_offset : self.buffer_offset + self.nbytes]

    async def read_into(self, buffer: AlignedBuffer, slots: StorageSlots | None = None) -> None:
        if slots is None:
            await anyio.to_thread.run_sync(self._copy, True, self._window(buffer))
        else:
            async with slots:
                await anyio.to_thread.run_sync(self._copy, True, self._window(buffer))
        self.counters.add(self.path, read=self.nbytes)

    async def write_from(self, buffer: AlignedBuffer) -> None:
        await anyio.to_thread.run_sync(self._copy, False, self._window(buffer))
        self.counters.add(self.path, written=self.nbytes)

    host_direct = True

    async def read_to_host(self, destination: torch.Tensor) -> None:
        """Copy the span from the mapping straight into a host tensor of exactly its bytes."""
        await anyio.to_thread.run_sync(self._copy, True, host_view(destination))
        self.counters.add(self.path, read=self.nbytes)

    async def write_from_host(self, source: torch.Tensor) -> None:
        """Copy a host tensor of exactly the span's bytes into the mapping."""
        await anyio.to_thread.run_sync(self._copy, False, host_view(source))
        self.counters.add(self.path, written=self.nbytes)


def count_residency(span: DirectSpan | PageCacheSpan | MmapSpan) -> None:
    """Count how much of a read through the page cache is resident *before* it starts.

    Called once per read, for the whole span, before the copy thread splits it into pieces:
    checked piece by piece, the readahead that one piece triggers would make the next piece look
    cached, and a file read cold would show a hit rate near that of a warm one.
    """
    if isinstance(span, DirectSpan):
        return
    hit = span.file.resident_bytes(span.file_offset, span.nbytes)
    span.counters.add_lookup(span.nbytes, hit)
    span.missing = span.nbytes - hit


async def check_write_back(span: DirectSpan | PageCacheSpan | MmapSpan) -> None:
    """Before a page-cache read that goes to storage, ask whether a write-back of the file
    failed: the kernel then marks the pages clean, and once they are evicted a read returns the
    old bytes from disk. A fully resident read cannot see stale bytes, so it is not asked.

    Raises:
        IOFailedError: op ``write-back``, the write-back error the file met.
    """
    if not isinstance(span, DirectSpan) and span.missing:
        await anyio.to_thread.run_sync(span.file.check_write_back)
