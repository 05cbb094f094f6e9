"""How a request is cut into commands: a device's by the engine's ``max_chunk``, a buffered
file's into a few memory copies that io_uring's workers run side by side."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualblade.io_engine import DirectFile, PageCacheFile
from dualblade.io_engine.targets.page_cache_file import (
    COPIES_PER_REQUEST,
    MIN_COPY_BYTES,
    PAGE_CACHE_CHUNK,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PageCacheFile]:
    with PageCacheFile(tmp_path_factory.mktemp("pc") / "f", 4096) as file:
        yield file


def test_a_device_command_is_capped_by_max_chunk_in_whole_lbas(tmp_path: Path) -> None:
    with DirectFile(tmp_path / "d", 1 << 20, max_transfer=512 << 10) as target:
        assert target.command_bytes(64 * MiB, None) == 512 << 10
        assert target.command_bytes(64 * MiB, 128 << 10) == 128 << 10
        assert target.command_bytes(64 * MiB, 10_000) == 8192  # whole LBAs
        assert target.command_bytes(64 * MiB, 100) == 4096  # never below one LBA


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (64 * MiB, 8 * MiB),  # a CUDA piece: eight copies of 8 MiB
        (3_342_336, MiB),  # a small layer: 1 MiB copies (four), as before
        (4096, MiB),  # one copy
        (1 << 30, PAGE_CACHE_CHUNK),  # never above max_transfer
    ],
)
def test_a_buffered_request_is_cut_into_a_few_copies(
    cached: PageCacheFile, size: int, expected: int
) -> None:
    assert cached.command_bytes(size, 64 << 10) == expected  # the device's max_chunk is ignored


@given(
    size=st.integers(1, 4 << 30),
    max_transfer=st.integers(1, 64).map(lambda pages: pages * (256 << 10)),
)
def test_buffered_commands_stay_within_their_bounds(
    cached: PageCacheFile, size: int, max_transfer: int
) -> None:
    cached.max_transfer = max_transfer
    try:
        chunk = cached.command_bytes(size, 64 << 10)
    finally:
        cached.max_transfer = PAGE_CACHE_CHUNK
    assert 0 < chunk <= max_transfer
    assert chunk % 4096 == 0  # whole pages
    commands = -(-size // chunk)
    if chunk < max_transfer:  # not held down by the cap: a few commands, none tiny
        assert chunk >= MIN_COPY_BYTES
        assert commands <= COPIES_PER_REQUEST
        if chunk > MIN_COPY_BYTES:  # above the floor only to keep to that many
            assert commands == COPIES_PER_REQUEST
