"""The GPU-DMA actor: copies between copy threads' pinned buffers and device tensors.

With CUDA, copies run on the actor's own stream (``non_blocking`` from page-locked memory is a
true DMA), ordered after the work already queued on the device's current stream (where the model
computes), and the actor waits for the stream's event off the event loop. On a CPU-only machine
the "device" is host memory and the copy is a host copy (on a worker thread for pieces of MiBs),
so every path of the pipeline runs and is tested here.

One copy at a time: DMAs are serialized on one stream, which is what both overlap strategies
assume (Overlap-Intra: DMAs one after another; Overlap-Cross: a DMA overlaps the next storage
read).
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import torch

from dualblade.actors._base import Actor, Reply
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
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.host_copies = 0  # copies that ran on the CPU (the fallback)
        # CUDA copies from a non-contiguous (row-padded) pinned view: torch stages them through
        # a temporary contiguous host buffer, an extra crossing of host memory.
        self.staged_copies = 0

    async def on_start(self) -> None:
        if self.cuda:
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    async def handle(self, message: Copy) -> None:
        nbytes = message.source.numel() * message.source.element_size()
        with self.tracer.span(self.name, f"{message.direction} {message.label}", bytes=nbytes):
            if self._stream is not None:
                await self._cuda_copy(message)
            elif nbytes < HOST_COPY_THREAD_BYTES:
                # A small copy (tens of microseconds) is cheaper inline than a worker-thread
                # round trip (about 200 us measured here).
                self._host_copy(message)
                await anyio.lowlevel.checkpoint()
            else:
                # A piece of MiBs takes a millisecond or more: on a worker thread it runs beside
                # the event loop (and the ring's completions) instead of stalling them.
                await anyio.to_thread.run_sync(self._host_copy, message)
        if message.direction == "h2d":
            self.bytes_h2d += nbytes
        else:
            self.bytes_d2h += nbytes
        message.reply.set(nbytes)

    async def _cuda_copy(self, message: Copy) -> None:
        assert self._stream is not None
        for side in (message.source, message.destination):
            if side.device.type == "cpu" and not side.is_contiguous():
                self.staged_copies += 1
        # The device side was made (a d2h source: the model's K and V) or last used (an h2d
        # destination: memory the caching allocator handed back) by work queued on the caller's
        # stream; the DMA stream must not start before that work ends, or it copies rows that are
        # not computed yet, or writes memory a kernel still reads.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            message.destination.copy_(message.source, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        # The caller's tensors must live until the DMA ends: they are held by ``message``.
        await anyio.to_thread.run_sync(done.synchronize)

    def _host_copy(self, message: Copy) -> None:
        message.destination.copy_(message.source)
        self.host_copies += 1
