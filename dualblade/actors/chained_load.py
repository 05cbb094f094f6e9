"""A CUDA load with no task of its own: its read and its copy are chained on the engine's thread,
and the copy thread hears of it once, on the event loop, when the copy is done.

A copy thread ran each transfer as a task: spawned, stepped when the read ended, stepped again
when the copy's reply came. On the H200 machine the event loop's Python per KPU set the
pipeline's pace (docs/pipeline-profile.md), and a task's spawn and steps were a large part of it.
A :class:`ChainedLoad` holds what the transfer needs to finish; the copy thread starts the read
(``read_then``) with the GPU-DMA actor's launch (``GpuDmaActor.chain``) chained to it, and the
load itself is the copy's reply: the actor answers it on the loop, and the copy thread finishes
the transfer there.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dualblade.actors.copy_messages import Load

#: A chained copy's launch (``GpuDmaActor.chain``): told on the engine's thread how the read ended.
Launch = Callable[[BaseException | None], None]


class ChainedLoad:
    """One load in flight. ``message``: as the requester sent it; ``placed``: moved into the
    copy thread's ``image``; ``ended(load, error)`` runs on the loop when the copy is done
    (``error`` None) or the read or the copy failed."""

    __slots__ = ("cancel", "ended", "image", "launch", "message", "placed", "read_end", "start")

    def __init__(
        self,
        message: Load,
        placed: Load,
        image: int,
        ended: Callable[[ChainedLoad, BaseException | None], None],
    ) -> None:
        self.message = message
        self.placed = placed
        self.image = image
        self.ended = ended
        self.start = time.perf_counter()
        self.read_end = self.start
        self.launch: Launch | None = None  # dropped once called: it holds the copy's tensors
        self.cancel: Callable[[], None] | None = None  # the read's, once started

    def read_ended(self, error: BaseException | None) -> None:
        """On the engine's thread: queue the copy (or report the read's error)."""
        self.read_end = time.perf_counter()
        launch, self.launch = self.launch, None
        assert launch is not None, "a read ends once"
        launch(error)

    # The copy's reply, answered by the GPU-DMA actor on the loop.
    def set(self, nbytes: int) -> None:
        self.ended(self, None)

    def fail(self, error: BaseException) -> None:
        self.ended(self, error)
