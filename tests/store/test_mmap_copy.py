"""The baseline's memory-map copy keeps every byte and lets the application's threads run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from dualblade.actors.spans import MmapSpan, PathCounters, host_view
from dualblade.io_engine import PageCacheFile

MiB = 1 << 20


def test_mmap_copy_round_trips_and_releases_the_gil(tmp_path: Path) -> None:
    """FlexLLMGen copies out of its memmap with torch's ``copy_``, which releases the GIL; a copy
    that held it (a memoryview assignment did) froze every other thread of the process for as long
    as the kernel took to fault the mapping in, and charged that to the application's compute.

    The main thread ticks while a worker copies 256 MiB into a fresh mapping: with the GIL held
    the longest gap between ticks is the copy itself; released, it stays a small part of it.
    """
    size = 256 * MiB
    file = PageCacheFile(tmp_path / "K0.kv", size)
    try:
        source = torch.randint(0, 256, (size,), dtype=torch.uint8)
        span = MmapSpan(file, 0, size, 0, "K0", PathCounters())
        copy_s = 0.0
        done = threading.Event()

        def write() -> None:
            nonlocal copy_s
            start = time.perf_counter()
            span._copy(False, host_view(source))
            copy_s = time.perf_counter() - start
            done.set()

        worker = threading.Thread(target=write)
        last = time.perf_counter()
        longest_gap = 0.0
        worker.start()
        while not done.is_set():
            now = time.perf_counter()
            longest_gap = max(longest_gap, now - last)
            last = now
        worker.join()
        assert copy_s > 0.02, f"the copy took {copy_s:.3f} s: too short to tell"
        assert longest_gap < copy_s / 2, (
            f"the main thread stood still {longest_gap:.3f} s of a {copy_s:.3f} s copy"
        )

        back = torch.empty(size, dtype=torch.uint8)
        span._copy(True, host_view(back))
        assert torch.equal(back, source)
        part = torch.empty(MiB, dtype=torch.uint8)
        MmapSpan(file, 5 * MiB + 3, MiB, 0, "K0", PathCounters())._copy(True, host_view(part))
        assert torch.equal(part, source[5 * MiB + 3 : 6 * MiB + 3])
    finally:
        file.close()
