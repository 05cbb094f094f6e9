"""How a store lays out each copy thread's pinned buffer: KPU images, then room for rows.

One answer for the store that allocates the buffers (``runtime.py``) and for ``dualblade plan
--device``, which shows the budget such a store would derive: the reservation the budget
subtracts is these bytes, so the two must never disagree. Where each image lies in the buffer
is the copy thread's answer (``actors/pinned_images.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualblade.actors import ROW_STAGING_BYTES
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
