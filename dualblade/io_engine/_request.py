"""One caller's transfer, split into chunks, tracked until the kernel is done with its buffer.

Both backends (the io_uring ring thread and the thread-pool compatibility engine) drive the same
:class:`IORequest`: they pull chunks with :meth:`IORequest.next_chunk`, report each completion
with :meth:`IORequest.chunk_done` or :meth:`IORequest.chunk_failed`, and the request calls its
``notify`` callback exactly once, when nothing of it is in flight any more. A request is touched
only by its backend's thread(s) under the backend's own discipline; the caller only reads its
result after ``notify``.
"""

from __future__ import annotations

import enum
import errno
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from dualblade.io_engine._lanes import check_lane
from dualblade.io_engine.errors import IOEngineError, IOFailedError

if TYPE_CHECKING:
    from dualblade.io_engine import opcodes
    from dualblade.io_engine.buffers import AlignedBuffer
    from dualblade.io_engine.targets.base import Target


class Kind(enum.Enum):
    """What a request does."""

    READ = "read"
    WRITE = "write"
    TRIM = "trim"


class CancelledError(Exception):
    """Internal marker: the caller cancelled the request before it finished."""


class IORequest:
    """A transfer of ``length`` bytes between ``buffer[buf_offset:]`` and ``target[offset:]``.

    Chunks are ``(rel, length)`` pairs relative to the request's start, none longer than
    ``chunk_size``. A short transfer re-queues its remainder; an error or a cancellation stops
    further submissions, and the request finishes when its in-flight chunks have completed.
    """

    __slots__ = (
        "buf_offset",
        "buffer",
        "cancelled",
        "chunk_size",
        "chunks_submitted",
        "done_bytes",
        "error",
        "finished",
        "inflight",
        "is_write",
        "kind",
        "length",
        "notify",
        "offset",
        "op_name",
        "retries",
        "submitted",
        "target",
    )

    def __init__(
        self,
        kind: Kind,
        target: Target,
        buffer: AlignedBuffer | None,
        buf_offset: int,
        length: int,
        offset: int,
        chunk_size: int,
        notify: Callable[[], None],
    ) -> None:
        self.kind = kind
        self.is_write = kind is Kind.WRITE  # read per chunk on the hot path
        self.op_name: str = kind.value  # an enum's ``.value`` is a property call, per chunk
        self.target = target
        self.buffer = buffer
        self.buf_offset = buf_offset
        self.length = length
        self.offset = offset
        self.chunk_size = chunk_size
        self.notify = notify
        self.submitted = 0  # bytes handed out by next_chunk (excluding retries)
        self.retries: deque[tuple[int, int]] = deque()
        self.inflight = 0
        self.done_bytes = 0
        self.chunks_submitted = 0
        self.error: BaseException | None = None
        self.cancelled = False
        self.finished = False
        if buffer is not None:
            # Counted once per request, from now until the last chunk's completion is reaped.
            buffer.begin_io()

    @property
    def stopped(self) -> bool:
        """No more chunks will be submitted (failed or cancelled)."""
        return self.error is not None or self.cancelled

    def next_chunk(self) -> tuple[int, int] | None:
        """The next ``(rel, length)`` to submit, or None when nothing is left to hand out."""
        if self.stopped:
            return None
        if self.retries:
            return self.retries.popleft()
        if self.submitted >= self.length:
            return None
        rel = self.submitted
        size = min(self.chunk_size, self.length - rel)
        self.submitted += size
        return rel, size

    def has_chunks(self) -> bool:
        """A chunk is left to hand out (a retry or a fresh one), and the request is not stopped."""
        return not self.stopped and (bool(self.retries) or self.submitted < self.length)

    def command(self, rel: int, size: int, fixed_index: dict[int, int]) -> opcodes.Op:
        """The target's command for the chunk ``(rel, size)``; ``fixed_index`` maps a registered
        buffer's id to its index in the ring's table (passthrough commands take none)."""
        target, offset = self.target, self.offset + rel
        if self.kind is Kind.TRIM:
            op = target.trim_op(offset, size)
            assert op is not None, "blocking trims do not go through the ring"
            return op
        buffer = self.buffer
        assert buffer is not None
        index = fixed_index.get(id(buffer)) if not target.passthrough else None
        address = buffer.address + self.buf_offset + rel
        return target.io_op(self.is_write, address, size, offset, index)

    def push_back(self, chunk: tuple[int, int]) -> None:
        """Return a chunk that could not be submitted (e.g. the SQ was full)."""
        self.retries.appendleft(chunk)

    def chunk_started(self) -> None:
        """A chunk was handed to the kernel (or a worker): its buffer is now under DMA."""
        self.inflight += 1
        self.chunks_submitted += 1

    def chunks_started(self, count: int) -> None:
        """``count`` chunks were handed to the kernel at once (the native chunk pump)."""
        self.inflight += count
        self.chunks_submitted += count

    def chunks_done(self, count: int, nbytes: int) -> None:
        """``count`` chunks completed in full, ``nbytes`` together (the native chunk pump)."""
        self.inflight -= count
        self.done_bytes += nbytes
        self._maybe_finish()

    def chunk_done(self, rel: int, size: int, transferred: int) -> None:
        """A chunk completed with ``transferred`` bytes (may be short)."""
        self._end_chunk()
        self.done_bytes += transferred
        if transferred < size:
            if transferred == 0:
                self.error = IOFailedError(
                    self.target.name,
                    self.op_name,
                    self.offset + rel,
                    size,
                    detail="unexpected end of target (0 bytes transferred)",
                )
            else:
                self.retries.append((rel + transferred, size - transferred))
        self._maybe_finish()

    def chunk_completed(self, rel: int, size: int, res: int, extra: int) -> None:
        """The kernel's answer for the chunk ``(rel, size)``: the CQE's ``res`` and, from a
        32-byte CQE, its ``extra`` word; the target's :meth:`~Target.transferred` reads them."""
        if res == -errno.ECANCELED and self.cancelled:
            self.chunk_failed(IOEngineError("cancelled"))  # ignored: the request is cancelled
            return
        try:
            transferred = self.target.transferred(self.op_name, res, size, self.offset + rel, extra)
        except BaseException as error:
            self.chunk_failed(error)
        else:
            self.chunk_done(rel, size, transferred)

    def chunk_failed(self, error: BaseException) -> None:
        """A chunk failed; the first error wins and stops further submissions."""
        self._end_chunk()
        if self.error is None and not self.cancelled:
            self.error = error
        self._maybe_finish()

    def cancel(self) -> None:
        """Stop handing out chunks; finish once the in-flight ones have completed."""
        self.cancelled = True
        self._maybe_finish()

    def _end_chunk(self) -> None:
        self.inflight -= 1

    def complete(self) -> bool:
        """All bytes were transferred."""
        return self.submitted >= self.length and not self.retries and self.inflight == 0

    def _maybe_finish(self) -> None:
        if self.finished or self.inflight:
            return
        if self.stopped or self.complete():
            self.finished = True
            if self.buffer is not None:
                self.buffer.end_io()  # the kernel has let go of the buffer
            self.notify()

    def abandon(self, error: BaseException) -> None:
        """Finish a request none of whose chunks is in flight (refused, or its backend died)."""
        assert self.inflight == 0, "abandon() with chunks in flight"
        if self.error is None:
            self.error = error
        self._maybe_finish()

    def abandon_under_dma(self, error: BaseException) -> None:
        """Fail a request whose chunks may still be in the kernel's hands (the ring died).

        The caller is told at once, but the buffer stays counted as in flight: nobody will ever
        see those completions, so the buffer must never be released or reused.
        """
        if self.finished:
            return
        self.error = self.error or error
        self.finished = True
        self.notify()

    def start_empty(self) -> None:
        """Finish a zero-length request at once."""
        self._maybe_finish()

    def result(self) -> int:
        """Bytes transferred; raises the request's error, or :class:`CancelledError`."""
        assert self.finished, "result() before the request finished"
        if self.error is not None:
            raise self.error
        if self.cancelled and not self.complete():
            raise CancelledError
        return self.done_bytes


def checked_request(
    kind: Kind,
    target: Target,
    buf: AlignedBuffer | None,
    size: int,
    offset: int,
    buf_offset: int,
    notify: Callable[[], None],
    *,
    passthrough_ring: bool,
    max_chunk: int | None,
) -> IORequest:
    """The request for a transfer, its arguments checked here, on the caller's thread (the
    ring thread must not raise). ``passthrough_ring``: the engine's ring carries NVMe commands;
    ``max_chunk``: the engine's cap on a device's commands.

    Raises:
        IOEngineError: a passthrough target on a plain ring, or the range overruns ``buf``.
        TargetError: misaligned or out-of-range arguments (``Target.check_io``).
    """
    if target.passthrough and not passthrough_ring:
        raise IOEngineError(
            f"{target.name} takes NVMe passthrough commands: open the engine with passthrough=True"
        )
    check_lane(target)
    address = None
    if buf is not None:
        if buf_offset < 0 or buf_offset + size > buf.size:
            raise IOEngineError(
                f"{kind.value} of {size} bytes at buffer offset {buf_offset} overruns the "
                f"{buf.size}-byte buffer"
            )
        address = buf.address + buf_offset
    target.check_io(kind.value, offset, size, address)
    chunk = target.max_trim if kind is Kind.TRIM else target.command_bytes(size, max_chunk)
    return IORequest(kind, target, buf, buf_offset, size, offset, chunk, notify)
