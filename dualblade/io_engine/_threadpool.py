"""The compatibility engine: the ring's interface on a pool of ``preadv``/``pwritev`` threads.

Used where io_uring is unavailable (``kernel.io_uring_disabled``, seccomp, old kernels) or when
compat mode is ``on``. It keeps the same request, chunking, queue-depth and cancellation rules as
the ring: at most ``queue_depth`` chunks of each lane run at once, a cancelled request stops
handing out chunks and reports back only after the running ones have returned.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from dualblade.io_engine._lanes import LANES, LaneQueues
from dualblade.io_engine._request import IORequest, Kind
from dualblade.io_engine.buffers import AlignedBuffer
from dualblade.io_engine.errors import IOEngineError, IOFailedError


class ThreadPoolBackend:
    """Chunks of requests executed by ``queue_depth`` worker threads per lane."""

    def __init__(self, queue_depth: int = 32, *, name: str = "compat") -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, got {queue_depth}")
        self.queue_depth = queue_depth
        self._pool = ThreadPoolExecutor(
            max_workers=len(LANES) * queue_depth, thread_name_prefix=name
        )
        # Re-entrant: a request that finishes under it may give its storage slot to a waiting
        # one, whose start submits here on the same thread (storage_slots.py).
        self._lock = threading.RLock()
        self._queues = LaneQueues(queue_depth)
        self._closed = False
        self.chunks_submitted = 0

    def submit(self, request: IORequest) -> None:
        if request.target.passthrough or not request.target.threadpool_capable:
            raise IOEngineError(
                f"{request.target.name} needs io_uring passthrough; the compatibility engine "
                "cannot serve it"
            )
        with self._lock:
            if self._closed:
                raise IOEngineError("the I/O engine is closed")
            if request.length == 0 and request.kind is not Kind.TRIM:
                request.start_empty()
                return
            self._queues.add(request)
            self._fill_locked()

    @property
    def inflight(self) -> int:
        """Chunks running now."""
        return self._queues.inflight

    @property
    def peak_inflight(self) -> int:
        """The most chunks that ran at once, over all lanes."""
        return self._queues.peak_inflight

    def cancel(self, request: IORequest) -> None:
        with self._lock:
            request.cancel()

    def register_buffers(self, buffers: Sequence[AlignedBuffer]) -> None:
        """Nothing to register: plain syscalls pin pages per call."""

    def add_fixed_buffer(self, buffer: AlignedBuffer) -> str | None:
        return "the thread-pool engine has no io_uring ring to register buffers with"

    def remove_fixed_buffer(self, buffer: AlignedBuffer) -> None:
        """Nothing was registered."""

    def buffer_index(self, buffer: AlignedBuffer) -> int | None:
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def _fill_locked(self) -> None:
        while (taken := self._queues.next_chunk()) is not None:
            request, chunk = taken
            request.chunk_started()
            self.chunks_submitted += 1
            self._pool.submit(self._execute, request, *chunk)

    def _execute(self, request: IORequest, rel: int, size: int) -> None:
        offset = request.offset + rel
        try:
            if request.kind is Kind.TRIM:
                request.target.trim_blocking(offset, size)
                transferred = size
            else:
                assert request.buffer is not None
                start = request.buf_offset + rel
                with request.buffer.view[start : start + size] as view:
                    if request.kind is Kind.WRITE:
                        transferred = request.target.pwrite_blocking(view, offset)
                    else:
                        transferred = request.target.pread_blocking(view, offset)
            error: BaseException | None = None
        except OSError as os_error:
            error = IOFailedError(
                request.target.name, request.kind.value, offset, size, errno=os_error.errno
            )
        except BaseException as other:
            error = other
        with self._lock:
            self._queues.chunk_finished(request)
            if error is not None:
                request.chunk_failed(error)
            else:
                had_retries = bool(request.retries)
                request.chunk_done(rel, size, transferred)
                if request.retries and not had_retries:
                    self._queues.add_first(request)
            self._fill_locked()
