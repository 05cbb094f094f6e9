"""Resident bytes counted by cachestat(2) against mincore(2), and the fallback to mincore."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualblade.io_engine import PageCacheFile, _cachestat
from dualblade.io_engine._libc import mincore_resident

PAGE = mmap.PAGESIZE
PAGES = 64


def _cachestat_here() -> bool:
    with tempfile.TemporaryFile() as probe:
        return _cachestat.cached_bytes(probe.fileno(), 0, 1) is not None


needs_cachestat = pytest.mark.skipif(
    not _cachestat_here(), reason="this kernel has no cachestat(2) (Linux 6.5+) or refuses it"
)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, mmap.mmap]]:
    """A file of 64 pages written and synced (clean pages: ``DONTNEED`` drops them), read
    without readahead (a read brings in only the pages it asks for)."""
    path = tmp_path_factory.mktemp("cachestat") / "f"
    path.write_bytes(os.urandom(PAGES * PAGE))
    fd = os.open(path, os.O_RDWR)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    mapping = mmap.mmap(fd, PAGES * PAGE)
    yield fd, mapping
    mapping.close()
    os.close(fd)


def _cache_only(fd: int, mapping: mmap.mmap, pages: set[int]) -> None:
    """Leave exactly ``pages`` of the file in the page cache, or skip where it cannot."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    for page in pages:
        os.pread(fd, PAGE, page * PAGE)
    state = {page for page in range(PAGES) if mincore_resident(mapping, page * PAGE, PAGE)}
    if state != pages:
        pytest.skip("this file system keeps or reads more pages than asked (tmpfs, readahead)")


@needs_cachestat
@settings(max_examples=60, deadline=None)
@given(
    cached=st.sets(st.integers(0, PAGES - 1)),
    offset=st.integers(0, PAGES * PAGE - 1),
    length=st.integers(1, PAGES * PAGE),
)
def test_cachestat_counts_what_mincore_counts(
    written: tuple[int, mmap.mmap], cached: set[int], offset: int, length: int
) -> None:
    fd, mapping = written
    _cache_only(fd, mapping, cached)
    length = min(length, PAGES * PAGE - offset)
    assert _cachestat.cached_bytes(fd, offset, length) == mincore_resident(mapping, offset, length)


@needs_cachestat
def test_a_partly_cached_range_counts_only_its_own_bytes(written: tuple[int, mmap.mmap]) -> None:
    fd, mapping = written
    _cache_only(fd, mapping, set(range(PAGES)) - set(range(10, 20)))  # pages 10-19 out
    assert _cachestat.cached_bytes(fd, 5 * PAGE + 100, 5 * PAGE) == 5 * PAGE - 100
    assert _cachestat.cached_bytes(fd, 19 * PAGE + 1, 2 * PAGE) == PAGE + 1
    assert _cachestat.cached_bytes(fd, 12 * PAGE, 3 * PAGE) == 0
    assert _cachestat.cached_bytes(fd, 30 * PAGE + 7, 10) == 10
    assert _cachestat.cached_bytes(fd, 0, 0) == 0


class _Refusing:
    """``cachestat_pages`` failing with ``code``, as a kernel or a seccomp policy would."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls = 0

    def __call__(self, *_args: object) -> int:
        self.calls += 1
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EPERM])
def test_a_refused_call_is_not_asked_again_and_mincore_answers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: int
) -> None:
    refusing = _Refusing(code)
    monkeypatch.setattr(_cachestat, "cachestat_pages", refusing)
    monkeypatch.setattr(_cachestat, "_usable", True)
    file = PageCacheFile(tmp_path / "f", 8 * PAGE)
    try:
        os.pwrite(file.fd, os.urandom(8 * PAGE), 0)
        assert file.resident_bytes(0, 8 * PAGE) == 8 * PAGE  # mincore's count
        assert file.resident_bytes(PAGE, 100) == 100
    finally:
        file.close()
    assert refusing.calls == 1
    assert _cachestat.cached_bytes(0, 0, PAGE) is None


def test_a_file_system_without_it_falls_back_for_that_call_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_cachestat, "cachestat_pages", _Refusing(errno.EOPNOTSUPP))
    monkeypatch.setattr(_cachestat, "_usable", True)
    assert _cachestat.cached_bytes(0, 0, PAGE) is None
    assert _cachestat._usable


@needs_cachestat
def test_a_bad_descriptor_is_an_error() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(OSError, match=os.strerror(errno.EBADF)):
        _cachestat.cached_bytes(fd, 0, PAGE)
