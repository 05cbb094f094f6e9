"""The machine-limit reference of the page-cache path moves every byte it times."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualblade.bench import page_cache_limit
from dualblade.bench.page_cache_limit import FileToMove, measure_page_cache_limit
from dualblade.io_engine import AlignedBuffer, BufferWindow


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


def _pieces(content: bytes, piece: int) -> list[bytes]:
    return [content[offset : offset + piece] for offset in range(0, len(content), piece)]


def test_pieces_carved_from_lent_windows_move_every_byte_and_allocate_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's floor moves its files through a store's pinned images: every piece is a
    page-aligned slice of a lent window (none touches the bytes after it, the row room of a
    CUDA buffer), each thread count gets the largest pieces the windows hold two a thread of,
    the files' bytes arrive whole, and no buffer of the mover's own is made."""
    opened = [_file(tmp_path / f"f{i}", (90 + 41 * i) << 10, i) for i in range(3)]
    buffers = [AlignedBuffer(6 * 4096, huge=False) for _ in range(2)]
    # 4 pages of each buffer are lent, at page 1: 8 pages in all
    windows = [BufferWindow(buffer, 4096, 4 * 4096) for buffer in buffers]
    moved: list[bytes] = []
    sizes: dict[int, set[int]] = {}
    real_copy = page_cache_limit._Mover._copy

    def spy(self: page_cache_limit._Mover, slot: int, nbytes: int) -> None:
        address = self.sources[slot].data_ptr()
        length = len(self.views[slot])
        assert any(
            buffer.address + 4096 <= address
            and address + length <= buffer.address + 5 * 4096
            and (address - buffer.address) % 4096 == 0
            for buffer in buffers
        ), "a piece outside the lent windows, or not on a page of one"
        sizes.setdefault(id(self), set()).add(length)
        moved.append(bytes(self.views[slot][:nbytes]))
        real_copy(self, slot, nbytes)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the mover allocated a buffer of its own")

    monkeypatch.setattr(page_cache_limit._Mover, "_copy", spy)
    monkeypatch.setattr(page_cache_limit, "AlignedBuffer", refuse)
    try:
        files = [FileToMove(fd, len(content)) for fd, content in opened]
        runs = measure_page_cache_limit(
            files, torch.device("cpu"), passes=1, counts=(1, 4), memory=windows
        )
    finally:
        for fd, _ in opened:
            os.close(fd)
    assert [run.threads for run in runs] == [1, 4]
    # one thread: two pieces of 4 pages (one a window); four threads: eight of one page
    assert sorted(set().union(*sizes.values())) == [4096, 4 * 4096]
    expected = [
        piece
        for _, content in opened
        for size in (4 * 4096, 4096)
        for piece in _pieces(content, size)
    ]
    assert sorted(moved) == sorted(expected)
    for buffer in buffers:
        buffer.close()  # nothing aliases the buffers any more


@settings(max_examples=200, deadline=None)
@given(
    window_pages=st.lists(st.integers(1, 64), min_size=1, max_size=8),
    movers=st.integers(1, 16),
    cap=st.integers(1, 80 * 4096),
)
def test_the_largest_piece_is_the_largest_that_fits(
    window_pages: list[int], movers: int, cap: int
) -> None:
    """Two pieces a thread fit the windows, a page more would not (or pass the cap), and a
    piece is whole pages, never above the cap rounded up to a page."""
    with AlignedBuffer(64 * 4096, huge=False) as buffer:
        windows = [BufferWindow(buffer, 0, pages * 4096) for pages in window_pages]

        def fits(piece: int) -> bool:
            return sum(window.nbytes // piece for window in windows) >= 2 * movers

        piece = page_cache_limit._largest_piece(windows, movers, cap)
        assert piece % 4096 == 0
        assert piece <= -(-cap // 4096) * 4096
        if piece == 0:
            assert not fits(4096)
        else:
            assert fits(piece)
            assert piece + 4096 > -(-cap // 4096) * 4096 or not fits(piece + 4096)


def test_a_window_outside_its_buffer_is_refused() -> None:
    with AlignedBuffer(4096, huge=False) as buffer:
        with pytest.raises(ValueError, match="does not lie inside a 4096-byte buffer"):
            BufferWindow(buffer, 4096, 1)
        with pytest.raises(ValueError, match="does not lie inside"):
            BufferWindow(buffer, 0, 0)
        assert BufferWindow.whole(buffer).nbytes == 4096


def test_windows_too_small_for_two_pages_a_thread_are_refused(tmp_path: Path) -> None:
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
                memory=[BufferWindow.whole(memory)],
            )
    finally:
        os.close(fd)
