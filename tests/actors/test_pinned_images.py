"""Where a copy thread's KPU images lie in its pinned buffer (``actors/pinned_images.py``): the
windows it places KPUs in and the store lends, never the room for rows after them."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.actors.pinned_images import image_windows
from dualblade.io_engine import AlignedBuffer, BufferWindow

PAGE = 4096


@given(
    images=st.integers(1, 2),
    image_pages=st.integers(1, 6),
    room_pages=st.integers(0, 3),
    buffers=st.integers(1, 3),
)
def test_images_lie_end_to_end_from_the_start_and_leave_the_room_alone(
    images: int, image_pages: int, room_pages: int, buffers: int
) -> None:
    image_bytes = image_pages * PAGE
    made = [AlignedBuffer(images * image_bytes + room_pages * PAGE) for _ in range(buffers)]
    try:
        named = [window for buffer in made for window in image_windows(buffer, images, image_bytes)]
        assert len(named) == images * buffers
        for buffer in made:
            mine = [image for image in named if image.buffer is buffer]
            spans = sorted((image.offset, image.offset + image.nbytes) for image in mine)
            assert spans[0][0] == 0
            assert all(end == start for (_, end), (start, _) in itertools.pairwise(spans))
            assert spans[-1][1] == images * image_bytes  # the room for rows is no image
            assert all(image.nbytes == image_bytes for image in mine)
    finally:
        for buffer in made:
            buffer.close()


def test_a_buffer_smaller_than_its_images_is_refused() -> None:
    with AlignedBuffer(3 * PAGE) as room:  # one image and room for rows is not two images
        with pytest.raises(ValueError, match="does not lie inside a 12288-byte buffer"):
            image_windows(room, 2, 2 * PAGE)
        with pytest.raises(ValueError, match="at least one KPU image"):
            image_windows(room, 0, PAGE)
        with pytest.raises(ValueError, match="does not lie inside"):
            BufferWindow(room, -PAGE, PAGE)
