"""The two reference bandwidths of a sweep: O_DIRECT reads from the disk, reads from page cache.

A decode step cannot be faster than reading what its placement keeps on storage at the disk's
rate plus what it keeps in page cache at memory-copy rate; ``decode_floor_s`` is built from these
two numbers, so both are measured by the sweep itself, on the same file system as its direct
target, with the same engine and request shape the pipeline uses:

- ``direct``: a scratch file is written once with real data (not holes: a punched or sparse
  range reads back zeros without touching the disk) and read back O_DIRECT in large requests at
  the configured queue depth and chunk size, page cache dropped first;
- ``cached``: the same file read through the page cache after a first read has made it resident —
  one copy from the page cache into an aligned buffer, what the page-cache path pays per byte.

The disk here drifts by up to 2x between minutes, so the sweep measures both before every limit
and uses the medians.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dualblade.bench.page_cache import drop_file_cache
from dualblade.io_engine import AlignedBuffer, DirectFile, IOEngine, PageCacheFile

REQUEST_BYTES = 64 << 20


@dataclass(frozen=True)
class Bandwidths:
    """One measurement of both rates, in bytes per second."""

    direct_read: float
    cached_read: float


class BandwidthProbe:
    """Owns the scratch file; each :meth:`measure` reads it cold (O_DIRECT) and warm."""

    def __init__(self, path: Path, size: int, queue_depth: int, max_chunk: int) -> None:
        self.path = path
        self.size = size - size % REQUEST_BYTES or REQUEST_BYTES
        self.queue_depth = queue_depth
        self.max_chunk = max_chunk
        self._written = False

    def _write_scratch(self, engine: IOEngine, buffer: AlignedBuffer) -> None:
        target = DirectFile(self.path, self.size)
        try:
            # Real bytes, different per page: holes or zero pages would not exercise the disk.
            buffer.tensor().copy_(torch.randint(0, 256, (buffer.size,), dtype=torch.uint8))
            for offset in range(0, self.size, REQUEST_BYTES):
                engine.write(target, buffer, REQUEST_BYTES, offset)
        finally:
            target.close()
        self._written = True

    def measure(self) -> Bandwidths:
        """Read the scratch file cold and then warm; returns both rates."""
        buffer = AlignedBuffer(REQUEST_BYTES)
        engine = IOEngine(queue_depth=self.queue_depth, max_chunk=self.max_chunk, name="bw-probe")
        try:
            if not self._written:
                self._write_scratch(engine, buffer)
            drop_file_cache(str(self.path))
            direct = DirectFile(self.path, self.size)
            try:
                direct_rate = self._read_all(engine, direct, buffer)
            finally:
                direct.close()
            cached = PageCacheFile(self.path, self.size)
            try:
                self._read_all(engine, cached, buffer)  # make it resident
                cached_rate = self._read_all(engine, cached, buffer)
                cached.advise_dontneed(0, self.size)
            finally:
                cached.close()
        finally:
            engine.close()
            buffer.close()
        return Bandwidths(direct_read=direct_rate, cached_read=cached_rate)

    def _read_all(
        self, engine: IOEngine, target: DirectFile | PageCacheFile, buffer: AlignedBuffer
    ) -> float:
        start = time.perf_counter()
        for offset in range(0, self.size, REQUEST_BYTES):
            engine.read(target, buffer, REQUEST_BYTES, offset)
        return self.size / (time.perf_counter() - start)

    def remove(self) -> None:
        """Delete the scratch file."""
        if self.path.exists():
            os.unlink(self.path)
