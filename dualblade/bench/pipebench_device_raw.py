"""pipebench's raw side on a GPU: the engine's reads and the copies to the device, no actors.

On a GPU the pipeline's loads end in device memory: each KPU is read into an image of a copy
thread's pinned buffer and copied from there to the GPU. A raw side that only reads into the
pinned memory leaves that copy out, and it read into one buffer per copy thread where the
pipeline has two images each: a different move at a different depth. On the H200 machine the
pipeline's passes took 2-3 ms longer than that side's with the same share of time in flight,
and nothing said whether the copies or the actors cost it (docs/pipeline-profile.md).

This raw side makes the pipeline's move with nothing of the pipeline: as many lanes as the
store has pinned images (each copy thread's buffer holds one or two), each reading its share of
the extents into its image through the store's engine, then copying the image to a device
tensor on a stream of its own. A lane reads into its image again once that copy has ended. The
reads share as many storage slots as the pipeline's overlap gate gives its direct path (one per
copy thread under Intra), held in the engine only while a read is in flight, so both sides
keep as many KPUs at the storage at once. The loop polls a copy's event rather than blocking a
thread on it: a KPU's copy takes about a tenth of its read, and a thread hop costs as much as
the wait.

The lanes' host tensors alias the store's pinned buffers: drop the lanes before the store
closes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import torch

from dualblade.io_engine import AlignedBuffer, BufferWindow, StorageSlots
from dualblade.pipeline import KpuExtent
from dualblade.store import KVContext, KVStore


@dataclass
class DeviceLane:
    """One image of a pinned buffer, the device memory it is copied into, and that copy's end."""

    buffer: AlignedBuffer
    image_offset: int
    host: torch.Tensor
    device_tensor: torch.Tensor
    stream: torch.cuda.Stream
    copied: torch.cuda.Event | None = None

    async def settle(self) -> None:
        """Wait for the last copy out of the image, yielding to the loop while it runs."""
        if self.copied is not None:
            while not self.copied.query():  # type: ignore[no-untyped-call]
                await anyio.sleep(0)
            self.copied = None


def device_lanes(images: Sequence[BufferWindow], device: torch.device) -> list[DeviceLane]:
    """A lane per pinned KPU image (the store's ``KVStore.pinned_images``: one or two per copy
    thread's buffer, the room for appended rows left out), each with device memory of its size
    and a stream of its own."""
    return [
        DeviceLane(
            image.buffer,
            image.offset,
            image.buffer.tensor(count=image.nbytes, offset=image.offset),
            torch.empty(image.nbytes, dtype=torch.uint8, device=device),
            torch.cuda.Stream(device),  # type: ignore[no-untyped-call]
        )
        for image in images
    ]


async def _lane_pass(
    store: KVStore, lane: DeviceLane, extents: list[KpuExtent], slots: StorageSlots
) -> None:
    for extent in extents:
        await lane.settle()
        await store.raw_direct_read(
            lane.buffer,
            extent.nbytes,
            extent.byte_offset,
            buf_offset=lane.image_offset,
            slots=slots,
        )
        with torch.cuda.stream(lane.stream):
            lane.device_tensor[: extent.nbytes].copy_(lane.host[: extent.nbytes], non_blocking=True)
            lane.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            lane.copied.record(lane.stream)
    await lane.settle()


async def raw_device_pass(
    store: KVStore, ctx: KVContext, lanes: list[DeviceLane], slots: StorageSlots
) -> None:
    """Every extent once, read (at most ``slots`` reads at a time) and copied to the device;
    ends when the last copy has.

    Raises:
        ValueError: an extent is larger than a lane's image (it would overrun into the next).
    """
    extents = list(await ctx.direct_map())
    image_bytes = min(lane.host.numel() for lane in lanes)
    if (largest := max(extent.nbytes for extent in extents)) > image_bytes:
        raise ValueError(f"an extent of {largest} bytes does not fit an image of {image_bytes}")
    async with anyio.create_task_group() as tg:
        for index, lane in enumerate(lanes):
            tg.start_soon(_lane_pass, store, lane, extents[index :: len(lanes)], slots)
