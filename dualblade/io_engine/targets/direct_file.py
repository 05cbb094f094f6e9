"""A preallocated regular file opened with O_DIRECT: the embedded default direct target.

It works on any Linux file system that supports O_DIRECT, needs no special hardware and no root,
and keeps the direct path's properties that matter for KV traffic: no page cache, aligned
transfers, one contiguous extent. TRIM punches holes (``fallocate(PUNCH_HOLE | KEEP_SIZE)``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from dualblade.io_engine import _uapi, opcodes
from dualblade.io_engine.errors import IOFailedError, TargetError
from dualblade.io_engine.targets._private_dirs import make_private_dirs
from dualblade.io_engine.targets.base import Target

#: Offsets, lengths and buffer addresses are kept 4 KiB-aligned: valid for every logical block
#: size a file system's device can have (512 or 4096), without asking statx(STATX_DIOALIGN).
DIRECT_FILE_ALIGNMENT = 4096
#: Default largest command; the block layer splits further if the device needs it.
DEFAULT_MAX_TRANSFER = 1 << 20


class DirectFile(Target):
    """A file of ``size`` bytes, created and preallocated if needed, opened O_DIRECT.

    Args:
        path: the file; its parent folder is created.
        size: bytes to preallocate (rounded up to 4 KiB); an existing larger file is kept.
        max_transfer: the largest single command in bytes.

    Raises:
        TargetError: the file system refuses O_DIRECT or preallocation, or permission is denied.
    """

    def __init__(
        self, path: str | os.PathLike[str], size: int, *, max_transfer: int = DEFAULT_MAX_TRANSFER
    ) -> None:
        self.name = str(path)
        self.lba_size = DIRECT_FILE_ALIGNMENT
        self.alignment = DIRECT_FILE_ALIGNMENT
        if max_transfer < self.lba_size or max_transfer % self.lba_size:
            raise TargetError(f"max_transfer {max_transfer} must be a positive multiple of 4096")
        self.max_transfer = max_transfer
        size = -(-size // self.lba_size) * self.lba_size
        file = Path(path)
        try:
            make_private_dirs(file.parent)
            self.fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        except PermissionError as error:
            raise TargetError(f"cannot open {file}: permission denied") from error
        except OSError as error:
            if error.errno == errno.EINVAL:
                raise TargetError(
                    f"{file}: the file system does not support O_DIRECT (tmpfs?); put the "
                    "direct file on a disk-backed file system"
                ) from error
            raise TargetError(f"cannot open {file}: {error.strerror}") from error
        try:
            current = os.fstat(self.fd).st_size
            if current < size:
                os.posix_fallocate(self.fd, 0, size)
        except OSError as error:
            os.close(self.fd)
            raise TargetError(
                f"cannot preallocate {size} bytes for {file}: {error.strerror}"
            ) from error
        self.size = max(size, current // self.lba_size * self.lba_size)

    def grow_to(self, size: int) -> None:
        """Preallocate up to ``size`` bytes (rounded up to 4 KiB); never shrinks.

        Raises:
            IOFailedError: the file system has no room (errno ENOSPC, op ``allocate``): the
                error a write that finds no room raises, so a full disk is one kind of failure
                wherever a context meets it.
        """
        size = -(-size // self.lba_size) * self.lba_size
        if size <= self.size:
            return
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as error:
            raise IOFailedError(
                self.name,
                "allocate",
                self.size,
                size - self.size,
                errno=error.errno,
                detail=f"cannot grow the file to {size} bytes",
            ) from error
        self.size = size

    def allocated_ranges(self, offset: int, length: int) -> list[tuple[int, int]]:
        """The parts of ``[offset, offset + length)`` that hold data (``SEEK_DATA`` /
        ``SEEK_HOLE``), widened to whole 4 KiB blocks and clipped to the range.

        Blocks that were preallocated but never written (unwritten extents) count as holes on
        ext4 and XFS: they hold nothing to reclaim. File systems without ``SEEK_DATA`` report
        the whole file as data, which errs on the safe side.
        """
        end = offset + length
        out: list[tuple[int, int]] = []
        position = offset
        while position < end:
            try:
                start = os.lseek(self.fd, position, os.SEEK_DATA)
            except OSError as error:
                if error.errno == errno.ENXIO:  # no data after position
                    break
                raise
            if start >= end:
                break
            stop = min(os.lseek(self.fd, start, os.SEEK_HOLE), end)
            low = max(offset, start // self.lba_size * self.lba_size)
            high = min(end, -(-stop // self.lba_size) * self.lba_size)
            if out and out[-1][0] + out[-1][1] >= low:
                first, _ = out.pop()
                low = first
            out.append((low, high - low))
            position = stop
        return out

    def trim_op(self, offset: int, length: int) -> opcodes.Op:
        return opcodes.Fallocate(
            self.fd, _uapi.FALLOC_FL_PUNCH_HOLE | _uapi.FALLOC_FL_KEEP_SIZE, offset, length
        )

    def trim_blocking(self, offset: int, length: int) -> None:
        from dualblade.io_engine._libc import fallocate

        fallocate(self.fd, _uapi.FALLOC_FL_PUNCH_HOLE | _uapi.FALLOC_FL_KEEP_SIZE, offset, length)
