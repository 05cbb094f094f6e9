"""Making reads cold: dropping files' pages from the page cache before a measurement."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def drop_page_cache(paths: Iterable[str | os.PathLike[str]]) -> str:
    """Evict the pages of the files ``paths`` (folders: every file below them); returns how
    (``"drop_caches"`` or ``"fadvise"``).

    Every file is written back (``fdatasync``) and its clean pages dropped
    (``posix_fadvise(DONTNEED)``), which is enough for files we own. As root the whole page cache
    is then dropped as well, once (``sync`` + ``/proc/sys/vm/drop_caches``), which also clears
    the file system's metadata and other processes' pages, as a cold start should.
    """
    for root in map(Path, paths):
        if not root.is_dir():
            if root.exists():
                _evict(root)
            continue
        for path in root.rglob("*"):
            if path.is_file():
                _evict(path)
    if os.geteuid() == 0:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    return "fadvise"


def drop_file_cache(path: str) -> str:
    """Evict one file's (or block device's) cached pages; see :func:`drop_page_cache`."""
    return drop_page_cache([path])


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if path.is_file():  # a block device's dirty pages are not ours to write back
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
