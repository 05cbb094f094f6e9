"""Where a copy thread's KPU images lie in its pinned buffer: image ``i`` at ``i × image_bytes``,
the room for appended rows (if any) after the last one.

The copy thread places its transfers by these windows, and the store lends the same windows to a
reference that moves bytes as the pipeline does (``KVStore.pinned_images``: the bench's floor,
``dualblade pipebench``'s device lanes), so the two cannot disagree about the layout.
"""

from __future__ import annotations

from dualblade.io_engine import AlignedBuffer, BufferWindow


def image_windows(buffer: AlignedBuffer, images: int, image_bytes: int) -> list[BufferWindow]:
    """``buffer``'s ``images`` KPU images of ``image_bytes``, end to end from its start.

    Raises:
        ValueError: ``images`` is below 1, or the buffer is smaller than its images.
    """
    if images < 1:
        raise ValueError(f"a pinned buffer holds at least one KPU image, not {images}")
    return [BufferWindow(buffer, image * image_bytes, image_bytes) for image in range(images)]
