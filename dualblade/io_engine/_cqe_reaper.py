"""Reaping the completion queue in Python: the ring's way when the native chunk pump is absent.

The same contract as :meth:`ChunkPump.reap <dualblade.io_engine._chunk_pump.ChunkPump.reap>`:
each call hands back completions as ``(user_data, res, big-CQE word)`` and says whether more
may be waiting, so the ring handles them one way whichever reaps.
"""

from __future__ import annotations

import ctypes
from typing import Final

from dualblade.io_engine import _uapi
from dualblade.io_engine._liburing import LibUring

_REAP_BATCH: Final = 64


class PlainReaper:
    """Peeks at up to 64 completions per call through liburing, copies them out and advances."""

    def __init__(self, lib: LibUring, ring: int, *, big_cqes: bool) -> None:
        self._lib = lib
        self._ring = ring
        self._big_cqes = big_cqes
        self._cqe_ptrs = (ctypes.c_void_p * _REAP_BATCH)()

    def wait(self) -> int:
        """Submit what is queued and wait for a completion (the GIL released, in liburing)."""
        return int(self._lib.io_uring_submit_and_wait(self._ring, 1))

    def reap(self) -> tuple[list[tuple[int, int, int]], bool]:
        """Up to 64 completions, and whether more may be waiting."""
        lib, ring, ptrs = self._lib, self._ring, self._cqe_ptrs
        count = lib.io_uring_peek_batch_cqe(ring, ptrs, _REAP_BATCH)
        if not count:
            return [], False
        from_address = _uapi.IoUringCqe.from_address
        reaped = []
        for i in range(count):
            address: int = ptrs[i]  # type: ignore[assignment]  # never NULL below count
            cqe = from_address(address)
            extra = ctypes.c_uint64.from_address(address + 16).value if self._big_cqes else 0
            reaped.append((cqe.user_data, cqe.res, extra))
        lib.io_uring_cq_advance(ring, count)
        return reaped, count == _REAP_BATCH
