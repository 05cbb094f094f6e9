"""How a store lays out each copy thread's pinned buffer: KPU images, then room for rows.

One answer for the store that allocates the buffers (``runtime.py``), for ``dualblade plan
--device``, which shows the budget such a store would derive (the reservation the budget
subtracts is these bytes, so the two must never disagree), and for the references that read
into the images as the pipeline does (:func:`pinned_images`: the bench's floor and
``dualblade pipebench``'s device lanes), which must not take the room for rows for an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dualblade.actors import ROW_STAGING_BYTES
from dualblade.io_engine import AlignedBuffer, BufferWindow
from dualblade.pipeline import PipelineConfig, pin_images_for, pin_images_in_plan


@dataclass(frozen=True)
class PinLayout:
    """One copy thread's pinned buffer: ``images`` KPU images, then ``row_room`` bytes."""

    images: int
    row_room: int

    @property
    def rows_aside(self) -> bool:
        """Whether appended rows are staged in their own room (actors/row_staging.py)."""
        return self.row_room > 0


def pin_layout_for(
    config: PipelineConfig,
    device_type: str,
    memory_limit: int | None = None,
    *,
    reserved: int = 0,
) -> PinLayout:
    """The buffer layout of a store of ``config`` on a device of ``device_type`` under
    ``memory_limit`` (None: the config's or the discovered one), with ``reserved`` bytes
    claimed but not touched yet.

    Where a second image has a use (CUDA) the buffer ends in room for appended rows, with one
    image or two; the images are ``pipeline.pin_images_in_plan``'s: two unless the second's
    memory would keep a layer of the config's context out of the page cache. Chosen once, when
    the store starts (a discovered limit is read from ``/proc`` and the cgroup: call it off the
    event loop).

    Raises:
        MemoryDiscoveryError: discovery was needed and ``/proc/meminfo`` is unreadable.
    """
    row_room = ROW_STAGING_BYTES if pin_images_for(device_type) > 1 else 0
    images = pin_images_in_plan(
        config, device_type, memory_limit, row_room=row_room, reserved=reserved
    )
    return PinLayout(images, row_room)


def pinned_images(
    buffers: Sequence[AlignedBuffer], images: int, image_bytes: int
) -> list[BufferWindow]:
    """Each buffer's ``images`` KPU images of ``image_bytes``, in buffer order, image ``i`` at
    ``i * image_bytes`` as a copy thread places them (``actors/copy_thread.py``); the room for
    rows after them is no image.

    Raises:
        ValueError: a buffer is smaller than its images, or ``images`` is below 1.
    """
    if images < 1:
        raise ValueError(f"a pinned buffer holds at least one KPU image, not {images}")
    return [
        BufferWindow(buffer, image * image_bytes, image_bytes)
        for buffer in buffers
        for image in range(images)
    ]
