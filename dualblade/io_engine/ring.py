"""The io_uring ring and the one OS thread that owns it.

All submitting and reaping happens on this thread, so liburing's single-producer rules hold
without locks. Other threads talk to it through an inbox (a deque) and wake it through an eventfd
that the ring itself keeps a READ posted on: waiting for "a completion or a new request" is one
``io_uring_submit_and_wait`` call, made inside C with the GIL released.

The thread keeps up to ``queue_depth`` chunks in flight per lane (the device, the page cache:
:mod:`._lanes`) and refills the queue as soon as completions are reaped. A request's buffer stays
referenced by the in-flight table until every CQE of it has been reaped, also after its caller
was cancelled: cancellation stops further chunks and asks the kernel to cancel the posted ones,
but the request only reports back once the kernel has let go of the memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, TypeVar

from dualblade.io_engine import _fixed_buffers, _liburing, _uapi, opcodes
from dualblade.io_engine._fixed_buffers import FixedBufferTable
from dualblade.io_engine._lanes import LANES, LaneQueues
from dualblade.io_engine._request import IORequest, Kind
from dualblade.io_engine._ring_setup import init_ring
from dualblade.io_engine.buffers import AlignedBuffer
from dualblade.io_engine.errors import IOEngineError
from dualblade.logs import get_logger

_log = get_logger(__name__)

ChunkObserver = Callable[[str, str, int, int, float, float, int], None]

#: user_data tags below this are internal (wake-ups, cancel requests).
_UD_IGNORE = 0
_UD_WAKE = 1
_UD_FIRST = 16

_REAP_BATCH = 64

_T = TypeVar("_T")


class Ring:
    """An io_uring instance driven by a dedicated thread.

    Args:
        queue_depth: chunks kept in flight at most, per lane.
        passthrough: set up 128-byte SQEs and 32-byte CQEs for NVMe commands.
        name: thread name, for debuggers and traces.

    Raises:
        IoUringUnavailableError: io_uring cannot be set up here; the message says why.
    """

    def __init__(
        self, queue_depth: int = 32, *, passthrough: bool = False, name: str = "ring"
    ) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, got {queue_depth}")
        self.lib = _liburing.load()
        self.queue_depth = queue_depth
        self.passthrough = passthrough
        self._ring_mem = ctypes.create_string_buffer(_liburing.RING_STRUCT_BYTES)
        self._ring = ctypes.addressof(self._ring_mem)
        self._cqe_size = 32 if passthrough else 16
        self._cqe_ptrs = (ctypes.c_void_p * _REAP_BATCH)()
        self._eventfd = os.eventfd(0, os.EFD_CLOEXEC)
        self._eventfd_buf = ctypes.create_string_buffer(8)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake_pending = False  # the eventfd was written and its read has not completed
        self._queues = LaneQueues(queue_depth)
        self._inflight: dict[int, tuple[IORequest, int, int, opcodes.Op, float]] = {}
        #: Called on the ring thread for every completed chunk when set (tracing, latency logs):
        #: ``observer(target, op, offset, length, submitted_s, completed_s, result)``.
        self.observer: ChunkObserver | None = None
        self._next_ud = _UD_FIRST
        self._pending_cancels: list[int] = []
        self._fixed = FixedBufferTable(self.lib, self._ring, functools.partial(self._post, "call"))
        self._fixed_index = self._fixed.index_by_id  # id(buffer) -> index, for every chunk
        self._stopping = False
        self._fatal: BaseException | None = None
        self.chunks_submitted = 0
        self.setup_flags = 0
        self._setup_done = threading.Event()
        self._setup_error: list[BaseException] = []  # filled by the ring thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._setup_done.wait()
        if self._setup_error:
            self._thread.join()
            os.close(self._eventfd)
            raise self._setup_error[0]

    def _setup(self) -> None:
        """Create the ring on the ring thread: with SINGLE_ISSUER the creator is the submitter."""
        self.setup_flags = init_ring(
            self.lib, self._ring, len(LANES) * self.queue_depth, passthrough=self.passthrough
        )

    # -- API used by other threads ---------------------------------------------------------------
    def submit(self, request: IORequest) -> None:
        """Queue a request; its ``notify`` runs on the ring thread when it finishes."""
        self._post("submit", request)

    def cancel(self, request: IORequest) -> None:
        """Stop a request: no more chunks, kernel cancel for posted ones. It still notifies."""
        self._post("cancel", request)

    def register_buffers(self, buffers: Sequence[AlignedBuffer]) -> None:
        """Register fixed buffers, the ring's first (``IORING_REGISTER_BUFFERS``); blocks until
        done.

        Raises:
            IOEngineError: the kernel refused, e.g. over ``RLIMIT_MEMLOCK`` as non-root.
        """
        self._call_on_thread(lambda: self._fixed.register_first(buffers))

    def add_fixed_buffer(self, buffer: AlignedBuffer) -> str | None:
        """Register one more fixed buffer; None when it is fixed now, else why it is not."""
        if self.passthrough:
            return "NVMe passthrough commands do not use fixed buffers"
        if (note := _fixed_buffers.memlock_note()) is not None:
            return note
        try:
            return self._call_on_thread(lambda: self._fixed.add(buffer))
        except IOEngineError as error:  # the ring is closed or dead
            return str(error)

    def remove_fixed_buffer(self, buffer: AlignedBuffer) -> None:
        """Give a buffer's slot in the fixed-buffer table back (nothing if it has none)."""
        if self._fixed_index.get(id(buffer)) is None:
            return
        with contextlib.suppress(IOEngineError):  # a closed or dead ring took its table along
            self._call_on_thread(lambda: self._fixed.remove(buffer))

    def _call_on_thread(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` on the ring thread (liburing's register calls belong to its owner) and
        return or raise what it did; blocks until then."""
        if threading.get_ident() == self._thread.ident:
            return call()
        if not self._thread.is_alive():  # nobody would run it (a daemon thread at exit, say)
            closed = self._stopping or self._fatal is not None
            raise IOEngineError("the I/O engine is closed" if closed else "the ring thread ended")
        done = threading.Event()
        outcome: list[Any] = [None, None]  # the result, the error

        def run() -> None:
            try:
                outcome[0] = call()
            except BaseException as error:  # delivered to the caller below
                outcome[1] = error
            finally:
                done.set()

        self._post("call", run)
        done.wait()
        if outcome[1] is not None:
            raise outcome[1]
        result: _T = outcome[0]
        return result

    @property
    def peak_inflight(self) -> int:
        """The most chunks that were in flight at once, over all lanes."""
        return self._queues.peak_inflight

    @property
    def inflight(self) -> int:
        """Chunks in flight now (read from another thread: a sample, not a lock-held count)."""
        return len(self._inflight)

    def buffer_index(self, buffer: AlignedBuffer) -> int | None:
        """The fixed-buffer index of ``buffer`` in this ring, or None if not registered."""
        return self._fixed_index.get(id(buffer))

    def close(self) -> None:
        """Finish everything in flight, stop the thread and tear down the ring (idempotent)."""
        if not self._thread.is_alive():
            self._teardown()
            return
        self._post("stop", None)
        self._thread.join()
        self._teardown()

    def _post(self, what: str, payload: Any) -> None:
        if self._fatal is not None:
            raise IOEngineError(f"the ring thread died: {self._fatal!r}") from self._fatal
        if self._stopping and what != "stop":
            raise IOEngineError("the I/O engine is closed")
        self._inbox.append((what, payload))
        # The ring thread itself (a finished request's storage slot starting the next one)
        # drains the inbox before it sleeps again, and so does a ring thread woken and not yet
        # past its wake-up's completion: one write per wake-up, not per post (a write per post
        # cost a system call and a GIL round trip: 8 % of the event loop in LMCache loads).
        if not self._wake_pending and threading.get_ident() != self._thread.ident:
            self._wake_pending = True  # before the write: the ring may reap it at once
            try:
                os.eventfd_write(self._eventfd, 1)
            except BaseException:
                self._wake_pending = False  # no wake-up is on its way: the next post writes
                raise

    # -- the ring thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as error:
            self._setup_error.append(error)
            self._ring_mem = None  # type: ignore[assignment]  # nothing to tear down
            return
        finally:
            self._setup_done.set()
        try:
            self._arm_wake()
            while True:
                self._drain_inbox()
                self._fill()
                if self._stopping and not self._queues and len(self._inflight) == 0:
                    break
                rc = self._submit_and_wait()
                if rc < 0 and -rc not in (errno.EINTR, errno.EAGAIN, errno.EBUSY, errno.ETIME):
                    raise OSError(-rc, f"io_uring_submit_and_wait: {os.strerror(-rc)}")
                self._reap()
        except BaseException as error:  # the thread must never die silently
            self._fatal = error
            self._fail_everything(error)  # first: even a broken logger must not stop this
            with contextlib.suppress(Exception):
                _log.error("ring thread died", error=repr(error))

    def _submit_and_wait(self) -> int:
        """Submit what is queued and sleep (GIL released) until a completion arrives: waking
        for several per wake-up (tried: a quarter of the queue, 2 ms bound) saved CPU but lost a
        quarter of the read throughput at 1 MiB, QD 32 on the virtio disk here."""
        return int(self.lib.io_uring_submit_and_wait(self._ring, 1))

    def _arm_wake(self) -> None:
        sqe = self._get_sqe()
        opcodes.Read(self._eventfd, ctypes.addressof(self._eventfd_buf), 8, 0).build(
            self.lib, sqe, _UD_WAKE
        )

    def _get_sqe(self) -> int:
        sqe: int | None = self.lib.io_uring_get_sqe(self._ring)
        if not sqe:
            self.lib.io_uring_submit(self._ring)  # flush and retry once
            sqe = self.lib.io_uring_get_sqe(self._ring)
            if not sqe:
                raise IOEngineError("submission queue full")
        return sqe

    def _drain_inbox(self) -> None:
        inbox = self._inbox
        while inbox:
            what, payload = inbox.popleft()
            if what == "submit":
                request: IORequest = payload
                if request.length == 0 and request.kind is not Kind.TRIM:
                    request.start_empty()
                else:
                    self._queues.add(request)
            elif what == "cancel":
                self._cancel(payload)
            elif what == "call":
                payload()
            elif what == "stop":
                self._stopping = True

    def _cancel(self, request: IORequest) -> None:
        request.cancel()
        for ud, entry in self._inflight.items():
            if entry[0] is request:
                self._pending_cancels.append(ud)

    def _fill(self) -> None:
        """Post queued chunks, each submitted alone (a system call each) as fio does: submitted
        together they met the block layer's plug as one batch and were merged, and this VM's
        virtio disk read them 11 % slower (merges off won back 3 %: docs/lmcache.md)."""
        lib, ring = self.lib, self._ring
        while self._pending_cancels:
            target_ud = self._pending_cancels.pop()
            opcodes.AsyncCancel(target_ud).build(lib, self._get_sqe(), _UD_IGNORE)
        queues, inflight = self._queues, self._inflight
        while (taken := queues.next_chunk()) is not None:
            request, chunk = taken
            rel, size = chunk
            op = self._op_for(request, rel, size)
            sqe: int | None = lib.io_uring_get_sqe(ring)
            if not sqe:
                queues.give_back(request, chunk)
                break
            ud = self._next_ud
            self._next_ud += 1
            op.build(lib, sqe, ud)
            inflight[ud] = (request, rel, size, op, perf_counter() if self.observer else 0.0)
            request.chunk_started()
            self.chunks_submitted += 1
            lib.io_uring_submit(ring)

    def _op_for(self, request: IORequest, rel: int, size: int) -> opcodes.Op:
        target = request.target
        offset = request.offset + rel
        if request.kind is Kind.TRIM:
            op = target.trim_op(offset, size)
            assert op is not None, "blocking trims do not go through the ring"
            return op
        buffer = request.buffer
        assert buffer is not None
        index = self._fixed_index.get(id(buffer)) if not target.passthrough else None
        return target.io_op(
            request.is_write,
            buffer.address + request.buf_offset + rel,
            size,
            offset,
            index,
        )

    def _reap(self) -> None:
        lib, ring, ptrs = self.lib, self._ring, self._cqe_ptrs
        from_address = _uapi.IoUringCqe.from_address
        while True:
            count = lib.io_uring_peek_batch_cqe(ring, ptrs, _REAP_BATCH)
            if not count:
                return
            for i in range(count):
                address: int = ptrs[i]  # type: ignore[assignment]  # never NULL below count
                cqe = from_address(address)
                ud, res = cqe.user_data, cqe.res
                if ud >= _UD_FIRST:
                    extra = (
                        ctypes.c_uint64.from_address(address + 16).value
                        if self._cqe_size == 32
                        else 0
                    )
                    self._complete(ud, res, extra)
                elif ud == _UD_WAKE:
                    # cleared before the next drain: a post that saw it set is drained then
                    self._wake_pending = False
                    self._arm_wake()
            lib.io_uring_cq_advance(ring, count)
            if count < _REAP_BATCH:
                return

    def _complete(self, ud: int, res: int, extra: int) -> None:
        request, rel, size, _op, submitted = self._inflight.pop(ud)
        self._queues.chunk_finished(request)
        if self.observer is not None:
            self.observer(
                request.target.name,
                request.op_name,
                request.offset + rel,
                size,
                submitted,
                perf_counter(),
                res,
            )
        if res == -errno.ECANCELED and request.cancelled:
            request.chunk_failed(IOEngineError("cancelled"))  # ignored: the request is cancelled
            return
        try:
            transferred = request.target.transferred(
                request.op_name, res, size, request.offset + rel, extra
            )
        except BaseException as error:
            request.chunk_failed(error)
            return
        request.chunk_done(rel, size, transferred)
        if request.retries and not request.stopped:
            self._queues.add_first(request)

    def _fail_everything(self, error: BaseException) -> None:
        """Report the ring's death to every waiting caller instead of leaving them hanging.

        Requests with chunks still posted keep their buffers counted as in flight forever: the
        kernel may still DMA into them, so such a buffer refuses to close (a leak, never a
        corruption). The engine is dead afterwards; every new call raises.
        """
        wrapped = IOEngineError(f"the ring thread died: {error!r}")
        posted = {id(entry[0]): entry[0] for entry in self._inflight.values()}
        for request in posted.values():
            request.abandon_under_dma(wrapped)
        for request in self._queues.waiting():
            if id(request) not in posted and not request.finished:
                request.abandon(wrapped)

    def _teardown(self) -> None:
        if self._ring_mem is not None and self._fatal is None:
            self.lib.io_uring_queue_exit(self._ring)
        if self._eventfd >= 0:
            os.close(self._eventfd)
            self._eventfd = -1
        self._fixed.forget()
        self._ring_mem = None  # type: ignore[assignment]
