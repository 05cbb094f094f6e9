"""The machine's limit for moving resident page-cache files to the device.

The reference ``dualblade pipebench --path page-cache`` holds the pipeline's page-cache path
against: what plain threads get for the same move, as FlexGen moves its cache, at their best.
Each of ``n`` threads takes every ``n``-th file, reads it piece by piece with ``preadv`` into
pinned memory of its own (two pieces, so a read overlaps the last piece's copy) and copies each
piece to the device on a CUDA stream of its own; on the host the copy goes into a host tensor.
``preadv`` and the copies release the GIL, so the threads run side by side. The limit is the
best rate over :func:`thread_counts` (powers of two up to the machine's cores).

The pieces are 64 MiB on CUDA (the pipeline moves a whole KPU as one chained piece there, with no
loop turn per piece: this side's threads pay a call per piece, which 64 MiB keeps few) and 4 MiB
on the host, as the pipeline's. A caller that must not allocate (a run's floor, measured
inside its memory limit, where new pinned memory would push the run's own pages out) lends
windows of memory it holds instead (a store's pinned KPU images), and each thread count's pieces
are carved from them: the largest of which the windows hold two a thread, up to a whole file on
CUDA (a store's images hold one KPU each: as many threads as copy threads move whole KPUs, more
threads smaller pieces) and up to 4 MiB on the host. Carved from one KPU-sized buffer for all
counts, they were about 4 MiB at 16 threads, and at 11 GiB the pipeline beat that floor (0.977):
a reference of another piece shape, not a bound.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dualblade.io_engine import AlignedBuffer, BufferWindow

CUDA_PIECE_BYTES = 64 << 20
HOST_PIECE_BYTES = 4 << 20
#: Pieces carved from a caller's buffer are whole pages.
_PAGE = 4096


def thread_counts() -> tuple[int, ...]:
    """Thread counts tried, the best being the limit: 1, 2, 4 ... up to the machine's cores
    (at least 2). On the H200 machine's 16 cores the rate still grew from 4 to 8 threads."""
    cores = max(2, os.cpu_count() or 2)
    return tuple(1 << power for power in range(cores.bit_length()) if 1 << power <= cores)


@dataclass(frozen=True)
class FileToMove:
    """``nbytes`` from the start of the open file ``fd`` (resident in the page cache)."""

    fd: int
    nbytes: int


@dataclass(frozen=True)
class LimitRun:
    """One thread count's rate (bytes per second) for ``passes`` passes over every file."""

    threads: int
    bytes_per_s: float


class _Mover:
    """One thread's two pinned pieces, stream and device destination. The pieces are its own
    (``pieces`` None) or views of a caller's buffer, which the mover neither pins nor frees."""

    def __init__(
        self,
        device: torch.device,
        piece_bytes: int,
        pieces: Sequence[tuple[memoryview, torch.Tensor]] | None = None,
    ) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.owned: list[AlignedBuffer] = []
        if pieces is None:
            self.owned = [AlignedBuffer(piece_bytes) for _ in range(2)]
            if cuda:
                for piece in self.owned:
                    piece.pin_for_cuda()
            pieces = [(piece.view, piece.tensor()) for piece in self.owned]
        self.views = [view for view, _ in pieces]
        self.sources = [tensor for _, tensor in pieces]
        self.destination = torch.empty(piece_bytes, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device=device) if cuda else None  # type: ignore[no-untyped-call]
        self.done: list[torch.cuda.Event | None] = [None, None]

    def move(self, files: Sequence[FileToMove], piece_bytes: int) -> None:
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)  # this thread's current stream from now on
        turn = 0
        for file in files:
            for offset in range(0, file.nbytes, piece_bytes):
                nbytes = min(piece_bytes, file.nbytes - offset)
                slot = turn % 2
                turn += 1
                event = self.done[slot]
                if event is not None:
                    event.synchronize()  # the piece's last copy has left it
                got = os.preadv(file.fd, [self.views[slot][:nbytes]], offset)
                if got != nbytes:
                    raise OSError(f"short read of a page-cache file: {got} of {nbytes} bytes")
                self._copy(slot, nbytes)
        for event in self.done:
            if event is not None:
                event.synchronize()

    def _copy(self, slot: int, nbytes: int) -> None:
        source, destination = self.sources[slot][:nbytes], self.destination[:nbytes]
        if self.stream is None:
            destination.copy_(source)
            return
        destination.copy_(source, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        self.done[slot] = event

    def close(self) -> None:
        self.sources.clear()  # they alias the pieces, which cannot unmap under them
        self.views.clear()
        for piece in self.owned:
            piece.close()


def _one_count(
    files: Sequence[FileToMove], movers: Sequence[_Mover], passes: int, piece_bytes: int
) -> float:
    """Seconds for ``len(movers)`` threads to move every file ``passes`` times."""
    shares = [list(files[index :: len(movers)]) * passes for index in range(len(movers))]
    errors: list[BaseException] = []

    def run(mover: _Mover, share: list[FileToMove]) -> None:
        try:
            mover.move(share, piece_bytes)
        except BaseException as error:  # reported by the caller, not lost in the thread
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(mover, share), name=f"limit-{index}")
        for index, (mover, share) in enumerate(zip(movers, shares, strict=True))
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def _largest_piece(windows: Sequence[BufferWindow], movers: int, cap: int) -> int:
    """The largest whole-page piece of at most ``cap`` bytes (rounded up to a page) of which
    ``windows`` hold two for each of ``movers`` threads; 0 if not even a page fits."""
    wanted = 2 * movers
    low, high = 0, -(-cap // _PAGE)
    while low < high:  # the count that fits only falls as the piece grows
        pages = (low + high + 1) // 2
        if sum(window.nbytes // (pages * _PAGE) for window in windows) >= wanted:
            low = pages
        else:
            high = pages - 1
    return low * _PAGE


def _piece_for(windows: Sequence[BufferWindow], movers: int, cap: int) -> int:
    """:func:`_largest_piece`, refusing windows that hold not even two pages a thread.

    Raises:
        ValueError: the windows are too small for ``movers`` threads.
    """
    piece_bytes = _largest_piece(windows, movers, cap)
    if piece_bytes <= 0:
        lent = sum(window.nbytes for window in windows)
        raise ValueError(
            f"{lent} bytes of lent memory cannot hold two pieces for each of {movers} threads"
        )
    return piece_bytes


def _carved(
    windows: Sequence[BufferWindow], movers: int, cap: int, device: torch.device
) -> tuple[int, list[list[tuple[memoryview, torch.Tensor]]]]:
    """Two pieces per mover out of ``windows`` (their buffers page-locked first, on CUDA): the
    piece size (:func:`_piece_for`), and each mover's pieces."""
    piece_bytes = _piece_for(windows, movers, cap)
    cut: list[tuple[memoryview, torch.Tensor]] = []
    for window in windows:
        if device.type == "cuda":
            window.buffer.pin_for_cuda()  # a no-op for a buffer the store page-locked
        whole = window.buffer.tensor()
        fits = window.nbytes // piece_bytes
        for start in range(window.offset, window.offset + fits * piece_bytes, piece_bytes):
            end = start + piece_bytes
            cut.append((window.buffer.view[start:end], whole[start:end]))
    return piece_bytes, [cut[2 * index : 2 * index + 2] for index in range(movers)]


def measure_page_cache_limit(
    files: Sequence[FileToMove],
    device: torch.device,
    *,
    passes: int,
    counts: Sequence[int] | None = None,
    memory: Sequence[BufferWindow] | None = None,
) -> list[LimitRun]:
    """Each thread count's rate (default: :func:`thread_counts`) for moving ``files`` to
    ``device`` ``passes`` times (blocking: run it in a worker thread). The files' pages should be
    resident (see the module). ``memory``: carve each count's pieces from these windows and
    allocate no host memory (raises ValueError if they cannot hold two pages a thread); on
    CUDA their buffers are page-locked for the copies and stay so until they are closed."""
    counts = thread_counts() if counts is None else counts
    cuda = device.type == "cuda"
    largest = max(file.nbytes for file in files)
    cap = min(CUDA_PIECE_BYTES if cuda else HOST_PIECE_BYTES, largest)
    moved = sum(file.nbytes for file in files) * passes
    if memory is not None:
        if cuda:
            cap = largest  # a whole KPU where the memory holds it, as the pipeline moves one
        _piece_for(memory, max(counts), cap)  # refuse before any count runs
        return [
            LimitRun(count, moved / _lent_count(files, device, memory, count, passes, cap))
            for count in counts
        ]
    movers = [_Mover(device, cap) for _ in range(max(counts))]
    try:
        return [
            LimitRun(count, moved / _one_count(files, movers[:count], passes, cap))
            for count in counts
        ]
    finally:
        for mover in movers:
            mover.close()


def _lent_count(
    files: Sequence[FileToMove],
    device: torch.device,
    memory: Sequence[BufferWindow],
    count: int,
    passes: int,
    cap: int,
) -> float:
    """:func:`_one_count` for ``count`` threads whose pieces are carved from ``memory``: fewer
    threads get larger pieces, as the pipeline's fewer copy threads move whole KPUs."""
    piece_bytes, pieces = _carved(memory, count, cap, device)
    movers = [_Mover(device, piece_bytes, mine) for mine in pieces]
    try:
        return _one_count(files, movers, passes, piece_bytes)
    finally:
        for mover in movers:
            mover.close()
