"""A raw block device (``/dev/nvme0n1p3``, ``/dev/loopN``) opened O_DIRECT | O_EXCL.

Before opening, the device is checked against the mount table, swap, stacked users (holders) and,
for a whole disk, each of its partitions: dualblade never writes to storage that holds a mounted
file system. ``O_EXCL`` then makes the kernel refuse the open if anyone claims the device later
on, and keeps others from claiming it while we hold it. TRIM is ``BLKDISCARD``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct

from dualblade.io_engine import _sysfs, _uapi
from dualblade.io_engine.buffers import PAGE_SIZE
from dualblade.io_engine.errors import TargetError
from dualblade.io_engine.targets.base import Target


def check_device_unused(path: str) -> None:
    """Refuse a device (or a disk with partitions) that is mounted, swapped on or held.

    Raises:
        TargetError: naming the mount point, swap area or holder that uses it.
    """
    major, minor = _sysfs.device_number(path)
    mounts = _sysfs.mounted_devices()
    swaps = {os.path.realpath(p) for p in _sysfs.swap_devices()}
    candidates = [(os.path.basename(os.path.realpath(path)), major, minor)]
    candidates += _sysfs.partitions(major, minor)
    for name, maj, mnr in candidates:
        where = f"{path}" if (maj, mnr) == (major, minor) else f"partition {name} of {path}"
        if (maj, mnr) in mounts:
            raise TargetError(
                f"refusing {path}: {where} holds a file system mounted at {mounts[(maj, mnr)]}; "
                "dualblade writes raw blocks and would destroy it. Unmount it or pick an unused "
                "device or partition"
            )
        if f"/dev/{name}" in swaps:
            raise TargetError(f"refusing {path}: {where} is an active swap area")
        users = _sysfs.holders(maj, mnr)
        if users:
            raise TargetError(
                f"refusing {path}: {where} is in use by {', '.join(users)} (device-mapper, md "
                "or similar)"
            )


class BlockDevice(Target):
    """A whole block device or partition used as a raw LBA space.

    Args:
        path: the device node.
        max_transfer: cap on one command in bytes (default: the queue's limits).

    Raises:
        TargetError: not a block device, in use, mounted, or permission denied.
    """

    def __init__(self, path: str, *, max_transfer: int | None = None) -> None:
        self.name = path
        try:
            mode = os.stat(path).st_mode
        except OSError as error:
            raise TargetError(f"cannot use {path}: {error.strerror}") from error
        if not stat.S_ISBLK(mode):
            raise TargetError(f"{path} is not a block device")
        check_device_unused(path)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_EXCL | os.O_CLOEXEC)
        except PermissionError as error:
            raise TargetError(
                f"cannot open {path}: permission denied (raw devices need root or the disk group)"
            ) from error
        except OSError as error:
            if error.errno == errno.EBUSY:
                raise TargetError(
                    f"{path} is busy: mounted, or claimed exclusively by another program"
                ) from error
            raise TargetError(f"cannot open {path}: {error.strerror}") from error
        size_buf = fcntl.ioctl(self.fd, _uapi.BLKGETSIZE64, b"\0" * 8)
        (self.size,) = struct.unpack("Q", size_buf)
        lba_buf = fcntl.ioctl(self.fd, _uapi.BLKSSZGET, b"\0" * 4)
        (self.lba_size,) = struct.unpack("i", lba_buf)
        self.alignment = max(self.lba_size, 512)
        limits = _sysfs.queue_limits(*_sysfs.device_number(path))
        self.discard_max_bytes = limits.get("discard_max_bytes", 0)
        self.max_transfer = max_transfer or self._default_max_transfer(limits)

    def _default_max_transfer(self, limits: dict[str, int]) -> int:
        # A command spans at most max_segments pages when the buffer's pages are not physically
        # contiguous; stay within that and within max_sectors_kb, as a power of two.
        cap = min(
            limits.get("max_sectors_kb", 1024) * 1024,
            limits.get("max_segments", 256) * PAGE_SIZE,
            1 << 20,
        )
        size = 1 << (cap.bit_length() - 1)
        return max(size, self.lba_size)

    def trim_blocking(self, offset: int, length: int) -> None:
        if not self.discard_max_bytes:
            raise TargetError(f"{self.name} does not support discard (TRIM)")
        fcntl.ioctl(self.fd, _uapi.BLKDISCARD, struct.pack("QQ", offset, length))
