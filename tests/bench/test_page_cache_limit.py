"""The machine-limit reference of the page-cache path moves every byte it times."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dualblade.bench import page_cache_limit
from dualblade.bench.page_cache_limit import FileToMove, measure_page_cache_limit
from dualblade.io_engine import AlignedBuffer


def _file(path: Path, nbytes: int, seed: int) -> tuple[int, bytes]:
    data = torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(seed))
    content = data.to(torch.uint8).numpy().tobytes()
    path.write_bytes(content)
    return os.open(path, os.O_RDONLY), content


def test_every_thread_count_moves_every_byte(tmp_path: Path, monkeypatch) -> None:
    """Each piece read is copied out whole and in order: the copies' checksum matches the
    files' (a short or misplaced read would change it)."""
    monkeypatch.setattr(page_cache_limit, "HOST_PIECE_BYTES", 64 << 10)  # several pieces a file
    opened = [_file(tmp_path / f"f{i}", (100 + 37 * i) << 10, i) for i in range(5)]
    moved: list[bytes] = []
    real_copy = page_cache_limit._Mover._copy

    def spy(self: page_cache_limit._Mover, slot: int, nbytes: int) -> None:
        moved.append(bytes(self.views[slot][:nbytes]))
        real_copy(self, slot, nbytes)

    monkeypatch.setattr(page_cache_limit._Mover, "_copy", spy)
    try:
        files = [FileToMove(fd, len(content)) for fd, content in opened]
        runs = measure_page_cache_limit(files, torch.device("cpu"), passes=2, counts=(1, 2, 4, 8))
    finally:
        for fd, _ in opened:
            os.close(fd)
    assert [run.threads for run in runs] == [1, 2, 4, 8]
    assert all(run.bytes_per_s > 0 for run in runs)
    piece = 64 << 10
    expected = [
        content[offset : offset + piece]
        for _, content in opened
        for offset in range(0, len(content), piece)
    ] * (2 * 4)  # 2 passes, for each of 4 thread counts
    assert sorted(moved) == sorted(expected)


def test_a_short_read_is_an_error_not_a_rate(tmp_path: Path) -> None:
    fd, content = _file(tmp_path / "f", 64 << 10, 1)
    try:
        with pytest.raises(OSError, match="short read"):
            measure_page_cache_limit(
                [FileToMove(fd, len(content) + (64 << 10))], torch.device("cpu"), passes=1
            )
    finally:
        os.close(fd)


def test_thread_counts_go_up_to_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert page_cache_limit.thread_counts() == (1, 2, 4, 8, 16)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert page_cache_limit.thread_counts() == (1, 2, 4)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert page_cache_limit.thread_counts() == (1, 2)


def test_pieces_carved_from_a_callers_buffer_move_every_byte_and_allocate_none(
    tmp_path: Path, monkeypatch
) -> None:
    """A run's floor moves its files through its own buffer: every piece is a page-aligned
    slice of it, the files' bytes arrive whole, and no buffer of the mover's own is made."""
    opened = [_file(tmp_path / f"f{i}", (90 + 41 * i) << 10, i) for i in range(3)]
    memory = AlignedBuffer(8 * 4096 + 100, huge=False)  # two pieces of 4 KiB for 4 threads
    moved: list[bytes] = []
    real_copy = page_cache_limit._Mover._copy

    def spy(self: page_cache_limit._Mover, slot: int, nbytes: int) -> None:
        assert len(self.views[slot]) == 4096
        moved.append(bytes(self.views[slot][:nbytes]))
        real_copy(self, slot, nbytes)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the mover allocated a buffer of its own")

    monkeypatch.setattr(page_cache_limit._Mover, "_copy", spy)
    monkeypatch.setattr(page_cache_limit, "AlignedBuffer", refuse)
    try:
        files = [FileToMove(fd, len(content)) for fd, content in opened]
        runs = measure_page_cache_limit(
            files, torch.device("cpu"), passes=1, counts=(1, 4), memory=memory
        )
    finally:
        for fd, _ in opened:
            os.close(fd)
    assert [run.threads for run in runs] == [1, 4]
    expected = [
        content[offset : offset + 4096]
        for _, content in opened
        for offset in range(0, len(content), 4096)
    ] * 2  # once for each thread count
    assert sorted(moved) == sorted(expected)
    memory.close()  # nothing aliases the buffer any more


def test_a_buffer_too_small_for_two_pages_a_thread_is_refused(tmp_path: Path) -> None:
    fd, content = _file(tmp_path / "f", 64 << 10, 1)
    try:
        with (
            AlignedBuffer(4096, huge=False) as memory,
            pytest.raises(ValueError, match="two pieces for each of 2 threads"),
        ):
            measure_page_cache_limit(
                [FileToMove(fd, len(content))],
                torch.device("cpu"),
                passes=1,
                counts=(1, 2),
                memory=memory,
            )
    finally:
        os.close(fd)
