"""The copy threads' KPU images as the store names them (``KVStore.pinned_images``): where a
reference that moves bytes as the pipeline does may read, and never the room for rows."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.io_engine import AlignedBuffer, BufferWindow
from dualblade.pipeline import pin_bytes
from dualblade.store import open_store
from dualblade.store.pin_layout import pinned_images

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
        named = pinned_images(made, images, image_bytes)
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
            pinned_images([room], 2, 2 * PAGE)
        with pytest.raises(ValueError, match="at least one KPU image"):
            pinned_images([room], 0, PAGE)
        with pytest.raises(ValueError, match="does not lie inside"):
            BufferWindow(room, -PAGE, PAGE)


@pytest.mark.anyio
async def test_the_store_names_the_images_its_copy_threads_read_into(
    make_config, monkeypatch
) -> None:
    """Two images and room for rows, as a CUDA store lays its buffers out (the count set here,
    so it runs without a GPU): each image is where its copy thread places a KPU."""
    import dualblade.store.pin_layout as pin_layout

    monkeypatch.setattr(pin_layout, "pin_images_for", lambda device_type: 2)
    monkeypatch.setattr(pin_layout, "pin_images_in_plan", lambda *args, **kwargs: 2)
    config = make_config("dual", memory={"limit": "4GiB"})
    async with open_store(config, device="cpu") as store:
        named = store.pinned_images()
        threads = store.runtime.pool.threads
        assert store.pin_images == 2
        assert len(named) == 2 * len(threads)
        for thread in threads:
            mine = [image for image in named if image.buffer is thread.buffer]
            assert [(image.offset, image.nbytes) for image in mine] == [
                (index * thread.image_bytes, thread.image_bytes) for index in range(2)
            ]
            assert thread.image_bytes == pin_bytes(config)
            assert thread.buffer.size > 2 * thread.image_bytes  # the room for rows follows
