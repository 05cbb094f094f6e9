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

from dataclasses import dataclass

import anyio
import torch

from dualblade.actors._base import Actor, ActorStoppedError, Reply
from dualblade.actors.cuda_driver import CudaDriver, DriverEvent, load_driver
from dualblade.actors.dma_completions import CompletionEvent, DmaCompletions
from dualblade.io_engine import loop_caller
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
    reply: Reply[int]


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
        self._free_events: list[int] = []  # done events whose copies were answered
        self.driver_copies = 0
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
            self._completions = DmaCompletions(loop_caller(), name=f"{self.name}-completions")
            self._completions.start()

    async def on_stop(self) -> None:
        if self._completions is not None:
            # Queued copies still read or write the copy threads' buffers: wait for them all
            # before the owner may free those buffers.
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
        assert self._stream is not None
        assert self._completions is not None
        if self._failure is not None:  # the stream broke: no copy after it can be trusted
            raise ActorStoppedError(f"{self.name}: an earlier copy failed: {self._failure!r}")
        for side in (message.source, message.destination):
            if side.device.type == "cpu" and not side.is_contiguous():
                self.staged_copies += 1
        start_us = self.tracer.now_us() if self.tracer.enabled else 0.0
        # The device side was made (a d2h source: the model's K and V) or last used (an h2d
        # destination: memory the caching allocator handed back) by work queued on the caller's
        # stream; the DMA stream must not start before that work ends, or it copies rows that are
        # not computed yet, or writes memory a kernel still reads.
        caller_stream = torch.cuda.current_stream(self.device)
        driver_done = self._driver_copy(message, nbytes, caller_stream)
        done: CompletionEvent = (
            driver_done if driver_done is not None else self._torch_copy(message, caller_stream)
        )

        def answer(error: BaseException | None) -> None:
            # Runs on the loop. The caller's tensors lived until now: ``message`` holds them.
            if error is not None:
                self._failure = error
                message.reply.fail(ActorStoppedError(f"{self.name}: the copy failed: {error!r}"))
                return
            if driver_done is not None:  # answered, so its event may be recorded again
                self._free_events.append(driver_done.handle)
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

        self._completions.watch(done, answer)

    def _driver_copy(
        self, message: Copy, nbytes: int, caller_stream: torch.cuda.Stream
    ) -> DriverEvent | None:
        """Queue the copy through the driver; its done event, or None where it cannot (no
        driver, a non-contiguous side, or another context current on this thread now)."""
        driver = self._driver
        source, destination = message.source, message.destination
        if (
            driver is None
            or not source.is_contiguous()
            or not destination.is_contiguous()
            or not driver.is_current()
        ):
            return None
        assert self._stream is not None
        stream = self._stream.cuda_stream
        driver.record(self._ready_event, caller_stream.cuda_stream)
        driver.wait(stream, self._ready_event)
        if message.direction == "h2d":
            driver.copy_to_device(destination.data_ptr(), source.data_ptr(), nbytes, stream)
        else:
            driver.copy_to_host(destination.data_ptr(), source.data_ptr(), nbytes, stream)
        event = self._free_events.pop() if self._free_events else driver.new_event()
        driver.record(event, stream)
        self.driver_copies += 1
        return DriverEvent(driver, event)

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
