"""The copy threads' KPU images as the store names them (``KVStore.pinned_images``): where a
reference that moves bytes as the pipeline does may read, and never the room for rows."""

from __future__ import annotations

import pytest

from dualblade.pipeline import pin_bytes
from dualblade.store import open_store


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
