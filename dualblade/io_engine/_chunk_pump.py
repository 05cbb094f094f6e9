"""The ring thread's chunks posted and counted in C (``native/chunk_pump.c``), per request.

Python's part per request: a slot holding the request's first SQE, built by its target as for
any chunk, and what moves it to the next chunk. C's part per chunk: copy the SQE, move it,
submit it; at completion, count it when it did what it asked and post the request's next chunk
in its place. The ring thread waits in C too (:meth:`ChunkPump.wait`, the GIL released) until
Python has something to do. Only what Python must see comes back: each touched request's posted
and completed chunks and bytes, in one call per request, and every other completion (errors,
short transfers, cancellations, the ring's own commands) as ``(user_data, res, big-CQE word)``
for the ring's Python path, which handles it as before.

A request goes to the pump when its target completes chunks the plain way
(:attr:`Target.native_completion`), its command is one the pump can move (a plain or fixed read
or write, an NVMe I/O command), and a slot is free. Everything else, and the remainder of a
short transfer, takes the Python path beside it on the same ring.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import ClassVar, Final

from dualblade.io_engine import native, opcodes
from dualblade.io_engine._liburing import LibUring
from dualblade.io_engine._request import IORequest

#: A pump chunk's user_data: the tag, its slot and its index in the request (chunk_pump.c).
PUMP_TAG: Final = 1 << 63
_SLOT_SHIFT: Final = 40
_CHUNK_MASK: Final = (1 << _SLOT_SHIFT) - 1
_KIND_FILE, _KIND_NVME = 0, 1
_FILE_OPS = (opcodes.Read, opcodes.Write, opcodes.ReadFixed, opcodes.WriteFixed)
#: Completions handed back to Python per reap call (three words each).
_OUT_CAPACITY: Final = 256


class _Slot(ctypes.Structure):
    """``struct db_slot``."""

    _fields_: ClassVar = [
        ("sqe", ctypes.c_uint8 * 128),
        ("addr", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
        ("chunk", ctypes.c_uint64),
        ("next_rel", ctypes.c_uint64),
        ("kind", ctypes.c_uint32),
        ("lba_shift", ctypes.c_uint32),
        ("done_chunks", ctypes.c_uint64),
        ("done_bytes", ctypes.c_uint64),
        ("posted", ctypes.c_uint64),
        ("touched", ctypes.c_uint32),
        ("stopped", ctypes.c_uint32),
        ("inflight", ctypes.c_uint32),
        ("successor", ctypes.c_uint32),
    ]


class _Pump(ctypes.Structure):
    """``struct db_pump``."""

    _fields_: ClassVar = [
        ("ring", ctypes.c_void_p),
        ("get_sqe", ctypes.c_void_p),
        ("submit", ctypes.c_void_p),
        ("peek_batch", ctypes.c_void_p),
        ("cq_advance", ctypes.c_void_p),
        ("submit_and_wait", ctypes.c_void_p),
        ("sqe_bytes", ctypes.c_uint32),
        ("big_cqe", ctypes.c_uint32),
        ("slot_count", ctypes.c_uint32),
        ("out_capacity", ctypes.c_uint32),
        ("slots", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("touched", ctypes.c_void_p),
        ("handed", ctypes.c_uint32),
        ("touched_count", ctypes.c_uint32),
        ("more", ctypes.c_uint32),
        ("successor_posts", ctypes.c_uint32),
    ]


def _address(function: object) -> int:
    value = ctypes.cast(function, ctypes.c_void_p).value  # type: ignore[arg-type]
    assert value is not None
    return value


class ChunkPump:
    """The slots of one ring (used on its thread only).

    Args:
        native: the loaded library (:func:`dualblade.io_engine.native.load`).
        lib: the ring's liburing; ring: the address of its ``struct io_uring``.
        passthrough: the ring has 128-byte SQEs and 32-byte CQEs.
        slot_count: requests the pump carries at once (the lanes' depth together, and one
            more per lane for the request it hands out next: a request holds its slot only
            while it has chunks to post or in flight).
        finished: called first, for every request with progress, with how many of its chunks
            completed (they are no longer in flight in its lane).
        progressed: called next with a request, how many of its chunks C posted (its fields
            already say so) and how many of its chunks and bytes completed.

    Raises:
        RuntimeError: the library's structures are not the ones mirrored here (a build of
            another source).
    """

    def __init__(
        self,
        native: ctypes.PyDLL,
        lib: LibUring,
        ring: int,
        *,
        passthrough: bool,
        slot_count: int,
        finished: Callable[[IORequest, int], None],
        progressed: Callable[[IORequest, int, int, int], None],
    ) -> None:
        if native.db_pump_slot_bytes() != ctypes.sizeof(_Slot) or native.db_pump_bytes() != (
            ctypes.sizeof(_Pump)
        ):
            raise RuntimeError("the chunk pump's library does not match dualblade's mirror of it")
        self._native = native
        self._lib = lib
        self._slots = (_Slot * slot_count)()
        self._out = (ctypes.c_uint64 * (3 * _OUT_CAPACITY))()
        self._touched = (ctypes.c_uint32 * slot_count)()
        self._pump = _Pump(
            ring=ring,
            get_sqe=_address(lib.io_uring_get_sqe),
            submit=_address(lib.io_uring_submit),
            peek_batch=_address(lib.io_uring_peek_batch_cqe),
            cq_advance=_address(lib.io_uring_cq_advance),
            submit_and_wait=_address(lib.io_uring_submit_and_wait),
            sqe_bytes=128 if passthrough else 64,
            big_cqe=1 if passthrough else 0,
            slot_count=slot_count,
            out_capacity=_OUT_CAPACITY,
            slots=ctypes.addressof(self._slots),
            out=ctypes.addressof(self._out),
            touched=ctypes.addressof(self._touched),
        )
        self._pump_ref = ctypes.byref(self._pump)
        self._reported = False  # the last wait() reaped what reap() hands out next
        self.slot_count = slot_count
        self._free = list(range(slot_count - 1, -1, -1))
        self._requests: list[IORequest | None] = [None] * slot_count
        self._slot_of: dict[int, int] = {}  # id(request) -> slot
        #: Per lane, the slot of the request opened last, while it holds it: the next request
        #: opened in that lane becomes its successor (chunk_pump.c's post_successor).
        self._lane_last: dict[str, int] = {}
        self._predecessor: dict[int, int] = {}  # slot -> the slot whose successor it is
        self._finished = finished
        self._progressed = progressed

    @classmethod
    def open(
        cls,
        lib: LibUring,
        ring: int,
        passthrough: bool,
        slot_count: int,
        finished: Callable[[IORequest, int], None],
        progressed: Callable[[IORequest, int, int, int], None],
    ) -> tuple[ChunkPump | None, str]:
        """The ring's pump and "", or None and why there is none (:func:`native.load`)."""
        library, why = native.load()
        if library is None:
            return None, why
        pump = cls(
            library,
            lib,
            ring,
            passthrough=passthrough,
            slot_count=slot_count,
            finished=finished,
            progressed=progressed,
        )
        return pump, ""

    def fill(self, request: IORequest, room: int, first_op: Callable[[], opcodes.Op]) -> int | None:
        """Post up to ``room`` of ``request``'s fresh chunks; returns how many were posted (0:
        the submission queue is full), or None when the request is not for the pump (the caller
        posts its chunks the Python way). ``first_op``: the target's command for the request's
        first chunk, built once per request."""
        slot_index = self._slot_of.get(id(request))
        if slot_index is None:
            slot_index = self._take_slot(request, first_op)
            if slot_index is None:
                # posted the Python way: a later pump request of the lane must not pass it
                self._lane_last.pop(request.target.lane, None)
                return None
        slot = self._slots[slot_index]
        slot.next_rel = request.submitted
        posted: int = self._native.db_pump_fill(self._pump_ref, slot_index, room)
        if posted:
            request.submitted = slot.next_rel
            request.chunks_started(posted)
        return posted

    def prepare(self, upcoming: list[IORequest], fixed: dict[int, int]) -> None:
        """Give slots to the requests a lane hands out next (``upcoming``, lane by lane, in
        order), posting nothing: opened behind the request in flight, the next one is its
        successor, and C posts its chunks in the places of the last ones of the request before
        it as they complete. Opened only when it is the lane's head, after a completion had
        already come back to Python for the room, the next request started a queue depth of
        completions late on a fast device, whose last chunks all complete in one batch. Stops
        at the first request the pump cannot take (its slot would pass it in the lane)."""
        for request in upcoming:
            if id(request) in self._slot_of or request.retries:
                continue
            first_size = min(request.chunk_size, request.length)
            first_op = functools.partial(request.command, 0, first_size, fixed)
            if self._take_slot(request, first_op) is None:
                return
            self._slots[self._slot_of[id(request)]].next_rel = request.submitted

    def _take_slot(self, request: IORequest, first_op: Callable[[], opcodes.Op]) -> int | None:
        if not self._free or request.buffer is None or not request.target.native_completion:
            return None
        op = first_op()
        if isinstance(op, opcodes.NvmeIo):
            kind = _KIND_NVME
        elif isinstance(op, _FILE_OPS):
            kind = _KIND_FILE
        else:
            return None
        slot_index = self._free.pop()
        slot = self._slots[slot_index]
        ctypes.memset(ctypes.addressof(slot.sqe), 0, 128)
        op.build(self._lib, ctypes.addressof(slot.sqe), 0)
        slot.addr = request.buffer.address + request.buf_offset
        slot.offset = request.offset
        slot.length = request.length
        slot.chunk = request.chunk_size
        slot.kind = kind
        slot.lba_shift = request.target.lba_size.bit_length() - 1
        slot.done_chunks = slot.done_bytes = slot.posted = slot.touched = slot.stopped = 0
        slot.inflight = slot.successor = 0
        self._requests[slot_index] = request
        self._slot_of[id(request)] = slot_index
        lane = request.target.lane
        if (before := self._lane_last.get(lane)) is not None:
            # a lane hands out its requests' chunks in order: this one is next after ``before``
            self._slots[before].successor = slot_index + 1
            self._predecessor[slot_index] = before
        self._lane_last[lane] = slot_index
        notify = request.notify

        def free_then_notify() -> None:
            # The slot is free before the waiter hears of the end: a caller that checks the
            # pump (or starts its next request) right after its await must find the slot back.
            self.settle(request)
            notify()

        request.notify = free_then_notify
        return slot_index

    def settle(self, request: IORequest) -> None:
        """Tell C what Python learned of ``request``: stopped (failed, cancelled), none of its
        chunks is posted any more; finished, its slot is free (nothing if it holds none)."""
        slot_index = self._slot_of.get(id(request))
        if slot_index is None:
            return
        if request.stopped:
            self._slots[slot_index].stopped = 1
        if request.finished:
            del self._slot_of[id(request)]
            self._requests[slot_index] = None
            self._unlink(slot_index, request.target.lane)
            self._free.append(slot_index)

    def _unlink(self, slot_index: int, lane: str) -> None:
        """Take a freed slot out of its lane's chain: no slot may name it as successor (it may
        serve another lane's request next), and a successor of it follows its predecessor."""
        before = self._predecessor.pop(slot_index, None)
        after = self._slots[slot_index].successor
        self._slots[slot_index].successor = 0
        if after:
            if before is None:
                self._predecessor.pop(after - 1, None)
            else:
                self._predecessor[after - 1] = before
        if before is not None:
            self._slots[before].successor = after
        if self._lane_last.get(lane) == slot_index:
            if before is None:
                del self._lane_last[lane]
            else:
                self._lane_last[lane] = before

    @property
    def successor_posts(self) -> int:
        """Chunks C posted in the place of another request's (of the same lane) so far: what
        kept the lane full at a request's end without a return to Python (modulo 2**32)."""
        return int(self._pump.successor_posts)

    @property
    def free_slots(self) -> int:
        """Slots no request holds (all of them, :attr:`slot_count`, when the ring is idle)."""
        return len(self._free)

    def holds(self) -> list[IORequest]:
        """The requests that hold a slot."""
        return [request for request in self._requests if request is not None]

    def chunk_of(self, user_data: int) -> tuple[IORequest, int, int]:
        """The request, offset in it and size of the pump chunk tagged ``user_data``."""
        slot_index = (user_data & ~PUMP_TAG) >> _SLOT_SHIFT
        request = self._requests[slot_index]
        assert request is not None, "a completion for a free slot"
        slot = self._slots[slot_index]
        rel = (user_data & _CHUNK_MASK) * slot.chunk
        return request, rel, min(slot.chunk, slot.length - rel)

    def recent_chunks(self, request: IORequest, count: int) -> list[int]:
        """The user_data of ``request``'s last ``count`` posted pump chunks (to cancel them: the
        ones still in flight are among the most recent, as a lane keeps at most its depth)."""
        slot_index = self._slot_of.get(id(request))
        if slot_index is None:
            return []
        slot = self._slots[slot_index]
        posted = -(-slot.next_rel // slot.chunk)
        tag = PUMP_TAG | slot_index << _SLOT_SHIFT
        return [tag | index for index in range(max(0, posted - count), posted)]

    def wait(self) -> int:
        """Submit, wait and reap in C (the GIL released) until Python has something to do; the
        result of ``io_uring_submit_and_wait`` (negative: an error other than a wake-up)."""
        result: int = self._native.db_pump_run_nogil(self._pump_ref)
        self._reported = True
        return result

    def reap(self) -> tuple[list[tuple[int, int, int]], bool]:
        """What the last :meth:`wait` reaped, or else the completion queue now: the touched
        requests' progress goes to ``progressed``; returns the other completions and whether
        more may be waiting."""
        if self._reported:
            self._reported = False
        else:
            self._native.db_pump_reap(self._pump_ref)
        pump, touched, slots, requests = self._pump, self._touched, self._slots, self._requests
        progress: list[tuple[IORequest, int, int, int]] = []
        for position in range(pump.touched_count):
            slot_index = touched[position]
            slot = slots[slot_index]
            posted, chunks, nbytes = slot.posted, slot.done_chunks, slot.done_bytes
            slot.posted = slot.done_chunks = slot.done_bytes = slot.touched = 0
            request = requests[slot_index]
            assert request is not None, "progress on a free slot"
            if posted:  # before the completions: the request must not look finished early
                request.submitted = slot.next_rel
                request.chunks_started(posted)
            progress.append((request, posted, chunks, nbytes))
        # Every request's completions leave its lane before any new chunk counts: a lane's
        # next request, posted in the places of the last one's chunks, would otherwise count
        # as in flight beside them.
        for request, _, chunks, _ in progress:
            self._finished(request, chunks)
        for request, posted, chunks, nbytes in progress:
            self._progressed(request, posted, chunks, nbytes)
            self.settle(request)
        out = self._out
        others = [
            (out[3 * i], ctypes.c_int64(out[3 * i + 1]).value, out[3 * i + 2])
            for i in range(pump.handed)
        ]
        return others, bool(pump.more)
