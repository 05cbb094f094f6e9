"""The io_uring ring and the one OS thread that owns it.

All submitting and reaping happens on this thread, so liburing's single-producer rules hold
without locks. Other threads talk to it through an inbox (a deque) and wake it through an eventfd
that the ring itself keeps a READ posted on: waiting for "a completion or a new request" is one
``io_uring_submit_and_wait`` call, made inside C with the GIL released.

The thread keeps up to ``queue_depth`` chunks in flight per lane (the device, the page cache:
:mod:`._lanes`) and refills the queue as soon as completions are reaped. Where the native chunk
pump is built (:mod:`.native`), a request's chunks are posted and counted in C
(:mod:`._chunk_pump`): Python then runs per request and per exceptional completion. A request's
buffer stays referenced until every CQE of it has been reaped, also after its caller was
cancelled: cancellation stops further chunks and asks the kernel to cancel the posted ones,
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

from dualblade.io_engine import _fixed_buffers, _liburing, opcodes, thread_names
from dualblade.io_engine._chunk_pump import PUMP_TAG, ChunkPump
from dualblade.io_engine._cqe_reaper import PlainReaper
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
        self._pump: ChunkPump | None = None  # set up on the ring thread, with the ring
        self._reaper: ChunkPump | PlainReaper  # set up on the ring thread, with the ring
        #: Why the native chunk pump is not used ("" when it is).
        self.pump_note = ""
        self._stopping = False
        self._fatal: BaseException | None = None
        self.chunks_submitted = 0
        self.setup_flags = 0
        self._setup_done = threading.Event()
        self._setup_error: list[BaseException] = []  # filled by the ring thread
        self._thread = thread_names.named_thread(self._run, name)
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
        slots = len(LANES) * (self.queue_depth + 1)  # a lane's requests in flight, and its next
        finished, progressed = self._queues.chunk_finished, self._progressed
        self._pump, self.pump_note = ChunkPump.open(
            self.lib, self._ring, self.passthrough, slots, finished, progressed
        )
        self._reaper = self._pump or PlainReaper(self.lib, self._ring, big_cqes=self.passthrough)

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
        return self._queues.inflight

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
                if self._stopping and not self._queues and self._queues.inflight == 0:
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
        """Submit what is queued and sleep (GIL released) until a completion arrives (with the
        pump: until one needs Python). Waking for several per wake-up (tried: a quarter of the
        queue, 2 ms bound) saved CPU but lost a quarter of the read throughput at 1 MiB, QD 32
        on the virtio disk here."""
        return self._reaper.wait()

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
        if self._pump is not None:
            if request.inflight:
                self._pending_cancels += self._pump.recent_chunks(request, self.queue_depth)
            self._pump.settle(request)

    def _fill(self) -> None:
        """Post queued chunks, each submitted alone (a system call each) as fio does: submitted
        together they met the block layer's plug as one batch and were merged, and this VM's
        virtio disk read them 11 % slower (merges off won back 3 %: docs/lmcache.md)."""
        lib, ring = self.lib, self._ring
        while self._pending_cancels:
            target_ud = self._pending_cancels.pop()
            opcodes.AsyncCancel(target_ud).build(lib, self._get_sqe(), _UD_IGNORE)
        queues, inflight, pump, fixed = self._queues, self._inflight, self._pump, self._fixed_index
        while (request := queues.head()) is not None:
            if pump and not request.retries and not self.observer and request.kind is not Kind.TRIM:
                first_size = min(request.chunk_size, request.length)
                first = functools.partial(request.command, 0, first_size, fixed)
                posted = pump.fill(request, queues.room(request), first)
                if posted is not None:
                    if not posted:
                        break  # the submission queue is full
                    queues.started(request, posted)
                    self.chunks_submitted += posted
                    continue
            taken = queues.next_chunk()
            assert taken is not None
            request, chunk = taken
            rel, size = chunk
            op = request.command(rel, size, fixed)
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
        if pump and not self.observer:
            pump.prepare(queues.upcoming(), fixed)

    def _reap(self) -> None:
        while True:
            completions, more = self._reaper.reap()
            for ud, res, extra in completions:
                if ud >= PUMP_TAG:
                    assert self._pump is not None
                    self._chunk_completed(*self._pump.chunk_of(ud), res, extra)
                elif ud >= _UD_FIRST:
                    request, rel, size, _op, submitted = self._inflight.pop(ud)
                    if (observer := self.observer) is not None:
                        where, now = request.offset + rel, perf_counter()
                        observer(
                            request.target.name, request.op_name, where, size, submitted, now, res
                        )
                    self._chunk_completed(request, rel, size, res, extra)
                elif ud == _UD_WAKE:
                    # cleared before the next drain: a post that saw it set is drained then
                    self._wake_pending = False
                    self._arm_wake()
            if not more:
                return

    def _progressed(self, request: IORequest, posted: int, chunks: int, nbytes: int) -> None:
        """The pump posted ``posted`` more of ``request``'s chunks and counted ``chunks`` of them
        done in full (they have left the lane's count already: the peak must not count both)."""
        if posted:
            self._queues.started(request, posted)
            self.chunks_submitted += posted
        request.chunks_done(chunks, nbytes)  # the pump gives a finished request's slot back

    def _chunk_completed(
        self, request: IORequest, rel: int, size: int, res: int, extra: int
    ) -> None:
        self._queues.chunk_finished(request)
        request.chunk_completed(rel, size, res, extra)
        if request.retries and not request.stopped:
            self._queues.add_first(request)
        if self._pump is not None:
            self._pump.settle(request)

    def _fail_everything(self, error: BaseException) -> None:
        """Report the ring's death to every waiting caller instead of leaving them hanging.

        Requests with chunks still posted keep their buffers counted as in flight forever: the
        kernel may still DMA into them, so such a buffer refuses to close (a leak, never a
        corruption). The engine is dead afterwards; every new call raises.
        """
        wrapped = IOEngineError(f"the ring thread died: {error!r}")
        posted = {id(entry[0]): entry[0] for entry in self._inflight.values()}
        if self._pump is not None:
            posted.update((id(held), held) for held in self._pump.holds() if held.inflight)
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
