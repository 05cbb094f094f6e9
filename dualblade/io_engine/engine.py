"""The I/O engine: POSIX-shaped, awaitable and blocking transfers between buffers and targets.

``await engine.pread(target, buf, size, file_offset)`` moves ``size`` bytes and returns the byte
count; ``engine.read(...)`` is the blocking form for sync callers. Large requests are split into
chunks (:meth:`Target.command_bytes`: ``max_transfer``, and ``max_chunk`` for a device), and
up to ``queue_depth`` chunks are in flight at once, across all requests of a lane: the device's,
and the page cache's (buffered files), so that memory copies never wait behind device commands
(:mod:`._lanes`).

Compat mode (``on | off | auto``, default ``auto`` or ``$DUALBLADE_COMPAT``): ``auto`` uses the
io_uring ring and falls back to the thread-pool ``preadv``/``pwritev`` engine when io_uring cannot
be set up, logging why once; ``off`` raises instead; ``on`` always uses the thread pool.

Notes:
    Buffers must be :class:`~dualblade.io_engine.buffers.AlignedBuffer` (O_DIRECT and NVMe need
    aligned DMA memory). A buffer is never released while an I/O on it is in flight: when an
    awaiting task is cancelled, the engine stops the request's remaining chunks, asks the kernel
    to cancel posted ones, and waits (shielded) until every posted chunk has completed before the
    cancellation propagates.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import anyio

from dualblade.io_engine._backend import open_backend
from dualblade.io_engine._chunk_observers import chained
from dualblade.io_engine._request import CancelledError, IORequest, Kind, checked_request
from dualblade.io_engine._threadpool import ThreadPoolBackend
from dualblade.io_engine._waker import async_waker, blocking_waker
from dualblade.io_engine.buffers import AlignedBuffer
from dualblade.io_engine.errors import IOEngineError
from dualblade.io_engine.ring import ChunkObserver, Ring
from dualblade.io_engine.storage_slots import StorageSlots
from dualblade.io_engine.targets.base import Target

CompatMode = Literal["on", "off", "auto"]


class IOEngine:
    """Moves bytes between aligned buffers and storage targets.

    Args:
        queue_depth: chunks in flight at most, over all requests of one lane (the device,
            the page cache).
        compat: ``on``, ``off`` or ``auto`` (see the module notes).
        passthrough: the ring must carry NVMe commands (128-byte SQEs, 32-byte CQEs).
        max_chunk: cap on the size of a device's commands, below each target's
            ``max_transfer`` (Algorithm 2's chunking). A buffered file cuts its own commands
            (:meth:`~dualblade.io_engine.targets.page_cache_file.PageCacheFile.command_bytes`).
        name: used for the ring thread and in logs.

    Raises:
        IoUringUnavailableError: compat is ``off`` (or ``passthrough`` is asked) and io_uring
            cannot be used.
    """

    def __init__(
        self,
        *,
        queue_depth: int = 32,
        compat: CompatMode | None = None,
        passthrough: bool = False,
        max_chunk: int | None = None,
        name: str = "dualblade-io",
    ) -> None:
        mode = compat or os.environ.get("DUALBLADE_COMPAT", "auto")
        if mode not in ("on", "off", "auto"):
            raise IOEngineError(f"compat mode must be 'on', 'off' or 'auto', got {mode!r}")
        if max_chunk is not None and max_chunk <= 0:
            raise IOEngineError(f"max_chunk must be positive, got {max_chunk}")
        self.max_chunk = max_chunk
        self._backend, self.fallback_reason = open_backend(
            mode, queue_depth, passthrough=passthrough, name=name
        )
        self.queue_depth = queue_depth
        self.passthrough = passthrough
        self._closed = False

    @property
    def kind(self) -> str:
        """``"io_uring"`` or ``"threadpool"``."""
        return "threadpool" if isinstance(self._backend, ThreadPoolBackend) else "io_uring"

    @property
    def chunks_submitted(self) -> int:
        """Chunks handed to the kernel (or workers) since the engine started."""
        return self._backend.chunks_submitted

    @property
    def inflight(self) -> int:
        """Chunks in flight now (a sample)."""
        return self._backend.inflight

    def observe_chunks(self, observer: ChunkObserver) -> None:
        """Call ``observer`` for each completed chunk (io_uring only; on the ring thread).

        It receives the target's name, the op, the chunk's offset and length, its submit and
        completion times (``time.perf_counter`` seconds) and the completion's raw result.
        Observers add up, called in the order given: a traced bench run's I/O track and its
        request log both see every chunk.
        """
        if isinstance(ring := self._backend, Ring):
            ring.observer = chained(ring.observer, observer)

    @property
    def peak_inflight(self) -> int:
        """The most chunks that were in flight at once, over all lanes (at most ``queue_depth``
        in each)."""
        return self._backend.peak_inflight

    def register_buffers(self, buffers: Sequence[AlignedBuffer]) -> None:
        """Register buffers as io_uring fixed buffers (once per engine; no-op in compat mode)."""
        self._backend.register_buffers(buffers)

    def add_fixed_buffer(self, buffer: AlignedBuffer) -> str | None:
        """Register one more buffer, later (``_fixed_buffers.py`` says what that saves): None
        when it is fixed now, else why not (its I/O works either way)."""
        return self._backend.add_fixed_buffer(buffer)

    def remove_fixed_buffer(self, buffer: AlignedBuffer) -> None:
        """Give ``buffer``'s slot back before it closes (one collected frees its own)."""
        self._backend.remove_fixed_buffer(buffer)

    def is_registered(self, buffer: AlignedBuffer) -> bool:
        """Whether transfers on ``buffer`` use the ring's fixed-buffer commands."""
        return self._backend.buffer_index(buffer) is not None

    # -- request construction ----------------------------------------------------------------
    def _rules(self) -> dict[str, Any]:
        """What :func:`checked_request` needs of this engine; raises once it is closed."""
        if self._closed:
            raise IOEngineError("the I/O engine is closed")
        return {"passthrough_ring": self.passthrough, "max_chunk": self.max_chunk}

    def _submit(self, request: IORequest) -> None:
        try:
            self._backend.submit(request)
        except BaseException as error:
            request.abandon(error)  # releases the buffer's in-flight count
            raise

    # -- async API ---------------------------------------------------------------------------
    async def pread(
        self,
        target: Target,
        buf: AlignedBuffer,
        size: int,
        file_offset: int,
        *,
        buf_offset: int = 0,
        slots: StorageSlots | None = None,
    ) -> int:
        """Read ``size`` bytes at ``file_offset`` into ``buf[buf_offset:]``; returns ``size``.

        ``slots``: the read waits for one of them in the engine and holds it exactly while in
        flight; when it ends, the engine's thread starts the next waiter (storage_slots.py).

        Raises:
            IOFailedError: a chunk failed (target, offset, length, errno or NVMe status).
            TargetError: misaligned or out-of-range arguments.
        """
        return await self._run_async(Kind.READ, target, buf, size, file_offset, buf_offset, slots)

    async def pwrite(
        self,
        target: Target,
        buf: AlignedBuffer,
        size: int,
        file_offset: int,
        *,
        buf_offset: int = 0,
        slots: StorageSlots | None = None,
    ) -> int:
        """Write ``size`` bytes from ``buf[buf_offset:]`` at ``file_offset``; returns ``size``.
        ``slots`` as for :meth:`pread`."""
        return await self._run_async(Kind.WRITE, target, buf, size, file_offset, buf_offset, slots)

    async def trim(self, target: Target, offset: int, length: int) -> None:
        """Deallocate ``[offset, offset+length)`` on the target (punch hole, discard, DSM)."""
        route = self._trim_route(target, offset, length)
        if route == "thread":
            await anyio.to_thread.run_sync(target.trim_blocking, offset, length)
        elif route == "ring":
            await self._run_async(Kind.TRIM, target, None, length, offset, 0)

    def _trim_route(self, target: Target, offset: int, length: int) -> str:
        """Check a trim, then say how it runs: ``none`` (empty), ``thread`` or ``ring``."""
        target.check_io("trim", offset, length, None)
        if length == 0:
            return "none"
        if self.kind == "threadpool" or target.trim_op(offset, length) is None:
            return "thread"
        return "ring"

    async def _run_async(
        self,
        kind: Kind,
        target: Target,
        buf: AlignedBuffer | None,
        size: int,
        offset: int,
        buf_offset: int,
        slots: StorageSlots | None = None,
    ) -> int:
        event, wake = async_waker()
        box: list[IORequest] = []
        rules = self._rules()
        make = functools.partial(
            checked_request, kind, target, buf, size, offset, buf_offset, **rules
        )
        cancel = self._start(make, wake, slots, box)
        try:
            await event.wait()
        except BaseException:
            # Cancelled (or interrupted): the kernel may still DMA into the buffer. Stop the
            # request and wait, shielded, until every posted chunk has completed.
            with anyio.CancelScope(shield=True):
                cancel()
                await event.wait()
            raise
        return box[0].result()

    def read_then(
        self,
        target: Target,
        buf: AlignedBuffer,
        size: int,
        file_offset: int,
        then: Callable[[BaseException | None], None],
        *,
        buf_offset: int = 0,
        slots: StorageSlots | None = None,
    ) -> Callable[[], None]:
        """Start a read as :meth:`pread` does; ``then(None)`` (every byte arrived) or
        ``then(error)`` runs on the engine's thread when it ends, and must not raise. No loop
        wakes between, so a GPU copy chained to the read starts at once (``GpuDmaActor.chain``).
        Returns a function that cancels the read (``then`` is still called). Bad arguments or a
        closed engine raise here (TargetError, IOEngineError), and ``then`` is not called."""
        box: list[IORequest] = []
        # emptied when the read ends: the request and its slot's claim refer to each other,
        # and ``then`` may hold the caller's tensors, which must not wait for the collector
        held = [then]

        def ended() -> None:
            request, told = box.pop(), held.pop()
            try:
                request.result()
            except BaseException as error:  # told() gets it
                told(error)
                return
            told(None)

        try:
            make = functools.partial(
                checked_request,
                Kind.READ,
                target,
                buf,
                size,
                file_offset,
                buf_offset,
                **self._rules(),
            )
            return self._start(make, ended, slots, box)
        except Exception:
            if held:  # then() was not told: bad arguments, nothing started
                raise
            return lambda: None  # a refused submit, already told to then()

    def _start(
        self,
        make_request: Callable[[Callable[[], None]], IORequest],
        notify: Callable[[], None],
        slots: StorageSlots | None,
        box: list[IORequest],
    ) -> Callable[[], None]:
        """Start the request ``make_request`` makes (or queue it for one of ``slots``); it
        calls ``notify`` when it has ended. ``box`` receives it before it can start (a
        ``notify`` may need it). Returns its cancel. A refused submit raises after ``notify``."""

        def make(notify: Callable[[], None]) -> IORequest:
            box.append(make_request(notify))
            return box[0]

        if slots is None:
            request = make(notify)
            self._submit(request)
            return lambda: self._backend.cancel(request)
        # queued for a slot, and started by whichever thread frees one (storage_slots.py)
        claim = slots.claim(lambda: self._start_granted(claim.request))

        def finished() -> None:  # on the backend's thread: the next waiter starts there
            if claim.granted:
                slots.release()
            notify()

        claim.request = make(finished)
        claim.enter()

        def cancel() -> None:
            if claim.withdraw():  # never started: nothing in flight
                claim.request.abandon(IOEngineError("cancelled while waiting for a storage slot"))
            else:
                self._backend.cancel(claim.request)

        return cancel

    def _start_granted(self, request: IORequest) -> None:
        """Submit a request whose storage slot was just granted (on the granting thread)."""
        try:
            self._backend.submit(request)
        except BaseException as error:  # closed meanwhile: it finishes and gives the slot back
            request.abandon(error)

    # -- blocking API ------------------------------------------------------------------------
    def read(
        self,
        target: Target,
        buf: AlignedBuffer,
        size: int,
        file_offset: int,
        *,
        buf_offset: int = 0,
    ) -> int:
        """Blocking :meth:`pread`."""
        return self._run_blocking(Kind.READ, target, buf, size, file_offset, buf_offset)

    def write(
        self,
        target: Target,
        buf: AlignedBuffer,
        size: int,
        file_offset: int,
        *,
        buf_offset: int = 0,
    ) -> int:
        """Blocking :meth:`pwrite`."""
        return self._run_blocking(Kind.WRITE, target, buf, size, file_offset, buf_offset)

    def trim_blocking(self, target: Target, offset: int, length: int) -> None:
        """Blocking :meth:`trim`."""
        route = self._trim_route(target, offset, length)
        if route == "thread":
            target.trim_blocking(offset, length)
        elif route == "ring":
            self._run_blocking(Kind.TRIM, target, None, length, offset, 0)

    def _run_blocking(
        self,
        kind: Kind,
        target: Target,
        buf: AlignedBuffer | None,
        size: int,
        offset: int,
        buf_offset: int,
    ) -> int:
        event, wake = blocking_waker()
        request = checked_request(
            kind, target, buf, size, offset, buf_offset, wake, **self._rules()
        )
        self._submit(request)
        try:
            event.wait()
        except BaseException:
            self._backend.cancel(request)
            event.wait()
            raise
        try:
            return request.result()
        except CancelledError:  # pragma: no cover - only async callers cancel
            raise IOEngineError("request cancelled") from None

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for in-flight I/O, then stop the backend (idempotent)."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> IOEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await anyio.to_thread.run_sync(self.close)
