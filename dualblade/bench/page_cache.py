"""Making reads cold: dropping a file's pages from the page cache before a measurement."""

from __future__ import annotations

import os


def drop_file_cache(path: str) -> str:
    """Evict ``path``'s cached pages; returns how (``"drop_caches"`` or ``"fadvise"``).

    As root the whole page cache is dropped after a ``sync`` (``/proc/sys/vm/drop_caches``), which
    also clears file-system metadata; otherwise ``posix_fadvise(DONTNEED)`` after ``fdatasync``
    evicts the file's clean pages, which is enough for a file we own.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.path.isfile(path):
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if os.geteuid() == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass
    return "fadvise"
