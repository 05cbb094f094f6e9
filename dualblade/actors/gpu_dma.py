"""The GPU-DMA actor: copies between copy threads' pinned buffers and device tensors.

With CUDA, copies run on the actor's own stream (``non_blocking`` from page-locked memory is a
true DMA), ordered after the work already queued on the device's current stream (where the model
computes). The actor queues each copy and goes on to the next message at once; a
:class:`~dualblade.actors.dma_completions.DmaCompletions` thread waits for the copies in order
and answers them on the event loop, several at a time. On a CPU-only machine the "device" is
host memory and the copy is a host copy (on a worker thread for pieces of MiBs), so every path
of the pipeline runs and is tested here.

Copies are serialized on one stream, which is what both overlap strategies assume
(Overlap-Intra: DMAs one after another; Overlap-Cross: a DMA overlaps the next storage read).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import anyio
import torch

from dualblade.actors._base import Actor, ActorStoppedError
from dualblade.actors.cuda_driver import CudaDriver, CudaDriverError, DriverEvent, load_driver
from dualblade.actors.dma_completions import DmaCompletions, OnDone
from dualblade.io_engine import LoopCaller, loop_caller
from dualblade.telemetry import NULL_TRACER, Tracer

#: Host copies of at least this many bytes run on a worker thread (see ``handle``).
HOST_COPY_THREAD_BYTES = 2 << 20


@dataclass(frozen=True)
class Copy:
    """Copy ``source`` into ``destination`` (same shape and dtype); ``direction`` for traces."""

    source: torch.Tensor
    destination: torch.Tensor
    direction: str  # "h2d" (pinned -> device) or "d2h" (device -> pinned)
    label: str
    reply: CopyAnswer  # a Reply, or a chained load (answered on the loop either way)


class CopyAnswer(Protocol):
    """What a copy's requester is told through, on the loop: the bytes copied, or an error."""

    def set(self, nbytes: int, /) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class GpuDmaActor(Actor[Copy]):
    """Owns the DMA stream of one device.

    Args:
        device: the compute device (``cuda:N`` or ``cpu``).
    """

    def __init__(self, device: torch.device, *, tracer: Tracer = NULL_TRACER) -> None:
        super().__init__("gpu-dma", tracer=tracer)
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None
        self._completions: DmaCompletions | None = None
        # Copies go through the driver with the GIL held where it loads (cuda_driver.py).
        self._driver: CudaDriver | None = None
        self._ready_event = 0  # recorded on the caller's stream, waited for by the DMA stream
        # Events whose copies were answered; taken on the loop and on the engine's thread.
        self._free_events: deque[int] = deque()
        self._call_on_loop: LoopCaller | None = None
        # Chained copies are queued from the engine's thread: none may start once stopping.
        self._launch_lock = threading.Lock()
        self._stopping = False
        self.driver_copies = 0
        self.chained_copies = 0  # copies the engine's thread queued as their read ended
        self._failure: BaseException | None = None  # a copy that failed breaks the stream
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.host_copies = 0  # copies that ran on the CPU (the fallback)
        # CUDA copies from a non-contiguous (row-padded) pinned view: torch stages them through
        # a temporary contiguous host buffer, an extra crossing of host memory.
        self.staged_copies = 0

    async def on_start(self) -> None:
        if self.cuda:
            # An indexed device keeps torch's stream calls off ``cuda.is_available()``, which
            # asks the driver for the device count each time (0.3 ms per call seen on the H200
            # machine while copies were in flight).
            index: int | None = self.device.index
            self.device = torch.device(
                "cuda", torch.cuda.current_device() if index is None else index
            )
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            if self.device.index == torch.cuda.current_device():
                # the stream's creation made the device's context current on this thread
                self._driver = load_driver()
                if self._driver is not None:
                    self._ready_event = self._driver.new_event()
            self._call_on_loop = loop_caller()
            self._completions = DmaCompletions(self._call_on_loop, name=f"{self.name}-completions")
            self._completions.start()

    async def on_stop(self) -> None:
        if self._completions is not None:
            # Queued copies still read or write the copy threads' buffers: wait for them all
            # before the owner may free those buffers.
            with self._launch_lock:
                self._stopping = True
                self._completions.close()
            await anyio.to_thread.run_sync(self._completions.join)
        if self._driver is not None:
            for event in [*self._free_events, self._ready_event]:
                self._driver.destroy_event(event)
            self._free_events.clear()

    async def handle(self, message: Copy) -> None:
        nbytes = message.source.numel() * message.source.element_size()
        if self._stream is not None:
            self._queue_cuda_copy(message, nbytes)
            return
        with self.tracer.span(self.name, f"{message.direction} {message.label}", bytes=nbytes):
            if nbytes < HOST_COPY_THREAD_BYTES:
                # A small copy (tens of microseconds) is cheaper inline than a worker-thread
                # round trip (about 200 us measured here).
                self._host_copy(message)
                await anyio.lowlevel.checkpoint()
            else:
                # A piece of MiBs takes a millisecond or more: on a worker thread it runs beside
                # the event loop (and the ring's completions) instead of stalling them.
                await anyio.to_thread.run_sync(self._host_copy, message)
        self._count(message.direction, nbytes)
        message.reply.set(nbytes)

    def _count(self, direction: str, nbytes: int) -> None:
        if direction == "h2d":
            self.bytes_h2d += nbytes
        else:
            self.bytes_d2h += nbytes

    def _queue_cuda_copy(self, message: Copy, nbytes: int) -> None:
        """Queue the copy on the DMA stream; it is answered when its event completes."""
        assert self._completions is not None
        if self._failure is not None:  # the stream broke: no copy after it can be trusted
            raise ActorStoppedError(f"{self.name}: an earlier copy failed: {self._failure!r}")
        for side in (message.source, message.destination):
            if side.device.type == "cpu" and not side.is_contiguous():
                self.staged_copies += 1
        # The device side was made (a d2h source: the model's K and V) or last used (an h2d
        # destination: memory the caching allocator handed back) by work queued on the caller's
        # stream; the DMA stream must not start before that work ends, or it copies rows that are
        # not computed yet, or writes memory a kernel still reads.
        caller_stream = self._caller_stream()
        if self._driver is not None and self._drivable(message):
            self._driver.record(self._ready_event, caller_stream.cuda_stream)
            self._queue_driver_copy(message, nbytes, self._ready_event, chained=False)
        else:
            done = self._torch_copy(message, caller_stream)
            self._completions.watch(done, self._answer(message, nbytes, None, self._start_us()))

    def chain(self, message: Copy) -> Callable[[BaseException | None], None] | None:
        """``message``'s copy as a function for the I/O engine's thread to call when the read
        that fills its source ends (``IOEngine.read_then``): the copy is queued at once, and
        the event loop hears of the load once, when the copy is done. Sent through the
        mailbox, a loaded KPU woke the loop for its read, then for its copy: on the H200
        machine the loop's Python per KPU set the pipeline's pace (docs/pipeline-profile.md).

        Called on the loop, which records the caller's stream now: the copy waits for the work
        queued there before the load was asked. None where a copy cannot go through the driver
        (no driver, a side not contiguous, another context current): :meth:`ask` then. A read
        that failed, or a copy that could not be queued, fails ``message.reply`` on the loop.
        """
        driver, call_on_loop = self._driver, self._call_on_loop
        if driver is None or call_on_loop is None or not self._drivable(message):
            return None
        if self._failure is not None:
            raise ActorStoppedError(f"{self.name}: an earlier copy failed: {self._failure!r}")
        nbytes = message.source.numel() * message.source.element_size()
        ready = self._event()
        driver.record(ready, self._caller_stream().cuda_stream)

        def launch(error: BaseException | None) -> None:  # on the engine's thread
            if error is None:
                try:
                    with self._launch_lock:
                        if self._stopping:
                            raise ActorStoppedError(f"{self.name} is stopping")
                        driver.bind()
                        self._queue_driver_copy(message, nbytes, ready, chained=True)
                    return
                except BaseException as failure:  # told to the requester, on the loop
                    # without its traceback, whose frame (this one) holds the copy's tensors
                    error = failure.with_traceback(None)
            self._free_events.append(ready)
            call_on_loop(self._fail_chained, message, error)

        return launch

    def _caller_stream(self) -> torch.cuda.Stream:
        """The stream the caller queues its work on (the model's), on this thread."""
        return torch.cuda.current_stream(self.device)

    def _fail_chained(self, message: Copy, error: BaseException) -> None:
        if isinstance(error, CudaDriverError):
            self._failure = error  # a driver call failed: the stream cannot be trusted
            error = ActorStoppedError(f"{self.name}: the copy failed: {error!r}")
        message.reply.fail(error)

    def _drivable(self, message: Copy) -> bool:
        """Whether the copy can go through the driver from the calling thread."""
        driver = self._driver
        return (
            driver is not None
            and message.source.is_contiguous()
            and message.destination.is_contiguous()
            and driver.is_current()
        )

    def _start_us(self) -> float:
        return self.tracer.now_us() if self.tracer.enabled else 0.0

    def _event(self) -> int:
        """An event to record: one whose copy was answered, or a new one."""
        assert self._driver is not None
        try:
            return self._free_events.pop()
        except IndexError:
            return self._driver.new_event()

    def _queue_driver_copy(self, message: Copy, nbytes: int, ready: int, *, chained: bool) -> None:
        """Queue the copy through the driver after ``ready`` (recorded on the caller's
        stream), and have the completions thread answer it. ``chained``: ``ready`` belongs to
        this copy and goes back to the pool with its done event."""
        driver, stream, completions = self._driver, self._stream, self._completions
        assert driver is not None
        assert stream is not None
        assert completions is not None
        start_us = self._start_us()
        source, destination = message.source, message.destination
        driver.wait(stream.cuda_stream, ready)
        if message.direction == "h2d":
            driver.copy_to_device(
                destination.data_ptr(), source.data_ptr(), nbytes, stream.cuda_stream
            )
        else:
            driver.copy_to_host(
                destination.data_ptr(), source.data_ptr(), nbytes, stream.cuda_stream
            )
        done = self._event()
        driver.record(done, stream.cuda_stream)
        events = (done, ready) if chained else (done,)
        completions.watch(
            DriverEvent(driver, done), self._answer(message, nbytes, events, start_us, chained)
        )

    def _answer(
        self,
        message: Copy,
        nbytes: int,
        events: tuple[int, ...] | None,
        start_us: float,
        chained: bool = False,
    ) -> OnDone:
        """What the completions thread calls on the loop when the copy has ended."""

        def answer(error: BaseException | None) -> None:
            # The caller's tensors lived until now: ``message`` holds them.
            if error is not None:
                self._failure = error
                message.reply.fail(ActorStoppedError(f"{self.name}: the copy failed: {error!r}"))
                return
            if events is not None:  # answered, so its events may be recorded again
                self._free_events.extend(events)
                self.driver_copies += 1
                self.chained_copies += chained
            if self.tracer.enabled:
                self.tracer.complete(
                    self.name,
                    f"{message.direction} {message.label}",
                    start_us,
                    self.tracer.now_us(),
                    bytes=nbytes,
                )
            self._count(message.direction, nbytes)
            message.reply.set(nbytes)

        return answer

    def _torch_copy(self, message: Copy, caller_stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Queue the copy through torch; its done event."""
        assert self._stream is not None
        self._stream.wait_stream(caller_stream)
        # ``set_stream`` rather than ``torch.cuda.stream()``: the context manager looks the
        # device up through ``cuda.is_available()`` on every entry.
        torch.cuda.set_stream(self._stream)
        try:
            message.destination.copy_(message.source, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        finally:
            torch.cuda.set_stream(caller_stream)
        return done

    def _host_copy(self, message: Copy) -> None:
        message.destination.copy_(message.source)
        self.host_copies += 1
