"""Requests waiting for the engine, in one FIFO queue per lane, each lane with its own depth.

A target names its lane (:attr:`Target.lane`): ``"device"`` for storage reached by commands
(O_DIRECT files, block devices, NVMe namespaces), ``"page-cache"`` for buffered files. The two
are two storage stacks. A buffered read of resident pages is a memory copy that takes
microseconds, while a chunk to the device waits for the device; dual places a context's layers on
both so that their bandwidths add.

With one FIFO queue of ``queue_depth`` chunks for both, a page-cache read waited until every
chunk of the direct reads queued before it had been submitted, and the chunks then in flight
had been answered. Measured on the pressure preset's shapes here (a 34 MiB direct layer and a
34 MiB page-cache layer read together, 32 chunks deep): the page-cache layer took 16 ms instead
of 3 ms, the time of the direct layer beside it, so the paths ran one after the other again.
Each lane now keeps up to ``queue_depth`` chunks in flight of its own: a device's queue depth
is a property of the device, and memory copies do not take part in it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dualblade.io_engine.errors import IOEngineError

if TYPE_CHECKING:
    from dualblade.io_engine._request import IORequest

#: The lanes, in the order a refill serves them.
LANES = ("page-cache", "device")


def check_lane(target: object) -> None:
    """Refuse a target whose lane the engine does not have.

    Raises:
        IOEngineError: the lane is unknown; the message names the target and the lanes.
    """
    lane = getattr(target, "lane", None)
    if lane not in LANES:
        raise IOEngineError(
            f"{getattr(target, 'name', target)}: unknown I/O lane {lane!r} "
            f"(lanes: {', '.join(LANES)})"
        )


class LaneQueues:
    """Waiting requests per lane and the chunks each lane has in flight.

    Not thread-safe: each backend calls it under its own discipline (the ring thread alone, or
    the thread pool's lock).
    """

    def __init__(self, queue_depth: int) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, got {queue_depth}")
        self.queue_depth = queue_depth
        self._waiting: dict[str, deque[IORequest]] = {lane: deque() for lane in LANES}
        self._inflight: dict[str, int] = dict.fromkeys(LANES, 0)
        self.peak_inflight = 0

    @staticmethod
    def lane_of(request: IORequest) -> str:
        """The lane ``request`` queues in (its target's)."""
        return request.target.lane

    def add(self, request: IORequest) -> None:
        """Queue ``request`` behind the others of its lane.

        Raises:
            IOEngineError: its target names a lane the engine does not have.
        """
        check_lane(request.target)
        self._waiting[self.lane_of(request)].append(request)

    def add_first(self, request: IORequest) -> None:
        """Queue ``request`` ahead of its lane (a short transfer's remainder), unless queued."""
        waiting = self._waiting[self.lane_of(request)]
        if request not in waiting:
            waiting.appendleft(request)

    def waiting(self) -> Iterator[IORequest]:
        """Every queued request, lane by lane."""
        for queue in self._waiting.values():
            yield from queue

    def __bool__(self) -> bool:
        return any(self._waiting.values())

    @property
    def inflight(self) -> int:
        """Chunks in flight over all lanes."""
        return sum(self._inflight.values())

    def lane_inflight(self, lane: str) -> int:
        """Chunks of ``lane`` in flight."""
        return self._inflight[lane]

    def head(self) -> IORequest | None:
        """The first request with a chunk to hand out, in the first lane with room; None when
        no lane has both room and work. A request with no chunks left leaves its queue here."""
        for lane, queue in self._waiting.items():
            if self._inflight[lane] >= self.queue_depth:
                continue
            while queue:
                if queue[0].has_chunks():
                    return queue[0]
                queue.popleft()
        return None

    def upcoming(self, per_lane: int = 2) -> list[IORequest]:
        """Lane by lane, the first ``per_lane`` queued requests with chunks left: the ones
        whose chunks a lane hands out next, in that order (nothing is taken off a queue)."""
        found: list[IORequest] = []
        for queue in self._waiting.values():
            taken = 0
            for request in queue:
                if taken == per_lane:
                    break
                if request.has_chunks():
                    found.append(request)
                    taken += 1
        return found

    def room(self, request: IORequest) -> int:
        """Chunks ``request``'s lane may start now."""
        return self.queue_depth - self._inflight[self.lane_of(request)]

    def started(self, request: IORequest, count: int) -> None:
        """``count`` of ``request``'s chunks are in flight now."""
        self._inflight[self.lane_of(request)] += count
        total = self.inflight
        if total > self.peak_inflight:
            self.peak_inflight = total

    def next_chunk(self) -> tuple[IORequest, tuple[int, int]] | None:
        """The next chunk to start, from a lane below its depth, counted as in flight; None when
        no lane has both room and work."""
        request = self.head()
        if request is None:
            return None
        chunk = request.next_chunk()
        assert chunk is not None, "head() returned a request with no chunk left"
        self.started(request, 1)
        return request, chunk

    def give_back(self, request: IORequest, chunk: tuple[int, int]) -> None:
        """Undo :meth:`next_chunk` for a chunk that could not be started."""
        request.push_back(chunk)
        self._inflight[self.lane_of(request)] -= 1

    def chunk_finished(self, request: IORequest, count: int = 1) -> None:
        """``count`` of ``request``'s chunks are no longer in flight."""
        self._inflight[self.lane_of(request)] -= count
